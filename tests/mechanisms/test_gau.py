"""GAU and FLASH (Hua et al. 2022): the functional cores against their definitions and references, the
``gau`` and ``flash_gau`` mechanisms beyond the conformance suite (and the old name ``flash`` refused), and the
gated attention unit as a block of the models (causal, padding, decoding equal to the full forward, gradcheck,
clear errors for options that make no sense)."""

import math

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo import Encoder, LanguageModel, SequenceClassifier, SequenceTagger
from attnzoo.functional.gau import (
    gau_attention,
    gau_attention_reference,
    rotate,
    rotate_reference,
    squared_relu_attention,
)
from attnzoo.functional.mixed_chunk import mixed_chunk_attention, mixed_chunk_attention_reference
from attnzoo.functional.softmax import softmax_attention_reference
from attnzoo.models import BlockConfig, Decoder, GatedAttentionUnit, GatedDecoderLayer, GatedEncoderLayer
from attnzoo.state import select_batch
from decoding_helpers import incremental_logits

VOCAB = 11


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def tokens(batch, seq, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# -- rotary ---------------------------------------------------------------------------------------------------
def test_rotate_matches_complex_rotation_and_depends_on_offsets_only():
    x = randn(2, 3, 7, 8)
    torch.testing.assert_close(rotate(x, start=5), rotate_reference(x, start=5), rtol=1e-12, atol=1e-12)
    q, k = randn(1, 1, 1, 8, seed=1), randn(1, 1, 1, 8, seed=2)
    dots = [(rotate(q, start=a) * rotate(k, start=a - 3)).sum() for a in (3, 10, 40)]
    torch.testing.assert_close(torch.stack(dots), dots[0].expand(3), rtol=1e-10, atol=1e-12)
    assert not torch.allclose((rotate(q, start=3) * rotate(k, start=1)).sum(), dots[0])


# -- GAU: the definition ----------------------------------------------------------------------------------------
def test_gau_relu2_is_scaled_by_the_number_of_keys_seen():
    q, k, v = randn(2, 1, 6, 4, seed=1), randn(2, 1, 6, 4, seed=2), randn(2, 1, 6, 5, seed=3)
    scores = F.relu(q @ k.transpose(-1, -2) / 2.0) ** 2
    torch.testing.assert_close(gau_attention(q, k, v), scores @ v / 6)  # the paper's 1/N
    causal = scores.tril() / torch.arange(1, 7, dtype=torch.float64)[:, None]  # row i sees i + 1 keys
    torch.testing.assert_close(gau_attention(q, k, v, causal=True), causal @ v)
    mask = torch.tensor([[False] * 6, [False, False, True, False, True, True]])
    padded = gau_attention(q, k, v, key_padding_mask=mask)
    keep = [0, 1, 3]
    alone = F.relu(q[1:] @ k[1:, :, keep].transpose(-1, -2) / 2.0) ** 2 @ v[1:, :, keep] / 3
    torch.testing.assert_close(padded[1:], alone)


def test_gau_softmax_scores_are_softmax_attention():
    q, k, v = randn(2, 2, 7, 4, seed=4), randn(2, 2, 7, 4, seed=5), randn(2, 2, 7, 4, seed=6)
    for causal in (False, True):
        torch.testing.assert_close(gau_attention(q, k, v, causal, scores="softmax"),
                                   softmax_attention_reference(q, k, v, causal))


# -- FLASH: the definition ------------------------------------------------------------------------------------
def _forms(batch=2, heads=2, length=13, dim=4, width=5, seed=0):
    return [randn(batch, heads, length, dim, seed=seed + i) for i in range(4)] + [
        randn(batch, heads, length, width, seed=seed + 4)
    ]


def test_one_chunk_is_quadratic_attention_scaled_by_the_chunk_size_plus_global_linear_attention():
    qq, kq, ql, kl, v = _forms(length=6)
    c = 8  # longer than the sequence: one (short) chunk, still scaled by 1 / c
    quad = F.relu(qq @ kq.transpose(-1, -2) / 2.0) ** 2 / c
    lin = (ql @ kl.transpose(-1, -2) / 2.0) / 6
    torch.testing.assert_close(mixed_chunk_attention(qq, kq, ql, kl, v, c), (quad + lin) @ v)
    # Causal: no earlier chunk, so no linear part.
    torch.testing.assert_close(mixed_chunk_attention(qq, kq, ql, kl, v, c, causal=True), quad.tril() @ v)


def test_causal_linear_part_reads_the_previous_chunks_only():
    qq, kq, ql, kl, v = _forms(length=7)
    zero = torch.zeros_like(qq)
    # Quadratic forms of zero: only the linear part is left. Chunks of 3: rows 3-5 read keys 0-2, row 6 keys 0-5.
    out = mixed_chunk_attention(zero, zero, ql, kl, v, 3, causal=True)
    weights = ql @ kl.transpose(-1, -2) / 2.0
    expected = torch.zeros_like(out)
    expected[:, :, 3:6] = weights[:, :, 3:6, :3] @ v[:, :, :3] / 3
    expected[:, :, 6:] = weights[:, :, 6:, :6] @ v[:, :, :6] / 6
    torch.testing.assert_close(out, expected)


def test_softmax_inside_one_chunk_without_linear_forms_is_softmax_attention():
    qq, kq, _, _, v = _forms(length=9, width=4)
    zero = torch.zeros_like(qq)
    for causal in (False, True):
        out = mixed_chunk_attention(qq, kq, zero, zero, v, 16, causal, scores="softmax")
        torch.testing.assert_close(out, softmax_attention_reference(qq, kq, v, causal))


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 13, 40])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scores", ["relu2", "softmax"])
def test_mixed_chunk_attention_matches_its_reference(chunk_size, causal, scores):
    forms = _forms(length=13, seed=chunk_size)
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[1, [0, 4, 11, 12]] = True
    for padding in (None, mask):
        fast = mixed_chunk_attention(*forms, chunk_size, causal, padding, scores=scores)
        slow = mixed_chunk_attention_reference(*forms, chunk_size, causal, padding, scores=scores)
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, options", [("gau", {}), ("flash_gau", {"chunk_size": 4}),
                                           ("flash_gau", {"chunk_size": 4, "rotary": True})])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_at_the_end_gives_what_the_sequence_gives_alone(name, options, causal):
    """A user batching sequences of several lengths gets for each what it gives alone: chunk boundaries, scales
    and positions do not move with the padding after it."""
    mechanism = attnzoo.build_mechanism(name, 2, 8, **options).double()
    q, k, v = (randn(1, 2, 14, 8, seed=s) for s in (1, 2, 3))
    mask = torch.zeros(1, 14, dtype=torch.bool)
    mask[:, 10:] = True
    padded = mechanism(q, k, v, causal=causal, key_padding_mask=mask)[:, :, :10]
    alone = mechanism(q[:, :, :10], k[:, :, :10], v[:, :, :10], causal=causal)
    torch.testing.assert_close(padded, alone, rtol=1e-12, atol=1e-12)


