"""Multi-query associative recall: look up the values of keys stored earlier in the sequence.

Each sequence is ``num_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (keys distinct within a sequence, drawn
uniformly without replacement from ``num_keys`` keys; values drawn uniformly, with replacement, from
``num_values`` values) followed by ``num_queries`` query keys: distinct keys of the pairs, in random order.
The inputs hold no answers, so a bidirectional encoder can be trained on them; the target at each query
position is the index (0..num_values-1) of the value paired with that key, and :data:`IGNORE_INDEX` at every
other position. Every sequence has the same length, ``2 * num_pairs + num_queries``; nothing is padded.

``causal=True`` asks for a causal model (each position sees only itself and earlier ones), as in the papers'
recall (MQAR, Zoology): a query then reads what the pairs before it stored, before any later query writes.
The data is the same: every pair precedes the queries, and each target sits at its query key.

Token ids: keys ``0..num_keys-1``, values ``num_keys..num_keys+num_values-1`` (value index i is token
``num_keys + i``); ``vocab_size = num_keys + num_values``, ``num_classes = num_values``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .._validation import check_bool, check_number, check_positive_int
from .base import IGNORE_INDEX, Split, Task, register


def check_recall_options(
    num_pairs: object, num_queries: object, num_keys: object, num_values: object
) -> Tuple[int, int, int, int]:
    """The sequence options, checked (errors name the option) and returned: ``num_pairs`` an int >= 1,
    ``num_queries`` an int from 1 to ``num_pairs`` (None: ``num_pairs``, every pair asked about), ``num_keys``
    an int >= ``num_pairs`` (the keys of a sequence are distinct), ``num_values`` an int >= 2."""
    num_pairs = check_positive_int("num_pairs", num_pairs)
    queries = check_number("num_queries", num_queries, integer=True, minimum=1, maximum=num_pairs, optional=True)
    num_keys = check_number("num_keys", num_keys, integer=True, minimum=num_pairs)
    num_values = check_number("num_values", num_values, integer=True, minimum=2)
    return num_pairs, num_pairs if queries is None else queries, num_keys, num_values


def generate_recall(
    count: int, *, num_pairs: int, num_queries: int, num_keys: int, num_values: int, rng: np.random.Generator
) -> Split:
    """``count`` recall sequences drawn from ``rng`` (see the module docstring). ``count`` is an int >= 1, the
    options as :func:`check_recall_options` takes them, ``rng`` a ``numpy.random.Generator``; anything else is
    refused naming the argument, before anything is drawn."""
    count = check_positive_int("count", count)
    num_pairs, num_queries, num_keys, num_values = check_recall_options(num_pairs, num_queries, num_keys,
                                                                        num_values)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {rng!r} "
                        f"({type(rng).__name__})")
    # The first num_pairs of a random permutation of the keys: distinct keys, uniformly.
    keys = rng.random((count, num_keys)).argsort(axis=1)[:, :num_pairs]
    values = rng.integers(0, num_values, (count, num_pairs))
    # Which pairs are asked about, and in what order: the first num_queries of a permutation of the pairs.
    asked = rng.random((count, num_pairs)).argsort(axis=1)[:, :num_queries]
    rows = np.arange(count)[:, None]
    pairs = np.stack([keys, num_keys + values], axis=2).reshape(count, 2 * num_pairs)
    inputs = np.concatenate([pairs, keys[rows, asked]], axis=1)
    targets = np.full(inputs.shape, IGNORE_INDEX, dtype=np.int64)
    targets[:, 2 * num_pairs :] = values[rows, asked]
    return Split(torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(targets), None)


@register
class Recall(Task):
    """Associative recall: the value stored with each query key (a label per query position)."""

    name = "recall"
    kind = "tag"
    metric = "accuracy"
    needs_causal = False
    summary = "multi-query associative recall: the value stored with each queried key"

    def __init__(
        self,
        *,
        seed: int = 0,
        train_size: int = 10000,
        validation_size: int = 1000,
        test_size: int = 1000,
        num_pairs: int = 16,
        num_queries: Optional[int] = None,
        num_keys: int = 64,
        num_values: int = 64,
        causal: bool = False,
    ) -> None:
        self.seed = self._check_seed(seed)
        self._set_split_sizes(train_size, validation_size, test_size)
        # num_queries=None asks about every pair; the resolved count is kept, so options() rebuilds the same data.
        self.num_pairs, self.num_queries, self.num_keys, self.num_values = check_recall_options(
            num_pairs, num_queries, num_keys, num_values)
        self.causal = check_bool("causal", causal)

        self.vocab_size = self.num_keys + self.num_values
        self.seq_len = 2 * self.num_pairs + self.num_queries
        self.num_classes = self.num_values
        self.pad_id = None

        rng = np.random.default_rng(self.seed)
        splits: Dict[str, Split] = {}
        for split_name, count in (("train", self.train_size), ("validation", self.validation_size),
                                  ("test", self.test_size)):
            splits[split_name] = generate_recall(count, num_pairs=self.num_pairs, num_queries=self.num_queries,
                                                 num_keys=self.num_keys, num_values=self.num_values, rng=rng)
        self._set_splits(splits)

    @property
    def needs_causal_model(self) -> bool:
        """``causal``: the model must be causal, each query reading only the positions before it."""
        return self.causal

    def _describe_extra(self) -> List[str]:
        model = ("causal model: each query sees only the positions before it" if self.causal
                 else "bidirectional model: every position sees the whole sequence")
        return [
            f"{self.num_pairs} key-value pairs then {self.num_queries} queries; keys are tokens "
            f"0..{self.num_keys - 1}, values {self.num_keys}..{self.vocab_size - 1}; seed {self.seed}",
            f"causal {self.causal}: {model}",
        ]
