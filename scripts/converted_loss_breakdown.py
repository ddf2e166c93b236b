"""Where a converted model loses to its teacher: the loss per token on the held-out windows that ``attnzoo convert``
measures perplexity on, split by the token's position in the window, and by whether it repeats text seen
earlier, near or far.

    PYTHONPATH=src python scripts/converted_loss_breakdown.py runs/lolcats-s2-200 [runs/other ...] \\
        [--ngram 4] [--near 64] [--positions 64,512,1024,1536] [--length 2048] [--windows 2] [--threads 1] \\
        [--output breakdown.json] [--plot breakdown.png]

By position: the predicted tokens cut at ``positions`` (a token's position is that of the token predicted), per
range, source and model the mean loss (nats) and its excess over the teacher's per token.

By repeats: each predicted token is put in one of three classes by the ``ngram`` tokens before it and itself
(``ngram + 1`` tokens): ``new`` when that sequence has not occurred earlier in the window, ``copy_near`` when its latest
earlier occurrence ended at most ``near`` positions back (inside a converted layer's exact window of 64), and
``copy_far`` when further back (only the linear part of a converted layer reaches it). Per source (prose, code),
class and model: the token count, the mean loss (nats) and the excess over the teacher's, summed over the class
(the nats that class adds to the window's total; their sum over the classes, divided by the tokens, is the log
of the perplexity ratio). Models are loaded with their adapters merged; the teacher is SmolLM2-135M-Instruct.
Prints (and with ``--output`` writes) JSON with the command; ``--plot`` draws the excess against position.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional

import torch

from attnzoo import conversion, pretrained
from attnzoo.conversion.data import evaluation_windows
from attnzoo.pretrained.evaluation import token_nll

CLASSES = ("new", "copy_near", "copy_far")


def token_classes(tokens: List[int], ngram: int, near: int) -> torch.Tensor:
    """For each predicted token (positions 1..n-1): 0 new, 1 a repeat ending at most ``near`` back, 2 further."""
    latest: Dict[tuple, int] = {}
    classes = []
    for t in range(1, len(tokens)):
        key = tuple(tokens[max(0, t - ngram):t + 1])
        seen = latest.get(key)
        classes.append(0 if seen is None else 1 if t - seen <= near else 2)
        if len(key) == ngram + 1:
            latest[key] = t
    return torch.tensor(classes)


def _positions(loss: torch.Tensor, windows: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """The losses of the tokens at positions [low, high) of every window (entry t predicts token t + 1)."""
    return loss.view(len(windows), -1)[:, low - 1:high - 1]


def _plot(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = sorted({row["source"] for row in rows}, reverse=True)
    figure, axes = plt.subplots(1, len(sources), figsize=(5.5 * len(sources), 3.8), sharey=True, squeeze=False)
    for axis, source in zip(axes[0], sources):
        for model in dict.fromkeys(row["model"] for row in rows):
            mine = [row for row in rows if row["source"] == source and row["model"] == model]
            axis.plot([sum(row["positions"]) / 2 for row in mine], [row["excess_per_token"] for row in mine],
                      marker="o", label=model)
        axis.axhline(0.0, color="gray", linewidth=0.8)
        axis.set_title(f"{source}: loss above the teacher's, by position")
        axis.set_xlabel("position in the window (middle of each range)")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("nats per token (converted - teacher)")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("converted", nargs="+", help="folders written by attnzoo convert")
    parser.add_argument("--ngram", type=int, default=4, help="context tokens that must repeat with the token")
    parser.add_argument("--near", type=int, default=64, help="a repeat at most this far back is near")
    parser.add_argument("--positions", default="64,512,1024,1536", help="where the position ranges are cut")
    parser.add_argument("--length", type=int, default=2048, help="tokens per held-out window")
    parser.add_argument("--windows", type=int, default=2, help="held-out windows per source")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("--plot", help="draw the excess loss against position, one panel a source, here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    teacher, tokenizer = pretrained.smollm2()
    models = {"teacher": teacher}
    for folder in args.converted:
        models[folder] = conversion.load_converted(folder, merged=True)[0]
    rows = []
    for source, windows in evaluation_windows(tokenizer, args.length, args.windows).items():
        classes = torch.cat([token_classes(row.tolist(), args.ngram, args.near) for row in windows])
        with torch.no_grad():
            losses = {name: torch.cat([token_nll(model, row[None])[0] for row in windows])
                      for name, model in models.items()}
        cuts = [1] + [int(p) for p in args.positions.split(",")] + [args.length]
        for low, high in zip(cuts, cuts[1:]):  # predicted token t + 1 is at entry t of the losses
            for name, loss in losses.items():
                mine, teachers = _positions(loss, windows, low, high), _positions(losses["teacher"], windows, low, high)
                excess = float((mine - teachers).mean())
                rows.append({"source": source, "positions": [low, high], "model": name,
                             "mean_nll": float(mine.mean()), "excess_per_token": excess})
                print(f"{source:5s} positions {low:5d}-{high:5d}  {name:28s} mean {rows[-1]['mean_nll']:.3f}  "
                      f"excess {excess:+.3f} a token", flush=True)
        for index, label in enumerate(CLASSES):
            chosen = classes == index
            for name, loss in losses.items():
                excess = float((loss[chosen] - losses["teacher"][chosen]).sum())
                rows.append({"source": source, "class": label, "model": name, "tokens": int(chosen.sum()),
                             "mean_nll": float(loss[chosen].mean()) if chosen.any() else None,
                             "excess_nats": excess})
                print(f"{source:5s} {label:9s} {int(chosen.sum()):5d} tokens  {name:28s} "
                      f"mean {rows[-1]['mean_nll'] or float('nan'):.3f}  excess {excess:8.1f} nats", flush=True)
    given = sys.argv[1:] if argv is None else argv
    result = {"command": ["python", "scripts/converted_loss_breakdown.py", *given],
              "settings": {"ngram": args.ngram, "near": args.near, "length": args.length, "windows": args.windows},
              "rows": rows}
    if args.output:
        with open(args.output, "w") as file:
            json.dump(result, file, indent=2)
    if args.plot:
        _plot([row for row in rows if "positions" in row and row["model"] != "teacher"], args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
