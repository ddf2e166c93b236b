"""Grouped-query attention beyond the conformance suite: native mechanisms never make the repeated keys or
values (every tensor created is recorded), MultiHeadAttention(kv_heads=...), and Llama with grouped heads."""

import copy
from typing import List, Tuple

import pytest
import torch

import attnzoo
from attnzoo import MultiHeadAttention, UnsupportedOptionError
from tensor_records import TensorRecorder

BATCH, HEADS, KV_HEADS, HEAD_DIM, QUERIES, KEYS = 2, 8, 1, 8, 3, 200


def repeated(sizes: TensorRecorder) -> List[Tuple[str, Tuple[int, ...]]]:
    """Tensors as large as the keys repeated to every query head (nothing else here is: the queries are
    few, the keys have one head)."""
    return sizes.at_least(BATCH * HEADS * KEYS * HEAD_DIM)


def grouped_inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, QUERIES, HEAD_DIM, generator=generator, requires_grad=True)
    k = torch.randn(BATCH, KV_HEADS, KEYS, HEAD_DIM, generator=generator, requires_grad=True)
    v = torch.randn(BATCH, KV_HEADS, KEYS, HEAD_DIM, generator=generator, requires_grad=True)
    return q, k, v


NATIVE = [("softmax", {}), ("softmax", {"quiet": True}), ("linear", {}), ("performer", {"nb_features": 16, "seed": 0}),
          ("efficient", {"chunk_size": 16})]


@pytest.mark.parametrize("name, options", NATIVE, ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("causal", [False, True])
def test_native_mechanisms_never_make_the_repeated_keys_or_values(name, options, causal):
    mechanism = attnzoo.build_mechanism(name, HEADS, HEAD_DIM, **options)
    assert mechanism.capabilities.grouped_kv == "native"
    q, k, v = grouped_inputs()
    mask = torch.zeros(BATCH, KEYS, dtype=torch.bool)
    mask[1, -5:] = True
    with TensorRecorder() as sizes:
        out = mechanism(q, k, v, causal=causal, key_padding_mask=mask, cross=True)
        out.square().sum().backward()
    assert out.shape == (BATCH, HEADS, QUERIES, HEAD_DIM)
    assert repeated(sizes) == []


@pytest.mark.parametrize("name, options", NATIVE[:1] + NATIVE[2:], ids=lambda x: x if isinstance(x, str) else "")
def test_native_decoding_steps_never_make_the_repeated_cache(name, options):
    mechanism = attnzoo.build_mechanism(name, HEADS, HEAD_DIM, **options)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(BATCH, HEADS, KEYS + 1, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, KV_HEADS, KEYS + 1, HEAD_DIM, generator=generator) for _ in range(2))
    _, state = mechanism.prefill(q[:, :, :KEYS], k[:, :, :KEYS], v[:, :, :KEYS])
    with TensorRecorder() as sizes:
        mechanism.step(q[:, :, KEYS:], k[:, :, KEYS:], v[:, :, KEYS:], state)
    assert repeated(sizes) == []


def test_the_allocation_check_sees_a_repeating_mechanism():
    mechanism = attnzoo.build_mechanism("rfa", HEADS, HEAD_DIM, nb_features=16, seed=0)
    assert mechanism.capabilities.grouped_kv == "repeat"
    with TensorRecorder() as sizes:
        mechanism(*grouped_inputs(), cross=True)
    assert repeated(sizes)


def test_attnzoo_list_capabilities_declare_grouping():
    declared = {name: attnzoo.capabilities(name).grouped_kv for name in attnzoo.available()}
    assert declared["softmax"] == declared["linear"] == declared["performer"] == "native"
    assert declared["retention"] == declared["gla"] == "repeat"
    assert declared["linformer"] == declared["aft"] == declared["synthesizer"] == "none"
    assert set(declared.values()) <= {"native", "repeat", "none"}


def test_an_instance_option_moves_grouping_down_only():
    assert attnzoo.build_mechanism("performer", 4, 8, optimal_features=True).capabilities.grouped_kv == "repeat"
    caps = attnzoo.capabilities("linear")
    with pytest.raises(ValueError, match="grouped_kv"):
        caps.narrowed("x", grouped_kv="bogus")
    with pytest.raises(ValueError, match="grouped_kv"):
        attnzoo.capabilities("retention").narrowed("x", grouped_kv="native")


