"""The files of ``attnzoo lm-eval`` (:mod:`.lm_eval`): ``lm-eval.json`` (all of it, with the command),
``lm-eval.csv`` (one row per measurement, its part in the first column), ``lm-eval.md`` (the tables) and the
figures of :mod:`.lm_eval_figures`."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

LM_EVAL_JSON = "lm-eval.json"
LM_EVAL_CSV = "lm-eval.csv"
LM_EVAL_MD = "lm-eval.md"
PARTS = ("perplexity", "passkey", "decode", "swap")
CSV_COLUMNS = [
    "part", "variant", "mechanism", "source", "length", "depth", "trial", "status", "reason", "perplexity",
    "mean_nll", "tokens", "windows", "single_document", "key", "answer", "correct", "depth_reached",
    "prompt_tokens", "context", "batch", "steps", "tokens_per_second", "prefill_seconds", "state_bytes",
    "state_bytes_per_token", "kind", "own_parameters", "prose_perplexity", "code_perplexity", "seconds",
]


def finite(value: Any) -> Any:
    """JSON has no infinity or NaN: such a float is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite(item) for item in value]
    return value


def write_outputs(data: Dict[str, Any], output: Path, figures: bool = True) -> Dict[str, Path]:
    """Every file of the run into ``output`` (created if missing), the figures only with ``figures``; returns
    their paths by kind."""
    from .lm_eval_figures import write_figures

    output.mkdir(parents=True, exist_ok=True)
    paths = {"json": output / LM_EVAL_JSON, "csv": output / LM_EVAL_CSV, "markdown": output / LM_EVAL_MD}
    paths["json"].write_text(json.dumps(finite(data), indent=2, allow_nan=False) + "\n")
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for part in PARTS:
            for row in data.get(part, []):
                writer.writerow({"part": part, **{k: ("" if v is None else v) for k, v in row.items()}})
    paths["markdown"].write_text(render_markdown(data))
    if figures:
        paths.update(write_figures(data, output))
    return paths


def _number(value: Optional[float], digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(row) + " |" for row in rows]


def _variants(data: Dict[str, Any]) -> List[str]:
    return [variant["label"] for variant in data["variants"]]


def _failed(row: Optional[Dict[str, Any]]) -> Optional[str]:
    if row is None:
        return "-"
    if row.get("status") != "ok":
        return row.get("status", "?")
    return None


def perplexity_table(data: Dict[str, Any]) -> List[str]:
    """Variants down, (source, length) across."""
    rows = data["perplexity"]
    settings = data["settings"]
    columns = [(s, n) for s in settings["sources"] for n in settings["lengths"]]
    found = {(r["variant"], r["source"], r["length"]): r for r in rows}
    body, joined = [], False
    for variant in _variants(data):
        cells = []
        for source, length in columns:
            row = found.get((variant, source, length))
            mixed = row is not None and row.get("single_document", 0) < row.get("windows", 0)
            joined = joined or mixed
            cells.append(_failed(row) or _number(row["perplexity"]) + ("*" if mixed else ""))
        body.append([variant] + cells)
    lines = _table(["variant"] + [f"{s} {n:,}" for s, n in columns], body)
    if joined:
        lines += ["", "\\* some windows join several documents (EOS between them): the split has too few documents "
                  "of that length"]
    return lines


def passkey_table(data: Dict[str, Any]) -> List[str]:
    """Variants down, lengths across: correct answers of all depths and trials at that length."""
    lengths = data["settings"]["passkey_lengths"]
    body = []
    for variant in _variants(data):
        own = [r for r in data["passkey"] if r["variant"] == variant]
        if own and own[0].get("status") == "unsupported":
            body.append([variant] + ["n/a"] * len(lengths))
            continue
        cells = []
        for length in lengths:
            at = [r for r in own if r.get("length") == length]
            ok = [r for r in at if r.get("status") == "ok"]
            right = sum(bool(r["correct"]) for r in ok)
            failed = len(at) - len(ok)
            cells.append(f"{right}/{len(at)}" + (f" ({failed} failed)" if failed else "") if at else "-")
        body.append([variant] + cells)
    return _table(["variant"] + [f"{n:,} tokens" for n in lengths], body)


