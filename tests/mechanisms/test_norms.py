"""The hand-written unit-row normalisation (``attnzoo.functional.norms.unit_rows``) against ``F.normalize``."""

import pytest
import torch
import torch.nn.functional as F

from attnzoo.functional.norms import unit_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unit_rows_equal_normalize_in_value_and_gradient(dtype):
    """The same values bit for bit, and the same gradient, also for a zero row and a row shorter than eps (where
    the clamp holds and the denominator is a constant)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    x[0, 0] = 0.0
    x[1, 2] = 1e-14
    weights = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    leaves = [x.to(dtype).requires_grad_() for _ in range(2)]
    ours, theirs = unit_rows(leaves[0]), F.normalize(leaves[1], dim=-1)
    assert torch.equal(ours, theirs)
    (ours * weights.to(dtype)).sum().backward()
    (theirs * weights.to(dtype)).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad, rtol=tolerance, atol=tolerance)


def test_unit_rows_pass_gradcheck_and_refuse_a_second_derivative():
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert torch.autograd.gradcheck(unit_rows, (x,))
    (grad,) = torch.autograd.grad(unit_rows(x).pow(3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()
