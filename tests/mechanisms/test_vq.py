"""Transformer-VQ (``vq``): exact attention when the codebook holds every key, the fast path against its
reference (gradients through the straight-through estimator included), the codebook's training made
explicit (commitment loss, EMA update, seeded restarts), a pure eval forward, and decoding in a model."""

import copy

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo import LanguageModel
from attnzoo.functional.softmax import softmax_attention_reference
from attnzoo.functional.prefix import lagged_prefix_sums, lagged_prefix_sums_reference
from attnzoo.functional.vq import (
    cached_vq_attention,
    dense_vq_attention,
    quantize,
    quantize_reference,
    vq_attention,
    vq_attention_reference,
)
from attnzoo.mechanisms import auxiliary_loss
from attnzoo.mechanisms.vq import VQAttention, update_codebooks

VOCAB = 11


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def keys_from(codebook, length, batch=2, seed=0):
    """Keys (batch, heads, length, d) each equal to a codeword of its head, drawn at random."""
    heads, size, _ = codebook.shape
    codes = torch.randint(0, size, (batch, heads, length), generator=torch.Generator().manual_seed(seed))
    return torch.stack([codebook[h][codes[:, h]] for h in range(heads)], dim=1)


def build(**options):
    settings = dict(codebook_size=8, block_size=3, seed=0)
    settings.update(options)
    return attnzoo.build_mechanism("vq", 2, 4, **settings).double()


# -- exactness --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_a_codebook_holding_every_distinct_key_gives_exact_softmax_attention(causal, block_size):
    codebook = randn(2, 6, 4, seed=1)
    k = keys_from(codebook, 13)
    q, v = randn(2, 2, 13, 4, seed=2), randn(2, 2, 13, 5, seed=3)
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[1, [0, 6, 12]] = True
    for padding in (None, mask):
        out = vq_attention(q, k, v, codebook, block_size, causal, padding)
        torch.testing.assert_close(out, softmax_attention_reference(q, k, v, causal, padding), rtol=1e-10, atol=1e-12)
    mechanism = build(codebook_size=6, block_size=block_size).eval()
    mechanism.codebook.copy_(codebook)
    torch.testing.assert_close(mechanism(q, k, v[..., :4], causal=causal),
                               softmax_attention_reference(q, k, v[..., :4], causal), rtol=1e-10, atol=1e-12)


def test_a_small_codebook_approximates_and_the_error_falls_with_its_size():
    q, k, v = (randn(1, 2, 64, 4, seed=s) for s in (4, 5, 6))
    exact = softmax_attention_reference(q, k, v, True)
    errors = []
    for size in (2, 16, 256):
        mechanism = build(codebook_size=size, block_size=8).eval()
        mechanism.codebook.copy_(torch.cat([k[0][:, :size],
                                            randn(2, max(0, size - 64), 4, seed=size)], dim=1)[:, :size])
        errors.append(float((mechanism(q, k, v, causal=True) - exact).norm() / exact.norm()))
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-12  # 256 codewords hold all 64 keys


def test_quantize_picks_the_nearest_codeword():
    codebook, k = randn(3, 10, 5, seed=7), randn(2, 3, 20, 5, seed=8)
    codes = quantize(k, codebook)
    assert torch.equal(codes, quantize_reference(k, codebook))
    distances = (k[:, :, :, None] - codebook[None, :, None]).square().sum(-1)
    assert torch.equal(distances.gather(-1, codes[..., None]).squeeze(-1), distances.amin(-1))


# -- gradients --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [7, 12])  # shorter than the sequence: the codeword cache; longer: dense
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 5])
def test_straight_through_gradients_match_the_reference(causal, block_size, size):
    codebook = randn(2, size, 4, seed=9)
    inputs = [randn(2, 2, 11, 4, seed=s) for s in (10, 11, 12)]
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, [2, 9, 10]] = True
    weights = randn(2, 2, 11, 4, seed=13)
    grads, outs = [], []
    for attend in (vq_attention, vq_attention_reference):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = attend(*leaves, codebook, block_size, causal, mask, straight_through=True)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in leaves])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)
    for fast, slow in zip(*grads):
        torch.testing.assert_close(fast, slow, rtol=1e-8, atol=1e-10)
    assert grads[0][1].abs().sum() > 0  # the keys learn through the attention


