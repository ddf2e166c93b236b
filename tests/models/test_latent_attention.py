"""Multi-head latent attention (``MultiHeadLatentAttention``, ``block="mla"``; docs/hybrids.md): the forward pass
against a plain float64 reference written here (queries, keys and values materialised, softmax), the absorbed
decoding against the forward, a cache of latent_dim + rope_dim numbers per position, padding and packing, the
errors, and MLA layers in mixed schedules that decode as their forward and train."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cli_runs import run_cli
from attnzoo import MultiHeadAttention, UnsupportedOptionError
from attnzoo.functional.latent import absorbed_latent_attention, absorbed_queries, expand_latent_values
from attnzoo.functional.latent import latent_attention_reference
from attnzoo.models import (
    BlockConfig,
    LanguageModel,
    LatentAttentionState,
    LatentDecoderLayer,
    ModelConfig,
    MultiHeadLatentAttention,
    SequenceClassifier,
)
from attnzoo.models.config import layer_spec
from attnzoo.models.schedule import LayerSpec, format_schedule
from attnzoo.state import select_batch

GATED = "gated_delta"
DIM, HEADS = 16, 2
SETTINGS = [
    {},
    {"q_latent_dim": 12, "latent_dim": 20, "rope_dim": 6},
    {"rope_dim": 0},
    {"bias": True, "output_gate": True, "head_dim": 5, "rotary_base": 500.0},
]


def _x(batch=2, length=9, seed=1):
    return torch.randn(batch, length, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _layer(**options):
    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(DIM, HEADS, **options).double()
    with torch.no_grad():  # norms away from 1, so that a missed scale shows
        for parameter in (layer.kv_norm, layer.q_norm):
            if parameter is not None:
                parameter.uniform_(0.5, 1.5)
    return layer


# -- the reference, written out ----------------------------------------------------------------------------------
def _linear(x, module):
    return x @ module.weight.T + (0 if module.bias is None else module.bias)


def _rms(x, weight):
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)


def _rope(x, base):
    """Interleaved rotary embedding of x (..., seq, r) from position 0: pairs (2i, 2i+1) turned by pos * base^(-2i/r),
    the frequencies rounded to float32 as attnzoo's RotaryEmbedding (and Llama) makes them, the angles in float64
    (the layer under test is float64, its frequencies too)."""
    seq, width = x.shape[-2], x.shape[-1]
    frequencies = (1.0 / base ** (torch.arange(0, width, 2, dtype=torch.float32) / width)).double()
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * frequencies[None, :]  # (seq, width / 2)
    cos, sin = angles.cos(), angles.sin()
    out = x.clone()
    for i in range(width // 2):
        even, odd = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i], out[..., 2 * i + 1] = even * cos[:, i] - odd * sin[:, i], even * sin[:, i] + odd * cos[:, i]
    return out


def _reference(layer, x, causal, key_padding_mask=None, base=10000.0):
    """The layer's output with every head's query, key and value materialised, in float64."""
    batch, seq, _ = x.shape
    h, d, r, latent_dim = layer.heads, layer.head_dim, layer.rope_dim, layer.latent_dim
    if layer.q_proj is not None:
        q = _linear(x, layer.q_proj)
    else:
        q = _linear(_rms(_linear(x, layer.q_down), layer.q_norm), layer.q_up)
    q = q.view(batch, seq, h, d + r).transpose(1, 2)  # (batch, h, seq, d + r)
    down = _linear(x, layer.kv_down)
    c = _rms(down[..., :latent_dim], layer.kv_norm)
    k_content = (c @ layer.k_up.weight.T).view(batch, seq, h, d).transpose(1, 2)
    v = (c @ layer.v_up.weight.T).view(batch, seq, h, d).transpose(1, 2)
    if r:
        q = torch.cat([q[..., :d], _rope(q[..., d:], base)], dim=-1)
        k_rope = _rope(down[..., latent_dim:], base)[:, None].expand(-1, h, -1, -1)
        k = torch.cat([k_content, k_rope], dim=-1)
    else:
        k = k_content
    scores = q @ k.transpose(-1, -2) / math.sqrt(d + r)
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), -math.inf)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], -math.inf)
    heads = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq, h * d)
    if layer.gate_proj is not None:
        heads = heads * torch.sigmoid(_linear(x, layer.gate_proj))
    return _linear(heads, layer.out_proj)


@pytest.mark.parametrize("options", SETTINGS)
@pytest.mark.parametrize("causal", [True, False])
def test_the_forward_equals_a_plain_float64_reference(options, causal):
    layer, x = _layer(**options), _x()
    expected = _reference(layer, x, causal, base=options.get("rotary_base", 10000.0))
    torch.testing.assert_close(layer(x, causal=causal), expected, rtol=1e-12, atol=1e-12)
    assert layer.scale == 1 / math.sqrt(layer.head_dim + layer.rope_dim)


def test_key_padding_masks_the_padded_keys():
    layer, x = _layer(), _x()
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 6:] = True
    for causal in (False, True):
        out = layer(x, causal=causal, key_padding_mask=mask)
        torch.testing.assert_close(out, _reference(layer, x, causal, mask), rtol=1e-12, atol=1e-12)
    changed = x.clone()
    changed[0, 6:] = 100.0  # what a padded position holds changes no other position's output
    torch.testing.assert_close(layer(changed, key_padding_mask=mask)[0, :6], layer(x, key_padding_mask=mask)[0, :6],
                               rtol=1e-12, atol=1e-12)


# -- decoding -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", SETTINGS)
@pytest.mark.parametrize("prompt", [0, 1, 4])
def test_absorbed_decoding_equals_the_forward(options, prompt):
    layer, x = _layer(**options), _x(length=11)
    full = layer(x, causal=True)
    outputs, state = [], None
    if prompt:
        out, state = layer.prefill(x[:, :prompt])
        outputs.append(out)
    for position in range(prompt, x.shape[1]):
        out, state = layer.step(x[:, position:position + 1], state)
        outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, rtol=1e-10, atol=1e-10)
    assert isinstance(state, LatentAttentionState) and state.length == state.position == x.shape[1]


def test_the_absorbed_core_equals_its_materialised_float64_reference():
    generator = torch.Generator().manual_seed(3)
    batch, heads, head_dim, latent_dim, rope_dim, seq = 2, 3, 4, 10, 2, 7
    draw = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    q_content, q_rope = draw(batch, heads, 1, head_dim), draw(batch, heads, 1, rope_dim)
    latent, k_rope = draw(batch, seq, latent_dim), draw(batch, seq, rope_dim)
    up_keys, up_values = draw(heads, head_dim, latent_dim), draw(heads, head_dim, latent_dim)
    scale = 1 / math.sqrt(head_dim + rope_dim)
    out = expand_latent_values(absorbed_latent_attention(absorbed_queries(q_content, up_keys), q_rope,
                                                         torch.cat([latent, k_rope], -1), scale), up_values)
    expected = latent_attention_reference(q_content, q_rope, latent, k_rope, up_keys, up_values)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    wrong = latent_attention_reference(q_content, q_rope, latent, -k_rope, up_keys, up_values)
    assert not torch.allclose(out, wrong)


def test_the_cache_holds_latent_dim_plus_rope_dim_numbers_per_position():
    layer, x = _layer(latent_dim=20, rope_dim=6), _x(length=5)
    _, state = layer.prefill(x)
    _, state = layer.step(_x(length=1, seed=2), state)
    per_position = {name: t for name, t in state.cache.items() if t.dim() > 1}
    assert list(per_position) == ["latent"]  # besides it only "filled": one count per sequence
    assert per_position["latent"].shape[:2] == (2, 1) and per_position["latent"].shape[-1] == 26 == layer.cache_width
    assert state.cache["filled"].shape == (2,) and state.rows.shape == (2, 6, 26)
    mha = MultiHeadAttention(DIM, HEADS).double()
    _, mha_state = mha.prefill(x)
    mha_per_position = sum(t.shape[1] * t.shape[-1] for t in mha_state.mechanism.tensors.values() if t.dim() > 1)
    assert mha_per_position == 2 * HEADS * (DIM // HEADS)  # keys and values of every head, against [c ; k_R]


def test_steps_branch_and_follow_reordered_beams():
    layer, x = _layer(), _x(length=6)
    _, state = layer.prefill(x[:, :4])
    first, _ = layer.step(x[:, 4:5], state)
    again, _ = layer.step(x[:, 4:5], state)  # stepping twice from one state: the second sees the same cache
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    swapped = select_batch(state, torch.tensor([1, 0]))
    out, _ = layer.step(x[:, 4:5].flip(0), swapped)
    torch.testing.assert_close(out, first.flip(0), rtol=1e-12, atol=1e-12)


# -- packing ------------------------------------------------------------------------------------------------------
def test_a_packed_row_gives_each_document_what_it_gives_alone():
    layer = _layer(q_latent_dim=12)
    first, second = _x(1, 4, seed=4), _x(1, 7, seed=5)
    row, offsets = torch.cat([first, second], dim=1), torch.tensor([0, 4, 11])
    for causal in (True, False):
        packed = layer(row, causal=causal, cu_seqlens=offsets)
        torch.testing.assert_close(packed[:, :4], layer(first, causal=causal), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(packed[:, 4:], layer(second, causal=causal), rtol=1e-12, atol=1e-12)
    out, states = layer.prefill_packed(row, offsets)
    torch.testing.assert_close(out, layer(row, causal=True, cu_seqlens=offsets), rtol=0, atol=0)
    next_token = _x(1, 1, seed=6)
    for state, document in zip(states, (first, second)):
        _, alone = layer.prefill(document)
        torch.testing.assert_close(layer.step(next_token, state)[0], layer.step(next_token, alone)[0],
                                   rtol=1e-12, atol=1e-12)


# -- errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, error, message", [
    ({"latent_dim": 0}, ValueError, "^latent_dim must be an integer >= 1"),
    ({"rope_dim": 3}, ValueError, "^rope_dim must be even"),
    ({"rope_dim": -2}, ValueError, "^rope_dim must be an integer >= 0"),
    ({"q_latent_dim": 0}, ValueError, "^q_latent_dim must be an integer >= 1"),
    ({"head_dim": 2.0}, TypeError, "^head_dim must be an integer"),
    ({"bias": "no"}, TypeError, "^bias must be True or False"),
    ({"output_gate": 1}, TypeError, "^output_gate must be True or False"),
    ({"dropout": 1.0}, ValueError, "^dropout must be a number"),
    ({"rotary_base": 1}, ValueError, "^rotary_base must be a number > 1"),
    ({"rotary_base": 500.0, "rope_dim": 0}, ValueError, "^rotary_base=500.0 given but rope_dim=0"),
])
def test_bad_options_are_refused_naming_them(options, error, message):
    with pytest.raises(error, match=message):
        MultiHeadLatentAttention(DIM, HEADS, **options)
    with pytest.raises(ValueError, match="^dim=16 is not divisible by heads=3"):
        MultiHeadLatentAttention(DIM, 3)


def test_bad_inputs_are_refused_naming_them():
    layer, x = _layer(), _x()
    with pytest.raises(UnsupportedOptionError, match="^context=...: multi-head latent attention is self-attention"):
        layer(x, x)
    with pytest.raises(ValueError, match=r"^x must have shape \(batch, seq, 16\)"):
        layer(x[..., :8])
    with pytest.raises(TypeError, match="^x is torch.float32 but the module's parameters are torch.float64"):
        layer(x.float())
    with pytest.raises(TypeError, match="^causal must be True or False"):
        layer(x, causal="yes")
    with pytest.raises(ValueError, match=r"^key_padding_mask must have shape"):
        layer(x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="^cu_seqlens and key_padding_mask cannot be used together"):
        layer(x[:1], cu_seqlens=torch.tensor([0, 9]), key_padding_mask=torch.zeros(1, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="^cu_seqlens describes the documents of one packed row"):
        layer(x, cu_seqlens=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="^step takes one position"):
        layer.step(x[:, :2], None)
    _, state = layer.prefill(x[:, :3])
    with pytest.raises(ValueError, match="^state holds batch 2 but x_t has batch 1"):
        layer.step(x[:1, :1], state)
    with pytest.raises(TypeError, match="^state must be None .* LatentAttentionState"):
        layer.step(x[:, :1], MultiHeadAttention(DIM, HEADS).double().prefill(x)[1])
    with pytest.raises(ValueError, match="^state does not hold this layer's cache of 20 numbers"):
        _layer(latent_dim=16).step(x[:, :1], state)


def test_bad_block_settings_are_refused_naming_them():
    with pytest.raises(TypeError, match="^layers item 'block:mla\\(latent_dimm=8\\)': block_options: unknown"):
        ModelConfig(vocab_size=23, dim=DIM, heads=HEADS, layers="block:mla(latent_dimm=8)")
    with pytest.raises(ValueError, match="^layers item 'block:mla\\(rope_dim=3\\)': rope_dim must be even"):
        ModelConfig(vocab_size=23, dim=DIM, heads=HEADS, depth=2, layers=f"{GATED},mla(rope_dim=3)")
    with pytest.raises(ValueError, match="^kv_heads=1 cannot be used with block='mla': an MLA block's heads share"):
        BlockConfig(DIM, HEADS, block="mla", kv_heads=1)
    with pytest.raises(ValueError, match="^self_attention='local' cannot be used: block='mla'"):
        BlockConfig(DIM, HEADS, block="mla", self_attention=__import__("attnzoo").models.AttentionSpec("local"))
    with pytest.raises(ValueError, match="^cross_attention cannot be used: block='mla'"):
        BlockConfig(DIM, HEADS, block="mla", cross_attention=__import__("attnzoo").models.AttentionSpec())
    with pytest.raises(ValueError, match="reversible=True needs block='attention'"):
        ModelConfig(vocab_size=23, dim=DIM, heads=HEADS, layers=f"{GATED},mla", reversible=True)


# -- in models ----------------------------------------------------------------------------------------------------
def _tokens(batch=2, length=10, seed=0):
    return torch.randint(0, 23, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_a_mixed_schedule_builds_decodes_as_its_forward_and_packs():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=23, dim=DIM, heads=HEADS, depth=4, kv_heads=1,
                         layers=f"{GATED}*3,block:mla(latent_dim=12,output_gate=true)")
    assert format_schedule(config.layers) == f"{GATED}*3,block:mla(latent_dim=12,output_gate=true)"
    assert config.layer_kinds == ("attention",) * 3 + ("mla",) and config.layer_configs[3].kv_heads is None
    assert layer_spec(config.layer_configs[3]) == LayerSpec(options={"latent_dim": 12, "output_gate": True},
                                                            block="mla")
    model = LanguageModel(config).double().eval()
    mla = model.decoder.layers[3]
    assert isinstance(mla, LatentDecoderLayer) and mla.self_attention.latent_dim == 12
    assert mla.self_attention.gate_proj is not None and model.decoder.layers[0].self_attention.kv_heads == 1
    ids = _tokens()
    full = model(ids)
    logits, state = model.prefill(ids[:, :3])
    steps = [logits]
    for position in range(3, ids.shape[1]):
        logits_t, state = model.step(ids[:, position], state)
        steps.append(logits_t[:, None])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    cache = state.layers[3].self_attention
    assert isinstance(cache, LatentAttentionState) and cache.rows.shape == (2, 10, 12 + mla.self_attention.rope_dim)
    first, second = _tokens(1, 4, seed=1), _tokens(1, 6, seed=2)
    packed = model(torch.cat([first, second], dim=1), cu_seqlens=torch.tensor([0, 4, 10]))
    torch.testing.assert_close(packed[:, :4], model(first), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(packed[:, 4:], model(second), rtol=1e-10, atol=1e-10)


def test_a_classifier_of_mla_layers_ignores_padding():
    torch.manual_seed(0)
    model = SequenceClassifier(ModelConfig(vocab_size=23, dim=DIM, heads=HEADS, depth=2, layers="mla"), 3).double()
    ids, mask = _tokens(), torch.zeros(2, 10, dtype=torch.bool)
    mask[1, 7:] = True
    out = model(ids, padding_mask=mask)
    torch.testing.assert_close(out[1:], model(ids[1:, :7]), rtol=1e-10, atol=1e-10)


def test_a_mixed_schedule_trains(one_thread):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=23, dim=DIM, heads=HEADS, depth=2, layers=f"{GATED},block:mla"))
    attention = model.decoder.layers[1].self_attention
    before = {name: p.detach().clone() for name, p in attention.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _tokens(4, 12)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(value) for value in losses) and losses[-1] < losses[0]
    unchanged = [name for name, p in attention.named_parameters() if torch.equal(p, before[name])]
    assert unchanged == []  # every MLA parameter got a gradient and moved


def test_attnzoo_train_takes_a_schedule_with_mla(capsys, tmp_path, one_thread):
    task = json.dumps({"train_bytes": 2048, "validation_bytes": 512, "test_bytes": 512, "seq_len": 16})
    code, stdout, err = run_cli(capsys, "train", "bytes", "--task-options", task, "--dim", "16", "--depth", "4",
                                "--heads", "2", "--batch-size", "4", "--steps", "2", "--eval-interval", "2",
                                "--eval-batches", "1", "--quiet", "--layers", f"{GATED}*3,block:mla",
                                "--output", str(tmp_path / "run"))
    assert code == 0 and stdout.startswith(f"{GATED}+mla on bytes"), err
    code, stdout, err = run_cli(capsys, "eval", str(tmp_path / "run"), "--json")
    assert code == 0 and json.loads(stdout)["layers"] == f"{GATED}*3,block:mla", err
