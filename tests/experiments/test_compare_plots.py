"""The figures of ``attnzoo compare`` at the scale of forty mechanisms, drawn from a synthetic result: every
registered mechanism and made-up ones of each kind, two peer libraries, lines that stop (out of memory) and a
mechanism that failed throughout. What a reader needs and a test can see: each figure is written at a
reasonable width, each line and bubble is named once, names do not overlap one another or their bubbles, no
panel holds more lines than colours and markers tell apart, and errors sit at their measured values."""

from __future__ import annotations

import random
import re
import struct
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional

import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Text

import attnzoo
from attnzoo.bench import plots
from attnzoo.bench.bubble import draw_bubble
from attnzoo.bench.plot_parts import MAX_LINES, panels, spread
from attnzoo.bench.results import BASELINE
from attnzoo.mechanisms import APPROXIMATE, EXACT, OWN, capabilities

LENGTHS = [1024, 2048, 4096, 8192]
MAX_BUBBLE_WIDTH = 1600  # pixels
MAX_LINES_WIDTH = 1600


def _row(name: str, kind: Optional[str], length: int, rng: random.Random, **extra: Any) -> Dict[str, Any]:
    slope = 2.0 if kind == EXACT else rng.uniform(0.9, 2.0)
    scale = rng.uniform(0.05, 3.0) * (length / 1024) ** slope
    row = dict(mechanism=name, source="attnzoo", counterpart=None, kind=kind, length=length, batch=1, heads=4,
               head_dim=16, dtype="float32", causal=False, device="cpu", status="ok", reason=None,
               forward_ms=10 * scale, forward_backward_ms=30 * scale, peak_memory_mib=5 * scale,
               forward_peak_memory_mib=2 * scale,
               error=3e-7 if kind == EXACT else rng.uniform(0.3, 1.5) if kind == APPROXIMATE else rng.uniform(1, 50))
    row.update(extra)
    return row


def synthetic_result(extra_own: int = 10, seed: int = 0) -> Dict[str, Any]:
    """A result of every registered mechanism, ``extra_own`` made-up attentions of their own and two peers
    (one of softmax, one of an approximate mechanism): forty mechanisms and more, as results.json holds them."""
    kinds = {name: capabilities(name).kind for name in attnzoo.available()}
    kinds.update({f"made_up_{index:02d}": OWN for index in range(extra_own)})
    approximate = sorted(name for name, kind in kinds.items() if kind == APPROXIMATE)[0]
    rows: List[Dict[str, Any]] = []
    peers = {"peer:lib-softmax": (EXACT, BASELINE), "peer:lib-approx": (APPROXIMATE, approximate)}
    for length in LENGTHS:
        for name, kind in kinds.items():  # each mechanism keeps its own scale and slope at every length
            rows.append(_row(name, kind, length, random.Random(zlib.crc32(name.encode()) + seed)))
        for name, (kind, counterpart) in peers.items():
            rows.append(_row(name, kind, length, random.Random(zlib.crc32(name.encode()) + seed), source="lib",
                             counterpart=counterpart))
    for row in rows:
        if row["mechanism"] == "made_up_00" and row["length"] == LENGTHS[-1]:
            row.update(status="oom", forward_ms=None, forward_backward_ms=None, peak_memory_mib=None,
                       forward_peak_memory_mib=None, error=None, reason="out of memory")
        if row["mechanism"] == "made_up_01":
            row.update(status="failed", forward_ms=None, forward_backward_ms=None, peak_memory_mib=None,
                       forward_peak_memory_mib=None, error=None, reason="RuntimeError: made up")
    uniform = [dict(length=length, error=0.8) for length in LENGTHS]
    sweeps = [dict(mechanism=approximate, option="rank", length=LENGTHS[0], uniform_error=0.8,
                   points=[dict(value=v, error=1.0 / v ** 0.5) for v in (16, 32, 64, 128)])]
    config = dict(batch=1, heads=4, head_dim=16, dtype="float32", causal=False, device="cpu")
    machine = dict(cpu="test cpu", threads=1, torch="2")
    return dict(rows=rows, config=config, machine=machine, uniform_error=uniform, sweeps=sweeps)


