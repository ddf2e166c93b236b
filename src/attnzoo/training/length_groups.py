"""Batches of examples of similar length, cut to their longest example (``TrainConfig.group_by_length``).

A task whose examples have many lengths pads them all to the longest of the split: a random batch of CMUdict
words (7.5 letters on average, padded to 20) is mostly padding, and every position of it costs as much as a
real one. Grouping by length makes batches of examples of about one length, and cutting each batch to its
longest example drops the padding from the computation:

* :class:`LengthGroupedOrder`: each epoch, the same seeded permutation :func:`~attnzoo.training.loop.batch_indices`
  uses, cut into pools of ``pool_batches`` batches; each pool sorted by length and cut into batches; the
  epoch's batches then shuffled (so consecutive steps do not go from short to long). A pure function of
  ``(seed, step)``, so a resumed run sees the same batches. Every batch is full: the ``size % batch_size``
  examples left over at the end of an epoch's permutation wait for another epoch (a different few each time).
* :func:`trimmed_batch`: the examples of a batch as a split of their own, every padded column that no example
  of the batch uses removed (the source side and, for a seq2seq task, the target side).

Cutting the padding is exact only for a model whose outputs at real positions do not depend on how many
padded positions follow; :func:`check_trimming_exact` measures it on the model being trained and refuses
the option otherwise (for example a mechanism whose landmarks or projections span the whole padded length).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor, nn

from ..tasks import IGNORE_INDEX, Seq2SeqSplit, Split

DEFAULT_POOL_BATCHES = 64
"""Batches per pool sorted by length: large enough that a pool's lengths are close, small enough that which
examples share a batch still changes from epoch to epoch."""


def epoch_permutation(size: int, seed: int, epoch: int) -> Tensor:
    """(size,) int64: the order of the training examples in ``epoch``, drawn from ``(seed, epoch)`` alone. Plain
    batches (:func:`~attnzoo.training.loop.batch_indices`) and length-grouped ones both start from it."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def example_lengths(split: Split) -> Tensor:
    """(n,) int64 sort keys of the examples' lengths: the source length, and for a seq2seq split the target
    length (scored tokens) below it, ``source * (target_len + 1) + target``. Raises if nothing is padded."""
    if split.padding_mask is None:
        raise ValueError("group_by_length needs a task whose examples are padded (this split has no padding "
                         "mask: every example has the same length)")
    mask = split.padding_mask
    if mask.shape[1] > 1 and not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        raise ValueError("group_by_length needs padding at the end of each row (a row of this split has padding "
                         "before a token), so that cutting the trailing columns keeps every token")
    lengths = (~mask).sum(dim=1)
    if isinstance(split, Seq2SeqSplit):
        target_lengths = (split.targets != IGNORE_INDEX).sum(dim=1)
        lengths = lengths * (split.targets.shape[1] + 1) + target_lengths
    return lengths.to(torch.int64)


