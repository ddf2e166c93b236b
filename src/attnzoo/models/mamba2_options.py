"""The options of a Mamba-2 block (``block="mamba2"``, :mod:`attnzoo.models.mamba2`), checked once.

Kept apart from the block so that :mod:`attnzoo.models.config` can check them when a config is made without
importing the block (which imports the config).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from .._validation import check_positive_int

MAMBA2_OPTIONS: Dict[str, Any] = {"state_dim": 128, "expansion": 2, "conv_size": 4, "groups": 1, "chunk_size": 64}
"""The options of a Mamba-2 block with their defaults (mamba_ssm's ``d_state``, ``expand``, ``d_conv`` and
``ngroups``; its ``chunk_size`` is 256, attnzoo's chunked path runs fastest on CPU at 64)."""


def mamba2_options(dim: int, heads: int, options: Optional[Mapping[str, Any]]) -> Dict[str, int]:
    """The checked options of a Mamba-2 block of width ``dim`` with ``heads`` SSM heads, defaults filled in.

    Args:
        options: any of

            * ``state_dim``: N, the state size per head (the width of B and C), 128 by default;
            * ``expansion``: the inner width ``expansion * dim`` that x and z take, 2 by default; it is split
              into ``heads`` heads of ``expansion * dim // heads`` (mamba_ssm's ``headdim``);
            * ``conv_size``: the width of the causal depthwise convolution over x, B and C, 4 by default;
            * ``groups``: B and C are shared by the ``heads // groups`` heads of each group (mamba_ssm's
              ``ngroups``), 1 by default; must divide ``heads``;
            * ``chunk_size``: chunk length of the SSD's parallel form, 64 by default.

    Returns:
        All five options.
    """
    given = dict(options or {})
    unknown = sorted(set(given) - set(MAMBA2_OPTIONS))
    if unknown:
        raise TypeError(f"block_options: unknown option(s) {', '.join(unknown)} for block='mamba2'; valid options: "
                        f"{', '.join(MAMBA2_OPTIONS)}")
    resolved = {**MAMBA2_OPTIONS, **given}
    for name in MAMBA2_OPTIONS:
        resolved[name] = check_positive_int(name, resolved[name])
    if heads % resolved["groups"]:
        raise ValueError(f"groups={resolved['groups']} must divide heads={heads} (B and C are shared by the heads "
                         f"of a group)")
    return resolved


__all__ = ["MAMBA2_OPTIONS", "mamba2_options"]
