"""The Mamba-2 block (``block="mamba2"``): the block against a float64 per-token definition of Mamba-2,
decoding step by step equal to the parallel forward, causal, padding invisible, gradcheck, autocast, clear
errors for options that make no sense, and training from ``attnzoo train --block mamba2``."""

import json

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo import Encoder, LanguageModel, SequenceClassifier, SequenceTagger
from attnzoo.cli import main
from attnzoo.models import BlockConfig, Decoder, Mamba2Block, Mamba2DecoderLayer, Mamba2EncoderLayer, Mamba2State
from attnzoo.state import select_batch
from decoding_helpers import incremental_logits

VOCAB = 11
TIGHT = dict(rtol=1e-10, atol=1e-10)
OPTIONS = [
    {"state_dim": 4, "chunk_size": 3},
    {"state_dim": 5, "chunk_size": 4, "groups": 2, "conv_size": 2, "expansion": 1},
    {"state_dim": 3, "conv_size": 1},
]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def tokens(batch, seq, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def language_model(options, **settings):
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, **{"dim": 16, "heads": 2, "depth": 2, "block": "mamba2", "block_options": options,
                                    **settings}).double().eval()
    _spread_step_sizes(model)
    return model


def _spread_step_sizes(model):
    """Step sizes of order one (Mamba-2 starts them at 0.001 to 0.1): decays far from 1, so that a wrong decay
    shows in the comparisons."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for block in (m for m in model.modules() if isinstance(m, Mamba2Block)):
            block.dt_bias.copy_(torch.randn(block.heads, generator=g, dtype=torch.float64))
            block.D.copy_(torch.randn(block.heads, generator=g, dtype=torch.float64))
            block.norm.weight.copy_(1 + 0.1 * torch.randn(block.inner_dim, generator=g, dtype=torch.float64))


# -- the definition ------------------------------------------------------------------------------------------
def mamba2_branch_definition(block, h):
    """Mamba-2's mixer written out for float64 input h (batch, seq, dim), one position at a time, in
    mamba_ssm's layout: (batch, seq, heads, head_dim) values, per-group B and C."""
    batch, seq, _ = h.shape
    e, n, g, heads, p = block.inner_dim, block.state_dim, block.groups, block.heads, block.head_dim
    z, xbc, dt = (h @ block.in_proj.weight.T).split([e, block.conv_dim, heads], dim=-1)
    weight, bias = block.conv1d.weight[:, 0], block.conv1d.bias  # (conv_dim, K), (conv_dim,)
    k = block.conv_size
    padded = torch.cat([xbc.new_zeros(batch, k - 1, block.conv_dim), xbc], dim=1)
    conv = torch.stack([(padded[:, t:t + k] * weight.T).sum(1) + bias for t in range(seq)], dim=1)
    x, b, c = F.silu(conv).split([e, g * n, g * n], dim=-1)
    x, b, c = x.view(batch, seq, heads, p), b.view(batch, seq, g, n), c.view(batch, seq, g, n)
    dt = F.softplus(dt + block.dt_bias)
    a = -torch.exp(block.A_log)
    state = h.new_zeros(batch, heads, n, p)
    ys = []
    for t in range(seq):
        group = torch.arange(heads) // (heads // g)
        bt, ct = b[:, t, group], c[:, t, group]  # (batch, heads, n)
        written = (dt[:, t, :, None] * bt)[..., None] * x[:, t, :, None]  # (batch, heads, n, p)
        state = torch.exp(dt[:, t] * a)[..., None, None] * state + written
        ys.append(torch.einsum("bhn,bhnp->bhp", ct, state) + block.D[:, None] * x[:, t])
    y = torch.stack(ys, dim=1).reshape(batch, seq, e) * F.silu(z)
    y = y.view(batch, seq, g, e // g)
    y = (y / torch.sqrt(y.square().mean(-1, keepdim=True) + block.norm.eps)).reshape(batch, seq, e) * block.norm.weight
    return y @ block.out_proj.weight.T


@pytest.mark.parametrize("options", OPTIONS)
def test_block_is_mamba2_written_out(options):
    model = language_model(options, heads=4 if options.get("groups") == 2 else 2)
    block = model.decoder.layers[0]
    h = randn(2, 11, 16, seed=3)
    torch.testing.assert_close(block._branch(h, None), mamba2_branch_definition(block, h), **TIGHT)


# -- decoding ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("positional", ["sinusoidal", "none"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_language_model_decodes_incrementally_like_the_full_forward(options, positional, norm_first):
    heads = 4 if options.get("groups") == 2 else 2
    model = language_model(options, positional=positional, norm_first=norm_first, heads=heads)
    sequence = tokens(2, 10)
    full = model(sequence)
    for prompt_len in (1, 2, 4, 7):
        torch.testing.assert_close(incremental_logits(model, prompt_len, sequence), full, **TIGHT)


def test_block_steps_from_no_state_like_the_parallel_forward():
    torch.manual_seed(0)
    layer = Mamba2DecoderLayer(BlockConfig(8, 2, block="mamba2", block_options={"state_dim": 3, "chunk_size": 2}))
    layer = layer.double()
    x = randn(3, 9, 8, seed=1)
    state, rows = None, []
    for t in range(9):
        out, state = layer.step(x[:, t:t + 1], state)
        rows.append(out)
    torch.testing.assert_close(torch.cat(rows, dim=1), layer(x), **TIGHT)


def test_decoding_state_has_a_constant_size_and_follows_select_batch():
    model = language_model({"state_dim": 4, "chunk_size": 3})
    sequence = tokens(3, 12, seed=3)
    _, short = model.prefill(sequence[:, :2])
    _, state = model.prefill(sequence[:, :5])
    for a, b in zip(short.layers, state.layers):
        assert isinstance(b, Mamba2State) and a.conv.shape == b.conv.shape and a.ssm.shape == b.ssm.shape
    assert state.layers[0].conv.shape == (3, 32 + 2 * 4, 3) and state.layers[0].ssm.shape == (3, 2, 4, 16)
    index = torch.tensor([2, 0])
    chosen = select_batch(state, index)
    rows = []
    for t in range(5, 12):
        logits_t, chosen = model.step(sequence[index, t], chosen)
        rows.append(logits_t)
    torch.testing.assert_close(torch.stack(rows, dim=1), model(sequence[index])[:, 5:], **TIGHT)


def test_greedy_and_beam_search_run_on_mamba2_blocks():
    model = language_model({"state_dim": 4, "chunk_size": 3})
    prompt = tokens(2, 3, seed=2)
    out = attnzoo.greedy_decode(model, prompt, max_new_tokens=6)
    sequence = prompt
    for _ in range(6):
        sequence = torch.cat([sequence, model(sequence)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, sequence)
    assert attnzoo.beam_search(model, prompt[:1], max_new_tokens=4, beam_size=3).best.shape[-1] >= 3


# -- causal and padding ----------------------------------------------------------------------------------------
def test_language_model_is_causal():
    model = language_model({"state_dim": 4, "chunk_size": 3})
    sequence = tokens(2, 10, seed=1)
    logits = model(sequence)
    for cut in (0, 4, 8):
        later = sequence.clone()
        later[:, cut + 1:] = (later[:, cut + 1:] + 3) % VOCAB
        torch.testing.assert_close(model(later)[:, : cut + 1], logits[:, : cut + 1], rtol=0, atol=1e-12)
    assert not torch.allclose(model(later), logits)


@pytest.mark.parametrize("options", OPTIONS[:2])
def test_encoder_classifier_and_tagger_ignore_padding(options):
    heads = 4 if options.get("groups") == 2 else 2
    torch.manual_seed(0)
    encoder = Encoder(16, heads, 2, block="mamba2", block_options=options).double().eval()
    _spread_step_sizes(encoder)
    x = randn(2, 9, 16)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 6:] = True
    mask[0, 2] = True  # inside the sequence too: the convolution sees zeros there
    out = encoder(x, key_padding_mask=mask)
    for filler in (float("nan"), float("inf"), 1e6):
        changed = x.masked_fill(mask[..., None], filler)
        got = encoder(changed, key_padding_mask=mask)
        torch.testing.assert_close(got.masked_fill(mask[..., None], 0), out.masked_fill(mask[..., None], 0),
                                   rtol=0, atol=1e-12)
    torch.testing.assert_close(encoder(x[1:, :6])[0], out[1, :6], **TIGHT)  # padded at the end: as if alone
    for model in (SequenceClassifier(VOCAB, 3, dim=16, heads=heads, depth=1, block="mamba2", block_options=options),
                  SequenceTagger(VOCAB, 3, dim=16, heads=heads, depth=1, block="mamba2", block_options=options)):
        model = model.double().eval()
        sequence = tokens(2, 9, seed=4)
        other = sequence.masked_fill(mask, 5)
        a, b = model(sequence, padding_mask=mask), model(other, padding_mask=mask)
        if isinstance(model, SequenceTagger):  # a tag per position: the unpadded ones must not change
            a, b = a[~mask], b[~mask]
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal_layer", [Mamba2DecoderLayer, Mamba2EncoderLayer])
def test_block_gradcheck_with_padding(causal_layer):
    torch.manual_seed(0)
    config = BlockConfig(8, 2, block="mamba2", block_options={"state_dim": 3, "chunk_size": 3, "groups": 2})
    layer = causal_layer(config).double()
    _spread_step_sizes(layer)
    x = randn(2, 7, 8, seed=5).requires_grad_()
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 5:] = True

    def run(x):
        out = layer(x, padding_mask=mask) if causal_layer is Mamba2DecoderLayer else layer(x, key_padding_mask=mask)
        return out.masked_fill(mask[..., None], 0)

    assert torch.autograd.gradcheck(run, (x,), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)
    run(x).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_language_model_trains_under_bfloat16_autocast():
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, 16, 2, 1, block="mamba2", block_options={"state_dim": 4, "chunk_size": 4})
    sequence = tokens(2, 9, seed=1)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 6:] = True

    def loss_and_grads(autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logits = model(sequence, padding_mask=mask)
        logits.float().square().mean().backward()
        return [logits.float()] + [p.grad for p in model.parameters()]

    for got, want in zip(loss_and_grads(True), loss_and_grads(False)):
        assert torch.isfinite(got).all()
        assert (got - want).norm() <= 0.1 * want.norm() + 1e-6


# -- shape and options -------------------------------------------------------------------------------------------
def test_block_has_mamba2s_parameters():
    dim, heads = 64, 4
    block = Mamba2Block(BlockConfig(dim, heads, block="mamba2"))  # state 128, expansion 2, conv 4, one group
    e, n = 2 * dim, 128
    shapes = {name: tuple(p.shape) for name, p in block.named_parameters()}
    assert shapes == {
        "block.norm.weight": (dim,), "block.norm.bias": (dim,),
        "in_proj.weight": (2 * e + 2 * n + heads, dim), "conv1d.weight": (e + 2 * n, 1, 4), "conv1d.bias": (e + 2 * n,),
        "dt_bias": (heads,), "A_log": (heads,), "D": (heads,), "norm.weight": (e,), "out_proj.weight": (dim, e),
    }
    assert block.head_dim == e // heads
    assert torch.all((F.softplus(block.dt_bias) >= 0.001 - 1e-6) & (F.softplus(block.dt_bias) <= 0.1 + 1e-6))


@pytest.mark.parametrize("build, error, match", [
    (lambda: LanguageModel(VOCAB, 16, 2, block="mamba2", block_options={"state": 4}), TypeError, "state"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="mamba2", block_options={"groups": 3}), ValueError, "groups=3"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="mamba2", block_options={"chunk_size": 0}), ValueError, "chunk_size"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="mamba2", block_options={"expansion": 1.5}), TypeError, "expansion"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="mamba2", block_options={"conv_size": True}), TypeError, "conv_size"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="mamba2", positional="rotary"), ValueError, "rotary"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="mamba2", self_attention="performer"), ValueError, "self_attention"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="mamba2", ff_dim=32), ValueError, "expansion"),
    (lambda: LanguageModel(VOCAB, 16, 4, block="mamba2", kv_heads=2), ValueError, "kv_heads=2.*groups"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="mamba2", reversible=True), ValueError, "reversible"),
    (lambda: Decoder(16, 2, 1, block="mamba2"), ValueError, "cross_attention"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", block_options={"state_dim": 4}), TypeError, "state_dim"),
])
def test_options_that_make_no_sense_raise_naming_them(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_a_mamba2_layer_refuses_memory_and_bidirectional_decoding():
    layer = Mamba2DecoderLayer(BlockConfig(16, 2, block="mamba2", block_options={"state_dim": 4}))
    with pytest.raises(ValueError, match="no cross-attention"):
        layer(torch.randn(1, 3, 16), torch.randn(1, 2, 16))
    decoder = Decoder(16, 2, 1, block="mamba2", cross_attention=None)
    with pytest.raises(ValueError, match="causal=False"):
        decoder(torch.randn(1, 3, 16), causal=False)
    with pytest.raises(TypeError, match="Mamba2State"):
        layer.step(torch.randn(1, 1, 16), object())


# -- training ------------------------------------------------------------------------------------------------
def test_train_bytes_with_block_mamba2_from_the_command_line(capsys, tmp_path):
    out_dir = tmp_path / "run"
    bytes_options = {"train_bytes": 8192, "validation_bytes": 2048, "test_bytes": 2048, "seq_len": 32}
    argv = ["train", "bytes", "--task-options", json.dumps(bytes_options), "--dim", "16", "--depth", "1",
            "--heads", "2", "--batch-size", "8", "--steps", "4", "--eval-interval", "2", "--block", "mamba2",
            "--block-options", "state_dim=8,chunk_size=8", "--output", str(out_dir), "--quiet", "--threads", "1"]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert main(["eval", str(out_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["block"] == "mamba2" and result["metrics"]["bits_per_byte"] > 0


def test_cls_pooling_is_refused_where_the_first_position_sees_no_token():
    from attnzoo import UnsupportedOptionError
    from attnzoo.models import SequenceClassifier

    with pytest.raises(UnsupportedOptionError, match="pooling='cls'.*mamba2"):
        SequenceClassifier(20, 3, dim=16, heads=2, depth=1, pooling="cls", block="mamba2",
                           block_options={"state_dim": 8})


# -- packed rows (cu_seqlens) ---------------------------------------------------------------------------------
LENGTHS = (5, 1, 7, 3, 8)  # a document of one position, none a multiple of the chunk sizes 3 and 4 but one


def _packed(lengths=LENGTHS):
    """Each document's (start, end) and the int64 offsets of the row that holds them back to back."""
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return list(zip(offsets[:-1].tolist(), offsets[1:].tolist())), offsets


def _gradients(module, loss):
    module.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in module.parameters()]


def _assert_packed_equals_alone(module, run, inputs, offsets, spans):
    """Outputs and parameter gradients of the packed row equal those of its documents run one by one."""
    packed = run(inputs, offsets)
    alone = [run(inputs[:, start:end], None) for start, end in spans]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), **TIGHT)
    weights = randn(*packed.shape, seed=9)  # a loss that weighs every output differently
    expected = _gradients(module, sum((out * weights[:, s:e]).sum() for out, (s, e) in zip(alone, spans)))
    for got, want in zip(_gradients(module, (run(inputs, offsets) * weights).sum()), expected):
        torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.parametrize("options, norm_first, causal_layer", [
    *((options, True, Mamba2DecoderLayer) for options in OPTIONS),
    (OPTIONS[0], False, Mamba2EncoderLayer),
])
def test_a_block_on_a_packed_row_gives_each_document_what_it_gives_alone(options, norm_first, causal_layer):
    """Convolution window and SSM state restart at each document (conv_size 1, 2 and 4; chunks of 3 and 4
    that documents straddle), in outputs, input gradients and parameter gradients."""
    torch.manual_seed(0)
    heads = 4 if options.get("groups") == 2 else 2
    layer = causal_layer(BlockConfig(16, heads, norm_first=norm_first, block="mamba2", block_options=options))
    layer = layer.double()
    _spread_step_sizes(layer)
    spans, offsets = _packed()
    x = randn(1, int(offsets[-1]), 16, seed=2).requires_grad_()

    def run(inputs, cu_seqlens):
        return layer(inputs, cu_seqlens=cu_seqlens)

    _assert_packed_equals_alone(layer, run, x, offsets, spans)
    weights = randn(*x.shape, seed=4)
    packed_grad, = torch.autograd.grad((run(x, offsets) * weights).sum(), x)
    alone_grad = torch.cat([torch.autograd.grad((run(x[:, s:e], None) * weights[:, s:e]).sum(), x)[0][:, s:e]
                            for s, e in spans], dim=1)
    torch.testing.assert_close(packed_grad, alone_grad, **TIGHT)
    # The comparison can fail: the row run as one sequence carries the window and state across documents.
    assert (run(x, None) - run(x, offsets)).abs().max() > 1e-3


def test_the_unpacked_block_is_unchanged_by_the_packed_path():
    """A row of one document packed is the row itself, bit for bit."""
    torch.manual_seed(0)
    layer = Mamba2EncoderLayer(BlockConfig(16, 2, block="mamba2", block_options={"state_dim": 4, "chunk_size": 3}))
    x = torch.randn(1, 10, 16)
    assert torch.equal(layer(x, cu_seqlens=torch.tensor([0, 10])), layer(x))


@pytest.mark.parametrize("build", [
    lambda: language_model({"state_dim": 4, "chunk_size": 3}, token_shift=True),
    lambda: language_model({"state_dim": 5, "chunk_size": 4, "groups": 2, "conv_size": 2}, heads=4,
                           positional="none", norm_first=False),
    lambda: SequenceTagger(VOCAB, 3, dim=16, heads=2, depth=2, block="mamba2", token_shift=True,
                           block_options={"state_dim": 4, "chunk_size": 4}),
], ids=["language_model", "language_model_post_norm", "tagger"])
def test_token_models_with_mamba2_blocks_pack(build):
    model = build().double().eval()
    _spread_step_sizes(model)
    spans, offsets = _packed()
    sequence = tokens(1, int(offsets[-1]), seed=6)

    def run(inputs, cu_seqlens):
        return model(inputs, cu_seqlens=cu_seqlens)

    _assert_packed_equals_alone(model, run, sequence, offsets, spans)


def test_a_classifier_with_mamba2_blocks_classifies_each_packed_document_as_alone():
    torch.manual_seed(0)
    model = SequenceClassifier(VOCAB, 3, dim=16, heads=2, depth=2, block="mamba2", positional="learned",
                               max_length=16, block_options={"state_dim": 4, "chunk_size": 3}).double().eval()
    _spread_step_sizes(model)
    spans, offsets = _packed()
    sequence = tokens(1, int(offsets[-1]), seed=7)
    packed = model(sequence, cu_seqlens=offsets)
    alone = [model(sequence[:, s:e]) for s, e in spans]
    torch.testing.assert_close(packed, torch.cat(alone), **TIGHT)
    expected = _gradients(model, sum(out.square().sum() for out in alone))
    for got, want in zip(_gradients(model, model(sequence, cu_seqlens=offsets).square().sum()), expected):
        torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.parametrize("stack", [
    lambda: Decoder(dim=16, heads=2, depth=2, block="mamba2", cross_attention=None,
                    block_options={"state_dim": 4, "chunk_size": 4}),
    lambda: Encoder(dim=16, heads=2, depth=2, block="mamba2", block_options={"state_dim": 4, "chunk_size": 4}),
], ids=["decoder", "encoder"])
def test_stacks_of_mamba2_layers_pack(stack):
    torch.manual_seed(0)
    stack = stack().double()
    _spread_step_sizes(stack)
    spans, offsets = _packed()
    x = randn(1, int(offsets[-1]), 16, seed=8)
    torch.testing.assert_close(stack(x, cu_seqlens=offsets), torch.cat([stack(x[:, s:e]) for s, e in spans], dim=1),
                               **TIGHT)


@pytest.mark.parametrize("call, error, match", [
    (lambda layer, x: layer(x, cu_seqlens=torch.tensor([0, 3, 9]), key_padding_mask=torch.zeros(1, 9).bool()),
     ValueError, "cu_seqlens and key_padding_mask"),
    (lambda layer, x: layer(x.expand(2, -1, -1), cu_seqlens=torch.tensor([0, 3, 9])), ValueError, "cu_seqlens.*batch"),
    (lambda layer, x: layer(x, cu_seqlens=torch.tensor([0, 3, 8])), ValueError, "cu_seqlens must end at"),
    (lambda layer, x: layer(x, cu_seqlens=torch.tensor([0, 3, 3, 9])), ValueError, "cu_seqlens must be strictly"),
    (lambda layer, x: layer(x, cu_seqlens=torch.tensor([0, 9]).int()), TypeError, "cu_seqlens must be int64"),
    (lambda layer, x, cu=torch.tensor([0, 9]): torch.jit.trace(lambda x: layer(x, cu_seqlens=cu), (x,)),
     attnzoo.UnsupportedOptionError, "cu_seqlens cannot be traced"),
])
def test_bad_packed_rows_are_refused_naming_cu_seqlens_before_computation(call, error, match):
    layer = Mamba2EncoderLayer(BlockConfig(16, 2, block="mamba2", block_options={"state_dim": 4}))
    calls = []
    layer.in_proj.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(error, match=match):
        call(layer, torch.randn(1, 9, 16))
    assert not calls


def test_train_bytes_packed_with_block_mamba2_from_the_command_line(capsys, tmp_path):
    bytes_options = {"train_bytes": 8192, "validation_bytes": 2048, "test_bytes": 2048, "seq_len": 32}
    argv = ["train", "bytes", "--pack", "--task-options", json.dumps(bytes_options), "--dim", "16", "--depth", "1",
            "--heads", "2", "--batch-size", "4", "--steps", "3", "--eval-interval", "3", "--block", "mamba2",
            "--block-options", "state_dim=8,chunk_size=8", "--output", str(tmp_path / "run"), "--quiet", "--json",
            "--threads", "1"]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert result["config"]["pack"] is True and result["config"]["block"] == "mamba2"
    assert result["test"]["bits_per_byte"] > 0
