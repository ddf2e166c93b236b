"""Monotonic cross-attention at inference: the window maths, the focus in the decoding state, and the decoders."""

import pytest
import torch

from attnzoo import LanguageModel, Seq2SeqTransformer, beam_search, greedy_decode, sample_decode
from attnzoo.functional.monotonic import (
    advance_focus,
    initial_focus,
    monotonic_window_mask,
    monotonic_window_mask_reference,
)
from attnzoo.mechanisms import UnsupportedOptionError
from attnzoo.models.cross_attention import CrossAttentionWeights
from attnzoo.models.monotonic import MonotonicInference, MonotonicState, monotonic_prefill, monotonic_step
from attnzoo.state import select_batch

SRC_VOCAB, TGT_VOCAB, BOS, EOS = 9, 7, 1, 2


def seq2seq(seed=0, dim=16, heads=2, decoder_depth=2, **options):
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(SRC_VOCAB, TGT_VOCAB, dim, heads, encoder_depth=1, decoder_depth=decoder_depth,
                               **options).double().eval()
    with torch.no_grad():  # sharper distributions than at initialization, so that rankings are clear
        model.head.weight.mul_(4.0)
    return model


def sources(batch, length, seed=1, pad_rows=True):
    """Random source ids (3..SRC_VOCAB) with right padding (id 0) on some rows, and the padding mask."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, SRC_VOCAB, (batch, length), generator=generator)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    if pad_rows:
        for row in range(1, batch, 2):
            keep = int(torch.randint(1, length + 1, (1,), generator=generator))
            mask[row, keep:] = True
    return src.masked_fill(mask, 0), mask


def start(batch):
    return torch.full((batch, 1), BOS, dtype=torch.long)


# -- the pure maths ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ahead,behind", [(1, 0), (3, 0), (2, 1), (5, 4)])
def test_window_mask_matches_reference(ahead, behind):
    focus = torch.randint(0, 12, (6,), generator=torch.Generator().manual_seed(ahead * 10 + behind))
    assert torch.equal(monotonic_window_mask(focus, 12, ahead, behind),
                       monotonic_window_mask_reference(focus, 12, ahead, behind))


def test_window_mask_shows_exactly_the_window():
    mask = monotonic_window_mask(torch.tensor([0, 4, 9]), 10, ahead=2, behind=1)
    assert mask.tolist()[1] == [True, True, True, False, False, False, False, True, True, True]
    assert (~mask).sum(dim=1).tolist() == [3, 4, 2]  # clipped at both ends of the source


def test_focus_moves_to_the_argmax_but_never_back():
    weights = torch.tensor([[0.1, 0.7, 0.2, 0.0], [0.6, 0.1, 0.1, 0.2], [0.0, 0.0, 0.1, 0.9]])
    assert advance_focus(torch.tensor([0, 2, 1]), weights).tolist() == [1, 2, 3]


def test_initial_focus_is_the_first_real_position():
    padding = torch.tensor([[False, False, True], [True, True, False], [True, False, False]])
    assert initial_focus(padding, 3, 3, torch.device("cpu")).tolist() == [0, 2, 1]
    assert initial_focus(None, 2, 3, torch.device("cpu")).tolist() == [0, 0]


# -- the focus in the decoding state -------------------------------------------------------------------------
def _walk(model, monotonic, src, mask, steps, seed):
    """Prefill and step with random target tokens; the focus after each position and each step's weights."""
    generator = torch.Generator().manual_seed(seed)
    _, state = monotonic_prefill(model, monotonic, src, start(src.shape[0]), src_padding_mask=mask)
    focuses, weights = [state.focus], []
    for _ in range(steps):
        token = torch.randint(0, TGT_VOCAB, (src.shape[0],), generator=generator)
        with CrossAttentionWeights(model, "the test") as recorded:
            _, state = monotonic_step(model, monotonic, token, state)
        focuses.append(state.focus)
        weights.append(recorded.weights)
    return focuses, weights


