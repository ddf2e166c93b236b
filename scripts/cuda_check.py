"""Check every registered mechanism, and the models, on a CUDA device against the same weights on the CPU.

The test suite runs on the CPU; this script is what to run on a machine with a GPU. For each mechanism, in its
conformance options and each declared variant, with the same weights and inputs on both devices:

- forward, in every setting its capabilities declare (plain, causal, key padding, cross-attention, grouped
  keys/values, a packed batch): the CUDA output equals the CPU's to 1e-4 (float32, TF32 off);
- backward: the gradients of q, k, v and every parameter equal the CPU's to 1e-3;
- decoding: prefill then one ``step`` on CUDA equals the causal forward's last row there;
- bfloat16 autocast: the forward is finite.

Then a small ``LanguageModel`` per block kind trains three steps and decodes greedily on CUDA. Every failure is a
row of ``cuda-check.json`` (``--output``); the exit status is 1 if any check failed.

    python scripts/cuda_check.py --output cuda-check.json [--mechanisms A,B]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

import attnzoo
from attnzoo.mechanisms.registry import build_mechanism, mechanism_class

BATCH, HEADS, LENGTH, CROSS_LENGTH, HEAD_DIM = 2, 4, 12, 7, 8  # within every test_options max_length
DEVICE = "cuda"  # --device: "cpu" runs the same checks CPU against CPU, to try the script without a GPU


def _inputs(kv_heads: int, k_len: int, seed: int) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM, generator=generator)
    k = torch.randn(BATCH, kv_heads, k_len, HEAD_DIM, generator=generator)
    v = torch.randn(BATCH, kv_heads, k_len, HEAD_DIM, generator=generator)
    return [q, k, v]


def _settings(caps: Any) -> Dict[str, Dict[str, Any]]:
    """name -> forward keyword arguments (plus the input shape), for what the capabilities declare."""
    settings: Dict[str, Dict[str, Any]] = {"plain": {}}
    if caps.causal:
        settings["causal"] = {"causal": True}
    if caps.key_padding:
        mask = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
        mask[1, LENGTH - 4:] = True
        settings["padded"] = {"key_padding_mask": mask}
    if caps.cross:
        settings["cross"] = {"cross": True, "k_len": CROSS_LENGTH}
    if caps.grouped_kv != "none":
        settings["grouped"] = {"causal": caps.causal, "kv_heads": 2}
    if caps.packing != "none":
        settings["packed"] = {"causal": caps.causal, "cu_seqlens": torch.tensor([0, 5, LENGTH]), "batch": 1}
    return settings


def _close(name: str, cpu: torch.Tensor, gpu: torch.Tensor, tolerance: float) -> Optional[str]:
    error = (cpu.double() - gpu.detach().cpu().double()).abs().max().item()
    scale = max(1.0, cpu.double().abs().max().item())
    return None if error <= tolerance * scale else f"{name}: CUDA differs from the CPU by {error:.3g}"


def _check_setting(mechanism: torch.nn.Module, arguments: Dict[str, Any], seed: int) -> List[str]:
    arguments = dict(arguments)
    mechanism.zero_grad(set_to_none=True)
    kv_heads = arguments.pop("kv_heads", HEADS)
    k_len = arguments.pop("k_len", LENGTH)
    batch = arguments.pop("batch", BATCH)
    cpu_inputs = [t[:batch].requires_grad_() for t in _inputs(kv_heads, k_len, seed)]
    gpu_inputs = [t.detach().to(DEVICE).requires_grad_() for t in cpu_inputs]
    gpu_mechanism = copy.deepcopy(mechanism).to(DEVICE)
    on_gpu = {key: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for key, value in arguments.items()}
    cpu_out = mechanism(*cpu_inputs, **arguments)
    gpu_out = gpu_mechanism(*gpu_inputs, **on_gpu)
    failures = [_close("output", cpu_out, gpu_out, 1e-4)]
    if gpu_out.device.type != torch.device(DEVICE).type:
        failures.append(f"output on {gpu_out.device}")
    weights = torch.randn(cpu_out.shape, generator=torch.Generator().manual_seed(seed + 1))
    (cpu_out * weights).sum().backward()
    (gpu_out * weights.to(DEVICE)).sum().backward()
    for label, cpu_t, gpu_t in zip("qkv", cpu_inputs, gpu_inputs):
        failures.append(_close(f"grad {label}", cpu_t.grad, gpu_t.grad, 1e-3))
    for (name, cpu_p), gpu_p in zip(mechanism.named_parameters(), gpu_mechanism.parameters()):
        if cpu_p.grad is not None:
            failures.append(_close(f"grad {name}", cpu_p.grad, gpu_p.grad, 1e-3))
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        low = gpu_mechanism(*[t.detach() for t in gpu_inputs], **on_gpu)
    if not torch.isfinite(low).all():
        failures.append("bfloat16 autocast output is not finite")
    return [f for f in failures if f]


def _check_step(mechanism: torch.nn.Module, seed: int) -> List[str]:
    gpu = copy.deepcopy(mechanism).to(DEVICE)
    q, k, v = (t.to(DEVICE) for t in _inputs(HEADS, LENGTH, seed))
    full = gpu(q, k, v, causal=True)
    _, state = gpu.prefill(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1])
    out, _ = gpu.step(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], state)
    return [f for f in [_close("prefill then step", full[:, :, -1:].cpu(), out, 1e-4)] if f]


def check_mechanism(name: str) -> List[Dict[str, Any]]:
    cls = mechanism_class(name)
    rows = []
    for index, options in enumerate((cls.test_options, *cls.test_variants)):
        torch.manual_seed(index)
        mechanism = build_mechanism(name, HEADS, HEAD_DIM, **options)
        caps = mechanism.capabilities
        checks: Dict[str, Callable[[], List[str]]] = {
            setting: (lambda a=arguments: _check_setting(mechanism, a, seed=7))
            for setting, arguments in _settings(caps).items()
        }
        if caps.recurrent_step and caps.causal:
            checks["step"] = lambda: _check_step(mechanism, seed=11)
        for setting, check in checks.items():
            started = time.perf_counter()
            try:
                failures = check()
            except Exception as error:  # a crash on CUDA is the finding: keep the traceback's last frames
                failures = [f"{type(error).__name__}: {error}",
                            "".join(traceback.format_exception(error)[-3:])]
            rows.append({"mechanism": name, "options": options, "setting": setting, "ok": not failures,
                         "failures": failures, "seconds": round(time.perf_counter() - started, 3)})
    return rows


def check_models() -> List[Dict[str, Any]]:
    rows = []
    for block, attention in [("attention", "softmax"), ("attention", "gated_delta"), ("mamba2", "softmax"),
                             ("flash_gau", "softmax")]:
        failures: List[str] = []
        try:
            torch.manual_seed(0)
            model = attnzoo.LanguageModel(vocab_size=50, dim=32, heads=2, depth=2, self_attention=attention,
                                          block=block).to(DEVICE)
            optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tokens = torch.randint(0, 50, (4, 33), device=DEVICE)
            for _ in range(3):
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
            if not torch.isfinite(loss):
                failures.append("training loss is not finite")
            model.eval()
            with torch.no_grad():
                out = attnzoo.greedy_decode(model, tokens[:, :8], max_new_tokens=8)
                logits, state = model.prefill(tokens[:, :8])
                step_logits, _ = model.step(tokens[:, 8], state)
                full = model(tokens[:, :9])[:, -1]
            if out.device.type != torch.device(DEVICE).type:
                failures.append(f"greedy_decode returned tokens on {out.device}")
            failures += [f for f in [_close("model step", full.cpu(), step_logits, 1e-4)] if f]
        except Exception as error:
            failures = [f"{type(error).__name__}: {error}", "".join(traceback.format_exception(error)[-3:])]
        rows.append({"model": f"LanguageModel block={block} self_attention={attention}", "ok": not failures,
                     "failures": failures})
    return rows


TRAIN_LISTOPS = {"train_size": 64, "validation_size": 16, "test_size": 16, "min_length": 8, "max_length": 48}


def _trained_parameters(run: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from attnzoo.training import find_checkpoint

    return load_file(str(find_checkpoint(run) / "model.safetensors"))


def _one_rank_group() -> "attnzoo.parallel.DataParallel":
    """A data-parallel run of one rank on the device (nccl on a GPU, gloo on the CPU): DDP's wrapping and the
    checkpoint's per-rank generators on the device, without a second GPU."""
    import os
    import socket

    from attnzoo.parallel import DataParallel

    with socket.socket() as probe:  # a free local port for the one-process rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(DEVICE)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                         **({"device_id": device} if device.type == "cuda" else {}))
    return DataParallel.from_group(device=device)


