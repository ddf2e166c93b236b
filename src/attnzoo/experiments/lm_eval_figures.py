"""The figures of ``attnzoo lm-eval`` (matplotlib, Agg backend):

``lm-eval-perplexity.png``  perplexity against context length (log-log), one panel per source, a line per variant;
``lm-eval-passkey.png``     passkey accuracy against context length, a line per variant;
``lm-eval-decode.png``      decoding speed and the decoding state's size against context length;
``lm-eval-swap.png``        the raw-swap perplexities, a bar per mechanism and source (log scale).

A figure whose part was not measured is not drawn.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib import ticker  # noqa: E402

from ..bench.results import BASELINE  # noqa: E402


def _style(index: int, label: str) -> Dict[str, Any]:
    if label == BASELINE:
        return {"color": "black", "marker": "o", "linewidth": 2}
    return {"color": plt.get_cmap("tab10").colors[index % 10], "marker": "os^vDP*X"[index % 8]}


def _save(fig: Any, path: Path, title: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _log2_axis(ax: Any, lengths: List[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n) for n in lengths])
    ax.grid(True, which="both", alpha=0.3)


def _plain_log_y(ax: Any) -> None:
    """A log y axis labelled with plain numbers (20, 30, 50), minor ticks included, not powers of ten."""
    ax.set_yscale("log")
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _series(rows: List[Dict[str, Any]], variant: str, column: str, **match: Any) -> Tuple[List[int], List[float]]:
    points = sorted((r["length"], r[column]) for r in rows if r["variant"] == variant and r.get("status") == "ok"
                    and all(r.get(k) == v for k, v in match.items()) and r.get(column) is not None)
    return [n for n, _ in points], [v for _, v in points]


def plot_perplexity(data: Dict[str, Any], path: Path) -> None:
    sources, lengths = data["settings"]["sources"], data["settings"]["lengths"]
    fig, axes = plt.subplots(1, len(sources), figsize=(5.5 * len(sources), 4.2), squeeze=False)
    for ax, source in zip(axes[0], sources):
        for index, variant in enumerate(v["label"] for v in data["variants"]):
            xs, ys = _series(data["perplexity"], variant, "perplexity", source=source)
            if xs:
                ax.plot(xs, ys, label=variant, **_style(index, variant))
        _log2_axis(ax, lengths)
        _plain_log_y(ax)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(f"perplexity, {source} (test split)")
        ax.set_title(source, fontsize=9)
        ax.legend(fontsize=8)
    windows = data["settings"]["windows"]
    _save(fig, path, f"{data['model']['file']}: perplexity against context length ({windows} window(s) per point)")


def plot_passkey(data: Dict[str, Any], path: Path) -> None:
    lengths = data["settings"]["passkey_lengths"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for index, variant in enumerate(v["label"] for v in data["variants"]):
        rows = [r for r in data["passkey"] if r["variant"] == variant and r.get("status") == "ok"]
        xs = [n for n in lengths if any(r["length"] == n for r in rows)]
        ys = [100 * sum(bool(r["correct"]) for r in rows if r["length"] == n)
              / sum(r["length"] == n for r in rows) for n in xs]
        if xs:
            ax.plot(xs, ys, label=variant, **_style(index, variant))
    _log2_axis(ax, lengths)
    ax.set_ylim(-5, 105)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("passkeys retrieved (%)")
    # Below the axes: the points sit anywhere from 0 to 100%, where a legend inside would hide one.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    depths = ", ".join(f"{d:g}" for d in data["settings"]["depths"])
    _save(fig, path, f"passkey retrieval, depths {depths}, {data['settings']['trials']} trial(s) each")


def plot_decode(data: Dict[str, Any], path: Path) -> None:
    lengths = data["settings"]["decode_lengths"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, variant in enumerate(v["label"] for v in data["variants"]):
        for ax, column, scale in ((axes[0], "tokens_per_second", 1.0), (axes[1], "state_bytes", 2.0 ** -20)):
            xs, ys = _series(data["decode"], variant, column)
            if xs:
                ax.plot(xs, [y * scale for y in ys], label=variant, **_style(index, variant))
    for ax, ylabel in zip(axes, ("decoding speed (tokens/s)", "decoding state (MiB)")):
        _log2_axis(ax, lengths)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    batch = data["settings"].get("decode_batch", 1)
    prompts = "a prose prompt" if batch == 1 else f"{batch} prose prompts decoded together"
    _save(fig, path, f"greedy decoding after {prompts}, {data['settings']['decode_tokens']} steps timed")


def plot_swap(data: Dict[str, Any], path: Path) -> None:
    sources = data["settings"]["sources"]
    rows = [r for r in data["swap"] if r.get("status") == "ok"]
    rows.sort(key=lambda r: r.get(f"{sources[0]}_perplexity") or math.inf)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.5))
    width = 0.8 / max(len(sources), 1)
    for offset, source in enumerate(sources):
        values = [r[f"{source}_perplexity"] for r in rows]
        ax.bar([i + offset * width for i in range(len(rows))], values, width, label=source)
    ax.set_xticks([i + width * (len(sources) - 1) / 2 for i in range(len(rows))])
    ax.set_xticklabels([r["mechanism"] for r in rows], rotation=60, ha="right", fontsize=8)
    _plain_log_y(ax)
    ax.set_ylabel("perplexity (log scale)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    unusable = [r["mechanism"] for r in data["swap"] if r.get("status") == "unusable"]
    failed = [r["mechanism"] for r in data["swap"] if r.get("status") == "failed"]
    notes = (f"\ncannot take the place: {', '.join(unusable)}" if unusable else "") + \
        (f"\nfailed: {', '.join(failed)}" if failed else "")
    _save(fig, path, f"raw swap (no training) at {data['settings']['swap_length']:,} tokens{notes}")


def write_figures(data: Dict[str, Any], output: Path) -> Dict[str, Path]:
    """Each figure whose part was measured; returns their paths by part."""
    drawers = {"perplexity": plot_perplexity, "passkey": plot_passkey, "decode": plot_decode, "swap": plot_swap}
    paths = {}
    for part, draw in drawers.items():
        if any(row.get("status") == "ok" for row in data.get(part, [])):
            paths[f"{part}_plot"] = output / f"lm-eval-{part}.png"
            draw(data, paths[f"{part}_plot"])
    return paths
