"""Autoregressive decoding for :class:`LanguageModel` (or any :class:`CausalLanguageModel`, such as the
pretrained :class:`attnzoo.pretrained.CausalLM`) and :class:`Seq2SeqTransformer`, and one-pass
non-autoregressive decoding (:func:`nat_decode`) for a Seq2SeqTransformer built for it.

Every decoder runs the model's incremental path: one ``prefill`` over the prompt, then one ``step`` per new
token, with the decoding state passed explicitly (beam search reorders it with
:func:`attnzoo.state.select_batch`). For a :class:`Seq2SeqTransformer` the ``prompt`` is the target prefix
(typically one start token per sequence) and ``source`` the source ids; the source is encoded and its
cross-attention keys and values are projected once. ``monotonic=MonotonicInference(ahead, behind)`` holds
its cross-attention to a window that moves left to right (:mod:`attnzoo.models.monotonic`); the focus is part
of the decoding state, so every decoder here supports it, beam search included.

The model's train/eval mode is left as it is: call ``model.eval()`` first so dropout is off.

Shapes: prompt (batch, prompt_len) integer ids; source (batch, seq_src); source_padding_mask (batch, seq_src)
bool, True = padding. Results include the prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Tuple, Union, runtime_checkable

import torch
from torch import Tensor

from ._validation import check_positive_int
from .models.monotonic import MonotonicInference, check_monotonic, monotonic_prefill, monotonic_step
from .models.nat import check_lengths, predicted_lengths
from .models.inputs import check_padding_mask, check_tokens
from .models.language import LanguageModel
from .models.seq2seq import Seq2SeqTransformer
from .models.stacks import DecoderState
from .state import select_batch



@runtime_checkable
class CausalLanguageModel(Protocol):
    """What the decoders need of a decoder-only model: its vocabulary, ``prefill`` over a prompt and ``step``
    by one token, as :class:`LanguageModel` has them. Declared rather than a class checked, so that a model
    built elsewhere (the pretrained models of :mod:`attnzoo.pretrained`) decodes here without this module
    importing it."""

    vocab_size: int

    def prefill(self, tokens: Tensor) -> Tuple[Tensor, Any]:
        """A prompt (batch, seq) -> its logits (batch, seq, vocab) and the decoding state."""

    def step(self, token_t: Tensor, state: Any) -> Tuple[Tensor, Any]:
        """One token per sequence (batch,) -> the next logits (batch, vocab) and the state."""


Model = Union[LanguageModel, CausalLanguageModel, Seq2SeqTransformer]
Step = Callable[[Tensor, Any], Tuple[Tensor, Any]]
"""One decoding step: (token_t (batch,), state) -> (logits (batch, vocab), state)."""


# -- argument checks -----------------------------------------------------------------------------------------
def _vocab_size(model: Model) -> int:
    if isinstance(model, Seq2SeqTransformer):  # before the protocol: it has a prefill and a step too
        return model.output_vocab_size  # the extended vocabulary when the model can copy
    if isinstance(model, (LanguageModel, CausalLanguageModel)):
        return model.vocab_size
    raise TypeError(f"model must be a LanguageModel, a Seq2SeqTransformer or a causal language model with "
                    f"vocab_size, prefill and step, got {type(model).__name__}")


def _check_eos(eos_id: Optional[int], vocab_size: int) -> None:
    if eos_id is None:
        return
    if isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id must be None or a token id in [0, {vocab_size}), got {eos_id!r}")


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _start(
    model: Model,
    prompt: Tensor,
    max_new_tokens: int,
    eos_id: Optional[int],
    source: Optional[Tensor],
    source_padding_mask: Optional[Tensor],
    monotonic: Optional[MonotonicInference] = None,
) -> Tuple[Tensor, Any, Step]:
    """Check the shared arguments, run the prompt, and return the last position's logits (batch, vocab), the
    decoding state and the step function that carries it on."""
    vocab_size = _vocab_size(model)
    check_positive_int("max_new_tokens", max_new_tokens)
    check_tokens("prompt", prompt, vocab_size)
    _check_eos(eos_id, vocab_size)
    monotonic = check_monotonic(model, monotonic)
    if not isinstance(model, Seq2SeqTransformer):
        if source is not None or source_padding_mask is not None:
            raise ValueError(f"source / source_padding_mask are for a Seq2SeqTransformer; a {type(model).__name__} "
                             f"takes none")
        logits, state = model.prefill(prompt)
        return logits[:, -1], state, model.step
    else:
        if source is None:
            raise ValueError("source (batch, seq_src) token ids are required to decode with a Seq2SeqTransformer")
        check_tokens("source", source, model.src_vocab_size)
        check_padding_mask("source_padding_mask", source_padding_mask, source)
        if source.shape[0] != prompt.shape[0]:
            raise ValueError(f"prompt batch {prompt.shape[0]} does not match source batch {source.shape[0]}")
        if monotonic is not None:
            logits, state = monotonic_prefill(model, monotonic, source, prompt, src_padding_mask=source_padding_mask)
            return logits[:, -1], state, lambda token_t, state: monotonic_step(model, monotonic, token_t, state)
        logits, state = model.prefill(source, prompt, src_padding_mask=source_padding_mask)
    return logits[:, -1], state, model.step


# -- greedy and sampling -------------------------------------------------------------------------------------
def _decode_loop(
    model: Model,
    prompt: Tensor,
    max_new_tokens: int,
    pick: Callable[[Tensor], Tensor],
    eos_id: Optional[int],
    source: Optional[Tensor],
    source_padding_mask: Optional[Tensor],
    monotonic: Optional[MonotonicInference],
) -> Tensor:
    logits, state, step = _start(model, prompt, max_new_tokens, eos_id, source, source_padding_mask, monotonic)
    tokens = [prompt]
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for position in range(max_new_tokens):
        next_token = pick(logits).to(prompt.dtype)
        if eos_id is not None:
            # A finished sequence keeps emitting eos_id, so every row has the same length.
            next_token = next_token.masked_fill(finished, eos_id)
            finished |= next_token == eos_id
        tokens.append(next_token[:, None])
        if position == max_new_tokens - 1 or bool(finished.all()):
            break
        logits, state = step(next_token, state)
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def greedy_decode(
    model: Model,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    eos_id: Optional[int] = None,
    source: Optional[Tensor] = None,
    source_padding_mask: Optional[Tensor] = None,
    monotonic: Optional[MonotonicInference] = None,
) -> Tensor:
    """Pick the most likely token at every step.

    Returns (batch, prompt_len + n) ids, n <= max_new_tokens: decoding stops early once every sequence has
    emitted ``eos_id``; a finished sequence is filled with ``eos_id`` after its end.
    """
    return _decode_loop(model, prompt, max_new_tokens, lambda logits: logits.argmax(dim=-1), eos_id, source,
                        source_padding_mask, monotonic)


def _check_filter(top_k: Optional[int], top_p: Optional[float]) -> None:
    if top_k is not None:
        check_positive_int("top_k", top_k)
    if top_p is not None and not 0.0 < _check_number("top_p", top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def filter_logits(logits: Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None) -> Tensor:
    """Keep the ``top_k`` largest logits and/or the smallest set whose probability reaches ``top_p``
    (nucleus, applied after ``top_k``), setting the rest to -inf. logits: (batch, vocab) -> (batch, vocab).
    The most likely token is always kept."""
    _check_filter(top_k, top_p)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the more likely ones before it already reach top_p.
            drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def sample_decode(
    model: Model,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    eos_id: Optional[int] = None,
    source: Optional[Tensor] = None,
    source_padding_mask: Optional[Tensor] = None,
    monotonic: Optional[MonotonicInference] = None,
) -> Tensor:
    """Sample each token from ``softmax(logits / temperature)``, restricted by ``top_k`` / ``top_p``.

    Pass a seeded ``generator`` (on the model's device) for reproducible samples. Returns ids as
    :func:`greedy_decode` does.
    """
    temperature = _check_number("temperature", temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use greedy_decode for argmax decoding), got {temperature!r}")
    _check_filter(top_k, top_p)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        device = next(model.parameters()).device
        if generator.device.type != device.type:
            raise ValueError(f"generator is on {generator.device}, the model on {device}: they must match")

    def pick(logits: Tensor) -> Tensor:
        scaled = filter_logits(logits.float() / temperature, top_k, top_p)
        return torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator)[:, 0]

    return _decode_loop(model, prompt, max_new_tokens, pick, eos_id, source, source_padding_mask, monotonic)


# -- beam search ---------------------------------------------------------------------------------------------
@dataclass
class BeamSearchResult:
    """The ``beam_size`` best hypotheses per batch element, best first.

    Attributes:
        sequences: (batch, beam_size, seq) ids including the prompt; positions past a hypothesis's end hold
            ``eos_id`` (or 0 without one).
        scores: (batch, beam_size) ``sum of token log-probabilities / generated_length ** length_penalty``;
            -inf for slots left empty when fewer hypotheses exist.
        lengths: (batch, beam_size) number of valid ids in each sequence, prompt and eos included.
    """

    sequences: Tensor
    scores: Tensor
    lengths: Tensor

    @property
    def best(self) -> Tensor:
        """The best hypothesis of each batch element, (batch, seq)."""
        return self.sequences[:, 0]


@dataclass
class _Hypothesis:
    score: float
    tokens: Tensor  # generated ids only, 1-D


def _normalized(raw: float, length: int, length_penalty: float) -> float:
    return raw / (length ** length_penalty)


@torch.no_grad()
def beam_search(
    model: Model,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    beam_size: int = 4,
    length_penalty: float = 1.0,
    eos_id: Optional[int] = None,
    source: Optional[Tensor] = None,
    source_padding_mask: Optional[Tensor] = None,
    monotonic: Optional[MonotonicInference] = None,
) -> BeamSearchResult:
    """Beam search over the model's incremental path.

    A hypothesis ends when it emits ``eos_id`` (included in its length) or after ``max_new_tokens`` tokens.
    It is ranked by its summed log-probability divided by ``generated_length ** length_penalty``
    (0 = raw sum; larger values favour longer outputs). A batch element stops early once it holds
    ``beam_size`` ended hypotheses that no live beam can still beat.
    """
    check_positive_int("beam_size", beam_size)
    length_penalty = _check_number("length_penalty", length_penalty)
    logits, state, step = _start(model, prompt, max_new_tokens, eos_id, source, source_padding_mask, monotonic)
    batch, vocab = logits.shape
    device = prompt.device
    beams = beam_size
    score_dtype = torch.promote_types(logits.dtype, torch.float32)

    rows = torch.arange(batch, device=device).repeat_interleave(beams)
    state = select_batch(state, rows)
    log_probs = logits.to(score_dtype).log_softmax(dim=-1)[rows]  # (batch * beams, vocab)
    # All beams start identical: only beam 0 may expand at the first step.
    beam_scores = torch.full((batch, beams), float("-inf"), dtype=score_dtype, device=device)
    beam_scores[:, 0] = 0.0
    generated = prompt.new_zeros(batch * beams, 0)
    ended: List[List[_Hypothesis]] = [[] for _ in range(batch)]
    done = [False] * batch

    for length in range(1, max_new_tokens + 1):
        candidates = (beam_scores.reshape(-1, 1) + log_probs).reshape(batch, beams * vocab)
        # 2 * beams candidates leave `beams` live ones even if every beam's best move is eos.
        top_scores, top_index = candidates.topk(min(2 * beams, beams * vocab), dim=1)
        top_scores, top_index = top_scores.tolist(), top_index.tolist()
        new_scores = torch.full((batch, beams), float("-inf"), dtype=score_dtype)
        parents = torch.zeros(batch, beams, dtype=torch.long)
        new_tokens = torch.zeros(batch, beams, dtype=torch.long)
        for b in range(batch):
            if done[b]:
                continue
            live = 0
            for score, index in zip(top_scores[b], top_index[b]):
                if score == float("-inf") or live == beams:
                    break
                parent, token = divmod(index, vocab)
                if token == eos_id:
                    tokens = torch.cat([generated[b * beams + parent], generated.new_tensor([token])])
                    ended[b].append(_Hypothesis(_normalized(score, length, length_penalty), tokens))
                else:
                    new_scores[b, live], parents[b, live], new_tokens[b, live] = score, parent, token
                    live += 1
            done[b] = live == 0 or _cannot_improve(ended[b], beams, new_scores[b, 0].item(), length,
                                                    max_new_tokens, length_penalty)
            if done[b]:
                new_scores[b] = float("-inf")  # the live beams can no longer enter the result

        flat_parents = (torch.arange(batch)[:, None] * beams + parents).reshape(-1).to(device)
        new_tokens = new_tokens.reshape(-1).to(device=device, dtype=prompt.dtype)
        generated = torch.cat([generated[flat_parents], new_tokens[:, None]], dim=1)
        beam_scores = new_scores.to(device)
        if all(done) or length == max_new_tokens:
            break
        state = select_batch(state, flat_parents)
        logits, state = step(new_tokens, state)
        log_probs = logits.to(score_dtype).log_softmax(dim=-1)

    _end_live_beams(ended, beam_scores, generated, length_penalty)
    return _collect(ended, prompt, beams, eos_id, score_dtype)


def _end_live_beams(
    ended: List[List[_Hypothesis]], beam_scores: Tensor, generated: Tensor, length_penalty: float
) -> None:
    """Beams still live at the end stop at the length limit: each one with a finite score (batch, beams) joins
    its batch element's ended hypotheses, with every token of ``generated`` (batch * beams, length)."""
    batch, beams = beam_scores.shape
    final_scores = beam_scores.cpu()
    for b in range(batch):
        for j in range(beams):
            raw = final_scores[b, j].item()
            if raw != float("-inf"):
                length = generated.shape[1]
                ended[b].append(_Hypothesis(_normalized(raw, length, length_penalty), generated[b * beams + j]))


def _cannot_improve(
    ended: List[_Hypothesis], beams: int, best_live: float, length: int, max_new_tokens: int, length_penalty: float
) -> bool:
    """True once ``beams`` ended hypotheses are at least as good as anything the best live beam can become.

    Future raw scores only fall (log-probabilities are <= 0); the normalized score is bounded by dividing the
    current raw score by the largest possible length factor (penalty > 0) or the current one (penalty <= 0).
    """
    if len(ended) < beams:
        return False
    worst_kept = sorted((h.score for h in ended), reverse=True)[beams - 1]
    bound_length = max_new_tokens if length_penalty > 0 else length
    return worst_kept >= _normalized(best_live, bound_length, length_penalty)


def _collect(
    ended: List[List[_Hypothesis]], prompt: Tensor, beams: int, eos_id: Optional[int], score_dtype: torch.dtype
) -> BeamSearchResult:
    batch, prompt_len = prompt.shape
    best = [sorted(hyps, key=lambda h: h.score, reverse=True)[:beams] for hyps in ended]
    width = prompt_len + max(len(h.tokens) for hyps in best for h in hyps)
    fill = 0 if eos_id is None else eos_id
    sequences = torch.full((batch, beams, width), fill, dtype=prompt.dtype, device=prompt.device)
    sequences[:, :, :prompt_len] = prompt[:, None]
    scores = torch.full((batch, beams), float("-inf"), dtype=score_dtype, device=prompt.device)
    lengths = torch.zeros(batch, beams, dtype=torch.long, device=prompt.device)
    for b, hyps in enumerate(best):
        for j, hyp in enumerate(hyps):
            end = prompt_len + len(hyp.tokens)
            sequences[b, j, prompt_len:end] = hyp.tokens
            scores[b, j] = hyp.score
            lengths[b, j] = end
    return BeamSearchResult(sequences, scores, lengths)


# -- non-autoregressive ----------------------------------------------------------------------------------------
@torch.no_grad()
def nat_decode(
    model: Seq2SeqTransformer,
    source: Tensor,
    *,
    eos_id: int,
    source_padding_mask: Optional[Tensor] = None,
    target_lengths: Optional[Tensor] = None,
) -> Tensor:
    """Decode every target position in one pass of a model built with ``decoding="non-autoregressive"``.

    Each row's length (END included) is ``target_lengths`` (batch,) when given (the true lengths, for tests
    and analysis), else the length head's prediction (``length="predicted"``); the decoder reads that many
    placeholders and the last of them is END. With ``length="max"`` the decoder reads ``max_target_length``
    placeholders and the output ends at its first END (given lengths then only cut it).

    Returns (batch, width) ids without a start token: ``eos_id`` from each row's first END (or its last
    position) on, as :func:`greedy_decode` fills finished rows.
    """
    if not isinstance(model, Seq2SeqTransformer) or model.nat is None:
        got = getattr(model, "decoding", type(model).__name__)
        raise TypeError(f"model must be a Seq2SeqTransformer built with decoding='non-autoregressive', got {got!r}")
    if eos_id is None:
        raise ValueError("eos_id (the END token id) is required: it marks where each output stops")
    _check_eos(eos_id, model.tgt_vocab_size)
    predicted = model.nat.length_mode == "predicted"
    memory = model.encode(source, src_padding_mask=source_padding_mask)
    lengths = target_lengths
    if predicted and lengths is None:
        lengths = predicted_lengths(model.nat.length_head(memory, source_padding_mask))
    masked = None
    if predicted:
        check_lengths("target_lengths", lengths, source.shape[0], model.nat.max_target_length)
        # Rows as long as the widest have no padding: without a mask the decoder runs its cheaper path
        # (every single-sentence decode).
        masked = lengths if bool((lengths != lengths.max()).any()) else None
    logits = model.decode_nat(memory, memory_padding_mask=source_padding_mask, target_lengths=masked,
                              width=int(lengths.max()) if predicted else None)
    tokens = logits.argmax(dim=-1).to(source.dtype)
    if lengths is not None:
        check_lengths("target_lengths", lengths, source.shape[0], tokens.shape[1])
        last = torch.arange(tokens.shape[1], device=tokens.device)[None, :] >= (lengths.to(tokens.device) - 1)[:, None]
        tokens = tokens.masked_fill(last, eos_id)
    ended = (tokens == eos_id).cumsum(dim=1) > 0
    return tokens.masked_fill(ended, eos_id)