def passkey_depth_table(data: Dict[str, Any], variant: str) -> List[str]:
    """For one variant: depths down, lengths across, each cell the correct answers over the trials."""
    lengths, depths = data["settings"]["passkey_lengths"], data["settings"]["depths"]
    own = [r for r in data["passkey"] if r["variant"] == variant and r.get("status") == "ok"]
    body = []
    for depth in depths:
        cells = []
        for length in lengths:
            at = [r for r in own if r["length"] == length and r["depth"] == depth]
            cells.append(f"{sum(bool(r['correct']) for r in at)}/{len(at)}" if at else "-")
        body.append([f"{depth:g}"] + cells)
    return _table([f"depth \\ tokens ({variant})"] + [f"{n:,}" for n in lengths], body)


def decode_table(data: Dict[str, Any]) -> List[str]:
    body = []
    for row in data["decode"]:
        if row.get("status") != "ok":
            body.append([row["variant"], str(row.get("length", "-")), row.get("status", "?"), "-", "-"])
            continue
        body.append([row["variant"], f"{row['context']:,}", _number(row["tokens_per_second"], 1),
                     _number(row["state_bytes"] / 2**20, 2), _number(row["state_bytes_per_token"] / 2**10, 2)])
    return _table(["variant", "context", "tokens/s", "state MiB", "state KiB per context token"], body)


def swap_table(data: Dict[str, Any]) -> List[str]:
    sources = data["settings"]["sources"]
    usable = [r for r in data["swap"] if r.get("status") != "unusable"]
    usable.sort(key=lambda r: (r.get("status") != "ok", r.get(f"{sources[0]}_perplexity") or math.inf))
    body = []
    for row in usable:
        if row.get("status") != "ok":
            body.append([row["mechanism"], row["kind"]] + ["-"] * len(sources) + ["-", row.get("reason") or ""])
            continue
        own = row.get("own_parameters") or 0
        note = f"{own:,} parameters of its own, untrained" if own else ""
        body.append([row["mechanism"], row["kind"]] + [_number(row[f"{s}_perplexity"]) for s in sources]
                    + [_number(row.get("seconds"), 0), note])
    lines = _table(["mechanism", "kind"] + [f"{s} perplexity" for s in sources] + ["s", "note"], body)
    unusable = [r for r in data["swap"] if r.get("status") == "unusable"]
    if unusable:
        lines += ["", "Cannot take the place of the model's causal, grouped-query attention:", ""]
        lines += _table(["mechanism", "why"], [[r["mechanism"], r["reason"]] for r in unusable])
    return lines


def render_markdown(data: Dict[str, Any]) -> str:
    """lm-eval.md: the command, the model and machine, and one table per part measured."""
    settings, machine, model = data["settings"], data["machine"], data["model"]
    text = [f"# attnzoo lm-eval: {model['file']}", "", f"Command: `{' '.join(data['command'])}`", "",
            f"Model: {model['architecture']}, {model['layers']} layers, {model['heads']} query heads sharing "
            f"{model['kv_heads']} key/value heads, context {model['context_length']:,} tokens. Text: the "
            f"{settings['split']} split of attnzoo.pretrained.corpus. Machine: {machine.get('cpu')}, "
            f"{machine.get('cores')} cores, {machine.get('threads')} torch threads, load average at the start "
            f"{(machine.get('load_average') or ['?'])[0]}. Took {data.get('seconds', 0) / 60:.1f} minutes.", ""]
    if data["perplexity"]:
        text += [f"## Perplexity ({settings['windows']} window(s) per source and length, each the beginning of a "
                 "document unless marked; the same documents at every length where they are long enough)", ""] \
            + perplexity_table(data) + [""]
    if data["passkey"]:
        text += [f"## Passkey retrieval (correct / prompts; depths {', '.join(f'{d:g}' for d in settings['depths'])}"
                 f", {settings['trials']} trial(s) each, seed {settings['seed']})", ""] + passkey_table(data) + [""]
        for variant in _variants(data):
            if any(r["variant"] == variant and r.get("status") == "ok" for r in data["passkey"]):
                text += passkey_depth_table(data, variant) + [""]
    if data["decode"]:
        batch = settings.get("decode_batch", 1)
        prompts = "a prose prompt" if batch == 1 else f"{batch} prose prompts decoded together"
        text += [f"## Decoding ({settings['decode_tokens']} greedy steps after {prompts})", ""] \
            + decode_table(data) + [""]
    if data["swap"]:
        text += [f"## Raw swap at {settings['swap_length']:,} tokens (no training; {settings['swap_windows']} "
                 "window(s) per source)", ""] + swap_table(data) + [""]
    return "\n".join(text)
