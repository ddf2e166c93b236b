"""Greedy, sampling and beam search through the incremental path, against full-forward references."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from attnzoo import LanguageModel, Seq2SeqTransformer, beam_search, greedy_decode, sample_decode
from attnzoo.decoding import filter_logits

VOCAB = 5
EOS = 0


def language_model(vocab=VOCAB, seed=0, **options):
    torch.manual_seed(seed)
    settings = dict(dim=16, heads=2, depth=2)
    settings.update(options)
    model = LanguageModel(vocab, **settings).double().eval()
    with torch.no_grad():  # sharper distributions than at initialization, so that rankings are clear
        model.head.weight.mul_(4.0)
    return model


def seq2seq(seed=0):
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(7, VOCAB, 16, 2, encoder_depth=1, decoder_depth=2).double().eval()
    with torch.no_grad():
        model.head.weight.mul_(4.0)
    return model


def ids(batch, seq, vocab=VOCAB, seed=1, low=0):
    return torch.randint(low, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def full_log_probs(model, sequence, source=None):
    """(batch, seq - 1) log-probabilities of sequence[:, 1:] from one full forward pass."""
    logits = model(sequence) if source is None else model(source, sequence)
    return logits[:, :-1].log_softmax(-1).gather(-1, sequence[:, 1:, None])[..., 0]


def naive_greedy(model, prompt, steps, source=None):
    """Greedy decoding that recomputes the full forward pass for every token: no state, no cache."""
    sequence = prompt
    for _ in range(steps):
        logits = model(sequence) if source is None else model(source, sequence)
        sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return sequence


# -- greedy --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rotary", "none"])
def test_greedy_matches_full_forward_recomputation(positional):
    model = language_model(positional=positional, max_length=16)
    prompt = ids(3, 4)
    torch.testing.assert_close(greedy_decode(model, prompt, 6), naive_greedy(model, prompt, 6), atol=0, rtol=0)


def test_seq2seq_greedy_matches_full_forward_recomputation():
    model = seq2seq()
    source, prompt = ids(2, 6, vocab=7, seed=2), torch.full((2, 1), 1)
    mask = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])
    got = greedy_decode(model, prompt, 5, source=source, source_padding_mask=mask)
    expected = torch.cat([naive_greedy(model, prompt[:1], 5, source[:1]),
                          naive_greedy(model, prompt[1:], 5, source[1:, :3])])
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_greedy_stops_at_eos_and_fills_after_it():
    model = language_model()
    prompt = ids(4, 3, low=1)
    free = greedy_decode(model, prompt, 8)
    got = greedy_decode(model, prompt, 8, eos_id=EOS)
    for row_free, row in zip(free, got):
        generated = row_free[3:].tolist()
        end = generated.index(EOS) + 1 if EOS in generated else len(generated)
        assert row[3:3 + end].tolist() == generated[:end]
        assert (row[3 + end:] == EOS).all()
    assert got.shape[1] <= free.shape[1]


# -- sampling ------------------------------------------------------------------------------------------------
def test_top_k_one_and_tiny_top_p_equal_greedy():
    model = language_model(vocab=11)
    prompt = ids(3, 2, vocab=11)
    greedy = greedy_decode(model, prompt, 7)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(sample_decode(model, prompt, 7, top_k=1, temperature=2.0, generator=generator), greedy)
    assert torch.equal(sample_decode(model, prompt, 7, top_p=1e-9, generator=generator), greedy)


def test_seeded_sampling_is_reproducible():
    model = language_model(vocab=11)
    prompt = ids(3, 2, vocab=11)

    def draw(seed, **options):
        return sample_decode(model, prompt, 12, temperature=1.5, generator=torch.Generator().manual_seed(seed),
                             **options)

    assert torch.equal(draw(7), draw(7))
    assert torch.equal(draw(7, top_k=4, top_p=0.9), draw(7, top_k=4, top_p=0.9))
    assert not torch.equal(draw(7), draw(8))


def test_sampling_follows_the_model_distribution():
    model = language_model(vocab=4)
    prompt = ids(1, 3, vocab=4).expand(4000, -1)
    first = sample_decode(model, prompt, 1, generator=torch.Generator().manual_seed(3))[:, -1]
    frequencies = torch.bincount(first, minlength=4).double() / first.numel()
    expected = model(prompt[:1])[0, -1].softmax(-1)
    torch.testing.assert_close(frequencies, expected, atol=0.03, rtol=0)


def reference_filter(logits, top_k, top_p):
    """Per row: rank tokens, keep the first top_k, and of those the shortest prefix reaching top_p."""
    out = torch.full_like(logits, float("-inf"))
    for r, row in enumerate(logits):
        order = sorted(range(len(row)), key=lambda i: -row[i].item())
        probs = row.softmax(-1)
        kept, mass = [], 0.0
        for i in order[: top_k or len(row)]:
            if top_p is not None and mass >= top_p:
                break
            kept.append(i)
            mass += probs[i].item()
        out[r, kept] = row[kept]
    return out


@pytest.mark.parametrize("top_k, top_p", [(3, None), (None, 0.5), (None, 0.9), (4, 0.7), (None, 1.0), (20, None)])
def test_filter_logits_matches_reference(top_k, top_p):
    logits = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 2
    expected = reference_filter(logits, top_k, top_p if top_k is None else None)
    got = filter_logits(logits, top_k, top_p if top_k is None else None)
    assert torch.equal(got, expected)
    if top_k is not None and top_p is not None:
        # top_p applies to the renormalized distribution left after top_k.
        restricted = filter_logits(logits, top_k)
        assert torch.equal(filter_logits(logits, top_k, top_p), filter_logits(restricted, None, top_p))


# -- beam search ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eos_id", [None, EOS])
def test_beam_size_one_equals_greedy(eos_id):
    model = language_model()
    prompt = ids(3, 3, low=1)
    greedy = greedy_decode(model, prompt, 8, eos_id=eos_id)
    result = beam_search(model, prompt, 8, beam_size=1, length_penalty=0.0, eos_id=eos_id)
    for b in range(3):
        length = int(result.lengths[b, 0])
        assert result.best[b, :length].tolist() == greedy[b, :length].tolist()
        assert (greedy[b, length:] == EOS).all()


def test_seq2seq_beam_size_one_equals_greedy():
    model = seq2seq()
    source, prompt = ids(2, 6, vocab=7, seed=5), torch.full((2, 1), 1)
    greedy = greedy_decode(model, prompt, 6, source=source)
    result = beam_search(model, prompt, 6, beam_size=1, source=source)
    assert torch.equal(result.best, greedy)


def brute_force(model, prompt, max_new_tokens, length_penalty, eos_id, source=None):
    """Every hypothesis beam search can return, scored from full forward passes, best first."""
    vocab = model.vocab_size if source is None else model.tgt_vocab_size
    others = [t for t in range(vocab) if t != eos_id]
    candidates = [list(c) for c in itertools.product(others, repeat=max_new_tokens)]
    if eos_id is not None:
        for length in range(max_new_tokens):
            candidates += [list(c) + [eos_id] for c in itertools.product(others, repeat=length)]
    scored = []
    for generated in candidates:
        sequence = torch.cat([prompt, torch.tensor([generated])], dim=1)
        raw = full_log_probs(model, sequence, source)[0, prompt.shape[1] - 1:].sum().item()
        scored.append((raw / len(generated) ** length_penalty, generated))
    return sorted(scored, key=lambda s: -s[0])


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, -0.5])
@pytest.mark.parametrize("eos_id", [None, EOS])
def test_wide_beam_search_finds_the_brute_force_best(length_penalty, eos_id):
    model = language_model(vocab=4, seed=2)
    prompt = ids(1, 2, vocab=4, low=1, seed=3)
    # 16 beams hold every live prefix of 2 tokens (at most 4^2), so nothing that could rank is pruned.
    beams, steps = 16, 3
    expected = brute_force(model, prompt, steps, length_penalty, eos_id)[:beams]
    result = beam_search(model, prompt, steps, beam_size=beams, length_penalty=length_penalty, eos_id=eos_id)
    for j, (score, generated) in enumerate(expected):
        length = int(result.lengths[0, j])
        assert result.sequences[0, j, 2:length].tolist() == generated
        assert math.isclose(result.scores[0, j].item(), score, rel_tol=1e-9, abs_tol=1e-12)


def test_seq2seq_wide_beam_search_finds_the_brute_force_best():
    model = seq2seq(seed=4)
    source, prompt = ids(1, 5, vocab=7, seed=6), torch.full((1, 1), 1)
    expected = brute_force(model, prompt, 3, 1.0, EOS, source)[:16]
    result = beam_search(model, prompt, 3, beam_size=16, length_penalty=1.0, eos_id=EOS, source=source)
    got = [result.sequences[0, j, 1:int(result.lengths[0, j])].tolist() for j in range(16)]
    assert got == [generated for _, generated in expected]


@pytest.mark.parametrize("length_penalty", [0.0, 0.7])
def test_beam_scores_are_the_scores_of_their_sequences(length_penalty):
    model = language_model(vocab=7, seed=5)
    prompt = ids(3, 2, vocab=7, low=1, seed=7)
    result = beam_search(model, prompt, 6, beam_size=3, length_penalty=length_penalty, eos_id=EOS)
    assert (result.scores[:, :-1] >= result.scores[:, 1:]).all()  # best first
    for b in range(3):
        for j in range(3):
            length = int(result.lengths[b, j])
            sequence = result.sequences[b, j, :length][None]
            raw = full_log_probs(model, sequence)[0, 1:].sum().item()  # the 2-token prompt is not scored
            generated = length - 2
            assert generated == 6 or sequence[0, -1].item() == EOS
            assert EOS not in sequence[0, 2:-1].tolist()
            assert math.isclose(result.scores[b, j].item(), raw / generated ** length_penalty, rel_tol=1e-9)


def test_beam_search_with_fewer_hypotheses_than_beams_leaves_empty_slots():
    model = language_model(vocab=2)
    result = beam_search(model, ids(1, 1, vocab=2), 1, beam_size=3, eos_id=None)
    assert result.scores[0, 0] > float("-inf") and result.scores[0, 1] > float("-inf")
    assert result.scores[0, 2] == float("-inf") and result.lengths[0, 2] == 0


# -- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m, p: greedy_decode(m, p, 0), ValueError, "max_new_tokens"),
        (lambda m, p: greedy_decode(m, p, -3), ValueError, "max_new_tokens"),
        (lambda m, p: greedy_decode(m, p, 2.5), TypeError, "max_new_tokens"),
        (lambda m, p: greedy_decode(m, p, True), TypeError, "max_new_tokens"),
        (lambda m, p: greedy_decode(m, p[:, :0], 3), ValueError, "prompt is empty"),
        (lambda m, p: greedy_decode(m, p.double(), 3), TypeError, "prompt must be an integer tensor"),
        (lambda m, p: greedy_decode(m, p[0], 3), ValueError, r"prompt must have shape \(batch, seq\)"),
        (lambda m, p: greedy_decode(m, p + VOCAB, 3), ValueError, "outside the vocabulary"),
        (lambda m, p: greedy_decode(m, p, 3, eos_id=VOCAB), ValueError, "eos_id"),
        (lambda m, p: greedy_decode(m, p, 3, source=p), ValueError, "source"),
        (lambda m, p: greedy_decode(torch.nn.Linear(2, 2), p, 3), TypeError, "model must be"),
        (lambda m, p: beam_search(m, p, 3, beam_size=0), ValueError, "beam_size"),
        (lambda m, p: beam_search(m, p, 3, length_penalty=float("nan")), ValueError, "length_penalty"),
        (lambda m, p: sample_decode(m, p, 3, temperature=0.0), ValueError, "temperature"),
        (lambda m, p: sample_decode(m, p, 3, temperature=-1.0), ValueError, "temperature"),
        (lambda m, p: sample_decode(m, p, 3, top_p=0.0), ValueError, "top_p"),
        (lambda m, p: sample_decode(m, p, 3, top_p=1.5), ValueError, "top_p"),
        (lambda m, p: sample_decode(m, p, 3, top_k=0), ValueError, "top_k"),
        (lambda m, p: sample_decode(m, p, 3, generator=0), TypeError, "generator"),
    ],
)
def test_bad_decoding_arguments_raise(call, error, match):
    with pytest.raises(error, match=match):
        call(language_model(), ids(2, 3))


def test_seq2seq_decoding_needs_a_source():
    model = seq2seq()
    with pytest.raises(ValueError, match="source"):
        greedy_decode(model, torch.ones(2, 1, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="prompt batch 2 does not match source batch 3"):
        greedy_decode(model, torch.ones(2, 1, dtype=torch.long), 3, source=ids(3, 4, vocab=7))
    with pytest.raises(ValueError, match="source holds ids"):
        greedy_decode(model, torch.ones(1, 1, dtype=torch.long), 3, source=ids(1, 4, vocab=7) + 7)
    with pytest.raises(ValueError, match="source_padding_mask must have shape"):
        greedy_decode(model, torch.ones(1, 1, dtype=torch.long), 3, source=ids(1, 4, vocab=7),
                      source_padding_mask=torch.zeros(1, 3, dtype=torch.bool))


# -- end to end ----------------------------------------------------------------------------------------------
TEXT = "hello attnzoo, hello world. "


@pytest.mark.slow
def test_tiny_language_model_learns_a_string_and_decodes_it_back():
    # Tiny matrices: one thread avoids oversubscription when the cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _learn_and_decode()
    finally:
        torch.set_num_threads(threads)


def _learn_and_decode():
    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    encode = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([[encode[c] for c in TEXT * 3]])
    model = LanguageModel(len(chars), dim=48, heads=4, depth=2, positional="rotary")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.transpose(1, 2), data[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05
    model.eval()

    prompt, new = data[:, :5], 2 * len(TEXT) - 5
    expected = "".join(chars[i] for i in data[0, : 2 * len(TEXT)])

    def text(sequence):
        return "".join(chars[i] for i in sequence.tolist())

    assert text(greedy_decode(model, prompt, new)[0]) == expected
    sampled = sample_decode(model, prompt, new, temperature=0.3, generator=torch.Generator().manual_seed(0))
    assert text(sampled[0]) == expected
    assert text(beam_search(model, prompt, new, beam_size=3).best[0]) == expected
