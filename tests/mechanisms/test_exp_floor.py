"""``exp`` of log decays raised to a floor above the subnormal range (``attnzoo.functional.exp_floor``)."""

import math

import pytest
import torch

from attnzoo.functional.exp_floor import exp_floor, exp_nonpositive, exp_nonpositive_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_nonpositive_is_exp_above_the_floor_and_a_normal_number_below(dtype):
    floor = exp_floor(dtype)
    tiny = torch.finfo(dtype).tiny
    assert math.log(tiny) < floor < math.log(tiny) + 1
    x = torch.tensor([0.0, -1.0, -50.0, floor + 1e-3, floor - 1e-3, -1e4, float("-inf")], dtype=dtype)
    out = exp_nonpositive(x)
    torch.testing.assert_close(out[:4], x[:4].exp(), rtol=4 * torch.finfo(dtype).eps, atol=0)
    lowest = torch.tensor(floor, dtype=dtype).exp()
    assert torch.equal(out[4:], lowest.expand(3)) and bool(lowest >= tiny)  # normal, never subnormal or 0
    assert torch.equal(x, torch.tensor([0.0, -1.0, -50.0, floor + 1e-3, floor - 1e-3, -1e4, float("-inf")],
                                       dtype=dtype))  # the input is untouched
    inplace = x.clone()
    assert exp_nonpositive_(inplace) is inplace and torch.equal(inplace, out)
