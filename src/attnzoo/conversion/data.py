"""The text a conversion trains and is judged on: windows of tokens from the corpora that ship in installed
packages (:mod:`attnzoo.pretrained.corpus`), prose and code alternating, each split kept apart: training from
``train``, the choice of softmax layers from ``validation``, perplexity from ``test``."""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import Tensor


def mixed_windows(tokenizer: Any, split: str, length: int, count: int) -> Tensor:
    """(count, length) token ids, prose and code windows alternating (prose first)."""
    from ..pretrained.corpus import token_windows

    prose = token_windows(tokenizer, "prose", split, length, (count + 1) // 2)
    code = token_windows(tokenizer, "code", split, length, count // 2) if count > 1 else prose[:0]
    order = [prose[i // 2] if i % 2 == 0 else code[i // 2] for i in range(count)]
    return torch.stack(order)


def evaluation_windows(tokenizer: Any, length: int, count: int) -> Dict[str, Tensor]:
    """``{"prose": (count, length), "code": (count, length)}`` from the test split."""
    from ..pretrained.corpus import token_windows

    return {source: token_windows(tokenizer, source, "test", length, count) for source in ("prose", "code")}