def check_training() -> List[Dict[str, Any]]:
    """``attnzoo.training.train`` on the device: six steps of a small ListOps model (length-grouped batches)
    equal the CPU's without dropout; with dropout, a run interrupted at step 3 and resumed there equals the
    uninterrupted one (the device's generator is saved with each checkpoint), alone and as one data-parallel
    rank (each rank's device generator is saved)."""
    import tempfile

    from attnzoo.training import TrainConfig, train

    def config(dropout: float) -> "TrainConfig":
        return TrainConfig("listops", task_options=TRAIN_LISTOPS, dim=32, depth=2, heads=2, batch_size=8, steps=6,
                           eval_interval=3, eval_batches=1, dropout=dropout, group_by_length=True)

    def stop_at_3(step: int, metrics: Dict[str, float]) -> None:
        if step == 3:
            raise KeyboardInterrupt

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for name, check in [("train on the device = on the CPU", "cpu"), ("resume on the device", "resume"),
                            ("resume data-parallel on the device", "parallel")]:
            failures: List[str] = []
            try:
                if check == "cpu":
                    here = train(config(0.0), root / "cpu", progress=False, device="cpu")
                    there = train(config(0.0), root / "device", progress=False, device=DEVICE)
                    if torch.device(there.device).type != torch.device(DEVICE).type:
                        failures.append(f"trained on {there.device}, not {DEVICE}")
                    a, b = _trained_parameters(root / "cpu"), _trained_parameters(root / "device")
                    failures += [f for f in (_close(f"parameter {k}", a[k], b[k], 1e-3) for k in a) if f]
                    if abs(here.test["loss"] - there.test["loss"]) > 1e-3:
                        failures.append(f"test loss {there.test['loss']} on the device, {here.test['loss']} on the CPU")
                else:
                    on = {"device": DEVICE} if check == "resume" else {"parallel": _one_rank_group()}
                    try:
                        train(config(0.1), root / check / "whole", progress=False, **on)
                        try:
                            train(config(0.1), root / check / "cut", progress=False, on_step=stop_at_3, **on)
                        except KeyboardInterrupt:
                            pass
                        train(None, root / check / "cut", resume=True, progress=False, **on)
                    finally:
                        if check == "parallel" and torch.distributed.is_initialized():
                            torch.distributed.destroy_process_group()
                    a, b = _trained_parameters(root / check / "whole"), _trained_parameters(root / check / "cut")
                    failures += [f for f in (_close(f"resumed parameter {k}", a[k], b[k], 1e-5) for k in a) if f]
            except Exception as error:
                failures = [f"{type(error).__name__}: {error}", "".join(traceback.format_exception(error)[-3:])]
            rows.append({"training": name, "ok": not failures, "failures": failures})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanisms", default=None, help="comma-separated (default: every registered one)")
    parser.add_argument("--output", default="cuda-check.json")
    parser.add_argument("--device", default="cuda", help="cuda[:N] (default), or cpu to try the script itself")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        print("cuda_check: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    names = args.mechanisms.split(",") if args.mechanisms else attnzoo.available()
    rows: List[Dict[str, Any]] = []
    for name in names:
        rows += check_mechanism(name)
        bad = [r for r in rows if r["mechanism"] == name and not r["ok"]]
        print(f"{name}: {'ok' if not bad else 'FAILED ' + ', '.join(r['setting'] for r in bad)}", flush=True)
    models = check_models()
    for row in models:
        print(f"{row['model']}: {'ok' if row['ok'] else 'FAILED ' + '; '.join(row['failures'][:1])}", flush=True)
    training = check_training()
    for row in training:
        print(f"{row['training']}: {'ok' if row['ok'] else 'FAILED ' + '; '.join(row['failures'][:1])}", flush=True)
    device = torch.cuda.get_device_name(torch.device(DEVICE)) if DEVICE.startswith("cuda") else DEVICE
    report = {"device": device, "torch": torch.__version__, "mechanisms": rows, "models": models,
              "training": training}
    with open(args.output, "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    failed = [r for r in rows + models + training if not r["ok"]]
    checked = len(rows) + len(models) + len(training)
    print(f"cuda_check: {checked - len(failed)} passed, {len(failed)} failed; {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