class LengthGroupedOrder:
    """The examples of each optimiser step, grouped by length (see the module docstring).

    Args:
        lengths: (n,) sort keys of the training examples (:func:`example_lengths`).
        batch_size: examples per batch, at most n.
        seed: the run's seed; epoch e's permutation is :func:`~attnzoo.training.loop.batch_indices`'s.
        pool_batches: batches per pool sorted by length.
    """

    def __init__(self, lengths: Tensor, batch_size: int, seed: int, pool_batches: int = DEFAULT_POOL_BATCHES):
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be 1-D (n,), got shape {tuple(lengths.shape)}")
        if not 1 <= batch_size <= len(lengths):
            raise ValueError(f"batch_size {batch_size} must be between 1 and the {len(lengths)} training examples "
                             "when grouping by length (every batch is full)")
        self.lengths, self.batch_size, self.seed, self.pool_batches = lengths, batch_size, seed, pool_batches
        self.batches_per_epoch = len(lengths) // batch_size
        self._epoch: Optional[int] = None
        self._batches: Tensor = torch.empty(0, batch_size, dtype=torch.int64)

    def __call__(self, step: int) -> Tensor:
        """(batch_size,) int64 indices of the training examples of optimiser step ``step`` (0-based)."""
        epoch, position = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            self._batches, self._epoch = self.epoch_batches(epoch), epoch
        return self._batches[position]

    def epoch_batches(self, epoch: int) -> Tensor:
        """(batches_per_epoch, batch_size) int64: the batches of ``epoch`` in the order they are trained."""
        size, batch = len(self.lengths), self.batch_size
        order = epoch_permutation(size, self.seed, epoch)[: self.batches_per_epoch * batch]
        pool = self.pool_batches * batch
        grouped = []
        for start in range(0, len(order), pool):
            members = order[start:start + pool]
            # Stable, so equal lengths keep the permutation's (random) order.
            grouped.append(members[torch.sort(self.lengths[members], stable=True).indices])
        batches = torch.cat(grouped).view(self.batches_per_epoch, batch)
        shuffle = torch.randperm(self.batches_per_epoch,
                                 generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 500_009))
        return batches[shuffle]


def trimmed_batch(split: Split, index: Tensor, *, trim: bool = True) -> Split:
    """The examples ``index`` of ``split`` as a split of their own, cut to their longest example (``trim``):
    source columns that are padding in every example removed, and for a seq2seq split the target columns
    scored in none. Padding is at the end of each row (every task pads after its tokens)."""
    mask, targets = split.padding_mask[index], split.targets[index]
    source_len = max(int((~mask).sum(dim=1).max()), 1) if trim else mask.shape[1]
    inputs, mask = split.inputs[index, :source_len], mask[:, :source_len]
    if isinstance(split, Seq2SeqSplit):  # its scored targets are a prefix of each row: tokens, then EOS
        target_len = max(int((targets != IGNORE_INDEX).sum(dim=1).max()), 1) if trim else targets.shape[1]
        return Seq2SeqSplit(inputs, targets[:, :target_len], mask, split.decoder_inputs[index, :target_len])
    if targets.dim() == 2:  # one target per position (tag)
        targets = targets[:, :source_len]
    return replace(split, inputs=inputs, targets=targets, padding_mask=mask)


LogitsOf = Callable[[Split], Tensor]


def check_trimming_exact(logits_of: LogitsOf, model: nn.Module, split: Split, label: str, *,
                         examples: int = 8, tolerance: float = 1e-4) -> None:
    """Raise ValueError unless ``model`` (in eval mode, dropout off) gives the same logits at the scored
    positions of ``examples`` training examples whether their batch is cut to its longest example or not.

    ``logits_of(split)`` returns the model's logits for every example of ``split``; ``label`` names the model
    in the message. The examples are the split's shortest, so the cut is as deep as it gets (a split whose
    examples all have the full length is never cut, and passes)."""
    index = torch.sort(example_lengths(split), stable=True).indices[:examples]
    whole, cut = trimmed_batch(split, index, trim=False), trimmed_batch(split, index)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            full, trimmed = logits_of(whole).float(), logits_of(cut).float()
    finally:
        model.train(was_training)
    if full.dim() == 3:  # one row of logits per position: compare the positions the cut batch kept
        full = full[:, : trimmed.shape[1]]
        scored = cut.targets != IGNORE_INDEX
        full, trimmed = full[scored], trimmed[scored]
    difference = float((full - trimmed).abs().max()) if full.numel() else 0.0
    scale = max(float(full.abs().max()) if full.numel() else 0.0, 1.0)
    if not difference <= tolerance * scale:
        raise ValueError(
            f"group_by_length is refused: {label} gives other outputs when a batch is cut to its longest example (largest "
            f"difference {difference:.3g}): its result depends on the padded length, so cutting the padding "
            "would change what it computes; train without group_by_length")


__all__: Tuple[str, ...] = ("LengthGroupedOrder", "check_trimming_exact", "example_lengths", "trimmed_batch")
