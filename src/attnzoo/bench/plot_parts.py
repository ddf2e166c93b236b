"""What the figures of ``attnzoo compare`` share (:mod:`attnzoo.bench.plots`, :mod:`attnzoo.bench.bubble`):
the subtitle, log ticks, the families that time.png and memory.png give a panel each, line styles that differ
within a panel, and labels placed beside lines and bubbles without covering each other.

Thirty or forty mechanisms cannot share one set of axes: no ten-colour cycle tells thirty lines apart. So each
family of mechanisms (by the ``kind`` its capabilities declare, the attentions of their own split further by
what else they declare) has a panel of at most :data:`MAX_LINES` lines, softmax drawn in every one as the
reference, and every line is named at its end rather than in a legend.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib import colors as mcolors  # noqa: E402
from matplotlib import ticker  # noqa: E402

from ..mechanisms import APPROXIMATE, EXACT, OWN, capabilities  # noqa: E402
from .peers import PEERS  # noqa: E402
from .results import BASELINE  # noqa: E402

DPI = 110
LABEL_SIZE = 8  # points, of every direct label
MAX_LINES = 8  # lines in one panel besides softmax's, so that each keeps a colour and a marker of its own
# tab10 without its grey (kept for references such as uniform attention); black is softmax's.
PALETTE = tuple(color for index, color in enumerate(plt.get_cmap("tab10").colors) if index != 7)
MARKERS = "osD^vP<>Xph*"

# The panels' families, in order: (title, the kind, and what the mechanism declares beyond it).
EXACT_FAMILY = "exact softmax and its peers"
APPROXIMATE_FAMILY = "approximations of softmax"
RECURRENT_FAMILY = "attentions of their own: linear-attention recurrences"
PATTERN_FAMILY = "attentions of their own: softmax over a pattern of positions"
OTHER_OWN_FAMILY = "attentions of their own: others"
UNKNOWN_FAMILY = "kind not recorded"
FAMILIES = (EXACT_FAMILY, APPROXIMATE_FAMILY, RECURRENT_FAMILY, PATTERN_FAMILY, OTHER_OWN_FAMILY, UNKNOWN_FAMILY)


def subtitle(data: Dict[str, Any]) -> str:
    config, machine = data["config"], data["machine"]
    return (f"batch {config['batch']}, {config['heads']} heads, head dim {config['head_dim']}, {config['dtype']}, "
            f"{'causal' if config['causal'] else 'non-causal'}; {machine['cpu']}, {machine['threads']} threads, "
            f"torch {machine['torch']}")


def row_is_own(name: str) -> bool:
    """Whether a row is attnzoo's own mechanism rather than a peer library's (``peer:...``)."""
    return not name.startswith("peer:")


def _plain(value: float, _: Any = None) -> str:
    """A tick: a plain number from 0.001 to 999999, a power of ten beyond."""
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:g}"
    exponent = math.floor(math.log10(abs(value)) + 1e-9)
    mantissa = value / 10 ** exponent
    return f"$10^{{{exponent}}}$" if abs(mantissa - 1) < 1e-6 else f"${mantissa:g} \\times 10^{{{exponent}}}$"


def plain_log_ticks(axis: Any) -> None:
    """Log axis ticks as plain numbers (0.01, 1, 100) rather than powers of ten, from 0.001 to 999999."""
    plain = ticker.FuncFormatter(_plain)
    low, high = sorted(abs(v) for v in axis.get_view_interval())
    decades = math.log10(high / low) if low > 0 else 10.0
    # Within a decade a tick at every digit, within about two 1-2-5 ticks; wider ranges one tick per decade.
    subs = tuple(range(1, 10)) if decades < 1 else (1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(ticker.NullFormatter())


def message_figure(path: Any, title: str, message: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, fontsize=11)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


# -- families and panels ------------------------------------------------------------------------------------
def declared_kind(name: str) -> Optional[str]:
    """The kind a registered mechanism declares, for results written before rows recorded it; else None."""
    try:
        return capabilities(name).kind
    except ValueError:
        return None


def row_kind(row: Dict[str, Any]) -> Optional[str]:
    """A row's kind: as recorded, else (results written before rows recorded it) the kind its mechanism
    declares, or for a peer library's row its attnzoo counterpart's; None when none is known."""
    if row.get("kind") or row_is_own(row["mechanism"]):
        return row.get("kind") or declared_kind(row["mechanism"])
    peer = PEERS.get(row.get("source") or "")
    counterpart = row.get("counterpart") or (peer.counterpart() if peer else None)
    return declared_kind(counterpart) if counterpart else None


def family(name: str, kind: Optional[str]) -> str:
    """The panel family of a mechanism: its kind, and for an attention of its own what it declares besides (a
    linear-attention recurrence, or softmax logits over a pattern of positions)."""
    if kind == EXACT:
        return EXACT_FAMILY
    if kind == APPROXIMATE:
        return APPROXIMATE_FAMILY
    if kind != OWN:
        return UNKNOWN_FAMILY
    try:
        declared = capabilities(name)
    except ValueError:  # not registered here: a peer library's row, or a mechanism of a module not imported
        return OTHER_OWN_FAMILY
    if declared.linear_recurrence:
        return RECURRENT_FAMILY
    if declared.dot_product_logits:
        return PATTERN_FAMILY
    return OTHER_OWN_FAMILY


def _units(rows: Sequence[Dict[str, Any]]) -> Dict[str, List[List[str]]]:
    """Family -> its units: a mechanism with the peer libraries that implement it (one colour each unit), in
    name order; softmax is in none, a peer of softmax is a unit of its own in the exact family."""
    kinds: Dict[str, Optional[str]] = {}
    counterparts: Dict[str, Optional[str]] = {}
    for row in rows:
        kinds.setdefault(row["mechanism"], row_kind(row))
        counterparts.setdefault(row["mechanism"], row.get("counterpart"))
    peers: Dict[str, List[str]] = {}
    for name in sorted(kinds):
        twin = counterparts[name]
        if not row_is_own(name) and twin in kinds and twin != BASELINE:
            peers.setdefault(twin, []).append(name)
    attached = {name for names in peers.values() for name in names}
    units: Dict[str, List[List[str]]] = {}
    for name in sorted(kinds, key=lambda n: (not row_is_own(n), n)):
        if name == BASELINE or name in attached:
            continue
        kind = EXACT if counterparts[name] == BASELINE else kinds[name]
        units.setdefault(family(name, kind), []).append([name] + peers.get(name, []))
    return units


def panels(rows: Sequence[Dict[str, Any]]) -> List[Tuple[str, List[List[str]]]]:
    """The panels of time.png and memory.png, in family order: (title, units), each panel at most
    :data:`MAX_LINES` lines; a family with more is split into nearly equal panels ("(1 of 2)")."""
    found = _units(rows)
    result: List[Tuple[str, List[List[str]]]] = []
    for title in FAMILIES:
        units = found.get(title, [])
        lines = sum(len(unit) for unit in units)
        if not lines:
            continue
        count = math.ceil(lines / MAX_LINES)
        target = math.ceil(lines / count)
        chunks: List[List[List[str]]] = [[]]
        for unit in units:
            if chunks[-1] and sum(len(u) for u in chunks[-1]) + len(unit) > target:
                chunks.append([])
            chunks[-1].append(unit)
        for index, chunk in enumerate(chunks):
            result.append((title + (f" ({index + 1} of {len(chunks)})" if len(chunks) > 1 else ""), chunk))
    return result


def baseline_style() -> Dict[str, Any]:
    return dict(color="black", marker="o", linestyle="-", linewidth=2.4, markerfacecolor="black")


def panel_styles(units: Sequence[Sequence[str]]) -> Dict[str, Dict[str, Any]]:
    """A colour and a marker per unit, so that no two lines of a panel look alike; a peer library takes its
    attnzoo counterpart's colour and marker, hollow, on a dashed line. Softmax is black, thicker."""
    styles: Dict[str, Dict[str, Any]] = {BASELINE: baseline_style()}
    for index, unit in enumerate(units):
        color = PALETTE[index % len(PALETTE)]
        marker = MARKERS[index % len(MARKERS)]
        for place, name in enumerate(unit):
            peer = place > 0 or not row_is_own(name)
            styles[name] = dict(color=color, marker=marker, linestyle="--" if peer else "-",
                                linewidth=1.3 if peer else 1.7, markerfacecolor="white" if peer else color)
    return styles