# -- MultiHeadAttention ----------------------------------------------------------------------------------------
def test_multi_head_attention_with_kv_heads_equals_repeated_projections():
    torch.manual_seed(0)
    grouped = MultiHeadAttention(32, 4, kv_heads=2).double()
    full = MultiHeadAttention(32, 4).double()
    with torch.no_grad():
        for name in ("q_proj", "out_proj"):
            getattr(full, name).load_state_dict(getattr(grouped, name).state_dict())
        for name in ("k_proj", "v_proj"):  # output row block j of kv head h // 2
            source, target = getattr(grouped, name), getattr(full, name)
            target.weight.copy_(source.weight.view(2, 8, 32).repeat_interleave(2, 0).reshape(32, 32))
            target.bias.copy_(source.bias.view(2, 8).repeat_interleave(2, 0).reshape(32))
    assert grouped.k_proj.out_features == 16
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    torch.testing.assert_close(grouped(x, causal=True), full(x, causal=True), rtol=0, atol=1e-12)
    out, state = grouped.prefill(x[:, :4])
    assert state.mechanism.tensors["k"].shape[1] == 2  # the cache holds kv_heads
    for t in (4, 5):
        y_t, state = grouped.step(x[:, t : t + 1], state)
        torch.testing.assert_close(y_t, full(x[:, : t + 1], causal=True)[:, -1:], rtol=0, atol=1e-12)


def test_multi_head_attention_refuses_bad_kv_heads_naming_it():
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        MultiHeadAttention(32, 4, kv_heads=3)
    with pytest.raises(ValueError, match="kv_heads"):
        MultiHeadAttention(32, 4, kv_heads=0)
    with pytest.raises(UnsupportedOptionError, match="kv_heads=2.*linformer"):
        MultiHeadAttention(32, 4, "linformer", kv_heads=2)


def test_a_state_of_heads_is_refused_for_kv_heads_naming_state():
    mechanism = attnzoo.build_mechanism("softmax", 4, 8)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8)
    _, full_state = mechanism.prefill(q, k, v)
    with pytest.raises(ValueError, match=r"state tensor .* kv_heads=2"):
        mechanism.step(q[:, :, :1], k[:, :2, :1], v[:, :2, :1], full_state)


# -- transformers' Llama with grouped heads ----------------------------------------------------------------------
def test_swapped_llama_uses_grouped_heads_without_repeating():
    transformers = pytest.importorskip("transformers", reason='transformers is an optional extra: "attnzoo[hf]"')
    from attnzoo.dropin.hf import use_attnzoo

    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.5 / parameter.shape[-1] ** 0.5)
    ours = copy.deepcopy(theirs)
    use_attnzoo(ours, "softmax")
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=0, atol=1e-10)
    # A decoding step from the cache: the repeated keys would be (batch, 8 heads, 12 positions, head_dim 4).
    cache = ours(ids[:, :-1], use_cache=True).past_key_values
    with TensorRecorder() as sizes:
        ours(ids[:, -1:], cache=cache, use_cache=True)
    assert not [shape for _, shape, _ in sizes.created if shape == (2, 8, 12, 4)]
    # A native mechanism the swap calls itself sees the two key/value heads.
    seen = []
    linear = copy.deepcopy(theirs)
    use_attnzoo(linear, "linear")
    for module in linear.modules():
        if isinstance(module, attnzoo.Mechanism):
            module.register_forward_pre_hook(lambda _, args: seen.append((args[0].shape[1], args[1].shape[1])))
    linear(ids)
    assert seen and set(seen) == {(8, 2)}


# -- models and training ---------------------------------------------------------------------------------------
def test_language_model_with_kv_heads_decodes_from_a_kv_heads_cache():
    from attnzoo.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    model = LanguageModel(50, dim=32, heads=4, depth=2, kv_heads=1).double().eval()
    assert model.config.kv_heads == 1 and model.config == ModelConfig(50, dim=32, heads=4, depth=2, kv_heads=1)
    tokens = torch.randint(0, 50, (2, 6))
    full = model(tokens)
    logits, state = model.prefill(tokens[:, :4])
    for t in (4, 5):
        step_logits, state = model.step(tokens[:, t], state)
        torch.testing.assert_close(step_logits, full[:, t], rtol=0, atol=1e-10)
    caches = []
    attnzoo.state.map_tensors(state, lambda t: caches.append(t) or t)
    caches = [t for t in caches if t.dim() == 4]
    assert caches and all(t.shape[1] == 1 for t in caches)


def test_model_config_refuses_kv_heads_it_cannot_use_naming_it():
    from attnzoo.models import ModelConfig

    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        ModelConfig(50, dim=32, heads=4, kv_heads=3)
    with pytest.raises(UnsupportedOptionError, match="kv_heads=2: self_attention='linformer'"):
        ModelConfig(50, dim=32, heads=4, kv_heads=2, self_attention="linformer",
                    self_attention_options={"max_seq_len": 8})
    with pytest.raises(ValueError, match="kv_heads=2 cannot be used with block='gau'"):
        ModelConfig(50, dim=32, heads=4, kv_heads=2, block="gau")


def test_train_config_and_cli_take_kv_heads(capsys):
    from attnzoo.cli import main
    from attnzoo.training.config import TrainConfig

    assert TrainConfig(task="recall", kv_heads=2).kv_heads == 2
    with pytest.raises(ValueError, match="kv_heads must divide heads"):
        TrainConfig(task="recall", heads=4, kv_heads=3)
    assert main(["train", "recall", "--kv-heads", "3", "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == "attnzoo train: error: --kv-heads must divide heads, got kv_heads=3 " \
                                              "and heads=4"
