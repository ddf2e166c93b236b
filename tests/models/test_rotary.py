"""RotaryEmbedding: the angles' table it keeps gives exactly the values computed afresh, at any start, after the
table grows, under inference mode and then with autograd."""

import math

import pytest
import torch

from attnzoo import RotaryEmbedding


def _fresh(x: torch.Tensor, start: int, inv_freq: torch.Tensor, pairs: str, rotary_dim: int) -> torch.Tensor:
    """Rotation written from the definition: pairs (x[i], x[i + r/2]) or (x[2i], x[2i+1]) turned by
    position * inv_freq[i]."""
    positions = torch.arange(start, start + x.shape[-2], dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    rotated, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if pairs == "halves":
        a, b = rotated[..., : rotary_dim // 2], rotated[..., rotary_dim // 2:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = rotated[..., 0::2], rotated[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    return torch.cat([out, rest], -1)


@pytest.mark.parametrize("pairs", ["halves", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_the_table_gives_the_values_computed_afresh(pairs, rotary_dim):
    rotary = RotaryEmbedding(8, rotary_dim, base=500.0, pairs=pairs)
    x = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # the table made here still serves autograd below
        for start in (0, 3, 254, 300, 1000):  # 300 and 1000 grow the table past its first 256 positions
            assert torch.equal(rotary(x, start=start), _fresh(x, start, rotary.inv_freq, pairs, rotary_dim))
    leaf = x.clone().requires_grad_()
    rotary(leaf, start=7).sum().backward()
    reference = leaf.detach().clone().requires_grad_()
    _fresh(reference, 7, rotary.inv_freq, pairs, rotary_dim).sum().backward()
    assert torch.allclose(leaf.grad, reference.grad, atol=1e-6)


def test_a_changed_frequency_is_seen():
    rotary = RotaryEmbedding(4, pairs="halves")
    x = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(0))
    rotary(x, start=2)
    with torch.no_grad():
        rotary.inv_freq.mul_(2.0)  # e.g. a checkpoint's scaled frequencies written in place
    assert torch.equal(rotary(x, start=2), _fresh(x, 2, rotary.inv_freq, "halves", 4))
    assert math.isclose(float(rotary.inv_freq[0]), 2.0)
