"""The measurements of ``attnzoo lm-eval`` (:mod:`.lm_eval`): one variant's perplexity, passkey and decoding
rows, and the raw-swap table. A measurement that fails is a row with status ``failed`` and the error's first line;
the run goes on."""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..conversion.lora import lora_state
from ..conversion.saved import build_converted
from ..conversion.student import mechanism_state
from ..mechanisms import available, capabilities
from ..pretrained.causal_lm import CausalLM
from ..pretrained.corpus import TEXT_SOURCES, TokenWindows
from ..pretrained.evaluation import greedy_continue, perplexity, swap_refusal, swapped
from ..pretrained.passkey import ANSWER_TOKENS, passkey, passkey_answer, passkey_prompt
Rows = List[Dict[str, Any]]
Progress = Callable[[str], None]
# The settings, the checked run and the variant are lm_eval's Any, Prepared and Variant (typed Any here:
# that module imports this one).


def passkey_cells(config: Any) -> List[Tuple[int, float, int]]:
    """(length, depth, trial) of every passkey prompt of an Any, in the order measured."""
    return [(n, d, t) for n in config.passkey_lengths for d in config.depths for t in range(config.trials)]


def timed(label: str, progress: Optional[Progress]) -> float:
    """Announce the measurement ``label``; returns its start time."""
    if progress is not None:
        progress(label)
    return time.perf_counter()


def _why(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def _guarded(row: Dict[str, Any], measure: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``row`` with what ``measure`` returns (status ok), or with status failed and the error."""
    start = time.perf_counter()
    try:
        row.update(measure())
        row["status"], row["reason"] = "ok", None
    except (RuntimeError, ValueError, TypeError, IndexError, MemoryError) as error:
        row["status"], row["reason"] = "failed", _why(error)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _perplexity_row(model: CausalLM, windows: TokenWindows) -> Dict[str, Any]:
    result = perplexity(model, windows.tokens)
    return {"perplexity": result.perplexity, "mean_nll": result.mean_nll, "tokens": result.tokens,
            "windows": result.windows, "single_document": min(windows.single_document, result.windows)}


def variant_model(prepared: Any, variant: Any, base: CausalLM, seed: int) -> Tuple[CausalLM, int]:
    """The model of ``variant`` and how many parameters it has that ``base`` has not: ``base`` itself for
    softmax, a copy with the variant's attention, or a converted model (its trained tensors on ``base``'s
    weights)."""
    if variant.is_baseline:
        return base, 0
    if variant.converted is not None:
        model = build_converted(base, *prepared.descriptions[variant.converted], merged=True,  # as deployed
                                options=variant.converted_options)
        trained = {**mechanism_state(model), **lora_state(model)}
        return model, sum(t.numel() for t in trained.values())
    return swapped(base, variant.mechanism, dict(variant.options), seed)


def measure_variant(config: Any, prepared: Any, variant: Any, base: CausalLM, tokenizer: Any,
                    text: Dict[Tuple[str, int], TokenWindows], progress: Optional[Progress]) -> Dict[str, Rows]:
    """Perplexity, passkey and decoding rows of one variant (the parts ``config`` asks for)."""
    model, own = variant_model(prepared, variant, base, config.seed)
    common = {"variant": variant.label, "mechanism": variant.mechanism, "own_parameters": own}
    rows: Dict[str, Rows] = {"perplexity": [], "passkey": [], "decode": []}
    if "perplexity" in config.parts:
        for source in config.sources:
            for length in config.lengths:
                timed(f"{variant.label}: perplexity, {source}, {length} tokens", progress)
                row = {**common, "source": source, "length": length}
                rows["perplexity"].append(_guarded(row, lambda: _perplexity_row(model, text[(source, length)])))
    unable = prepared.cannot_decode.get(variant.label)
    if unable is not None:
        for part in ("passkey", "decode"):
            if part in config.parts:
                rows[part].append({**common, "status": "unsupported", "reason": unable})
        return rows
    if "passkey" in config.parts:
        for length, depth, trial in passkey_cells(config):
            timed(f"{variant.label}: passkey, {length} tokens, depth {depth:g}, trial {trial + 1}", progress)
            row = {**common, "length": length, "depth": depth, "trial": trial}
            rows["passkey"].append(_guarded(row, lambda: _passkey_row(model, tokenizer, config.seed, length, depth,
                                                                        trial)))
    if "decode" in config.parts:
        for length in config.decode_lengths:
            timed(f"{variant.label}: decoding after {length} tokens", progress)
            prompt = text[(TEXT_SOURCES[0], length)].tokens[:config.decode_batch]
            row = {**common, "source": TEXT_SOURCES[0], "length": length}
            rows["decode"].append(_guarded(row, lambda: _decode_row(model, prompt, config.decode_tokens)))
    return rows


def _passkey_row(model: CausalLM, tokenizer: Any, seed: int, length: int, depth: float, trial: int) -> Dict[str, Any]:
    key = passkey(seed, length, depth, trial)
    prompt = passkey_prompt(tokenizer, length, depth, key)
    continuation = greedy_continue(model, prompt.tokens, ANSWER_TOKENS)
    said = tokenizer.decode(continuation.tokens)
    answer = passkey_answer(said)
    return {"key": key, "answer": answer, "correct": answer == key, "continuation": said.strip()[:40],
            "prompt_tokens": int(prompt.tokens.numel()), "depth_reached": round(prompt.depth_reached, 4)}


def _decode_row(model: CausalLM, prompt: torch.Tensor, steps: int) -> Dict[str, Any]:
    continuation = greedy_continue(model, prompt, steps + 1)
    return {"context": continuation.context, "batch": continuation.batch, "steps": continuation.steps,
            "tokens_per_second": continuation.tokens_per_second, "prefill_seconds": continuation.prefill_seconds,
            "state_bytes": continuation.state_bytes, "state_bytes_per_token": continuation.state_bytes_per_token}


def measure_swaps(config: Any, prepared: Any, base: CausalLM, text: Dict[Tuple[str, int], TokenWindows],
                  progress: Optional[Progress], rows: Optional[Rows] = None,
                  measured: Optional[Callable[[], None]] = None) -> Rows:
    """The raw-swap table: every registered mechanism (or ``--swap-mechanisms``) in the model's attention slots
    with default options and no training, its perplexity at the swap length on every source; the mechanisms that
    cannot take the place (by their declared capabilities) listed with the reason. Rows are appended to ``rows``
    (a new list if None), ``measured()`` called after each one measured."""
    rows = [] if rows is None else rows
    length = config.swap_length
    for name in config.swap_mechanisms or available():
        timed(f"raw swap: {name}, {length} tokens", progress)
        caps = capabilities(name)
        row: Dict[str, Any] = {"mechanism": name, "kind": caps.kind, "length": length}
        reason = swap_refusal(name, prepared.model_config, length)
        if reason is not None:
            rows.append({**row, "status": "unusable", "reason": reason})
            continue
        rows.append(_guarded(row, lambda: _swap_row(config, base, name, text)))
        gc.collect()
        if measured is not None:
            measured()
    return rows


def _swap_row(config: Any, base: CausalLM, name: str,
              text: Dict[Tuple[str, int], TokenWindows]) -> Dict[str, Any]:
    model, own = swapped(base, name, None, config.seed)
    row: Dict[str, Any] = {"own_parameters": own}
    for source in config.sources:
        windows = text[(source, config.swap_length)]
        tokens = windows.tokens[:config.swap_windows]
        result = perplexity(model, tokens)
        row[f"{source}_perplexity"] = result.perplexity
        row[f"{source}_tokens"] = result.tokens
    return row