@pytest.mark.parametrize("case", range(8))
def test_focus_never_moves_backwards_over_random_models_and_inputs(case):
    generator = torch.Generator().manual_seed(100 + case)
    draw = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=generator))  # noqa: E731
    heads = draw(1, 3)
    model = seq2seq(seed=case, dim=8 * heads, heads=heads, decoder_depth=draw(1, 3))
    monotonic = MonotonicInference(ahead=draw(1, 3), behind=draw(0, 2) if case % 2 else 0)
    src, mask = sources(draw(1, 4), draw(2, 9), seed=case)
    focuses, weights = _walk(model, monotonic, src, mask, steps=10, seed=case)
    lengths = (~mask).sum(dim=1)
    for before, after, step_weights in zip(focuses, focuses[1:], weights):
        assert (after >= before).all() and (after - before <= monotonic.ahead).all()
        assert (after < lengths).all()  # the focus never lands on padding
        hidden = monotonic_window_mask(before, src.shape[1], monotonic.ahead, monotonic.behind) | mask
        for layer_weights in step_weights:  # every layer and head attended inside the window only
            assert layer_weights.shape == (src.shape[0], heads, 1, src.shape[1])
            assert (layer_weights * hidden[:, None, None, :]).abs().sum() == 0.0
            if monotonic.behind == 0:  # then attention itself stays or moves forward
                assert (layer_weights.argmax(dim=-1) >= before[:, None, None]).all()


def test_full_window_decoding_equals_unconstrained_decoding():
    model = seq2seq()
    src, mask = sources(4, 6)
    full = MonotonicInference(ahead=6, behind=6)
    kwargs = dict(eos_id=EOS, source=src, source_padding_mask=mask)
    assert torch.equal(greedy_decode(model, start(4), 8, monotonic=full, **kwargs),
                       greedy_decode(model, start(4), 8, **kwargs))
    sampled = [sample_decode(model, start(4), 8, generator=torch.Generator().manual_seed(3), monotonic=monotonic,
                             **kwargs) for monotonic in (full, None)]
    assert torch.equal(*sampled)
    beams = [beam_search(model, start(4), 8, beam_size=3, monotonic=monotonic, **kwargs) for monotonic in (full, None)]
    assert torch.equal(beams[0].sequences, beams[1].sequences)
    torch.testing.assert_close(beams[0].scores, beams[1].scores)


def test_a_narrow_window_changes_the_decode():
    """The constraint is not a no-op: on random models a one-position window decodes differently somewhere."""
    src, mask = sources(8, 9)
    narrow, changed = MonotonicInference(ahead=1), False
    for seed in range(4):
        model = seq2seq(seed=seed)
        kwargs = dict(source=src, source_padding_mask=mask)
        changed |= not torch.equal(greedy_decode(model, start(8), 8, monotonic=narrow, **kwargs),
                                   greedy_decode(model, start(8), 8, **kwargs))
    assert changed


@torch.no_grad()
def _monotonic_log_prob(model, monotonic, src, mask, sequence):
    """Summed log-probability of sequence[1:] under monotonic decoding, one row, stepping by hand."""
    logits, state = monotonic_prefill(model, monotonic, src, sequence[None, :1], src_padding_mask=mask)
    logits, total = logits[:, -1], 0.0
    for position in range(1, sequence.shape[0]):
        total += float(logits.log_softmax(-1)[0, sequence[position]])
        if position + 1 < sequence.shape[0]:
            logits, state = monotonic_step(model, monotonic, sequence[position:position + 1], state)
    return total


def test_beam_search_reorders_the_focus_with_the_beams():
    """Each beam's score is that of its sequence decoded alone: the focus followed its beam through reordering."""
    model = seq2seq(seed=2)
    src, mask = sources(2, 7, seed=5)
    monotonic = MonotonicInference(ahead=1)
    result = beam_search(model, start(2), 6, beam_size=3, length_penalty=0.0, monotonic=monotonic, source=src,
                         source_padding_mask=mask)
    for row in range(2):
        for beam in range(3):
            expected = _monotonic_log_prob(model, monotonic, src[row:row + 1], mask[row:row + 1],
                                           result.sequences[row, beam])
            assert result.scores[row, beam].item() == pytest.approx(expected, abs=1e-9)


