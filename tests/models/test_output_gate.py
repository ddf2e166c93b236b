"""Gated attention (``MultiHeadAttention(output_gate=True)``, Qiu et al. 2025, as in Qwen3-Next): a sigmoid gate
from the layer input on each head's output before the output projection, for any mechanism, in every path of
the layer (forward, cross-attention, prefill, step, packed prefill), in the models' configs and schedules, and
nowhere when it is off."""

from __future__ import annotations

import pytest
import torch

from attnzoo import MultiHeadAttention
from attnzoo.models import BlockConfig, LanguageModel, ModelConfig, Seq2SeqTransformer
from attnzoo.models.config import BLOCKS, layer_spec
from attnzoo.models.schedule import LayerSpec, format_schedule, parse_schedule
from attnzoo.tasks import load
from attnzoo.training import TrainConfig
from attnzoo.training.model import build_model

GATED, SOFTMAX = "gated_delta", "softmax"
DIM, HEADS = 16, 4


def _pair(mechanism, **options):
    """A gated module and an ungated one with the same q, k, v, output projections and mechanism parameters."""
    torch.manual_seed(0)
    gated = MultiHeadAttention(DIM, HEADS, mechanism, output_gate=True, **options).double()
    plain = MultiHeadAttention(DIM, HEADS, mechanism, **options).double()
    missing, unexpected = plain.load_state_dict(gated.state_dict(), strict=False)
    assert missing == [] and sorted(unexpected) == ["gate_proj.bias", "gate_proj.weight"]
    return gated, plain


def _x(batch=2, length=9, seed=1):
    return torch.randn(batch, length, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("mechanism", [SOFTMAX, GATED, "performer"])
def test_the_gate_multiplies_each_head_channel_by_a_sigmoid_of_the_input(mechanism):
    gated, plain = _pair(mechanism)
    x = _x()
    causal = mechanism != "performer"
    heads_out = {}
    plain.mechanism.register_forward_hook(lambda module, args, out: heads_out.update(out=out))
    plain(x, causal=causal)
    merged = heads_out["out"].transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
    expected = plain.out_proj(merged * torch.sigmoid(x @ gated.gate_proj.weight.T + gated.gate_proj.bias))
    torch.testing.assert_close(gated(x, causal=causal), expected, rtol=0, atol=1e-12)
    # A gate held open (sigmoid -> 1) gives the ungated layer; a gate at 0 logits halves every head's output.
    with torch.no_grad():
        gated.gate_proj.weight.zero_()
        gated.gate_proj.bias.fill_(60.0)
    torch.testing.assert_close(gated(x, causal=causal), plain(x, causal=causal), rtol=0, atol=1e-12)
    with torch.no_grad():
        gated.gate_proj.bias.zero_()
    bias = plain.out_proj.bias
    torch.testing.assert_close(gated(x, causal=causal) - bias, 0.5 * (plain(x, causal=causal) - bias), rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize("mechanism", [SOFTMAX, GATED])
def test_decoding_and_packed_prefill_equal_the_gated_forward(mechanism):
    gated, _ = _pair(mechanism, **({"chunk_size": 4} if mechanism == GATED else {}))
    x = _x(batch=1, length=10)
    whole = gated(x, causal=True)
    out, state = gated.prefill(x[:, :6])
    outs = [out]
    for t in range(6, 10):
        out, state = gated.step(x[:, t:t + 1], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=0, atol=1e-12)
    packed, _ = gated.prefill_packed(torch.cat([x[:, :4], x[:, 4:]], dim=1), torch.tensor([0, 4, 10]))
    alone = torch.cat([gated(x[:, :4], causal=True), gated(x[:, 4:], causal=True)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)


def test_cross_attention_gates_from_the_queries_input():
    gated, plain = _pair(SOFTMAX)
    x, context = _x(length=5), _x(length=7, seed=2)
    k, v = gated.project_context(context)
    torch.testing.assert_close(gated.attend_projected(x, k, v), gated(x, context), rtol=0, atol=1e-12)
    assert not torch.allclose(gated(x, context), plain(x, context))


def test_off_adds_nothing_and_the_option_is_checked():
    torch.manual_seed(0)
    plain = MultiHeadAttention(DIM, HEADS, GATED)
    assert plain.gate_proj is None and not any("gate_proj" in name for name in plain.state_dict())
    assert "output_gate" not in repr(plain)
    assert "output_gate=True" in repr(MultiHeadAttention(DIM, HEADS, output_gate=True))
    for bad in ("true", 1, None):
        with pytest.raises(TypeError, match="^output_gate must be True or False"):
            MultiHeadAttention(DIM, HEADS, output_gate=bad)
    with pytest.raises(ValueError, match="^output_gate=True cannot be used with block='mamba2'"):
        BlockConfig(DIM, HEADS, block="mamba2", output_gate=True)
    with pytest.raises(TypeError, match="output_gate must be True or False"):
        ModelConfig(vocab_size=11, dim=DIM, heads=HEADS, output_gate="yes")


def test_a_schedule_item_gates_its_own_layer_and_is_recorded():
    text = f"{GATED}(chunk_size=4)*3,{SOFTMAX}(output_gate=true)"
    specs = parse_schedule(text, BLOCKS)
    assert specs[-1] == LayerSpec(SOFTMAX, {"output_gate": True})
    assert specs[-1].mechanism_options == {} and specs[0].mechanism_options == {"chunk_size": 4}
    assert format_schedule(specs) == text
    model = LanguageModel(ModelConfig(vocab_size=11, dim=DIM, heads=HEADS, depth=8, layers=text))
    gates = [layer.self_attention.gate_proj is not None for layer in model.decoder.layers]
    assert gates == [False, False, False, True] * 2
    assert [layer_spec(config) for config in model.config.layer_configs[:4]] == list(specs)
    # The whole model's setting gates every attention layer; an item may turn its own off; blocks have none.
    every = ModelConfig(vocab_size=11, dim=DIM, heads=HEADS, depth=3, output_gate=True,
                        layers=f"{GATED}(output_gate=false),{SOFTMAX},block:mamba2(state_dim=8,chunk_size=4)")
    assert [config.output_gate for config in every.layer_configs] == [False, True, False]
    with pytest.raises(TypeError, match=r"^layers item 'softmax\(output_gate=maybe\)'.*output_gate must be True or False"):
        ModelConfig(vocab_size=11, dim=DIM, heads=HEADS, depth=2, layers="softmax(output_gate=maybe)")


def test_training_builds_the_gate_on_token_and_seq2seq_models():
    task = load("recall", num_pairs=4, train_size=8, validation_size=4, test_size=4)
    tagger = build_model(TrainConfig("recall", task_options={"num_pairs": 4}, dim=DIM, heads=HEADS,
                                     output_gate=True), task)
    assert all(layer.self_attention.gate_proj is not None for layer in tagger.encoder.layers)
    scheduled = build_model(TrainConfig("recall", task_options={"num_pairs": 4}, dim=DIM, heads=HEADS, depth=2,
                                        layers=f"{GATED},{SOFTMAX}(output_gate=true)"), task)
    assert [layer.self_attention.gate_proj is not None for layer in scheduled.encoder.layers] == [False, True]
    seq2seq = Seq2SeqTransformer(13, 13, dim=DIM, heads=HEADS, encoder_depth=1, decoder_depth=1, output_gate=True)
    assert seq2seq.encoder.layers[0].self_attention.gate_proj is not None
    assert seq2seq.decoder.layers[0].self_attention.gate_proj is not None
    assert seq2seq.decoder.layers[0].cross_attention.gate_proj is None  # the self-attention slot only