@pytest.mark.parametrize("size", [5, 11])  # the codeword cache, or dense (a codebook as long as the sequence)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 5, 16])
def test_gradients_without_the_estimator_match_the_reference(causal, block_size, size):
    # Without the estimator the fast path moves keys between the exact window and the cache (the output and
    # the gradients of q and v are the same either way); an approximate codebook keeps the check honest.
    codebook = randn(2, size, 4, seed=30)
    inputs = [randn(2, 2, 11, 4, seed=s) for s in (31, 32, 33)]
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, [0, 1, 2, 7]] = True  # a row whose only visible keys are padding: zero output, zero gradient
    weights = randn(2, 2, 11, 4, seed=34)
    grads, outs = [], []
    for attend in (vq_attention, vq_attention_reference):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = attend(*leaves, codebook, block_size, causal, mask)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append([leaves[0].grad, leaves[2].grad])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)
    for fast, slow in zip(*grads):
        torch.testing.assert_close(fast, slow, rtol=1e-8, atol=1e-10)
    assert grads[0][0].abs().sum() > 0 and grads[0][1].abs().sum() > 0


@pytest.mark.parametrize("autocast", [False, True])  # both keep their float32 working dtype under autocast
@pytest.mark.parametrize("straight", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_and_cached_paths_agree_in_outputs_and_gradients_in_float32(causal, straight, autocast):
    # The path depends on the length against the codebook; on the same inputs the two give the same numbers.
    codebook = randn(2, 6, 4, seed=40).float()
    inputs = [randn(2, 2, 10, 4, seed=s).float() for s in (41, 42, 43)]
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, [3, 4]] = True
    inputs[1][0, :, 3] = float("nan")  # padded keys are invisible on both paths
    codes = quantize(inputs[1].masked_fill(mask[:, None, :, None], 0.0), codebook)
    results = []
    for attend in (dense_vq_attention, cached_vq_attention):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = attend(*leaves, codebook, codes, 3, causal, mask, straight)
        assert out.dtype == torch.float32
        out.square().sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for dense, cached in zip(*results):
        torch.testing.assert_close(dense, cached, rtol=1e-5, atol=1e-6)
    key_grad = results[0][2]  # only the estimator passes a gradient to k
    assert (torch.isfinite(key_grad).all() and key_grad.abs().sum() > 0) if straight else key_grad is None


@pytest.mark.parametrize("lag", [1, 2, 7])
def test_lagged_prefix_sums_match_cumsum_forward_and_backward(lag):
    per_block = randn(2, 3, 6, 4, 5, seed=35).requires_grad_()
    weights = randn(2, 3, 6, 4, 5, seed=36)
    fast = lagged_prefix_sums(per_block, lag)
    slow = lagged_prefix_sums_reference(per_block, lag)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    (fast_grad,) = torch.autograd.grad((fast * weights).sum(), per_block)
    (slow_grad,) = torch.autograd.grad((slow * weights).sum(), per_block)
    torch.testing.assert_close(fast_grad, slow_grad, rtol=1e-12, atol=1e-12)


def test_keys_get_the_straight_through_gradient_in_training_and_zero_in_eval():
    mechanism = build()
    q, k, v = (randn(2, 2, 9, 4, seed=s).requires_grad_() for s in (14, 15, 16))
    mechanism.train()(q, k, v, causal=True).sum().backward()
    assert k.grad.abs().sum() > 0
    k.grad = None
    mechanism.eval()(q, k, v, causal=True).sum().backward()
    assert k.grad is not None and torch.equal(k.grad, torch.zeros_like(k))


# -- the codebook's training ------------------------------------------------------------------------------------
def buffers(module):
    return {name: b.clone() for name, b in module.named_buffers()}


