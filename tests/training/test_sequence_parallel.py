"""Sequence parallelism for causal kernelized attention: the scan maths against its float64 definition, and 2 and 4
gloo processes against one process, outputs and gradients to float64 precision."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo import UnsupportedOptionError
from attnzoo.parallel.sequence import sequence_parallel_attention, sequence_parallel_reasons
from attnzoo.functional.linear import kernel_attention_reference
from attnzoo.functional.state_scan import (
    combine,
    exclusive_state_scan,
    part_terms,
    prefix_states_reference,
    split_causal_attention,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "sequence_parallel_worker.py"
TIMEOUT_S = 150  # four processes on two busy cores start in seconds; a hang fails instead of blocking CI


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * scale


def rand(*shape, seed=0):
    return torch.rand(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


B, H, M, D = 2, 3, 5, 4


def padding(n):
    mask = torch.zeros(B, n, dtype=torch.bool)
    mask[1, 2] = True
    mask[1, n // 2 : n // 2 + 3] = True
    return mask


# -- the maths, in one process ---------------------------------------------------------------------------------
@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_scan_gives_the_prefix_states_of_the_definition(decayed, padded):
    n, lengths = 19, [6, 1, 8, 4]
    phi_k, v = rand(B, H, n, M, seed=1), randn(B, H, n, D, seed=2)
    log_decay = -rand(B, H, n, seed=3) * 0.5 if decayed else None
    mask = padding(n) if padded else None
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    terms = [
        part_terms(rand(B, H, length, M, seed=9), phi_k[:, :, s : s + length], v[:, :, s : s + length],
                   None if mask is None else mask[:, s : s + length],
                   None if log_decay is None else log_decay[..., s : s + length], chunk_size=3)
        for s, length in zip(starts, lengths)
    ]
    totals = torch.stack([t.log_decay_total for t in terms]) if decayed else None
    got = exclusive_state_scan(torch.stack([t.state for t in terms]), totals)
    expected = prefix_states_reference(phi_k, v, starts, mask, log_decay)
    torch.testing.assert_close(got, expected, atol=1e-13, rtol=1e-12)


def test_combine_is_associative():
    parts = [(-rand(B, H, seed=s), randn(B, H, M, D + 1, seed=10 + s)) for s in range(3)]
    left = combine(combine(parts[0], parts[1]), parts[2])
    right = combine(parts[0], combine(parts[1], parts[2]))
    for a, b in zip(left, right):
        torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-13)
    plain = [(None, u) for _, u in parts]
    torch.testing.assert_close(combine(combine(plain[0], plain[1]), plain[2])[1], sum(u for _, u in parts))


@pytest.mark.parametrize("normalizer", ["sum", "max_abs"])
@pytest.mark.parametrize("decayed", [False, True])
def test_split_attention_equals_the_whole_sequence_with_gradients(normalizer, decayed):
    n = 23
    phi_q, phi_k = rand(B, H, n, M, seed=1).requires_grad_(), rand(B, H, n, M, seed=2).requires_grad_()
    v = randn(B, H, n, D, seed=3).requires_grad_()
    log_decay = (-rand(B, H, n, seed=4) * 0.3).requires_grad_() if decayed else None
    mask = padding(n)
    inputs = [phi_q, phi_k, v] + ([log_decay] if decayed else [])
    grad_out = randn(B, H, n, D, seed=5)
    results = []
    for compute in (
        lambda: kernel_attention_reference(phi_q, phi_k, v, True, mask, log_decay=log_decay, normalizer=normalizer),
        lambda: split_causal_attention(phi_q, phi_k, v, [7, 5, 11], mask, log_decay, normalizer=normalizer,
                                       chunk_size=3),
    ):
        out = compute()
        results.append([out] + list(torch.autograd.grad(out, inputs, grad_out)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


def test_scan_and_split_refuse_bad_input():
    with pytest.raises(ValueError, match="states must have shape"):
        exclusive_state_scan(torch.zeros(2, 3, M, D))
    with pytest.raises(ValueError, match="log_decay_totals"):
        exclusive_state_scan(torch.zeros(2, B, H, M, D), torch.zeros(3, B, H))
    with pytest.raises(ValueError, match="lengths must add up"):
        split_causal_attention(rand(B, H, 5, M), rand(B, H, 5, M), randn(B, H, 5, D), [2, 2])
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        split_causal_attention(rand(B, H, 5, M), rand(B, H, 5, M), randn(B, H, 5, D), [5, 0])


def test_unsupported_mechanisms_are_named():
    assert sequence_parallel_reasons(attnzoo.build_mechanism("linear", heads=2, head_dim=4)) == []
    assert "constant-size" in sequence_parallel_reasons(attnzoo.build_mechanism("softmax", heads=2, head_dim=4))[0]
    shrunk = attnzoo.build_mechanism("performer", heads=2, head_dim=4, nb_features=8, shrinkage=True)
    assert "shrinkage=True" in sequence_parallel_reasons(shrunk)[0]
    with pytest.raises(RuntimeError, match="init_process_group"):
        q = randn(1, 2, 3, 4)
        sequence_parallel_attention(attnzoo.build_mechanism("linear", heads=2, head_dim=4), q, q, q)


# -- 2 and 4 gloo processes against one ----------------------------------------------------------------------
MECHANISMS = {
    "linear": {"chunk_size": 4},
    "performer": {"nb_features": 16, "seed": 0, "chunk_size": 4},
    "rfa-gated": {"nb_features": 16, "seed": 0, "chunk_size": 4, "gated": True},
    "retention": {"chunk_size": 4},
    "gla": {"chunk_size": 4},
    "ssd": {"chunk_size": 4},
}


def mechanism_case(label, lengths, padded, seed):
    name = label.split("-")[0]
    options = MECHANISMS[label]
    torch.manual_seed(seed)
    mechanism = attnzoo.build_mechanism(name, heads=H, head_dim=D, **options).double()
    n = sum(lengths)
    # performer at logit scale 2: the keys' shared shift differs from part to part, so agreeing on it matters.
    scale = 2.0 if name == "performer" else 1.0
    mask = None
    if padded:
        mask = padding(n)
        mask[1, -lengths[-1]:] = True  # the last part of one sequence is all padding
    return {
        "kind": "mechanism", "label": label, "name": name, "options": options, "heads": H, "head_dim": D,
        "state_dict": mechanism.state_dict(), "lengths": lengths, "mask": mask,
        "q": randn(B, H, n, D, seed=seed + 1, scale=scale), "k": randn(B, H, n, D, seed=seed + 2, scale=scale),
        "v": randn(B, H, n, D, seed=seed + 3), "grad_out": randn(B, H, n, D, seed=seed + 4),
    }


def mha_case(lengths, seed):
    spec = {"dim": 8, "heads": 2, "mechanism": "gla", "chunk_size": 4}
    torch.manual_seed(seed)
    module = attnzoo.MultiHeadAttention(**spec).double()
    n = sum(lengths)
    return {"kind": "mha", "label": "mha-gla", "module": spec, "state_dict": module.state_dict(), "lengths": lengths,
            "x": randn(B, n, 8, seed=seed + 1), "grad_out": randn(B, n, 8, seed=seed + 2)}


def single_process(case):
    """The same computation in one process: outputs and gradients."""
    if case["kind"] == "mha":
        module = attnzoo.MultiHeadAttention(**case["module"]).double()
        module.load_state_dict(case["state_dict"])
        x = case["x"].clone().requires_grad_()
        out = module(x, causal=True)
        out.backward(case["grad_out"])
        return {"out": out.detach(), "x": x.grad, "params": {n: p.grad for n, p in module.named_parameters()}}
    mechanism = attnzoo.build_mechanism(case["name"], heads=case["heads"], head_dim=case["head_dim"], **case["options"])
    mechanism = mechanism.double()
    mechanism.load_state_dict(case["state_dict"])
    q, k, v = (case[name].clone().requires_grad_() for name in "qkv")
    out = mechanism(q, k, v, causal=True, key_padding_mask=case["mask"])
    out.backward(case["grad_out"])
    grads = {n: p.grad for n, p in mechanism.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad, "params": grads}


def run_ranks(world, cases, directory):
    """Run the worker on ``world`` gloo processes; returns each rank's results. Kills them all on a timeout."""
    directory.mkdir(parents=True, exist_ok=True)
    cases_path = directory / "cases.pt"
    torch.save(cases, cases_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    outputs = [directory / f"rank{rank}.pt" for rank in range(world)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(directory / "store"), str(rank), str(world), str(cases_path),
             str(outputs[rank])],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        pytest.fail(f"{world} gloo processes did not finish within {TIMEOUT_S} s")
    for rank, (process, log) in enumerate(zip(processes, logs)):
        assert process.returncode == 0, f"rank {rank} failed:\n{log}"
    return [torch.load(path, weights_only=False) for path in outputs]


def gather_parts(per_rank, key, dim):
    return torch.cat([result[key] for result in per_rank], dim=dim)


def assert_matches_single_process(case, per_rank):
    for result in per_rank:
        assert "error" not in result, result.get("traceback")
    expected = single_process(case)
    dim = 1 if case["kind"] == "mha" else 2
    for key in ("out", "x") if case["kind"] == "mha" else ("out", "q", "k", "v"):
        torch.testing.assert_close(gather_parts(per_rank, key, dim), expected[key], atol=1e-12, rtol=1e-10, msg=key)
    # Each rank holds its part's share of the parameters' gradients: summed they are the single-process ones.
    assert set(expected["params"]) == set(per_rank[0]["params"])
    for name, grad in expected["params"].items():
        total = sum(result["params"][name] for result in per_rank)
        torch.testing.assert_close(total, grad, atol=1e-12, rtol=1e-10, msg=name)


TWO = [mechanism_case(label, [9, 8], padded, seed) for seed, label in enumerate(MECHANISMS)
       for padded in (False, True)] + [mha_case([6, 11], 40)]
FOUR = [mechanism_case(label, [5, 3, 6, 4], True, 50 + seed) for seed, label in enumerate(MECHANISMS)]
CHECKS = [
    {"kind": "replicated", "label": "seeded", "name": "performer", "options": {"nb_features": 8, "seed": 3},
     "lengths": [1, 1]},
    {"kind": "replicated", "label": "unseeded", "name": "performer", "options": {"nb_features": 8},
     "lengths": [1, 1], "unseeded": True},
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(2, TWO + CHECKS, tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_ranks(4, FOUR, tmp_path_factory.mktemp("four"))


def case_id(case):
    return f"{case['label']}-{'padded' if case.get('mask') is not None else 'plain'}-{case['lengths']}"


@pytest.mark.slow  # starting the processes takes seconds (importing torch in each)
@pytest.mark.parametrize("index", range(len(TWO)), ids=[case_id(c) for c in TWO])
def test_two_processes_match_one(two_ranks, index):
    assert_matches_single_process(TWO[index], [rank[index] for rank in two_ranks])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(FOUR)), ids=[case_id(c) for c in FOUR])
def test_four_processes_match_one(four_ranks, index):
    assert_matches_single_process(FOUR[index], [rank[index] for rank in four_ranks])


@pytest.mark.slow
def test_replicas_are_checked(two_ranks):
    seeded, unseeded = (two_ranks[0][len(TWO) + i] for i in range(2))
    assert "error" not in seeded
    assert "feature_map.projection" in unseeded["error"] and "differ between ranks" in unseeded["error"]


def test_an_unsupported_mechanism_is_refused_before_communicating():
    mechanism = attnzoo.build_mechanism("nystrom", heads=2, head_dim=4, landmarks=2)
    assert sequence_parallel_reasons(mechanism)
    with pytest.raises(UnsupportedOptionError, match="nystrom"):
        # refused whether or not a process group exists: the check comes first
        import torch.distributed as dist

        if dist.is_initialized():  # pragma: no cover - the suite never initialises one in-process
            pytest.skip("a process group exists in this process")
        store = Path(os.environ.get("TMPDIR", "/tmp")) / f"attnzoo-sp-{os.getpid()}"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            q = randn(1, 2, 4, 4)
            sequence_parallel_attention(mechanism, q, q, q)
        finally:
            dist.destroy_process_group()
            store.unlink(missing_ok=True)


def test_the_supported_mechanisms_are_read_from_the_registry():
    """The causal kernelized mechanisms, each accepted as it is built by default; the refusal lists them."""
    from attnzoo.parallel.sequence import sequence_parallel_mechanisms

    supported = sequence_parallel_mechanisms()
    assert set(supported) == {"linear", "performer", "rfa", "retention", "gla", "ssd"}
    # Every one of them is run across processes above.
    assert set(supported) == {label.split("-")[0] for label in MECHANISMS}
    for name in supported:
        assert sequence_parallel_reasons(attnzoo.build_mechanism(name, heads=2, head_dim=4)) == [], name
    refusal = sequence_parallel_reasons(attnzoo.build_mechanism("softmax", heads=2, head_dim=4))
    assert len(refusal) == 1 and all(name in refusal[0] for name in supported)
    shrunk = attnzoo.build_mechanism("performer", heads=2, head_dim=4, shrinkage=True)
    assert "non-causal" in sequence_parallel_reasons(shrunk)[0]