def test_beam_size_one_equals_greedy_under_the_constraint():
    model = seq2seq(seed=1)
    src, mask = sources(3, 6)
    monotonic = MonotonicInference(ahead=2)
    kwargs = dict(source=src, source_padding_mask=mask, monotonic=monotonic)
    assert torch.equal(beam_search(model, start(3), 7, beam_size=1, **kwargs).best,
                       greedy_decode(model, start(3), 7, **kwargs))


def test_select_batch_reorders_the_focus():
    model = seq2seq()
    src, mask = sources(3, 5)
    _, state = monotonic_prefill(model, MonotonicInference(), src, start(3), src_padding_mask=mask)
    state = MonotonicState(state.decoder, torch.tensor([0, 1, 2]), state.source_padding_mask, state.source_len)
    moved = select_batch(state, torch.tensor([2, 2, 0]))
    assert isinstance(moved, MonotonicState) and moved.focus.tolist() == [2, 2, 0]
    assert torch.equal(moved.source_padding_mask, mask[[2, 2, 0]])


def test_prefill_cross_attention_mask_hides_sources_from_the_decoder_only():
    model = seq2seq()
    src, mask = sources(2, 5)
    nothing_hidden = torch.zeros_like(mask)
    logits, state = model.prefill(src, start(2), src_padding_mask=mask, cross_attention_mask=nothing_hidden)
    plain, _ = model.prefill(src, start(2), src_padding_mask=mask)
    torch.testing.assert_close(logits, plain)
    assert state.memory_padding_mask is mask  # the state keeps the padding alone
    with pytest.raises(TypeError, match="cross_attention_mask"):
        model.prefill(src, start(2), cross_attention_mask=nothing_hidden.long())


# -- bad options ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,error,match", [
    (dict(ahead=0), ValueError, "ahead"),
    (dict(ahead=1.5), TypeError, "ahead"),
    (dict(ahead=True), TypeError, "ahead"),
    (dict(behind=-1), ValueError, "behind"),
    (dict(behind=None), TypeError, "behind"),
])
def test_bad_window_options_raise(options, error, match):
    with pytest.raises(error, match=match):
        MonotonicInference(**options)


@pytest.mark.parametrize("cross_attention,options", [("performer", {"nb_features": 8}), ("linear", {}),
                                                     ("softmax", {"quiet": True})])
def test_monotonic_needs_softmax_cross_attention(cross_attention, options):
    model = seq2seq(cross_attention=cross_attention, cross_attention_options=options)
    src, mask = sources(2, 4)
    with pytest.raises(UnsupportedOptionError, match="monotonic"):
        greedy_decode(model, start(2), 3, source=src, source_padding_mask=mask, monotonic=MonotonicInference())


def test_monotonic_is_refused_for_a_language_model_and_must_be_the_option_type():
    torch.manual_seed(0)
    lm = LanguageModel(TGT_VOCAB, dim=8, heads=2, depth=1).eval()
    with pytest.raises(UnsupportedOptionError, match="monotonic"):
        greedy_decode(lm, start(1), 2, monotonic=MonotonicInference())
    src, mask = sources(1, 4)
    with pytest.raises(TypeError, match="monotonic"):
        beam_search(seq2seq(), start(1), 2, source=src, monotonic={"ahead": 2})


def test_monotonic_step_refuses_another_state():
    model = seq2seq()
    src, _ = sources(1, 4)
    _, state = model.prefill(src, start(1))
    with pytest.raises(TypeError, match="state"):
        monotonic_step(model, MonotonicInference(), torch.tensor([3]), state)
