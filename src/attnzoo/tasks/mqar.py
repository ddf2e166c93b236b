"""MQAR: multi-query associative recall as Zoology defines it (Arora et al. 2024, "Zoology: Measuring and
Improving Recall in Efficient Language Models"), in the causal language-model form.

The vocabulary is split in halves: keys are tokens ``0..vocab_size // 2 - 1``, values the rest. A sequence of
``seq_len`` tokens starts with ``num_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (keys distinct, values
distinct, each drawn uniformly from its half). The rest is ``space = (seq_len - 2 * num_pairs) // 2`` slots of
two positions (and, when ``seq_len`` is odd, one filler position at the end). Each key is queried exactly once,
in the first position of a slot; the slots are drawn from a power law over their distance from the pairs,
slot ``g`` (0-based) weighted ``(g + 1) ** (power_a - 1)``: in turn for pair 1, 2, ..., each among the slots
not yet taken (Zoology draws them with ``numpy``'s ``choice(replace=False, p=...)``). So with ``power_a``
small most queries come soon after the pairs, and the earlier pairs tend to be asked first; at ``power_a=1``
the slots are uniform. With ``value_after_query`` the query key is followed by its value, so that every scored
target is the next input token (a language-model sequence); without it, a filler token, as Zoology's
generator writes it. Every other position is a filler token drawn uniformly from the whole vocabulary
(Zoology's ``random_non_queries``).

The model is a causal tagger (each position sees only itself and earlier ones) with a label per position over
the whole vocabulary, a language model's head: the target at each query key is its value's token id, and
:data:`IGNORE_INDEX` everywhere else (only the value right after a query key is scored). ``num_classes =
vocab_size``.

Splits never share a sequence: the validation split is drawn first, then test, then train, and a sequence
whose tokens equal one kept before (in any split) is dropped and drawn again; so the held-out splits do not
change with ``train_size``.
"""

from __future__ import annotations

from typing import Dict, List, Set, Tuple

import numpy as np
import torch

from .._validation import check_bool, check_number, check_positive_int
from .base import IGNORE_INDEX, SPLITS, Split, Task, register

# Rounds of drawing again before giving up on distinct sequences (only a tiny vocabulary gets near it).
_MAX_ROUNDS = 50


def check_mqar_options(
    seq_len: object, num_pairs: object, vocab_size: object, power_a: object
) -> Tuple[int, int, int, float]:
    """The sequence options, checked (errors name the option) and returned: ``num_pairs`` an int >= 1,
    ``seq_len`` an int >= ``4 * num_pairs`` (the pairs and a slot per query), ``vocab_size`` an int >= ``2 *
    num_pairs`` (distinct keys in the lower half, distinct values in the upper), ``power_a`` a number in
    (0, 1] (1: uniform slots)."""
    num_pairs = check_positive_int("num_pairs", num_pairs)
    seq_len = check_number("seq_len", seq_len, integer=True, minimum=4 * num_pairs)
    vocab_size = check_number("vocab_size", vocab_size, integer=True, minimum=2 * num_pairs)
    power_a = check_number("power_a", power_a, minimum=0.0, maximum=1.0, exclusive_minimum=True)
    return seq_len, num_pairs, vocab_size, power_a


def _distinct_per_row(rng: np.random.Generator, count: int, low: int, high: int, size: int) -> np.ndarray:
    """(count, size) ints from ``[low, high)``, distinct within each row, every ordered tuple equally likely.

    When ``size`` is more than half the range: the first ``size`` of a random permutation per row (then the
    permutation is at most twice the output). Otherwise a (count, range) permutation could be far too large
    (20,000 rows of 4,096 keys), so: draw every entry uniformly, then draw again each entry that repeats an
    earlier one of its row, until none does; each round redraws with probability below 1/2. The result is
    uniform over ordered distinct tuples because the procedure treats every value alike (relabelling the
    values maps its runs onto each other)."""
    span = high - low
    if 2 * size > span:
        return low + rng.random((count, span)).argsort(axis=1)[:, :size]
    out = rng.integers(0, span, (count, size))
    while True:
        order = out.argsort(axis=1, kind="stable")  # equal values stay in their order: the first one is kept
        ordered = np.take_along_axis(out, order, axis=1)
        repeated = np.zeros(out.shape, dtype=bool)
        np.put_along_axis(repeated, order[:, 1:], ordered[:, 1:] == ordered[:, :-1], axis=1)
        if not repeated.any():
            return low + out
        out[repeated] = rng.integers(0, span, int(repeated.sum()))


def query_slots(rng: np.random.Generator, count: int, space: int, num_pairs: int, power_a: float) -> np.ndarray:
    """(count, num_pairs) slot indices in ``[0, space)``, distinct per row, column j the slot of pair j: drawn in
    turn, each among the slots not yet taken with probability proportional to ``(g + 1) ** (power_a - 1)``.

    Drawn all at once by exponential keys (Efraimidis and Spirakis 2006): the slots in increasing order of
    ``E_g / w_g``, ``E_g`` standard exponential, are distributed as successive draws without replacement with
    weights ``w_g``."""
    weights = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
    keys = rng.standard_exponential((count, space)) / weights
    return keys.argsort(axis=1, kind="stable")[:, :num_pairs]


