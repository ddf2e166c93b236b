"""Per-layer schedules: what each layer of a stack is, for hybrid stacks (docs/hybrids.md).

A schedule is a pattern of :class:`LayerSpec` items, one per layer, repeated to the stack's depth (its length
must divide the depth): ``(gated_delta, gated_delta, gated_delta, softmax)`` on 8 layers is layers 0-2 and 4-6
gated_delta, 3 and 7 softmax. An item is an attention layer with its mechanism and that mechanism's options, or
a block kind (a gated attention unit, a Mamba-2 block) with the block's options.

The compact text form, read by :func:`parse_schedule` and written by :func:`format_schedule` (the
``attnzoo train --layers`` value)::

    SCHEDULE := ITEM[,ITEM...]                   the pattern, from the first layer on
    ITEM     := KIND[(OPTION=VALUE[,...])][*COUNT] an item, with its options, COUNT times in a row
    KIND     := MECHANISM | block:BLOCK | BLOCK  a mechanism name, or a block kind (BLOCK alone when no
                                                 mechanism has that name)

e.g. ``gated_delta*3,softmax``, ``local(window=64)*2,softmax``, ``gated_delta,mamba2``,
``block:flash_gau(chunk_size=64),softmax``. A VALUE reads as on the command line: ``true``/``false``, ``none``,
an integer, a number, else the text itself. Every error names the schedule (``layers``) and the item.

This module knows no block name: the callers pass the block kinds (:data:`attnzoo.models.config.BLOCKS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..mechanisms import available

ATTENTION = "attention"
"""The block of an attention layer (attention + feed-forward): an item naming a mechanism."""

BLOCK_PREFIX = "block:"
LAYER_OPTION = "output_gate"
"""The option of an attention item that belongs to its layer, not to its mechanism: ``softmax(output_gate=true)``
gates that layer's heads (``MultiHeadAttention(output_gate=True)``)."""
DEFAULT_MECHANISM = "softmax"

_ITEM = re.compile(r"^\s*(?P<block>block:)?\s*(?P<kind>[A-Za-z0-9_.\-]+)\s*(?:\((?P<options>[^()]*)\))?\s*"
                   r"(?:\*\s*(?P<count>\S+?))?\s*$")


@dataclass(frozen=True)
class LayerSpec:
    """One item of a schedule: an attention layer (``block="attention"``) whose self-attention is
    ``mechanism`` with ``options``, or a ``block`` kind (``"mamba2"``, ...) with ``options`` as its block
    options (``mechanism`` then stays at its default). ``LayerSpec("gated_delta")``,
    ``LayerSpec(block="mamba2", options={"state_dim": 16})``."""

    mechanism: str = DEFAULT_MECHANISM
    options: Optional[Mapping[str, Any]] = None
    block: str = ATTENTION

    @property
    def is_attention(self) -> bool:
        return self.block == ATTENTION

    @property
    def mechanism_options(self) -> Dict[str, Any]:
        """An attention item's options for its mechanism: ``options`` without the layer's own
        (:data:`LAYER_OPTION`)."""
        return {key: value for key, value in (self.options or {}).items() if key != LAYER_OPTION}

    @property
    def kind(self) -> str:
        """What the layer is, for messages: its mechanism, or its block kind."""
        return self.mechanism if self.is_attention else self.block

    def __str__(self) -> str:
        return format_item(self)


# -- the text form ------------------------------------------------------------------------------------------
def parse_value(raw: str) -> Any:
    """An option's value: true/false, none, an int, a float, else the text (as the command line reads one)."""
    text = raw.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "none" if value is None else str(value)


def format_item(spec: LayerSpec) -> str:
    """The text of one item: ``local(window=64)``, ``block:mamba2``."""
    kind = spec.mechanism if spec.is_attention else BLOCK_PREFIX + spec.block
    options = spec.options or {}
    shown = ",".join(f"{key}={_format_value(value)}" for key, value in options.items())
    return f"{kind}({shown})" if shown else kind


def format_schedule(specs: Sequence[LayerSpec]) -> str:
    """The compact text of a schedule, runs of equal items as ``ITEM*COUNT``; :func:`parse_schedule` reads it
    back to the same items."""
    parts: List[Tuple[str, int]] = []
    for spec in specs:
        text = format_item(spec)
        if parts and parts[-1][0] == text:
            parts[-1] = (text, parts[-1][1] + 1)
        else:
            parts.append((text, 1))
    return ",".join(text if count == 1 else f"{text}*{count}" for text, count in parts)