def test_eval_forward_is_pure_and_training_forward_only_records():
    mechanism = build()
    q, k, v = (randn(2, 2, 9, 4, seed=s) for s in (17, 18, 19))
    before = buffers(mechanism)
    first = mechanism.eval()(q, k, v, causal=True)
    assert all(torch.equal(b, before[name]) for name, b in mechanism.named_buffers())
    assert mechanism.commitment_loss is None
    train_one = mechanism.train()(q, k, v, causal=True)
    train_two = mechanism(q, k, v, causal=True)
    # The codebook did not move (k + (c - k) of the straight-through estimator rounds to c within an ulp).
    torch.testing.assert_close(train_one, first, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(train_two, train_one, rtol=0, atol=0)
    assert torch.equal(mechanism.codebook, before["codebook"])
    assert mechanism.pending_counts.sum() == 2 * 2 * 9 * 2  # two forwards, batch 2, 9 keys, per head (2)


def test_update_applies_the_ema_formula():
    mechanism = build(decay=0.5, restart_threshold=0.0).train()
    k = randn(1, 2, 9, 4, seed=20)
    codes = quantize(k, mechanism.codebook)
    mechanism(k, k, k)
    ema_counts, ema_sums = mechanism.ema_counts.clone(), mechanism.ema_sums.clone()
    mechanism.update_codebook()
    one_hot = F.one_hot(codes[0], 8).double()  # (heads, 9, 8)
    counts = 0.5 * ema_counts + 0.5 * one_hot.sum(1)
    sums = 0.5 * ema_sums + 0.5 * one_hot.transpose(1, 2) @ k[0]
    total = counts.sum(-1, keepdim=True)
    smoothed = (counts + 1e-5) / (total + 8e-5) * total
    torch.testing.assert_close(mechanism.ema_counts, counts)
    torch.testing.assert_close(mechanism.codebook, sums / smoothed[..., None])
    assert int(mechanism.updates) == 1 and mechanism.pending_counts.sum() == 0


def test_dead_codes_restart_at_recorded_keys_the_same_way_every_run():
    results = []
    for _ in range(2):
        mechanism = build(codebook_size=16, seed=3).train()
        k = randn(2, 2, 6, 4, seed=21) + 10.0  # far from every codeword drawn N(0, 1): most codes unused
        mechanism(k, k, k, causal=True)
        used = torch.zeros(2, 16, dtype=torch.bool)
        used.scatter_(1, quantize(k, mechanism.codebook).transpose(0, 1).reshape(2, -1), True)
        mechanism.update_codebook()
        results.append(mechanism.codebook.clone())
        keys = k.transpose(0, 1).reshape(2, -1, 4)
        for h in range(2):
            for s in torch.nonzero(~used[h]).squeeze(-1).tolist():
                assert (mechanism.codebook[h, s] - keys[h]).abs().sum(-1).min() < 1e-12, (h, s)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_commitment_loss_pulls_keys_towards_their_codewords_and_is_collected_once():
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, 16, 2, 2, self_attention="vq",
                          self_attention_options={"codebook_size": 8, "block_size": 4, "commitment": 0.5})
    sequence = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    logits = model(sequence)
    mechanisms = [m for m in model.modules() if isinstance(m, VQAttention)]
    expected = sum(m.commitment_loss for m in mechanisms)
    loss = auxiliary_loss(model)
    torch.testing.assert_close(loss, expected)
    assert all(m.commitment_loss is None for m in mechanisms)
    assert auxiliary_loss(model) is None  # taken: never added twice
    (F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), sequence[:, 1:].reshape(-1)) + loss).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    before = [m.codebook.clone() for m in mechanisms]
    assert update_codebooks(model) == 2
    assert all(not torch.equal(m.codebook, b) for m, b in zip(mechanisms, before))


def test_commitment_loss_formula():
    mechanism = build(commitment=0.25).train()
    k = randn(2, 2, 7, 4, seed=22).requires_grad_()
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 4:] = True
    mechanism(k, k, k, key_padding_mask=mask)
    nearest = quantize_reference(k.detach(), mechanism.codebook)
    codeword = torch.stack([mechanism.codebook[h][nearest[:, h]] for h in range(2)], dim=1)
    error = (k.detach() - codeword).square().sum(-1)  # (batch, heads, seq)
    keep = (~mask)[:, None, :].double()
    torch.testing.assert_close(mechanism.commitment_loss, 0.25 * (error * keep).sum() / (keep.sum() * 2 * 4))


def test_training_forwards_do_not_change_outputs_until_the_update():
    mechanism = build()
    snapshot = copy.deepcopy(mechanism)
    q, k, v = (randn(1, 2, 8, 4, seed=s) for s in (23, 24, 25))
    mechanism.train()(q.requires_grad_(), k, v)
    assert copy.deepcopy(mechanism).commitment_loss is None  # the loss stays with its graph, not with copies
    mechanism.eval()
    torch.testing.assert_close(mechanism(q, k, v), snapshot.eval()(q, k, v), rtol=0, atol=0)
    mechanism.update_codebook()
    assert not torch.equal(mechanism.codebook, snapshot.codebook)


# -- decoding and bad input -------------------------------------------------------------------------------------
def test_decoding_state_has_a_constant_size_and_matches_the_forward():
    mechanism = build().eval()
    q, k, v = (randn(1, 2, 20, 4, seed=s) for s in (26, 27, 28))
    full = mechanism(q, k, v, causal=True)
    state, shapes = None, set()
    for t in range(20):
        out_t, state = mechanism.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        torch.testing.assert_close(out_t, full[:, :, t:t + 1], rtol=1e-10, atol=1e-12)
        shapes.add(tuple(tuple(x.shape) for x in state.tensors.values()))
    assert len(shapes) == 1