def text_color(color: Any) -> Tuple[float, float, float]:
    """A line's colour darkened for the text that names it (tab10's olive and cyan are faint as text)."""
    red, green, blue = mcolors.to_rgb(color)
    return (red * 0.75, green * 0.75, blue * 0.75)


# -- labels that do not cover each other -------------------------------------------------------------------
def spread(targets: Sequence[float], sizes: Sequence[float], low: float, high: float) -> List[float]:
    """Centres as near ``targets`` as can be for boxes of ``sizes`` that do not overlap, kept within [low, high]
    while they fit there (centred on the range when they do not); in the order of ``targets``."""
    order = sorted(range(len(targets)), key=lambda i: targets[i])
    if not order:
        return []
    half = [sizes[i] / 2 for i in order]
    placed = [float(targets[i]) for i in order]
    if sum(sizes) > high - low:  # too many for the range: centre them on it
        placed[0] = (low + high - sum(sizes)) / 2 + half[0]
        for k in range(1, len(placed)):
            placed[k] = placed[k - 1] + half[k - 1] + half[k]
    else:
        placed[0] = max(placed[0], low + half[0])
        for k in range(1, len(placed)):
            placed[k] = max(placed[k], placed[k - 1] + half[k - 1] + half[k])
        placed[-1] = min(placed[-1], high - half[-1])
        for k in range(len(placed) - 2, -1, -1):
            placed[k] = min(placed[k], placed[k + 1] - half[k + 1] - half[k])
    result = [0.0] * len(placed)
    for k, i in enumerate(order):
        result[i] = placed[k]
    return result


def end_label(name: str, note: Optional[str] = None) -> str:
    """A line's name, with why it ends early on a line of its own when both would make a long label."""
    if not note:
        return name
    return f"{name} ({note})" if len(name) + len(note) <= 24 else f"{name}\n({note})"


def label_line_ends(ax: Any, ends: Sequence[Tuple[str, float, float, Any]]) -> List[Any]:
    """Name each line (text, last x, last y, colour) in the margin right of ``ax``, level with its last point
    and nudged apart so that no two names overlap, with a thin leader to that point. The axes' limits and
    place must be final. Returns the texts."""
    fig = ax.figure
    line = LABEL_SIZE * 1.3 * fig.dpi / 72  # one line of text, in pixels
    box = ax.bbox
    heights = [ax.transData.transform((x, y))[1] for _, x, y, _ in ends]
    placed = spread(heights, [line * (text.count("\n") + 1) for text, *_ in ends], box.y0, box.y1)
    texts = []
    for (text, x, y, color), height in zip(ends, placed):
        texts.append(ax.annotate(
            text, (x, y), xytext=(1.03, (height - box.y0) / box.height), textcoords="axes fraction",
            ha="left", va="center", linespacing=1.1, fontsize=LABEL_SIZE, color=text_color(color), annotation_clip=False,
            arrowprops=dict(arrowstyle="-", color=color, linewidth=0.6, alpha=0.7, shrinkA=1, shrinkB=3)))
    return texts