def _split(text: str, name: str) -> List[str]:
    """The items of a schedule's text: split at the commas outside parentheses."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "()":
            depth += 1 if char == "(" else -1
            if depth not in (0, 1):
                raise ValueError(f"{name} {text!r}: unbalanced or nested parentheses (an item's options are "
                                 f"ITEM(OPTION=VALUE,...))")
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"{name} {text!r}: a parenthesis is not closed")
    return items + [text[start:]]


def _options(text: Optional[str], item: str, name: str) -> Optional[Dict[str, Any]]:
    if text is None or not text.strip():
        return None
    options: Dict[str, Any] = {}
    for pair in text.split(","):
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"{name} item {item!r}: expected OPTION=VALUE between the parentheses, got {pair!r}")
        if key.strip() in options:
            raise ValueError(f"{name} item {item!r}: option {key.strip()} given twice")
        options[key.strip()] = parse_value(raw)
    return options


def _count(text: Optional[str], item: str, name: str) -> int:
    if text is None:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name} item {item!r}: the count after * must be an integer >= 1, got {text!r}")
    return int(text)


def parse_item(text: str, blocks: Sequence[str], name: str = "layers") -> Tuple[LayerSpec, int]:
    """One item's (spec, count) from its text; its kind must be a registered mechanism or one of ``blocks``."""
    item = text.strip()
    match = _ITEM.match(text)
    if not item or match is None:
        raise ValueError(f"{name} item {item!r}: expected MECHANISM or block:BLOCK, then optional (OPTION=VALUE,...) "
                         f"and *COUNT")
    kind, options = match["kind"], _options(match["options"], item, name)
    count = _count(match["count"], item, name)
    explicit_block = match["block"] is not None
    if not explicit_block and kind in available():
        return LayerSpec(kind, options), count
    if kind in blocks and kind != ATTENTION:
        return LayerSpec(options=options, block=kind), count
    if explicit_block:
        raise ValueError(f"{name} item {item!r}: unknown block {kind!r}; blocks: "
                         f"{', '.join(b for b in blocks if b != ATTENTION)}")
    raise ValueError(f"{name} item {item!r}: unknown mechanism or block {kind!r}; mechanisms: "
                     f"{', '.join(available())}; blocks: {', '.join(b for b in blocks if b != ATTENTION)} (a "
                     f"mechanism of your own: give --import MODULE_OR_PATH)")


def parse_schedule(text: str, blocks: Sequence[str], name: str = "layers") -> Tuple[LayerSpec, ...]:
    """The pattern of a schedule's compact text (module docstring), each ``ITEM*COUNT`` spelt out."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{name} must be a schedule such as 'gated_delta*3,softmax', got {text!r}")
    specs: List[LayerSpec] = []
    for item in _split(text, name):
        spec, count = parse_item(item, blocks, name)
        specs.extend([spec] * count)
    return tuple(specs)


# -- a schedule as a value ------------------------------------------------------------------------------------
def _check_spec(spec: LayerSpec, blocks: Sequence[str], name: str) -> LayerSpec:
    item = format_item(spec) if isinstance(spec.block, str) and isinstance(spec.mechanism, str) else repr(spec)
    if spec.block not in blocks:
        raise ValueError(f"{name} item {item!r}: block must be one of {', '.join(map(repr, blocks))}, got "
                         f"{spec.block!r}")
    if spec.is_attention and spec.mechanism not in available():
        raise ValueError(f"{name} item {item!r}: unknown mechanism {spec.mechanism!r}; valid: "
                         f"{', '.join(available())}")
    if not spec.is_attention and spec.mechanism != DEFAULT_MECHANISM:
        raise ValueError(f"{name} item {item!r}: a block={spec.block!r} item has no mechanism (its options are the "
                         f"block's); leave mechanism at its default")
    options = spec.options
    if options is not None and not (isinstance(options, Mapping) and all(isinstance(key, str) for key in options)):
        raise TypeError(f"{name} item {item!r}: options must be a dict of option names to values or None, got "
                        f"{type(options).__name__}")
    return spec


def schedule_of(value: Union[None, str, Sequence[Union[LayerSpec, str]]], blocks: Sequence[str],
                name: str = "layers") -> Optional[Tuple[LayerSpec, ...]]:
    """A schedule as a tuple of checked :class:`LayerSpec` (None stays None): from its compact text, or from a
    sequence whose items are LayerSpecs or the text of one item each."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_schedule(value, blocks, name)
    if not isinstance(value, Sequence) or not value:
        raise TypeError(f"{name} must be None, a schedule's text such as 'gated_delta*3,softmax', or a non-empty "
                        f"list of LayerSpec items, got {value!r}")
    specs: List[LayerSpec] = []
    for entry in value:
        if isinstance(entry, str):
            spec, count = parse_item(entry, blocks, name)
            specs.extend([spec] * count)
        elif isinstance(entry, LayerSpec):
            specs.append(_check_spec(entry, blocks, name))
        else:
            raise TypeError(f"{name} items must be LayerSpec or an item's text ('local(window=64)'), got "
                            f"{entry!r} ({type(entry).__name__})")
    return tuple(specs)


def repeat_to_depth(specs: Sequence[LayerSpec], depth: int, name: str = "layers") -> Tuple[LayerSpec, ...]:
    """The schedule's items for each of ``depth`` layers: the pattern repeated; its length must divide depth."""
    if depth % len(specs):
        raise ValueError(f"{name} has {len(specs)} items ({format_schedule(specs)}), which does not divide "
                         f"depth={depth}: give a pattern whose length divides the depth")
    return tuple(specs) * (depth // len(specs))


__all__ = ["LayerSpec", "format_item", "format_schedule", "parse_item", "parse_schedule", "repeat_to_depth",
           "schedule_of"]