def test_language_model_with_vq_decodes_like_the_forward():
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, 16, 2, 2, self_attention="vq",
                          self_attention_options={"codebook_size": 16, "block_size": 3}).double().eval()
    sequence = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    logits, state = model.prefill(sequence[:, :4])
    rows = [logits]
    for t in range(4, 11):
        logits_t, state = model.step(sequence[:, t], state)
        rows.append(logits_t[:, None])
    torch.testing.assert_close(torch.cat(rows, dim=1), model(sequence), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options, match", [
    ({"codebook_size": 1}, "codebook_size"),
    ({"codebook_size": 4.0}, "codebook_size"),
    ({"block_size": 0}, "block_size"),
    ({"decay": 1.0}, "decay"),
    ({"commitment": -0.1}, "commitment"),
    ({"restart_threshold": float("nan")}, "restart_threshold"),
    ({"seed": -1}, "seed"),
])
def test_bad_options_raise_naming_them(options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        attnzoo.build_mechanism("vq", 2, 4, **options)


# -- training hooks ---------------------------------------------------------------------------------------------
def test_training_hooks_hand_over_the_commitment_loss_once_and_update_the_codebook():
    from attnzoo.mechanisms import hooks

    assert attnzoo.mechanisms.auxiliary_loss is hooks.auxiliary_loss  # one, for the loop and by hand alike
    assert not hasattr(attnzoo.mechanisms.vq, "auxiliary_loss")
    torch.manual_seed(0)
    model = LanguageModel(VOCAB, 16, 2, 2, self_attention="vq",
                          self_attention_options={"codebook_size": 8, "block_size": 4, "commitment": 0.5})
    model(torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1)))
    mechanisms = [m for m in model.modules() if isinstance(m, VQAttention)]
    expected = sum(m.commitment_loss for m in mechanisms)
    torch.testing.assert_close(hooks.auxiliary_loss(model), expected)  # the loop's sum, in module order
    assert hooks.auxiliary_loss(model) is None  # taken: never added twice
    before = [m.codebook.clone() for m in mechanisms]
    hooks.after_optimizer_step(model, step=0, seed=0)  # the codebooks' EMA update
    assert all(int(m.updates) == 1 and not torch.equal(m.codebook, b) for m, b in zip(mechanisms, before))


def test_vq_gives_its_reason_against_data_parallel_training():
    (reason,) = build().data_parallel_reasons()
    assert reason.startswith("mechanism 'vq'") and "per-rank EMA statistics" in reason


# -- packed rows ---------------------------------------------------------------------------------------------------
def test_a_packed_training_forward_records_what_the_padded_batch_records():
    lengths = (5, 2, 7, 5)
    padded, packed = build(), build()
    padded.train()
    packed.train()
    q, k, v = (randn(1, 2, sum(lengths), 4, seed=s) for s in (1, 2, 3))
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    rows = [[x[:, :, s:s + n] for x in (q, k, v)] for s, n in zip(starts, lengths)]
    longest = max(lengths)
    batch = [torch.cat([F.pad(piece, (0, 0, 0, longest - piece.shape[2])) for piece in pieces])
             for pieces in zip(*rows)]
    mask = torch.arange(longest)[None, :] >= torch.tensor(lengths)[:, None]
    padded(*batch, True, mask)
    out = packed(q, k, v, True, cu_seqlens=torch.tensor(starts))
    for name in ("pending_counts", "pending_sums", "pending_keys", "pending_key_count"):
        torch.testing.assert_close(getattr(packed, name), getattr(padded, name), rtol=0, atol=1e-12, msg=name)
    torch.testing.assert_close(packed.auxiliary_loss(), padded.auxiliary_loss(), rtol=0, atol=1e-12)
    packed.update_codebook()
    padded.update_codebook()
    torch.testing.assert_close(packed.codebook, padded.codebook, rtol=0, atol=1e-12)
    # The output of each document is the padded batch's row.
    reference = padded.eval()(*batch, True, mask)
    packed.eval()
    out = packed(q, k, v, True, cu_seqlens=torch.tensor(starts))
    for row, (start, n) in enumerate(zip(starts, lengths)):
        torch.testing.assert_close(out[0, :, start:start + n], reference[row, :, :n], rtol=0, atol=1e-10)
