"""Where the delta family's time goes: the chunked cores and the mechanisms' input maps, forward+backward, each
timed alone (docs/kda.md and docs/rwkv7.md, "Speed").

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/profile_delta_parts.py --rounds 7 [--chunk 16]

Rows, all at N tokens (default 16384), 4 heads, head dim 64, float32, one thread, with the allocator setting of
``attnzoo train`` (``keep_freed_memory()``), the cores on chunks of ``--chunk`` positions (default 32, the
mechanisms' default):

* ``core: scalar decay``: :class:`ChunkedDeltaRule` (the causal core of ``gated_delta``);
* ``core: per-channel decay, gentle``: the same core with a decay per key channel whose every chunk takes one
  reference (``kda``'s core);
* ``core: per-channel decay, a quarter strong``: one head of four decaying fast enough that its chunks split
  (``kda``'s at its initial gates has such a head);
* ``core: DPLR``: :class:`ChunkedDPLR` (``rwkv7``'s core) with RWKV-7's range of decays; it takes the log decay
  and sums it within each chunk itself, so its row includes that cumulative sum (the other cores' rows do not);
* ``inputs: gated_delta``, ``inputs: kda``, ``inputs: rwkv7``: each mechanism's maps from the keys to what its
  core takes (beta and the decay; RWKV-7's vectors), at its initial parameters.

Each row reports its median forward and backward CPU time over the rounds, after one warm-up round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from attnzoo._malloc import keep_freed_memory
from attnzoo.functional.delta.fused import ChunkedDeltaRule
from attnzoo.functional.dplr.fused import ChunkedDPLR
from attnzoo.functional.dplr.rwkv7 import rwkv7_vectors
from attnzoo.mechanisms import build_mechanism

HEADS, HEAD_DIM = 4, 64


def _core_rows(length: int, chunk: int, generator: torch.Generator
               ) -> Dict[str, Callable[[], Tuple[torch.Tensor, ...]]]:
    """Each core row as a function returning (its outputs' sum, its leaves), the forward only."""
    chunks = length // chunk

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator)

    def unit(*shape: int) -> torch.Tensor:
        return F.normalize(torch.randn(*shape, generator=generator), dim=-1)

    shape = (HEADS, chunks, chunk, HEAD_DIM)
    q, k, kappa = unit(*shape) * HEAD_DIM ** -0.5, unit(*shape), unit(*shape)
    v, beta, alpha = torch.randn(*shape, generator=generator), rand(HEADS, chunks, chunk), rand(*shape)
    gentle = -0.05 * rand(*shape)
    strong = gentle.clone()
    strong[-1] = -8.0 * rand(chunks, chunk, HEAD_DIM)  # about 154 across a chunk of 32: those chunks split
    state = torch.zeros(HEADS, HEAD_DIM, HEAD_DIM)

    def delta(log_decay: torch.Tensor) -> Callable[[], Tuple[torch.Tensor, ...]]:
        def forward() -> Tuple[torch.Tensor, ...]:
            leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, log_decay)]
            out, final = ChunkedDeltaRule.apply(*leaves[:4], leaves[4].cumsum(2), state)
            return out.sum() + final.sum(), *leaves
        return forward

    def dplr() -> Tuple[torch.Tensor, ...]:
        leaves = [x.clone().requires_grad_() for x in (q, k, v, -kappa, kappa * alpha, -0.6 * rand(*shape))]
        out, final = ChunkedDPLR.apply(*leaves[:5], leaves[5], state)
        return out.sum() + final.sum(), *leaves

    return {"core: scalar decay": delta(gentle.mean(-1)), "core: per-channel decay, gentle": delta(gentle),
            "core: per-channel decay, a quarter strong": delta(strong), "core: DPLR": dplr}


def _input_rows(length: int, generator: torch.Generator) -> Dict[str, Callable[[], Tuple[torch.Tensor, ...]]]:
    keys = torch.randn(1, HEADS, length, HEAD_DIM, generator=generator)
    gated, kda, rwkv7 = (build_mechanism(name, HEADS, HEAD_DIM) for name in ("gated_delta", "kda", "rwkv7"))

    def maps(mechanism: torch.nn.Module) -> Callable[[], Tuple[torch.Tensor, ...]]:
        def forward() -> Tuple[torch.Tensor, ...]:
            k = keys.clone().requires_grad_()
            return mechanism.write_strengths(k).sum() + mechanism.log_decay(k).sum(), k
        return forward

    def vectors() -> Tuple[torch.Tensor, ...]:
        k = keys.clone().requires_grad_()
        outs = rwkv7_vectors(k, (rwkv7.w0, rwkv7.w1, rwkv7.w2), (rwkv7.a0, rwkv7.a1, rwkv7.a2), rwkv7.k_k,
                             rwkv7.k_a)
        return sum(out.sum() for out in outs), k

    return {"inputs: gated_delta": maps(gated), "inputs: kda": maps(kda), "inputs: rwkv7": vectors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384, help="tokens, a multiple of --chunk")
    parser.add_argument("--chunk", type=int, default=32, help="chunk length of the cores")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.chunk < 1 or args.length < args.chunk or args.length % args.chunk or args.rounds < 1:
        parser.error("--chunk must be at least 1, --length a positive multiple of it and --rounds at least 1")
    torch.set_num_threads(1)
    keep_freed_memory()
    generator = torch.Generator().manual_seed(0)
    rows = {**_core_rows(args.length, args.chunk, generator), **_input_rows(args.length, generator)}
    times: Dict[str, List[Tuple[float, float]]] = {name: [] for name in rows}
    for round_ in range(args.rounds + 1):
        for name, forward in rows.items():
            start = time.thread_time()
            total = forward()[0]
            middle = time.thread_time()
            total.backward()
            if round_:
                times[name].append((middle - start, time.thread_time() - middle))
    print(f"N={args.length}, {HEADS} heads, head dim {HEAD_DIM}, chunks of {args.chunk}, float32, one thread, "
          f"median CPU ms of {args.rounds} rounds")
    print(f"{'row':<44} {'forward':>8} {'backward':>9} {'total':>7}")
    for name, pairs in times.items():
        forward, backward = (1000 * statistics.median(pair[i] for pair in pairs) for i in (0, 1))
        print(f"{name:<44} {forward:8.1f} {backward:9.1f} {forward + backward:7.1f}")


if __name__ == "__main__":
    main()
