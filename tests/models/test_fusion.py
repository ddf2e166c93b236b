"""AttentionFusion: shapes, weights, missing modalities, validation, reference, gradients, and the example."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

from attnzoo.models.fusion import AttentionFusion, attention_fusion_reference

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "attention_fusion.py"


def _inputs(batch: int = 5, modalities: int = 3, dim: int = 8, dtype: torch.dtype = torch.float32):
    return torch.randn(batch, modalities, dim, dtype=dtype)


def _missing() -> torch.Tensor:
    # Rows: nothing missing, one missing, two missing, one missing elsewhere, all missing.
    return torch.tensor(
        [[False, False, False], [False, True, False], [True, False, True], [False, False, True], [True, True, True]]
    )


def test_shapes_and_weights_sum_to_one():
    fusion = AttentionFusion(8, 3, hidden=6)
    fused, weights = fusion(_inputs())
    assert fused.shape == (5, 8) and weights.shape == (5, 3)
    assert fused.dtype == weights.dtype == torch.float32
    assert (weights > 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))


def test_fused_is_the_weighted_sum():
    fusion = AttentionFusion(8, 3)
    h = _inputs()
    fused, weights = fusion(h)
    torch.testing.assert_close(fused, (weights.unsqueeze(-1) * h).sum(1))


def test_hidden_defaults_to_dim_and_repr():
    fusion = AttentionFusion(8, 3)
    assert fusion.proj.weight.shape == (8, 8) and fusion.context.shape == (8,)
    assert "dim=8, modalities=3, hidden=8" in repr(fusion)
    assert AttentionFusion(8, 3, hidden=4).proj.weight.shape == (4, 8)


def test_single_modality_gets_all_the_weight():
    fusion = AttentionFusion(8, 1)
    h = _inputs(modalities=1)
    fused, weights = fusion(h)
    torch.testing.assert_close(weights, torch.ones(5, 1))
    torch.testing.assert_close(fused, h[:, 0])


def test_missing_modalities_get_zero_weight_and_do_not_leak():
    fusion = AttentionFusion(8, 3)
    h, missing = _inputs(), _missing()
    fused, weights = fusion(h, missing=missing)
    assert (weights[missing] == 0).all()
    present = ~missing
    sums = weights.sum(-1)
    torch.testing.assert_close(sums[present.any(-1)], torch.ones(4))

    poisoned = h.clone()
    poisoned[missing] = torch.tensor([math.nan, math.inf, -math.inf, 1e30, 0, 0, 0, 0])
    fused_p, weights_p = fusion(poisoned, missing=missing)
    assert torch.isfinite(fused_p).all() and torch.isfinite(weights_p).all()
    torch.testing.assert_close(fused_p, fused, rtol=0, atol=0)
    torch.testing.assert_close(weights_p, weights, rtol=0, atol=0)


def test_missing_equals_dropping_the_modality():
    """The weights of the present modalities are a softmax over them alone, as if the others never existed."""
    fusion = AttentionFusion(8, 3)
    h = _inputs()
    missing = torch.zeros(5, 3, dtype=torch.bool)
    missing[:, 1] = True
    fused, weights = fusion(h, missing=missing)
    scores = torch.tanh(fusion.proj(h[:, [0, 2]])) @ fusion.context
    expected = torch.softmax(scores, -1)
    torch.testing.assert_close(weights[:, [0, 2]], expected)
    torch.testing.assert_close(fused, (expected.unsqueeze(-1) * h[:, [0, 2]]).sum(1))


def test_all_missing_gives_zeros_not_nan():
    fusion = AttentionFusion(8, 3)
    h = torch.full((2, 3, 8), math.nan)
    fused, weights = fusion(h, missing=torch.ones(2, 3, dtype=torch.bool))
    assert (fused == 0).all() and (weights == 0).all()
    # And a mixed batch: the all-missing row is zeros, the others are untouched by it.
    h, missing = _inputs(), _missing()
    fused, weights = fusion(h, missing=missing)
    assert (fused[4] == 0).all() and (weights[4] == 0).all()
    torch.testing.assert_close(fused[:4], fusion(h[:4], missing=missing[:4])[0])


def test_all_false_mask_equals_no_mask():
    fusion = AttentionFusion(8, 3)
    h = _inputs()
    fused, weights = fusion(h)
    fused_m, weights_m = fusion(h, missing=torch.zeros(5, 3, dtype=torch.bool))
    torch.testing.assert_close(fused_m, fused)
    torch.testing.assert_close(weights_m, weights)


@pytest.mark.parametrize("with_missing", [False, True])
def test_matches_float64_reference(with_missing):
    fusion = AttentionFusion(8, 3, hidden=5).double()
    h = _inputs(dtype=torch.float64)
    missing = _missing() if with_missing else None
    fused, weights = fusion(h, missing=missing)
    ref_fused, ref_weights = fusion.reference(h, missing=missing)
    torch.testing.assert_close(fused, ref_fused, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-10, atol=1e-12)
    # float32 against the same reference, to float32 accuracy.
    fusion32 = fusion.float()
    fused32, weights32 = fusion32(h.float(), missing=missing)
    torch.testing.assert_close(fused32.double(), ref_fused, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights32.double(), ref_weights, rtol=1e-5, atol=1e-5)


def test_reference_function_directly():
    f64 = torch.float64
    weight, bias, context = torch.randn(4, 2, dtype=f64), torch.randn(4, dtype=f64), torch.randn(4, dtype=f64)
    h = torch.randn(1, 2, 2, dtype=f64)
    fused, weights = attention_fusion_reference(h, weight, bias, context)
    scores = [float(context @ torch.tanh(weight @ h[0, p] + bias)) for p in range(2)]
    a0 = 1 / (1 + math.exp(scores[1] - scores[0]))
    assert weights[0].tolist() == pytest.approx([a0, 1 - a0], rel=1e-12)
    assert fused[0].tolist() == pytest.approx((a0 * h[0, 0] + (1 - a0) * h[0, 1]).tolist(), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    fusion = AttentionFusion(8, 3)
    h = _inputs()
    fused, weights = fusion.to(dtype)(h.to(dtype), missing=_missing())
    assert fused.dtype == weights.dtype == dtype
    ref_fused, ref_weights = fusion.reference(h.to(dtype), missing=_missing())
    torch.testing.assert_close(fused.double(), ref_fused, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weights.double(), ref_weights, rtol=2e-2, atol=2e-2)


def test_gradients_finite_and_missing_inputs_get_none():
    fusion = AttentionFusion(8, 3).double()
    h = _inputs(dtype=torch.float64)
    missing = _missing()
    h[missing] = math.nan
    h.requires_grad_(True)
    fused, weights = fusion(h, missing=missing)
    (fused.square().sum() + (weights * torch.arange(3.0, dtype=torch.float64)).sum()).backward()
    assert torch.isfinite(h.grad).all()
    assert (h.grad[missing] == 0).all()
    for name, parameter in fusion.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name


def test_gradcheck():
    fusion = AttentionFusion(4, 3, hidden=3).double()
    h = torch.randn(3, 3, 4, dtype=torch.float64, requires_grad=True)
    missing = torch.tensor([[False, True, False], [False, False, False], [True, True, True]])
    assert torch.autograd.gradcheck(lambda x: fusion(x, missing=missing), (h,))
    assert torch.autograd.gradcheck(lambda x: fusion(x), (h,))


def test_deterministic_construction_and_batch_independence():
    torch.manual_seed(3)
    a = AttentionFusion(8, 3)
    torch.manual_seed(3)
    b = AttentionFusion(8, 3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    h, missing = _inputs(), _missing()
    fused, weights = a(h, missing=missing)
    one_fused, one_weights = a(h[2:3], missing=missing[2:3])
    torch.testing.assert_close(one_fused, fused[2:3])
    torch.testing.assert_close(one_weights, weights[2:3])


class _Traced(torch.nn.Module):
    """AttentionFusion with a mask, as torch.jit.trace takes it (tensors in, tensors out)."""

    def __init__(self, fusion: AttentionFusion) -> None:
        super().__init__()
        self.fusion = fusion

    def forward(self, h: torch.Tensor, missing: torch.Tensor):
        return self.fusion(h, missing=missing)


def test_traced_matches_eager_for_other_masks():
    """No Python branch on mask values: a graph traced with no missing modality is right for any mask,
    an all-missing row included."""
    fusion = AttentionFusion(8, 3)
    h = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about the shape checks are expected
        traced = torch.jit.trace(_Traced(fusion), (h, torch.zeros(5, 3, dtype=torch.bool)), check_trace=False)
    missing = _missing()
    with torch.no_grad():
        for got, want in zip(traced(h, missing), fusion(h, missing=missing)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "args, kwargs, error, pattern",
    [
        ((0, 3), {}, ValueError, "dim"),
        ((8.0, 3), {}, TypeError, "dim"),
        ((8, 0), {}, ValueError, "modalities"),
        ((8, True), {}, TypeError, "modalities"),
        ((8, 3), {"hidden": 0}, ValueError, "hidden"),
        ((8, 3), {"hidden": "4"}, TypeError, "hidden"),
    ],
)
def test_constructor_validation(args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        AttentionFusion(*args, **kwargs)


@pytest.mark.parametrize(
    "h, missing, error, pattern",
    [
        (torch.randn(5, 24), None, ValueError, r"h must have shape \(batch, modalities, dim\), got 2 dims"),
        (torch.randn(5, 3, 8, 1), None, ValueError, r"h must have shape .*got 4 dims"),
        (torch.randn(5, 4, 8), None, ValueError, r"got 4 modalities, the module was built with modalities=3"),
        (torch.randn(5, 3, 7), None, ValueError, r"h .*got feature size 7, the module was built with dim=8"),
        (torch.ones(5, 3, 8, dtype=torch.long), None, TypeError, r"h must be a floating tensor"),
        ([[0.0] * 8] * 3, None, TypeError, r"h must be a torch.Tensor"),
        (torch.randn(5, 3, 8), torch.zeros(5, 3), TypeError, r"missing must be a bool tensor"),
        (torch.randn(5, 3, 8), torch.zeros(5, 4, dtype=torch.bool), ValueError,
         r"missing must have shape \(batch, modalities\) = \(5, 3\), got \(5, 4\)"),
        (torch.randn(5, 3, 8), torch.zeros(3, dtype=torch.bool), ValueError, r"missing must have shape"),
        (torch.randn(5, 3, 8), [[False] * 3] * 5, TypeError, r"missing must be a torch.Tensor"),
    ],
)
def test_forward_validation(h, missing, error, pattern):
    fusion = AttentionFusion(8, 3)
    with pytest.raises(error, match=pattern):
        fusion(h, missing=missing)


def test_device_mismatch_names_the_argument():
    fusion = AttentionFusion(8, 3).to("meta")
    with pytest.raises(ValueError, match=r"h must be on the module's device meta"):
        fusion(torch.randn(5, 3, 8))
    with pytest.raises(ValueError, match=r"missing must be on h's device meta"):
        fusion(torch.randn(5, 3, 8, device="meta"), missing=torch.zeros(5, 3, dtype=torch.bool))


def _example():
    spec = importlib.util.spec_from_file_location("attention_fusion_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_learns_to_trust_the_informative_modality():
    """The example's default run (python examples/attention_fusion.py --steps 300 --seed 0)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = _example().train(300, 0)
        again = _example().train(300, 0)
    finally:
        torch.set_num_threads(threads)
    assert results == again  # seeded and deterministic
    weights = results["mean_weights"]
    assert weights["signal"] > 0.9, weights
    assert max(weights["noise A"], weights["noise B"]) < 0.05, weights
    assert results["fused_accuracy"] > 0.95, results
    # Mean pooling lets the noise swamp the signal: close to chance, far below the fused classifier.
    assert results["mean_pool_accuracy"] < 0.7, results
    assert results["fused_accuracy"] - results["mean_pool_accuracy"] > 0.25, results


def test_example_cli_writes_results(tmp_path, monkeypatch):
    module = _example()
    monkeypatch.setattr("sys.argv", ["attention_fusion.py", "--steps", "20", "--seed", "1", "--out", str(tmp_path)])
    module.main()
    results = json.loads((tmp_path / "results.json").read_text())
    assert re.search(r"--steps 20 --seed 1 --out ", results["command"])
    assert set(results["mean_weights"]) == {"signal", "noise A", "noise B"}
    assert results["settings"]["steps"] == 20
    assert (tmp_path / "weights.png").stat().st_size > 0
