"""How evaluation decodes an autoregressive seq2seq model, and the scores of what it decodes.

:class:`DecoderSettings` chooses the decoder of the decoded metrics: greedy (the default), beam search or
seeded sampling (:mod:`attnzoo.decoding`), each optionally under monotonic cross-attention
(:mod:`attnzoo.models.monotonic`). :func:`timed_outputs` decodes a batch with it and measures the wall time;
:func:`corpus_bleu` scores the outputs by sacrebleu's corpus BLEU over the token strings.

The decoding time is wall time over whole batches (every sentence of a batch is decoded at once, the
incremental path stopping when all have ended) divided by the number of sentences: the time per sentence of
batched decoding on this machine, not of decoding one sentence alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._validation import check_choice
from ..decoding import beam_search, greedy_decode, sample_decode
from ..models.monotonic import DECODING_COMMANDS, MonotonicInference
from .seq2seq import strip_output
from .settings import check_declared, check_owners, number, optional_instance, setting

DECODER_NAMES = {"greedy": "greedy decoding", "beam": "beam search", "sample": "sampling"}
"""The decoders, and what a message calls each."""
DECODERS = tuple(DECODER_NAMES)
DEFAULT_BEAM_SIZE = 4


@dataclass(frozen=True)
class DecoderSettings:
    """The decoder of the decoded metrics.

    Args:
        decoder: "greedy", "beam" or "sample".
        beam_size, length_penalty: beam search only: beams (>= 1; None: :data:`DEFAULT_BEAM_SIZE`) and the
            exponent of the length normalisation (None: 1.0; see :func:`attnzoo.beam_search`).
        temperature, top_k, top_p, seed: sampling only: the softmax temperature (> 0; None: 1.0), the top-k
            and nucleus filters (None: off) and the seed of the generator (>= 0; None: 0), drawn from once per
            evaluation, so an evaluation is reproducible.
        monotonic: monotonic cross-attention (:class:`MonotonicInference`) with any decoder, or None.

    An option of another decoder than the one chosen is an error naming it, never silently ignored. Each field
    declares (:mod:`attnzoo.training.settings`) its check, the decoder it is an option of (``owner``) and its
    flag of ``attnzoo train`` and ``attnzoo eval``, which choose the decoder by the options given.
    """

    decoder: str = setting("greedy", choices=DECODERS, flag=False,
                           help="greedy, beam or sample; on the command line, chosen by the options given")
    beam_size: Optional[int] = setting(
        None, check=number(integer=True, minimum=1, optional=True), owner="beam", flag="--beam-size", metavar="N",
        commands=DECODING_COMMANDS, help="beam search with this many beams")
    length_penalty: Optional[float] = setting(
        None, check=number(optional=True), owner="beam", flag="--length-penalty", metavar="X",
        commands=DECODING_COMMANDS, help="beam search: scores divided by length ** this (default 1.0)")
    temperature: Optional[float] = setting(
        None, check=number(minimum=0.0, exclusive_minimum=True, optional=True), owner="sample",
        flag="--sampling-temperature", metavar="T", commands=DECODING_COMMANDS,
        help="sampling at this temperature (seeded: --sampling-seed)")
    top_k: Optional[int] = setting(
        None, check=number(integer=True, minimum=1, optional=True), owner="sample", flag="--top-k", metavar="K",
        commands=DECODING_COMMANDS, help="sampling: keep the k likeliest tokens")
    top_p: Optional[float] = setting(
        None, check=number(minimum=0.0, maximum=1.0, exclusive_minimum=True, optional=True), owner="sample",
        flag="--top-p", metavar="P", commands=DECODING_COMMANDS, help="sampling: nucleus of this probability")
    seed: Optional[int] = setting(
        None, check=number(integer=True, minimum=0, optional=True), owner="sample", flag="--sampling-seed",
        metavar="SEED", commands=DECODING_COMMANDS, help="sampling: the generator's seed (default 0)")
    monotonic: Optional[MonotonicInference] = setting(
        None, check=optional_instance(MonotonicInference), flag="--monotonic-inference", commands=DECODING_COMMANDS,
        help="hold the cross-attention to a window that moves left to right with its focus (any decoder)")

    def __post_init__(self) -> None:
        check_choice("decoder", self.decoder, DECODERS)  # first: the options are refused under a known decoder
        check_owners(self, "decoder")
        check_declared(self)

    def describe(self) -> str:
        """One line naming the decoder and its settings, e.g. ``beam (size 4, length penalty 1)``."""
        if self.decoder == "beam":
            text = (f"beam (size {self.beam_size or DEFAULT_BEAM_SIZE}, length penalty "
                    f"{1.0 if self.length_penalty is None else self.length_penalty:g})")
        elif self.decoder == "sample":
            text = (f"sampling (temperature {1.0 if self.temperature is None else self.temperature:g}, top-k "
                    f"{self.top_k or 'off'}, top-p {self.top_p or 'off'}, seed {self.seed or 0})")
        else:
            text = "greedy"
        if self.monotonic is not None:
            text += f", monotonic (ahead {self.monotonic.ahead}, behind {self.monotonic.behind})"
        return text

    def generator(self) -> Optional[torch.Generator]:
        """A fresh generator for one evaluation's sampling (None for the other decoders)."""
        if self.decoder != "sample":
            return None
        return torch.Generator().manual_seed(self.seed or 0)


GREEDY = DecoderSettings()


@torch.no_grad()
def timed_outputs(
    model: torch.nn.Module,
    source: Tensor,
    source_mask: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
    settings: DecoderSettings = GREEDY,
    generator: Optional[torch.Generator] = None,
) -> Tuple[List[List[int]], float]:
    """Decode a batch of sources (batch, seq_src) (padding mask alike) with ``settings``: each output cut at
    its EOS (at most ``max_new_tokens`` tokens), and the wall seconds the decoding took. ``generator``: the
    evaluation's sampling generator (:meth:`DecoderSettings.generator`)."""
    prompt = torch.full((source.shape[0], 1), bos_id, dtype=torch.long, device=source.device)
    common = dict(eos_id=eos_id, source=source, source_padding_mask=source_mask, monotonic=settings.monotonic)
    began = time.perf_counter()
    if settings.decoder == "beam":
        decoded = beam_search(
            model, prompt, max_new_tokens, beam_size=settings.beam_size or DEFAULT_BEAM_SIZE,
            length_penalty=1.0 if settings.length_penalty is None else settings.length_penalty, **common,
        ).best
    elif settings.decoder == "sample":
        decoded = sample_decode(
            model, prompt, max_new_tokens, temperature=1.0 if settings.temperature is None else settings.temperature,
            top_k=settings.top_k, top_p=settings.top_p, generator=generator, **common,
        )
    else:
        decoded = greedy_decode(model, prompt, max_new_tokens, **common)
    seconds = time.perf_counter() - began
    return [strip_output(row[1:].tolist(), eos_id) for row in decoded], seconds


def corpus_bleu(
    predictions: Sequence[Sequence[int]], references: Sequence[Sequence[int]], token_names: Sequence[str]
) -> float:
    """sacrebleu's corpus BLEU (0-100, one reference per sentence) of token-id lists, each written as its
    token names joined by spaces and scored as they are (``tokenize="none"``: the tokens are the words)."""
    import sacrebleu  # a core dependency; imported here so that importing attnzoo stays light

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    text = lambda ids: " ".join(token_names[i] for i in ids)  # noqa: E731
    return sacrebleu.corpus_bleu([text(p) for p in predictions], [[text(r) for r in references]],
                                 tokenize="none").score
