"""FAVOR+ approximation quality: relative error of the attention output against exact softmax attention.

For logit standard deviations 0.25, 0.5 and 1 (queries and keys with iid N(0, s) entries, so that the softmax
logits q.k / sqrt(d) have standard deviation s) and feature counts 64 to 1024, prints

    || favor(q, k, v) - softmax(q, k, v) ||_F / || softmax(q, k, v) ||_F

averaged over projection draws, for iid and orthogonal projections, plain and symmetric (hyperbolic) positive
features, the default (orthogonal, symmetric) with FAVOR++'s variance-optimal features
(``optimal_features=True``), with noise shrinkage (``shrinkage=True``) and with both, and performer-pytorch's
FastAttention when it is installed, beside the same error of uniform attention (every
query outputs the mean of v). Where an approximation's error is not clearly below uniform attention's, its
output carries little information beyond the mean of v.

Usage:
    python scripts/favor_error_table.py --output favor_errors.json [--seq-len 1024] [--draws 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

import torch

from attnzoo import build_mechanism
from attnzoo.bench.peers import peer_installed
from attnzoo.feature_maps import FavorPositiveFeatures
from attnzoo.functional import linear_attention, softmax_attention_reference

LOGIT_STDS = (0.25, 0.5, 1.0)
FEATURE_COUNTS = (64, 128, 256, 512, 1024)
VARIANTS = {
    "orthogonal+symmetric": dict(orthogonal=True, symmetric=True),
    "orthogonal": dict(orthogonal=True, symmetric=False),
    "iid+symmetric": dict(orthogonal=False, symmetric=True),
    "iid": dict(orthogonal=False, symmetric=False),
}
# Variants built through the registered mechanism with these performer options.
MECHANISM_VARIANTS = {
    "optimal": dict(optimal_features=True),
    "shrinkage": dict(shrinkage=True),
    "optimal+shrinkage": dict(optimal_features=True, shrinkage=True),
}
PEER = "performer-pytorch"


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.double() - exact).norm() / exact.norm())


def estimate(variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nb_features: int, seed: int) -> torch.Tensor:
    """One projection draw of ``variant``'s estimate of softmax attention, in float64."""
    heads, head_dim = q.shape[1], q.shape[3]
    if variant in MECHANISM_VARIANTS:
        options = MECHANISM_VARIANTS[variant]
        mechanism = build_mechanism("performer", heads, head_dim, nb_features=nb_features, seed=seed, **options)
        return mechanism.double()(q, k, v)
    if variant == PEER:
        from performer_pytorch import FastAttention

        torch.manual_seed(seed)  # performer-pytorch draws its projection from the global generator
        return FastAttention(dim_heads=head_dim, nb_features=nb_features).double()(q, k, v)
    generator = torch.Generator().manual_seed(seed)
    features = FavorPositiveFeatures(head_dim, nb_features, generator=generator, **VARIANTS[variant]).double()
    return linear_attention(q, k, v, features)


def measure(seq_len: int, head_dim: int, heads: int, draws: int, seed: int) -> Dict[str, object]:
    data = torch.Generator().manual_seed(seed)
    rows: List[Dict[str, object]] = []
    variants = list(VARIANTS) + list(MECHANISM_VARIANTS) + ([PEER] if peer_installed(PEER) else [])
    for logit_std in LOGIT_STDS:
        entry_std = logit_std**0.5  # std(q.k / sqrt(d)) = entry_std^2 for iid entries
        q, k = (torch.randn(1, heads, seq_len, head_dim, generator=data, dtype=torch.float64) * entry_std for _ in "qk")
        v = torch.randn(1, heads, seq_len, head_dim, generator=data, dtype=torch.float64)
        exact = softmax_attention_reference(q, k, v)
        uniform = relative_error(v.mean(dim=2, keepdim=True).expand_as(exact), exact)
        for variant in variants:
            for nb_features in FEATURE_COUNTS:
                errors = []
                for draw in range(draws):
                    errors.append(relative_error(estimate(variant, q, k, v, nb_features, seed * 1000 + draw), exact))
                rows.append(
                    dict(
                        logit_std=logit_std,
                        variant=variant,
                        nb_features=nb_features,
                        error=sum(errors) / draws,
                        uniform_error=uniform,
                    )
                )
    return dict(seq_len=seq_len, head_dim=head_dim, heads=heads, draws=draws, seed=seed, rows=rows)


def print_table(result: Dict[str, object]) -> None:
    rows = result["rows"]
    print(
        f"FAVOR+ relative error vs exact softmax (seq_len={result['seq_len']}, head_dim={result['head_dim']}, "
        f"heads={result['heads']}, mean of {result['draws']} projection draws)"
    )
    header = f"{'logit std':>9}  {'variant':<32}" + "".join(f"{m:>8}" for m in FEATURE_COUNTS) + f"{'uniform':>9}"
    print(header)
    for logit_std in LOGIT_STDS:
        for variant in dict.fromkeys(r["variant"] for r in rows):
            selected = [r for r in rows if r["logit_std"] == logit_std and r["variant"] == variant]
            errors = "".join(f"{r['error']:8.3f}" for r in selected)
            print(f"{logit_std:9.2f}  {variant:<32}{errors}{selected[0]['uniform_error']:9.3f}")


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="path of the JSON file to write")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--draws", type=int, default=4, help="projection draws averaged per cell")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("seq_len", "head_dim", "heads", "draws"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    result = measure(args.seq_len, args.head_dim, args.heads, args.draws, args.seed)
    print_table(result)
    with open(args.output, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
