"""Sequence-to-sequence tasks: ``copy``, ``reverse`` and ``sort`` of random symbol strings, and ``copy-names``.

Every seq2seq task shares three special ids in both vocabularies: :data:`PAD_ID` (0), :data:`BOS_ID` (1)
and :data:`EOS_ID` (2); the tokens proper start at :data:`FIRST_TOKEN` (3). A source is its tokens then
padding; a target is its tokens then EOS (the decoder reads BOS first, see :class:`~.base.Seq2SeqSplit`).

``copy-names`` is the task for a copy mechanism: template sentences that mention a person and a number,
whose answers repeat both. The names of the validation and test sentences are drawn from names that no
training sentence uses, so a model must copy them from its source rather than recall them.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._validation import check_bool, check_number, check_positive_int
from .base import IGNORE_INDEX, SPLITS, Seq2SeqSplit, Task, register

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_TOKEN = 3
SPECIALS = ("<pad>", "<bos>", "<eos>")


def make_seq2seq_split(
    sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], seq_len: int, target_len: int
) -> Seq2SeqSplit:
    """A :class:`Seq2SeqSplit` from token lists: sources padded to ``seq_len``; targets followed by EOS and
    :data:`IGNORE_INDEX` up to ``target_len``; decoder inputs BOS then the target shifted right, PAD after."""
    n = len(sources)
    inputs = np.full((n, seq_len), PAD_ID, dtype=np.int64)
    labels = np.full((n, target_len), IGNORE_INDEX, dtype=np.int64)
    decoder_inputs = np.full((n, target_len), PAD_ID, dtype=np.int64)
    for row, (source, target) in enumerate(zip(sources, targets)):
        if not 1 <= len(source) <= seq_len or len(target) + 1 > target_len:
            raise ValueError(f"sequence {row}: source length {len(source)} (max {seq_len}) or target length "
                             f"{len(target)} + EOS (max {target_len}) out of range")
        inputs[row, : len(source)] = source
        labels[row, : len(target) + 1] = [*target, EOS_ID]
        decoder_inputs[row, : len(target) + 1] = [BOS_ID, *target]
    inputs_t = torch.from_numpy(inputs)
    return Seq2SeqSplit(inputs_t, torch.from_numpy(labels), inputs_t == PAD_ID, torch.from_numpy(decoder_inputs))


class Seq2SeqTask(Task):
    """Base of the seq2seq tasks: the special ids and the token names (``source_tokens``, ``target_tokens``,
    one string per id, for printing decoded sequences)."""

    kind = "seq2seq"
    metric = "accuracy"
    needs_causal = False

    target_len: int
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    source_tokens: List[str]
    target_tokens: List[str]
    rare_ids: Optional[FrozenSet[int]] = None
    """Target ids of the rare tokens an answer repeats from its source (the names and numbers of
    ``copy-names``), or None: evaluation then reports the share of them the model reproduces."""
    extended_tokens: Tuple[str, ...] = ()
    """Source tokens outside the target vocabulary that answers may hold all the same, as the extended ids
    ``num_classes + k``: only a copy mechanism can produce them (empty for most tasks)."""

    def copy_map(self) -> torch.Tensor:
        """What a copy mechanism produces when it copies each source token: (vocab_size,) int64, the target
        (or extended) id of the token of the same name, -1 for the special tokens and for a source token that
        no answer can hold (see :mod:`attnzoo.models.pointer`). All -1 when the vocabularies share nothing
        (g2p: letters and phonemes): such a task has nothing to copy."""
        target_id = {token: i for i, token in enumerate((*self.target_tokens, *self.extended_tokens))}
        return torch.tensor([-1 if token in SPECIALS else target_id.get(token, -1) for token in self.source_tokens],
                            dtype=torch.int64)

    def _finish(self, data: Dict[str, Tuple[List[List[int]], List[List[int]]]]) -> None:
        """Set the sizes from the longest sequences and build the three splits."""
        self.pad_id = PAD_ID
        self.vocab_size = len(self.source_tokens)
        self.num_classes = len(self.target_tokens)
        self.seq_len = max(len(s) for sources, _ in data.values() for s in sources)
        self.target_len = max(len(t) for _, targets in data.values() for t in targets) + 1
        self._set_splits({name: make_seq2seq_split(*data[name], self.seq_len, self.target_len) for name in SPLITS})


def _symbols(num_symbols: int) -> List[str]:
    return [*SPECIALS, *(f"s{i}" for i in range(num_symbols))]


class _SymbolTask(Seq2SeqTask):
    """Random strings of ``num_symbols`` symbols, ``min_length..length`` long, mapped by :meth:`transform`."""

    def __init__(
        self,
        *,
        seed: int = 0,
        train_size: int = 10000,
        validation_size: int = 1000,
        test_size: int = 1000,
        length: int = 16,
        min_length: int = 4,
        num_symbols: int = 16,
    ) -> None:
        self.seed = self._check_seed(seed)
        self._set_split_sizes(train_size, validation_size, test_size)
        self.length = check_positive_int("length", length)
        self.min_length = check_number("min_length", min_length, integer=True, minimum=1, maximum=self.length)
        self.num_symbols = check_number("num_symbols", num_symbols, integer=True, minimum=2)
        self.source_tokens = self.target_tokens = _symbols(self.num_symbols)
        rng = np.random.default_rng(self.seed)
        data = {}
        for split_name, count in (("train", self.train_size), ("validation", self.validation_size),
                                  ("test", self.test_size)):
            lengths = rng.integers(self.min_length, self.length + 1, count)
            sources = [(FIRST_TOKEN + rng.integers(0, self.num_symbols, int(n))).tolist() for n in lengths]
            data[split_name] = (sources, [self.transform(s) for s in sources])
        self._finish(data)

    @staticmethod
    def transform(source: List[int]) -> List[int]:
        raise NotImplementedError

    def _describe_extra(self) -> List[str]:
        return [f"{self.min_length}..{self.length} symbols of {self.num_symbols}; seed {self.seed}"]


@register
class Copy(_SymbolTask):
    """The target is the source."""

    name = "copy"
    summary = "seq2seq: repeat a random string of symbols"

    @staticmethod
    def transform(source: List[int]) -> List[int]:
        return list(source)


@register
class Reverse(_SymbolTask):
    """The target is the source reversed."""

    name = "reverse"
    summary = "seq2seq: a random string of symbols reversed"

    @staticmethod
    def transform(source: List[int]) -> List[int]:
        return list(reversed(source))


@register
class Sort(_SymbolTask):
    """The target is the source sorted (by token id)."""

    name = "sort"
    summary = "seq2seq: a random string of symbols sorted"

    @staticmethod
    def transform(source: List[int]) -> List[int]:
        return sorted(source)


# -- copy-names ----------------------------------------------------------------------------------------------
_ONSETS = ("b", "br", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "kl", "l", "m", "n", "p", "r", "s", "sh",
           "st", "t", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
_CODAS = ("", "n", "r", "l", "s", "th", "x", "m")

# (source template, target template): {name} and {number} are replaced by one token each.
TEMPLATES = (
    ("please tell {name} that the meeting moved to room {number}", "{name} : room {number}"),
    ("{name} called about order {number} this morning", "order {number} for {name}"),
    ("send {number} copies of the report to {name}", "{name} gets {number} copies"),
    ("the parcel for {name} weighs {number} grams", "{name} : {number} grams"),
    ("remind {name} to bring {number} chairs tomorrow", "{name} brings {number} chairs"),
    ("{name} scored {number} points in the final", "{name} scored {number}"),
)


def _name_pool(rng: np.random.Generator, count: int) -> List[str]:
    """``count`` distinct made-up two-syllable names, capitalised (deterministic under ``rng``)."""
    names: List[str] = []
    seen = set()
    while len(names) < count:
        parts = [_ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))] for _ in range(2)]
        name = ("".join(parts) + _CODAS[rng.integers(len(_CODAS))]).capitalize()
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


@register
class CopyNames(Seq2SeqTask):
    """Template sentences whose answers repeat a name and a number of the source.

    ``num_names`` names are made up; ``held_out`` of them (a share) appear only in the validation and test
    sentences, never in training. Numbers are drawn from ``0..num_numbers-1``, rare each. With
    ``shared_vocabulary`` (the default) source and target share one word vocabulary (every word of every
    template, name and number), so a copy mechanism can point at a source token and produce the same id;
    without it the target vocabulary lacks the held-out names, which the answers of validation and test hold
    as extended ids (:attr:`extended_tokens`): only a copy mechanism can produce them at all. ``name_ids``
    and ``number_ids`` are the target ids of the names and numbers, ``rare_ids`` both.
    """

    name = "copy-names"
    summary = "seq2seq: template sentences whose answers repeat rare names and numbers of the source"

    def __init__(
        self,
        *,
        seed: int = 0,
        train_size: int = 10000,
        validation_size: int = 1000,
        test_size: int = 1000,
        num_names: int = 2000,
        held_out: float = 0.5,
        num_numbers: int = 1000,
        shared_vocabulary: bool = True,
    ) -> None:
        self.seed = self._check_seed(seed)
        self._set_split_sizes(train_size, validation_size, test_size)
        self.num_names = check_number("num_names", num_names, integer=True, minimum=2)
        self.held_out = check_number("held_out", held_out, minimum=0.0, maximum=1.0, exclusive_minimum=True,
                                     exclusive_maximum=True)
        self.num_numbers = check_positive_int("num_numbers", num_numbers)
        self.shared_vocabulary = check_bool("shared_vocabulary", shared_vocabulary)
        rng = np.random.default_rng(self.seed)
        names = _name_pool(rng, self.num_names)
        cut = min(max(int(round(self.num_names * (1 - self.held_out))), 1), self.num_names - 1)
        pools = {"train": names[:cut], "validation": names[cut:], "test": names[cut:]}
        words = sorted({w for pair in TEMPLATES for t in pair for w in t.split() if not w.startswith("{")})
        numbers = [str(i) for i in range(self.num_numbers)]
        self.source_tokens = [*SPECIALS, *words, *names, *numbers]
        self.target_tokens = self.source_tokens if self.shared_vocabulary else [*SPECIALS, *words, *names[:cut],
                                                                                *numbers]
        self.extended_tokens = () if self.shared_vocabulary else tuple(names[cut:])
        index = {token: i for i, token in enumerate(self.source_tokens)}
        target_index = {token: i for i, token in enumerate((*self.target_tokens, *self.extended_tokens))}
        self.name_ids = frozenset(target_index[t] for t in names)
        self.number_ids = frozenset(target_index[t] for t in numbers)
        self.rare_ids = self.name_ids | self.number_ids
        data = {}
        for split_name, count in (("train", self.train_size), ("validation", self.validation_size),
                                  ("test", self.test_size)):
            pool = pools[split_name]
            sources, targets = [], []
            for _ in range(count):
                source, target = TEMPLATES[rng.integers(len(TEMPLATES))]
                fill = {"name": pool[rng.integers(len(pool))], "number": str(rng.integers(self.num_numbers))}
                sources.append([index[w] for w in source.format(**fill).split()])
                targets.append([target_index[w] for w in target.format(**fill).split()])
            data[split_name] = (sources, targets)
        self._finish(data)

    def _describe_extra(self) -> List[str]:
        vocabulary = "one shared vocabulary" if self.shared_vocabulary else \
            f"the {len(self.extended_tokens)} held-out names outside the target vocabulary (extended ids)"
        return [f"{len(TEMPLATES)} templates, {self.num_names} names ({self.held_out:.0%} only in validation "
                f"and test), numbers 0..{self.num_numbers - 1}, {vocabulary}; seed {self.seed}"]
