"""The blockwise family's default block size: blocks of 128 against blocks of 64 for one mechanism.

    python scripts/bench_block_size.py {local,longformer} [--length N] [--repeats R]

Forward+backward at N tokens (batch 1, 4 heads of 64, float32, one thread), non-causal and causal, windows 128
and 256, the two block sizes timed in turns in one process (medians of the repeats): the figures behind
``attnzoo.functional.blocksparse.DEFAULT_BLOCK``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attnzoo

SIZES = (64, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mechanism", choices=["local", "longformer"])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    extra = {"global_tokens": 1} if args.mechanism == "longformer" else {}
    heads, head_dim = 4, 64
    for causal in (False, True):
        for window in (128, 256):
            mechanisms = {size: attnzoo.build_mechanism(args.mechanism, heads, head_dim, window=window,
                                                        block_size=size, **extra) for size in SIZES}
            q, k, v = (torch.randn(1, heads, args.length, head_dim, requires_grad=True) for _ in range(3))
            seconds = {size: [] for size in SIZES}
            for _ in range(args.repeats):
                for size in SIZES:  # in turns, so a busy machine slows both alike
                    start = time.perf_counter()
                    mechanisms[size](q, k, v, causal=causal).sum().backward()
                    seconds[size].append(time.perf_counter() - start)
            small, large = (statistics.median(seconds[size]) for size in SIZES)
            print(f"{args.mechanism} causal={causal} window={window}: blocks 128 / blocks 64 = {large / small:.2f} "
                  f"({small * 1e3:.0f} ms against {large * 1e3:.0f} ms)", flush=True)


if __name__ == "__main__":
    main()
