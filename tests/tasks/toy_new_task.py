"""A task defined outside attnzoo, as a user would write one: the whole of the "adding a task" recipe.

``attnzoo train --import tests/tasks/toy_new_task.py toy-parity`` trains on it and ``attnzoo eval`` reads the run back;
no other file names it.
The task: the parity of the number of ones in a random bit string (a class per sequence).
"""

from __future__ import annotations

import numpy as np
import torch

from attnzoo._validation import check_positive_int
from attnzoo.tasks import Split, Task, register


@register
class Parity(Task):
    """Whether a random bit string holds an odd number of ones."""

    name = "toy-parity"
    kind = "classify"
    metric = "accuracy"
    needs_causal = False
    summary = "the parity of a random bit string (a toy task defined outside attnzoo)"

    def __init__(self, *, seed: int = 0, train_size: int = 256, validation_size: int = 32, test_size: int = 32,
                 length: int = 8) -> None:
        self.seed = self._check_seed(seed)
        self._set_split_sizes(train_size, validation_size, test_size)
        self.length = check_positive_int("length", length)
        self.vocab_size, self.seq_len, self.num_classes, self.pad_id = 2, self.length, 2, None
        rng = np.random.default_rng(self.seed)
        splits = {}
        for split, count in (("train", self.train_size), ("validation", self.validation_size),
                             ("test", self.test_size)):
            bits = torch.from_numpy(rng.integers(0, 2, (count, self.length)).astype(np.int64))
            splits[split] = Split(bits, bits.sum(dim=1) % 2, None)
        self._set_splits(splits)