def test_flash_gau_decoding_state_has_a_constant_size():
    mechanism = attnzoo.build_mechanism("flash_gau", 2, 8, chunk_size=4).double()
    q = randn(1, 2, 1, 8)
    state = None
    sizes = set()
    for _ in range(11):
        _, state = mechanism.step(q, q, q, state)
        sizes.add(tuple((name, tuple(t.shape)) for name, t in sorted(state.tensors.items())))
    assert len(sizes) == 1


def test_flash_gau_handles_a_value_width_other_than_head_dim():
    mechanism = attnzoo.build_mechanism("flash_gau", 1, 4, chunk_size=3).double()
    q, k, v = randn(2, 1, 8, 4, seed=1), randn(2, 1, 8, 4, seed=2), randn(2, 1, 8, 6, seed=3)
    full = mechanism(q, k, v, causal=True)
    out, state = mechanism.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5])
    steps = [out]
    for t in range(5, 8):
        out_t, state = mechanism.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        steps.append(out_t)
    torch.testing.assert_close(torch.cat(steps, dim=2), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(full, mechanism.reference(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name, options, match", [
    ("flash_gau", {"chunk_size": 0}, "chunk_size"),
    ("flash_gau", {"chunk_size": 2.0}, "chunk_size"),
    ("flash_gau", {"scores": "relu"}, "scores"),
    ("gau", {"scores": "sigmoid"}, "scores"),
    ("gau", {"rotary": "yes"}, "rotary"),
])
def test_bad_mechanism_options_raise_naming_them(name, options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        attnzoo.build_mechanism(name, 2, 8, **options)


def test_rotary_needs_an_even_head_dim():
    with pytest.raises(ValueError, match="rotary"):
        attnzoo.build_mechanism("flash_gau", 2, 7, rotary=True)


@pytest.mark.parametrize("call", [
    lambda: attnzoo.build_mechanism("flash", 2, 8),
    lambda: attnzoo.MultiHeadAttention(16, 2, mechanism="flash"),
    lambda: attnzoo.capabilities("flash"),
])
def test_the_old_name_flash_is_refused_naming_the_new_one(call):
    """The name "flash" reads as Dao et al.'s FlashAttention: it is refused with the same exception as an unknown
    name (which the command line turns into a usage error), and the message names ``flash_gau``."""
    assert "flash" not in attnzoo.available()
    with pytest.raises(ValueError, match=r"mechanism 'flash' was renamed 'flash_gau' \(FLASH mixed chunk attention"):
        call()
    assert isinstance(attnzoo.build_mechanism("flash_gau", 2, 8), attnzoo.mechanisms.MixedChunkAttention)


def test_a_name_never_registered_is_still_merely_unknown():
    with pytest.raises(ValueError, match="unknown mechanism 'flashy'"):
        attnzoo.build_mechanism("flashy", 2, 8)


# -- the block --------------------------------------------------------------------------------------------------
def language_model(block, **options):
    settings = dict(dim=16, heads=2, depth=2, block=block, positional="rotary")
    settings.update(options)
    torch.manual_seed(0)
    return LanguageModel(VOCAB, **settings).double().eval()


BLOCKS = [("gau", None), ("flash_gau", {"chunk_size": 3}), ("flash_gau", {"chunk_size": 4, "scores": "softmax"})]


@pytest.mark.parametrize("block, options", BLOCKS)
@pytest.mark.parametrize("positional", ["rotary", "sinusoidal"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_language_model_decodes_incrementally_like_the_full_forward(block, options, positional, norm_first):
    model = language_model(block, block_options=options, positional=positional, norm_first=norm_first)
    sequence = tokens(2, 10)
    full = model(sequence)
    for prompt_len in (1, 3, 4):
        torch.testing.assert_close(incremental_logits(model, prompt_len, sequence), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block, options", BLOCKS)
def test_language_model_is_causal(block, options):
    model = language_model(block, block_options=options)
    sequence = tokens(2, 10, seed=1)
    logits = model(sequence)
    for cut in (0, 4, 8):
        later = sequence.clone()
        later[:, cut + 1:] = (later[:, cut + 1:] + 3) % VOCAB
        torch.testing.assert_close(model(later)[:, : cut + 1], logits[:, : cut + 1], rtol=0, atol=1e-12)
    assert not torch.allclose(model(later), logits)


@pytest.mark.parametrize("block, options", BLOCKS)
def test_beam_search_and_greedy_decoding_run_on_gated_units(block, options):
    model = language_model(block, block_options=options)
    prompt = tokens(2, 3, seed=2)
    out = attnzoo.greedy_decode(model, prompt, max_new_tokens=6)
    # Greedy decoding equals picking the argmax of the full forward, one token at a time.
    sequence = prompt
    for _ in range(6):
        sequence = torch.cat([sequence, model(sequence)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, sequence)
    best = attnzoo.beam_search(model, prompt[:1], max_new_tokens=4, beam_size=3).best
    assert best.shape[-1] >= 3


def test_decoding_state_follows_select_batch():
    model = language_model("flash_gau", block_options={"chunk_size": 3})
    sequence = tokens(3, 8, seed=3)
    _, state = model.prefill(sequence[:, :5])
    index = torch.tensor([2, 0])
    chosen = select_batch(state, index)
    rows = []
    for t in range(5, 8):
        logits_t, chosen = model.step(sequence[index, t], chosen)
        rows.append(logits_t)
    torch.testing.assert_close(torch.stack(rows, dim=1), model(sequence[index])[:, 5:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block, options", BLOCKS)
def test_encoder_and_classifier_ignore_padding(block, options):
    torch.manual_seed(0)
    encoder = Encoder(16, 2, 2, block=block, block_options=options).double().eval()
    x = randn(2, 9, 16)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 6:] = True
    out = encoder(x, key_padding_mask=mask)
    changed = x.clone()
    changed[1, 6:] = float("nan")
    torch.testing.assert_close(encoder(changed, key_padding_mask=mask)[1, :6], out[1, :6], rtol=0, atol=1e-12)
    torch.testing.assert_close(encoder(x[1:, :6])[0], out[1, :6], rtol=1e-10, atol=1e-10)  # as if alone
    for model in (SequenceClassifier(VOCAB, 3, dim=16, heads=2, depth=1, block=block, block_options=options),
                  SequenceTagger(VOCAB, 3, dim=16, heads=2, depth=1, block=block, block_options=options)):
        model = model.double().eval()
        sequence = tokens(2, 9, seed=4)
        other = sequence.clone()
        other[1, 6:] = (other[1, 6:] + 1) % VOCAB
        a, b = model(sequence, padding_mask=mask), model(other, padding_mask=mask)
        torch.testing.assert_close(a[:1], b[:1], rtol=0, atol=1e-12)
        torch.testing.assert_close(a[1, :6] if a.dim() == 3 else a[1], b[1, :6] if b.dim() == 3 else b[1],
                                   rtol=0, atol=1e-12)


@pytest.mark.parametrize("block, options", BLOCKS)
@pytest.mark.parametrize("causal", [False, True])
def test_gated_unit_gradcheck(block, options, causal):
    torch.manual_seed(0)
    config = BlockConfig(8, 1, block=block, block_options=options, rotary=True)
    unit = (GatedDecoderLayer if causal else GatedEncoderLayer)(config).double()
    x = randn(2, 7, 8, seed=5).requires_grad_()
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 5:] = True

    def run(x):
        return unit(x, padding_mask=mask) if causal else unit(x, key_padding_mask=mask)

    assert torch.autograd.gradcheck(run, (x,), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)
    run(x).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in unit.parameters())


def test_a_unit_has_the_papers_shape_and_half_the_parameters_of_a_block():
    dim = 512
    unit = GatedAttentionUnit(BlockConfig(dim, 4, block="gau"), causal=True)
    e, s = 2 * dim, 128
    assert unit.expansion_dim == e and unit.shared_dim == s
    assert GatedAttentionUnit(BlockConfig(64, 4, block="gau"), causal=True).shared_dim == 64  # min(128, dim)
    weights = dim * (2 * e + s) + e * dim
    count = sum(p.numel() for p in unit.parameters())
    assert count == weights + (2 * e + s) + dim + 2 * dim + 2 * 2 * s  # biases, norm, scales and offsets
    block = attnzoo.DecoderLayer(BlockConfig(dim, 4))
    assert abs(2 * count / sum(p.numel() for p in block.parameters()) - 1) < 0.05  # 6.25 dim^2 against 12


def test_the_default_block_is_unchanged():
    model = LanguageModel(VOCAB, 16, 2, 1)
    assert model.decoder.config.block == "attention"
    assert type(model.decoder.layers[0]) is attnzoo.DecoderLayer


@pytest.mark.parametrize("build, error, match", [
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", self_attention="performer"), ValueError, "self_attention"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="flash_gau", self_attention_options={"scale": 0.5}), ValueError,
     "self_attention_options"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", ff_dim=32), ValueError, "ff_dim"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", activation="swiglu"), ValueError, "activation"),
    (lambda: Encoder(16, 2, 1, block="flash_gau", ff_chunks=2), ValueError, "ff_chunks"),
    (lambda: Decoder(16, 2, 1, block="gau"), ValueError, "cross_attention"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", reversible=True), ValueError, "reversible"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gated"), ValueError, "block"),
    (lambda: LanguageModel(VOCAB, 16, 2, block_options={"chunk_size": 4}), ValueError, "block_options"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="flash_gau", block_options={"chunk": 4}), TypeError, "chunk"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", block_options={"chunk_size": 4}), ValueError, "chunk_size"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="flash_gau", block_options={"chunk_size": 0}), ValueError, "chunk_size"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", block_options={"shared_dim": 32}), ValueError, "shared_dim"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", block_options={"expansion_dim": 1.5}), TypeError,
     "expansion_dim"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", block_options={"scores": "relu"}), ValueError, "scores"),
    (lambda: LanguageModel(VOCAB, 16, 2, block="gau", positional="rotary", block_options={"shared_dim": 5}),
     ValueError, "shared_dim"),
    (lambda: BlockConfig(16, 2, block="flash_gau", block_options=[("chunk_size", 4)]), TypeError, "block_options"),
])
def test_options_that_make_no_sense_for_a_gated_unit_raise_naming_them(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_a_gated_decoder_layer_refuses_memory():
    layer = GatedDecoderLayer(BlockConfig(16, 2, block="flash_gau"))
    with pytest.raises(ValueError, match="memory"):
        layer(torch.randn(1, 3, 16), torch.randn(1, 2, 16))


def test_flash_trains_a_language_model_one_step():
    model = LanguageModel(VOCAB, 16, 2, 2, block="flash_gau", block_options={"chunk_size": 4}).double()
    sequence = tokens(2, 12, seed=7)
    loss = F.cross_entropy(model(sequence)[:, :-1].reshape(-1, VOCAB), sequence[:, 1:].reshape(-1))
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# -- the fused squared-ReLU core ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", ["none", "causal", "broadcast padding"])
def test_squared_relu_attention_and_its_backward_match_autograd_on_the_formula(mask):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 2, 7, 5, generator=g, dtype=torch.float64) for _ in range(3))
    allowed = None
    if mask == "causal":
        allowed = torch.ones(7, 7, dtype=torch.bool).tril()
    elif mask == "broadcast padding":
        allowed = torch.rand(2, 1, 2, 1, 7, generator=g) > 0.3
    grad = torch.randn(2, 3, 2, 7, 5, generator=g, dtype=torch.float64)
    results = []
    for fused in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if fused:
            out = squared_relu_attention(*leaves, allowed)
        else:
            weights = F.relu(leaves[0] @ leaves[1].transpose(-1, -2)) ** 2
            if allowed is not None:
                weights = torch.where(allowed, weights, torch.zeros(()))
            out = weights @ leaves[2]
        (out * grad).sum().backward()
        results.append((out.detach(), *(x.grad for x in leaves)))
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    assert results[0][1].abs().sum() > 0 and results[0][3].abs().sum() > 0
