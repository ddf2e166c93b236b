"""One rank of a sequence-parallel test: ``python sequence_parallel_worker.py STORE RANK WORLD CASES OUT``.

Joins a gloo group through a file store, runs every case of CASES (saved by tests/training/test_sequence_parallel.py) on
its part of the sequence, and saves its outputs and gradients (or the error a case raised) to OUT."""

import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import attnzoo
from attnzoo.parallel.sequence import assert_replicated, sequence_parallel_attention, sequence_parallel_self_attention


def part(x, lengths, rank, dim):
    start = sum(lengths[:rank])
    return x.narrow(dim, start, lengths[rank])


def run_case(case, rank):
    lengths = case["lengths"]
    torch.manual_seed(case.get("seed_offset", 0) + (rank if case.get("unseeded") else 0))
    mask = case.get("mask")
    mask = None if mask is None else part(mask, lengths, rank, 1).contiguous()
    if case["kind"] == "replicated":
        mechanism = attnzoo.build_mechanism(case["name"], heads=2, head_dim=4, **case["options"])
        assert_replicated(mechanism)
        return {}
    if case["kind"] == "mha":
        module = attnzoo.MultiHeadAttention(**case["module"]).double()
        module.load_state_dict(case["state_dict"])
        x = part(case["x"], lengths, rank, 1).clone().requires_grad_()
        out = sequence_parallel_self_attention(module, x, mask)
        out.backward(part(case["grad_out"], lengths, rank, 1))
        grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
        return {"out": out.detach(), "x": x.grad, "params": grads}
    mechanism = attnzoo.build_mechanism(case["name"], heads=case["heads"], head_dim=case["head_dim"], **case["options"])
    mechanism = mechanism.double()
    mechanism.load_state_dict(case["state_dict"])
    q, k, v = (part(case[name], lengths, rank, 2).clone().requires_grad_() for name in "qkv")
    out = sequence_parallel_attention(mechanism, q, k, v, mask)
    out.backward(part(case["grad_out"], lengths, rank, 2))
    grads = {name: p.grad for name, p in mechanism.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad, "params": grads}


def main():
    store, rank, world, cases_path, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    cases = torch.load(cases_path, weights_only=False)
    results = []
    for case in cases:
        try:
            results.append(run_case(case, rank))
        except Exception as error:  # reported to the test, which decides whether it was expected
            results.append({"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()})
            if case["kind"] != "replicated":  # the ranks may be out of step now: stop rather than wait
                break
    torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
