"""scripts/converted_loss_breakdown.py: the token classes and position ranges its figures are made of (the models
themselves are SmolLM2 and its conversions, run by hand: docs/conversion.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("converted_loss_breakdown",
                                               ROOT / "scripts" / "converted_loss_breakdown.py")
breakdown = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = breakdown
_spec.loader.exec_module(breakdown)


def test_a_token_is_new_a_near_repeat_or_a_far_one():
    # predicted tokens 1..11; with 2 tokens of context a repeat is 3 tokens seen before
    tokens = [1, 2, 3, 1, 2, 3, 9, 9, 9, 9, 9, 9]
    assert breakdown.token_classes(tokens, ngram=2, near=3).tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1]
    far = [5, 6, 7] + list(range(20, 30)) + [5, 6, 7]
    assert breakdown.token_classes(far, ngram=2, near=3).tolist()[-1] == 2  # "5 6 7" again, 13 positions on
    assert breakdown.token_classes(far, ngram=2, near=20).tolist()[-1] == 1


def test_position_ranges_take_the_losses_of_the_tokens_predicted_there():
    windows = torch.zeros(2, 9, dtype=torch.long)  # 8 predicted tokens a window, at positions 1..8
    loss = torch.arange(16, dtype=torch.float64)  # the two windows' losses one after the other
    part = breakdown._positions(loss, windows, 1, 3)
    assert part.tolist() == [[0.0, 1.0], [8.0, 9.0]]
    assert breakdown._positions(loss, windows, 7, 9).tolist() == [[6.0, 7.0], [14.0, 15.0]]
