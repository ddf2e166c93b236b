"""Packed training batches (``TrainConfig.pack``): a batch of examples as one packed row with its ``cu_seqlens``.

The models take one packed row per call (the mechanism contract's packed batch is a batch of one row), so a
batch of ``batch_size`` examples becomes one row:

* the rows of a :class:`~attnzoo.tasks.PackedSplit` (``bytes``: files back to back, ``seq_len`` bytes a row)
  are joined into one row of ``batch_size * seq_len`` tokens; its documents start where ``document_starts``
  marks them (every row starts one, so no document runs from one row into the next);
* the examples of a padded split (``listops``) lose their padding and are laid back to back, one document each;
  a classifier then returns one row of logits per example, in order, as it would unpacked.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..tasks import PackedSplit, Split


def take_packed(split: Split, index: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The examples ``index`` of ``split`` as one packed row: inputs (1, tokens), targets ((1, tokens), or
    (examples,) for a classification split) and ``cu_seqlens`` (int64 document offsets ``[0, ..., tokens]``)."""
    inputs, targets = split.inputs[index], split.targets[index]
    if isinstance(split, PackedSplit):
        starts = split.document_starts[index].reshape(-1)
        total = starts.numel()
        offsets = torch.cat([starts.nonzero().reshape(-1), torch.tensor([total])])
        return inputs.reshape(1, total), targets.reshape(1, total), offsets
    if split.padding_mask is None:
        raise ValueError("a packed batch needs a packed split or a padded one (nothing to pack here)")
    keep = ~split.padding_mask[index]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), keep.sum(dim=1).cumsum(0)])
    if targets.dim() == 2:  # one target per position (tag): the kept positions'
        targets = targets[keep].unsqueeze(0)
    return inputs[keep].unsqueeze(0), targets, offsets


__all__ = ["take_packed"]