def png_size(path: Path) -> tuple:
    """(width, height) in pixels, from the PNG header."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def _boxes(texts: List[Any]) -> List[Any]:
    """The texts' boxes in pixels, without an annotation's leader line (after a draw, which places them)."""
    renderer = texts[0].figure.canvas.get_renderer()
    return [Text.get_window_extent(text, renderer) for text in texts]


def _overlapping(texts: List[Any]) -> List[tuple]:
    boxes = _boxes(texts)
    return [(texts[i].get_text(), texts[j].get_text()) for i in range(len(boxes)) for j in range(i)
            if boxes[i].overlaps(boxes[j])]


def test_spread_keeps_order_and_gap():
    placed = spread([5.0, 5.0, 5.5, 40.0, 100.0], [10, 10, 20, 10, 10], low=0, high=100)
    assert 5 <= placed[0] <= placed[1] <= placed[2] < placed[3] < placed[4] <= 95
    assert placed[1] - placed[0] >= 10 - 1e-9 and placed[2] - placed[1] >= 15 - 1e-9
    assert spread([50.0], [10], low=0, high=100) == [50.0]
    crowded = spread([50.0] * 20, [10] * 20, low=0, high=100)  # more than fit: centred on the range
    assert min(crowded) == pytest.approx(50 - 95) and max(crowded) == pytest.approx(50 + 95)


def test_panels_hold_few_lines_and_every_mechanism_once():
    data = synthetic_result()
    names = {row["mechanism"] for row in data["rows"]} - {BASELINE}
    assert len(names) >= 40
    found = panels(data["rows"])
    drawn = [name for _, units in found for unit in units for name in unit]
    assert sorted(drawn) == sorted(names)
    assert all(sum(len(unit) for unit in units) <= MAX_LINES for _, units in found)
    # a peer shares its counterpart's panel
    assert any(unit[1:] == ["peer:lib-approx"] for _, units in found for unit in units)


@pytest.mark.parametrize("columns", [plots.TIME_COLUMNS, plots.MEMORY_COLUMNS])
def test_time_and_memory_panels_name_every_line(columns):
    data = synthetic_result()
    fig, labels = plots.draw_lines(data, columns, "y", "title")
    try:
        fig.canvas.draw()
        for (place, index), texts in labels.items():
            assert texts[0].get_text() == BASELINE  # the reference, in every panel
            assert not _overlapping(texts), f"panel {place}, {index}"
        named = {text.get_text().split("(")[0].strip() for texts in labels.values() for text in texts}
        measured = {row["mechanism"] for row in data["rows"] if row[columns[1][0]]}
        assert named == measured
        assert any("oom at N=8192" in text.get_text() for texts in labels.values() for text in texts)
        assert any("RuntimeError: made up" in text.get_text() for text in fig.texts)
    finally:
        plt.close(fig)


def test_bubble_names_every_mechanism_with_an_error_at_its_value():
    data = synthetic_result()
    fig, labels = draw_bubble(data)
    try:
        fig.canvas.draw()
        expected = {row["mechanism"] for row in data["rows"] if row["length"] == LENGTHS[-1]
                    and row["kind"] != OWN and row["error"] is not None}
        assert set(labels) == expected
        assert not _overlapping(list(labels.values()))
        ax = fig.axes[0]
        softmax_y = [offsets[0][1] for offsets in (c.get_offsets() for c in ax.collections) if len(offsets)]
        assert min(softmax_y) == pytest.approx(3e-7)  # measured, not moved to a floor
        assert any("attentions of their own have no approximation error" in t.get_text() for t in fig.texts)
    finally:
        plt.close(fig)


def test_bubble_with_accuracy_places_forty_labels_clear_of_bubbles(tmp_path):
    data = synthetic_result()
    rng = random.Random(1)
    accuracy = {row["mechanism"]: rng.uniform(0.3, 0.7) for row in data["rows"]}
    fig, labels = draw_bubble(data, accuracy)
    try:
        fig.canvas.draw()
        at_length = {row["mechanism"] for row in data["rows"] if row["length"] == LENGTHS[-1]
                     and row["forward_backward_ms"]}
        assert set(labels) == at_length and len(labels) >= 40
        assert not _overlapping(list(labels.values()))
        ax, scale = fig.axes[0], fig.dpi / 72
        for collection, label in zip([c for c in ax.collections if len(c.get_offsets())], labels.values()):
            x, y = ax.transData.transform(collection.get_offsets()[0])
            radius = (collection.get_sizes()[0] ** 0.5) / 2 * scale
            box = _boxes([label])[0]
            nearest = (min(max(x, box.x0), box.x1) - x) ** 2 + (min(max(y, box.y0), box.y1) - y) ** 2
            assert nearest >= (radius - 1) ** 2, f"{label.get_text()} covers its bubble"
        fig.savefig(tmp_path / "bubble.png", dpi=fig.dpi, bbox_inches="tight")
        assert png_size(tmp_path / "bubble.png")[0] <= MAX_BUBBLE_WIDTH
    finally:
        plt.close(fig)


def test_error_figure_has_a_panel_per_logit_spread_and_the_caption(tmp_path):
    data = synthetic_result()
    approximate = sorted({row["mechanism"] for row in data["rows"] if row["kind"] == APPROXIMATE
                          and row["source"] == "attnzoo"})[:4]
    data["sweeps"] = [dict(mechanism=name, option="rank", length=LENGTHS[0], logit_std=std,
                           uniform_error=0.8 * std, points=[dict(value=v, error=(index + 1) * std / v ** 0.5)
                                                            for v in (16, 32, 64, 128)])
                      for std in (1.0, 0.25) for index, name in enumerate(approximate)]
    fig, labels = plots.draw_error(data)
    try:
        fig.canvas.draw()
        titled = [ax for ax in fig.axes if ax.get_title()]
        assert [re.search(r"logit std ([\d.]+)", ax.get_title()).group(1) for ax in titled[:2]] == ["1", "0.25"]
        for ax in titled[:2]:  # every sweep named in both sweep panels, at its measured last error
            texts = [label for label in labels if label.axes is ax]
            assert {text.get_text() for text in texts} == {f"{name} (rank)" for name in approximate} | {
                plots.UNIFORM_LABEL}
            assert not _overlapping(texts)
        # A mechanism keeps its colour in every panel: its name's colour in the sweeps and against N.
        by_panel = [{text.get_text().split(" (")[0]: text.get_color() for text in labels if text.axes is ax}
                    for ax in titled[:3]]
        for name in approximate:
            assert by_panel[0][name] == by_panel[1][name] == by_panel[2][name], name
        assert any("Why some sit above that floor" in text.get_text() for ax in fig.axes for text in ax.texts)
        fig.savefig(tmp_path / "error.png", dpi=fig.dpi, bbox_inches="tight")
        assert png_size(tmp_path / "error.png")[0] <= MAX_LINES_WIDTH
    finally:
        plt.close(fig)


@pytest.mark.slow
def test_write_plots_writes_four_figures_of_reasonable_width(tmp_path):
    data = synthetic_result()
    paths = plots.write_plots(data, tmp_path, accuracy=None)
    assert sorted(paths) == ["bubble", "error", "memory", "time"]
    for name, path in paths.items():
        width, height = png_size(path)
        assert width <= (MAX_BUBBLE_WIDTH if name == "bubble" else MAX_LINES_WIDTH), (name, width)
        assert height > 300