def generate_mqar(
    count: int, *, seq_len: int, num_pairs: int, vocab_size: int, power_a: float, value_after_query: bool,
    rng: np.random.Generator,
) -> Tuple[np.ndarray, np.ndarray]:
    """``count`` MQAR sequences (see the module docstring) drawn from ``rng``: inputs (count, seq_len) and
    targets (count, seq_len), int64 numpy arrays. Options as :func:`check_mqar_options` takes them."""
    half = vocab_size // 2
    keys = _distinct_per_row(rng, count, 0, half, num_pairs)
    values = _distinct_per_row(rng, count, half, vocab_size, num_pairs)
    inputs = rng.integers(0, vocab_size, (count, seq_len))  # the filler, overwritten where something is placed
    context = 2 * num_pairs
    inputs[:, 0:context:2], inputs[:, 1:context:2] = keys, values
    query_at = context + 2 * query_slots(rng, count, (seq_len - context) // 2, num_pairs, power_a)
    rows = np.arange(count)[:, None]
    inputs[rows, query_at] = keys
    if value_after_query:
        inputs[rows, query_at + 1] = values
    targets = np.full((count, seq_len), IGNORE_INDEX, dtype=np.int64)
    targets[rows, query_at] = values
    return inputs.astype(np.int64), targets


@register
class MQAR(Task):
    """Zoology's multi-query associative recall: the value of each key queried after the pairs, causally."""

    name = "mqar"
    kind = "tag"
    metric = "accuracy"
    needs_causal = False  # the kind's; this task always asks for a causal model (needs_causal_model)
    summary = "Zoology's multi-query associative recall: each key's value, queried at power-law distances, causally"

    def __init__(
        self,
        *,
        seed: int = 0,
        train_size: int = 20000,
        validation_size: int = 1000,
        test_size: int = 1000,
        seq_len: int = 256,
        num_pairs: int = 64,
        vocab_size: int = 8192,
        power_a: float = 0.01,
        value_after_query: bool = True,
    ) -> None:
        self.seed = self._check_seed(seed)
        self._set_split_sizes(train_size, validation_size, test_size)
        self.seq_len, self.num_pairs, self.vocab_size, self.power_a = check_mqar_options(
            seq_len, num_pairs, vocab_size, power_a)
        self.value_after_query = check_bool("value_after_query", value_after_query)
        self.num_classes = self.vocab_size
        self.pad_id = None
        self._set_splits(self._draw_splits())

    def _draw_splits(self) -> Dict[str, Split]:
        """The three splits, no sequence in two of them (nor twice in one): held-out splits first."""
        rng = np.random.default_rng(self.seed)
        seen: Set[bytes] = set()
        sizes = {"train": self.train_size, "validation": self.validation_size, "test": self.test_size}
        splits = {name: self._distinct(rng, sizes[name], seen) for name in ("validation", "test", "train")}
        return {name: splits[name] for name in SPLITS}

    def _distinct(self, rng: np.random.Generator, count: int, seen: Set[bytes]) -> Split:
        """``count`` sequences, none equal to one in ``seen`` or to another of them; adds them to ``seen``."""
        inputs: List[np.ndarray] = []
        targets: List[np.ndarray] = []
        wanted = count
        for _ in range(_MAX_ROUNDS):
            drawn, answers = generate_mqar(wanted, seq_len=self.seq_len, num_pairs=self.num_pairs,
                                           vocab_size=self.vocab_size, power_a=self.power_a,
                                           value_after_query=self.value_after_query, rng=rng)
            keep = np.zeros(wanted, dtype=bool)
            for i, row in enumerate(drawn):
                key = row.tobytes()
                keep[i] = key not in seen
                seen.add(key)
            inputs.append(drawn[keep])
            targets.append(answers[keep])
            wanted -= int(keep.sum())
            if wanted == 0:
                return Split(torch.from_numpy(np.concatenate(inputs)), torch.from_numpy(np.concatenate(targets)), None)
        raise ValueError(f"mqar: too few distinct sequences at vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
                         f"num_pairs={self.num_pairs} for splits of {self.train_size}, {self.validation_size} and "
                         f"{self.test_size}: give a larger vocab_size or seq_len, or smaller splits")

    @property
    def needs_causal_model(self) -> bool:
        """Always: a query reads only the pairs and the filler before it, as in a language model."""
        return True

    def _describe_extra(self) -> List[str]:
        space = (self.seq_len - 2 * self.num_pairs) // 2
        after = "its value" if self.value_after_query else "a filler token"
        return [
            f"{self.num_pairs} key-value pairs, then {self.num_pairs} queries in {space} slots drawn by a power law "
            f"(power_a {self.power_a:g}), each query key followed by {after}; keys are tokens "
            f"0..{self.vocab_size // 2 - 1}, values {self.vocab_size // 2}..{self.vocab_size - 1}; seed {self.seed}",
            "causal model: each query sees only the positions before it; scored: the value at each query key",
        ]
