"""Block-sparse patterns: the blockwise core against one dense masked softmax, by the share of the N x N
logits the blocks compute (what ``attnzoo.functional.blocksparse.DENSE_SHARE`` decides on).

    PYTHONPATH=src python scripts/bench_blocksparse_dense.py

Forward and backward, one thread, median of 5; 4 heads of width 16 at each mechanism's default options."""

import time

import torch

import attnzoo
from attnzoo.functional.blocksparse import (
    blocksparse_attention_unchecked,
    blocksparse_plan,
    blockwise_logits,
    pattern_dense_mask,
)
from attnzoo.functional.softmax import masked_sdpa


def median_seconds(run, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def main() -> None:
    torch.set_num_threads(1)
    print("| mechanism | N | batch | blocks' logits / N^2 | blockwise s | dense s |")
    print("|---|---|---|---|---|---|")
    for name in ("strided", "local"):
        for length, batch in ((256, 32), (1024, 4), (4096, 4)):
            pattern = attnzoo.build_mechanism(name, 4, 16).pattern()
            plan = blocksparse_plan(pattern, length, False, torch.device("cpu"), dense_when_cheaper=False)
            q, k, v = (torch.randn(batch, 4, length, 16, requires_grad=True) for _ in range(3))
            mask = pattern_dense_mask(pattern, length).view(1, 1, length, length)

            def blockwise() -> None:
                blocksparse_attention_unchecked(q, k, v, pattern, False, None, None, plan).sum().backward()

            def dense() -> None:
                masked_sdpa(q, k, v, mask).sum().backward()

            share = blockwise_logits(plan) / length ** 2
            print(f"| {name} | {length} | {batch} | {share:.2f} | {median_seconds(blockwise):.3f} | "
                  f"{median_seconds(dense):.3f} |")


if __name__ == "__main__":
    main()
