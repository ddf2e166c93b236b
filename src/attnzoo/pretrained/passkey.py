"""Passkey retrieval (Mohtashami and Jaggi 2023): a 5-digit number hidden at a chosen depth in filler text, asked
for at the end; the model's greedy continuation must give exactly that number.

A prompt is, in tokens: the instruction (:data:`INTRO`), whole repetitions of the filler sentence group
(:data:`FILLER`) with the key sentence (:data:`KEY_SENTENCE`) placed between two of them, and the question
(:data:`QUESTION`). Depth 0 puts the key right after the instruction, 1 right before the question, 0.5 after half
the filler's repetitions; the depth reached (:attr:`PasskeyPrompt.depth_reached`) is the asked one rounded to a
whole repetition. The prompt holds at most ``length - answer_tokens`` tokens, so that the answer still falls
within ``length`` positions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, List

import numpy as np
import torch

from .._validation import check_number, check_positive_int

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will ask you about it at the end.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_SENTENCE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
ANSWER_TOKENS = 8
"""Tokens decoded for the answer (SmolLM2's tokenizer spells a 5-digit number in 5 tokens, after a space)."""


@dataclass(frozen=True)
class PasskeyPrompt:
    """A passkey prompt.

    Attributes:
        tokens: (seq,) int64 ids of the whole prompt.
        key: the 5-digit number, as text.
        depth: the depth asked for, in [0, 1].
        key_start, key_end: the key sentence's token span ``tokens[key_start:key_end]``.
        filler_start, filler_end: where the filler (with the key sentence inside) begins and ends.
        repetitions: whole filler repetitions in the prompt; ``before``: how many precede the key sentence.
    """

    tokens: torch.Tensor
    key: str
    depth: float
    key_start: int
    key_end: int
    filler_start: int
    filler_end: int
    repetitions: int
    before: int

    @property
    def depth_reached(self) -> float:
        """The share of the filler's repetitions before the key sentence (the asked depth, rounded)."""
        return self.before / self.repetitions


def passkey(seed: int, length: int, depth: float, trial: int) -> str:
    """The 5-digit key (10000-99999) of one trial, fixed by (seed, length, depth, trial)."""
    rng = np.random.default_rng([seed, length, round(depth * 1000), trial])
    return str(int(rng.integers(10000, 100000)))


def _encode(tokenizer: Any, text: str) -> List[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: str,
                   answer_tokens: int = ANSWER_TOKENS) -> PasskeyPrompt:
    """The prompt hiding ``key`` at ``depth`` (0 to 1) in filler, at most ``length - answer_tokens`` tokens.

    ``tokenizer``: anything with ``encode(text, add_special_tokens=False)``. Each piece is tokenized on its own
    (the filler group, key sentence and question with a leading space, as they follow a sentence), so the key
    sentence's tokens are the same at every depth."""
    length = check_positive_int("length", length)
    depth = check_number("depth", depth, minimum=0.0, maximum=1.0)
    answer_tokens = check_positive_int("answer_tokens", answer_tokens)
    if not (isinstance(key, str) and key.isdigit()):
        raise ValueError(f"key must be a string of digits, got {key!r}")
    intro = _encode(tokenizer, INTRO)
    unit = _encode(tokenizer, " " + FILLER)
    sentence = _encode(tokenizer, " " + KEY_SENTENCE.format(key=key))
    question = _encode(tokenizer, " " + QUESTION)
    room = length - answer_tokens - len(intro) - len(sentence) - len(question)
    repetitions = room // len(unit)
    if repetitions < 1:
        fixed = length - room
        raise ValueError(f"length={length} is too short for a passkey prompt: it needs at least "
                         f"{fixed + len(unit)} tokens")
    before = round(depth * repetitions)
    ids = intro + unit * before + sentence + unit * (repetitions - before) + question
    key_start = len(intro) + before * len(unit)
    return PasskeyPrompt(torch.tensor(ids, dtype=torch.long), key, float(depth), key_start, key_start + len(sentence),
                         len(intro), len(ids) - len(question), repetitions, before)


def passkey_answer(text: str) -> str:
    """The number a continuation gives: its first run of digits ("" if none)."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else ""


def passkey_correct(text: str, key: str) -> bool:
    """Whether the continuation ``text`` gives exactly ``key``: its first run of digits equals it (a longer or
    shorter number, or another one first, is wrong)."""
    return passkey_answer(text) == key
