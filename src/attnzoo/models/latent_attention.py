"""Multi-head latent attention (MLA; DeepSeek-V2, 2024; the softmax layers of Kimi Linear, 2025).

MLA changes the projections, not the attention: every position is compressed to one latent shared by all heads,
``c = RMSNorm(x W_dkv)`` (latent_dim wide), from which each head's keys ``k_C = c W_uk_h^T`` and values
``v = c W_uv_h^T`` (head_dim each) are expanded. Rotary positions cannot pass through that compression (a
rotation between the query and the up-projection would not commute with it), so the rotary part is decoupled:
``q_R = RoPE(W_qr ...)`` per head and one ``k_R = RoPE(x W_kr)`` shared by every head (rope_dim each). A head's
query and key are ``[q_C ; q_R]`` and ``[k_C ; k_R]``; attention is exact causal softmax at scale
``1 / sqrt(head_dim + rope_dim)``. The queries may be compressed too (``q_latent_dim``): ``c_q = RMSNorm(x
W_dq)``, then ``[q_C ; q_R] = c_q W_uq`` per head, as in DeepSeek-V2; without it one ``W_q`` makes both from x.

Decoding caches per position only ``[c ; k_R]``: latent_dim + rope_dim numbers, against 2 * heads * head_dim
for multi-head attention's keys and values. A step absorbs the up-projections instead of expanding the cache
(:mod:`attnzoo.functional.latent`): its logits are ``(q_C W_uk_h) . c + q_R . k_R``, its output the
softmax-weighted sum of the cached c multiplied by ``W_uv_h^T``. The forward pass and ``prefill`` materialise
the keys and values (cheaper for a whole sequence) and run the same softmax core.

As in DeepSeek-V2, ``bias`` adds biases to the projections from x (``W_q`` or ``W_dq``, ``W_dkv`` with
``W_kr``, the gate and the output projection), never to the up-projections from a latent, and the latents'
RMSNorms have epsilon :data:`LATENT_NORM_EPS` and a learned scale. ``rope_dim=0`` leaves out the rotary part
(no positions in the attention, as Kimi Linear's MLA layers, whose linear layers carry the order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validation import check_bool, check_floating, check_key_padding_mask, check_number, check_positive_int
from .._validation import check_probability
from ..functional.kv_cache import cache_append, prefilled_cache
from ..functional.latent import absorbed_latent_attention, absorbed_queries, expand_latent_values
from ..functional.norms import rms_norm
from ..functional.packing import check_cu_seqlens
from ..functional.softmax import packed_softmax_attention_unchecked, softmax_attention_unchecked
from ..mechanisms.base import UnsupportedOptionError
from ..positional import RotaryEmbedding

LATENT_NORM_EPS = 1e-6
"""Epsilon of the RMSNorms of the latents (DeepSeek-V2's)."""

LATENT_BLOCK_OPTIONS: Dict[str, Any] = {"head_dim": None, "latent_dim": None, "rope_dim": None,
                                        "q_latent_dim": None, "rotary_base": 10000.0, "bias": False}
"""The options of an MLA block (``block="mla"``) with their defaults; None: worked out from the model's width and
heads (:func:`latent_sizes`)."""


def latent_sizes(dim: int, heads: int, head_dim: object = None, latent_dim: object = None, rope_dim: object = None,
                 q_latent_dim: object = None) -> Tuple[int, int, int, Optional[int]]:
    """The checked (head_dim, latent_dim, rope_dim, q_latent_dim), defaults filled in: head_dim ``dim //
    heads``; latent_dim ``4 * head_dim`` and rope_dim ``head_dim / 2`` rounded down to an even number (at least
    2), DeepSeek-V2's proportions (512 and 64 for heads of 128); q_latent_dim stays None (a full W_q)."""
    if head_dim is None:
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}; pass head_dim explicitly")
        head_dim = dim // heads
    head_dim = check_positive_int("head_dim", head_dim)
    latent_dim = 4 * head_dim if latent_dim is None else check_positive_int("latent_dim", latent_dim)
    if rope_dim is None:
        rope_dim = max(2, 2 * (head_dim // 4))
    rope_dim = check_number("rope_dim", rope_dim, integer=True, minimum=0)
    if rope_dim % 2:
        raise ValueError(f"rope_dim must be even (rotary embeddings turn pairs of channels), got {rope_dim}; 0 "
                         f"leaves out the rotary part")
    q_latent_dim = check_number("q_latent_dim", q_latent_dim, integer=True, minimum=1, optional=True)
    return head_dim, latent_dim, rope_dim, q_latent_dim


def latent_block_options(dim: int, heads: int, options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The checked options of an MLA block of width ``dim`` with ``heads`` heads, defaults filled in.

    Args:
        options: any of :data:`LATENT_BLOCK_OPTIONS`: ``head_dim``, ``latent_dim``, ``rope_dim``, ``q_latent_dim``
            (see :class:`MultiHeadLatentAttention`), ``rotary_base`` (10000) and ``bias`` (False).

    Returns:
        All six options, the sizes resolved by :func:`latent_sizes`.
    """
    given = dict(options or {})
    unknown = sorted(set(given) - set(LATENT_BLOCK_OPTIONS))
    if unknown:
        raise TypeError(f"block_options: unknown option(s) {', '.join(unknown)} for block='mla'; valid options: "
                        f"{', '.join(LATENT_BLOCK_OPTIONS)}")
    resolved = {**LATENT_BLOCK_OPTIONS, **given}
    sizes = latent_sizes(dim, heads, resolved["head_dim"], resolved["latent_dim"], resolved["rope_dim"],
                         resolved["q_latent_dim"])
    resolved.update(zip(("head_dim", "latent_dim", "rope_dim", "q_latent_dim"), sizes))
    resolved["rotary_base"] = _rotary_base(resolved["rotary_base"], resolved["rope_dim"], "rotary_base" in given)
    check_bool("bias", resolved["bias"])
    return resolved


def _rotary_base(base: object, rope_dim: int, given: bool) -> float:
    checked = check_number("rotary_base", base, minimum=1.0, exclusive_minimum=True)
    if given and rope_dim == 0:
        raise ValueError(f"rotary_base={base!r} given but rope_dim=0: there is no rotary part to use it")
    return checked


@dataclass(frozen=True)
class LatentAttentionState:
    """Decoding state of one :class:`MultiHeadLatentAttention` after ``length`` positions.

    ``cache``: ``{"latent": (batch, 1, capacity, latent_dim + rope_dim), "filled": (batch,)}``, a growing cache of
    :mod:`attnzoo.functional.kv_cache` whose first ``length`` rows are in use, each row ``[c ; k_R]`` of one
    position (k_R rotated by its position). Nothing else is kept per position. Its tensors have the batch first,
    so :func:`attnzoo.state.select_batch` reorders beams."""

    cache: Dict[str, Tensor]
    length: int

    @property
    def position(self) -> int:
        """The next position (the rotary part rotates by it): the positions decoded so far."""
        return self.length

    @property
    def rows(self) -> Tensor:
        """(batch, length, latent_dim + rope_dim): the cached rows in use."""
        return self.cache["latent"][:, 0, : self.length]


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (module docstring): self-attention only, (batch, seq, dim) -> same.

    Args:
        dim: model width of the input x and of the output.
        heads: number of heads.
        head_dim: width of each head's content query, key and value; ``dim // heads`` by default.
        latent_dim: width of the shared latent c, the cache's content part; ``4 * head_dim`` by default.
        rope_dim: width of the decoupled rotary query (per head) and key (shared), even; ``head_dim / 2``
            rounded down to even (at least 2) by default; 0: no rotary part.
        q_latent_dim: compress the queries through a latent of this width (``W_dq``, RMSNorm, ``W_uq``); None:
            one full ``W_q``.
        bias: biases in the projections from x and the output projection (not the up-projections).
        dropout: on the attention output, before the output projection, a probability in [0, 1).
        rotary_base: base of the rotary angles (RoFormer's 10000 by default), a finite number > 1.
        output_gate: gated attention (Qiu et al. 2025), as :class:`attnzoo.MultiHeadAttention`'s: each head's
            output times ``sigmoid(x W_g + b_g)`` before the output projection.

    Shapes:
        x: (batch, seq, dim); key_padding_mask: (batch, seq) bool, True marks padding. Output: (batch, seq, dim).
    """

    def __init__(self, dim: int, heads: int, *, head_dim: Optional[int] = None, latent_dim: Optional[int] = None,
                 rope_dim: Optional[int] = None, q_latent_dim: Optional[int] = None, bias: bool = False,
                 dropout: float = 0.0, rotary_base: float = 10000.0, output_gate: bool = False) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("heads", heads)
        sizes = latent_sizes(dim, heads, head_dim, latent_dim, rope_dim, q_latent_dim)
        self.head_dim, self.latent_dim, self.rope_dim, self.q_latent_dim = sizes
        self.dim, self.heads = dim, heads
        check_bool("bias", bias)
        check_bool("output_gate", output_gate)
        base = _rotary_base(rotary_base, self.rope_dim, rotary_base != 10000.0)
        self.scale = 1.0 / math.sqrt(self.head_dim + self.rope_dim)
        inner, query_width = heads * self.head_dim, heads * (self.head_dim + self.rope_dim)
        if self.q_latent_dim is None:
            self.q_proj: Optional[nn.Linear] = nn.Linear(dim, query_width, bias=bias)
            self.q_down = self.q_up = None
            self.register_parameter("q_norm", None)
        else:
            self.q_proj = None
            self.q_down = nn.Linear(dim, self.q_latent_dim, bias=bias)
            self.q_norm = nn.Parameter(torch.ones(self.q_latent_dim))
            self.q_up = nn.Linear(self.q_latent_dim, query_width, bias=False)
        # W_dkv and W_kr in one projection: x -> [c before its norm ; k_R before its rotation].
        self.kv_down = nn.Linear(dim, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_norm = nn.Parameter(torch.ones(self.latent_dim))
        self.k_up = nn.Linear(self.latent_dim, inner, bias=False)
        self.v_up = nn.Linear(self.latent_dim, inner, bias=False)
        self.out_proj = nn.Linear(inner, dim, bias=bias)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.rotary = RotaryEmbedding(self.rope_dim, base=base) if self.rope_dim else None
        self.gate_proj = nn.Linear(dim, inner, bias=bias) if output_gate else None

    @property
    def cache_width(self) -> int:
        """Numbers cached per position by decoding: latent_dim + rope_dim."""
        return self.latent_dim + self.rope_dim

    # -- projections ---------------------------------------------------------------------------------------
    def _rotate(self, x: Tensor, start: int, spans: Optional[List[Tuple[int, int]]]) -> Tensor:
        """The rotary part x (batch, heads, seq, rope_dim) rotated from position ``start``, or from 0 in each
        document (start, end) of a packed row."""
        assert self.rotary is not None
        if spans is None:
            return self.rotary(x, start=start)
        return torch.cat([self.rotary(x[:, :, begin:end]) for begin, end in spans], dim=2)

    def _queries(self, x: Tensor, start: int, spans: Optional[List[Tuple[int, int]]]) -> Tuple[Tensor, Optional[Tensor]]:
        """q_C (batch, heads, seq, head_dim) and the rotated q_R (batch, heads, seq, rope_dim), None without."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_down is not None and self.q_up is not None
            q = self.q_up(rms_norm(self.q_down(x), self.q_norm, LATENT_NORM_EPS))
        batch, seq, _ = x.shape
        q = q.view(batch, seq, self.heads, self.head_dim + self.rope_dim).transpose(1, 2)
        q_content, q_rope = q.split([self.head_dim, self.rope_dim], dim=-1)
        return q_content, None if self.rotary is None else self._rotate(q_rope, start, spans)

    def _rows(self, x: Tensor, start: int, spans: Optional[List[Tuple[int, int]]]) -> Tensor:
        """What decoding caches of each position, (batch, seq, latent_dim + rope_dim): ``[c ; k_R]``."""
        latent, k_rope = self.kv_down(x).split([self.latent_dim, self.rope_dim], dim=-1)
        latent = rms_norm(latent, self.kv_norm, LATENT_NORM_EPS)
        if self.rotary is None:
            return latent
        return torch.cat([latent, self._rotate(k_rope[:, None], start, spans)[:, 0]], dim=-1)

    def _keys_values(self, rows: Tensor) -> Tuple[Tensor, Tensor]:
        """Every head's key [k_C ; k_R] (batch, heads, seq, head_dim + rope_dim) and value (batch, heads, seq,
        head_dim), expanded from the rows."""
        batch, seq, _ = rows.shape
        latent, k_rope = rows.split([self.latent_dim, self.rope_dim], dim=-1)
        k, v = (up(latent).view(batch, seq, self.heads, self.head_dim).transpose(1, 2) for up in (self.k_up, self.v_up))
        if self.rotary is not None:
            k = torch.cat([k, k_rope[:, None].expand(-1, self.heads, -1, -1)], dim=-1)
        return k, v

    def _output(self, heads_out: Tensor, x: Tensor) -> Tensor:
        """Heads (batch, heads, seq, head_dim) merged, gated when there is a gate, dropout, projection."""
        batch, _, seq, _ = heads_out.shape
        merged = heads_out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)
        if self.gate_proj is not None:
            merged = merged * torch.sigmoid(self.gate_proj(x))
        return self.out_proj(self.dropout(merged))

    def _attend(self, x: Tensor, causal: bool, key_padding_mask: Optional[Tensor],
                spans: Optional[List[Tuple[int, int]]]) -> Tuple[Tensor, Tensor]:
        """The output (batch, seq, dim) with materialised keys and values, and the rows decoding caches."""
        q_content, q_rope = self._queries(x, 0, spans)
        q = q_content if q_rope is None else torch.cat([q_content, q_rope], dim=-1)
        rows = self._rows(x, 0, spans)
        k, v = self._keys_values(rows)
        # SDPA's fused kernels need values as wide as the keys; with narrower ones it would materialise every
        # (seq, seq) logit. Zero channels added to the values leave the others as they are.
        v = F.pad(v, (0, self.rope_dim))
        if spans is None:
            out = softmax_attention_unchecked(q, k, v, causal, key_padding_mask, False, self.scale)
        else:
            out = packed_softmax_attention_unchecked(q, k, v, spans, causal, False, self.scale)
        return self._output(out[..., : self.head_dim], x), rows

    # -- checks ----------------------------------------------------------------------------------------------
    def _check_input(self, name: str, x: Tensor) -> None:
        check_floating(name, x)
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{name} must have shape (batch, seq, {self.dim}), got {tuple(x.shape)}")
        if x.shape[1] == 0:
            raise ValueError(f"{name} must have at least one position, got seq=0")
        weight = self.kv_down.weight
        if x.dtype != weight.dtype:
            raise TypeError(f"{name} is {x.dtype} but the module's parameters are {weight.dtype}: convert one to "
                            f"the other (e.g. module.to({x.dtype}) or {name}.to({weight.dtype}))")
        if x.device != weight.device:
            raise ValueError(f"{name} is on {x.device} but the module's parameters are on {weight.device}")

    def _check_state(self, state: object, x_t: Tensor) -> None:
        if state is None:
            return
        if not isinstance(state, LatentAttentionState):
            raise TypeError(f"state must be None (to start) or the LatentAttentionState that prefill or step "
                            f"returned, got {type(state).__name__}")
        cache = state.cache.get("latent")
        if cache is None or cache.dim() != 4 or cache.shape[1] != 1 or cache.shape[3] != self.cache_width:
            raise ValueError(f"state does not hold this layer's cache of {self.cache_width} numbers per position "
                             f"(latent_dim + rope_dim): pass the state this layer's prefill or step returned")
        if cache.shape[0] != x_t.shape[0]:
            raise ValueError(f"state holds batch {cache.shape[0]} but x_t has batch {x_t.shape[0]}")
        if cache.dtype != x_t.dtype or cache.device != x_t.device:
            raise ValueError(f"state is {cache.dtype} on {cache.device}, x_t {x_t.dtype} on {x_t.device}")

    # -- the forward pass ------------------------------------------------------------------------------------
    def forward(self, x: Tensor, context: Optional[Tensor] = None, *, causal: bool = False,
                key_padding_mask: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """Self-attention over x (batch, seq, dim) -> (batch, seq, dim); ``causal``: each position sees itself and
        the earlier ones. ``cu_seqlens``: a packed row (batch 1) of documents at these int64 offsets ``[0, ...,
        seq]``, each attending only within itself, its rotary positions from 0. ``context`` (cross-attention) is
        refused: the latent and the rotary key are made from the attending sequence itself."""
        self._check_input("x", x)
        if context is not None:
            raise UnsupportedOptionError("context=...: multi-head latent attention is self-attention only (its "
                                         "shared latent and rotary key come from x itself); use "
                                         "MultiHeadAttention for cross-attention")
        check_bool("causal", causal)
        batch, seq, _ = x.shape
        check_key_padding_mask(key_padding_mask, batch, seq, x.device)
        spans = None
        if cu_seqlens is not None:
            if key_padding_mask is not None:
                raise ValueError("cu_seqlens and key_padding_mask cannot be used together: a packed row has no "
                                 "padding")
            spans = check_cu_seqlens(cu_seqlens, batch, seq, x.device)
        return self._attend(x, causal, key_padding_mask, spans)[0]

    # -- incremental decoding (causal) -----------------------------------------------------------------------
    def prefill(self, x: Tensor) -> Tuple[Tensor, LatentAttentionState]:
        """Causal self-attention over a prompt x (batch, seq, dim); returns the output and the decoding state,
        which holds the prompt's rows ``[c ; k_R]`` only."""
        self._check_input("x", x)
        out, rows = self._attend(x, True, None, None)
        return out, LatentAttentionState(prefilled_cache({"latent": rows[:, None]}), x.shape[1])

    def prefill_packed(self, x: Tensor, cu_seqlens: Tensor) -> Tuple[Tensor, List[LatentAttentionState]]:
        """:meth:`prefill` of a packed row x (1, seq, dim) of prompts at offsets ``cu_seqlens``: the output, each
        prompt alone, and one decoding state per prompt (batch 1), in order."""
        self._check_input("x", x)
        spans = check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], x.device)
        out, rows = self._attend(x, True, None, spans)
        states = [LatentAttentionState(prefilled_cache({"latent": rows[:, None, start:end]}), end - start)
                  for start, end in spans]
        return out, states

    def step(self, x_t: Tensor, state: Optional[LatentAttentionState]) -> Tuple[Tensor, LatentAttentionState]:
        """One decoding step, x_t (batch, 1, dim) -> (y_t (batch, 1, dim), new state); start with state=None.

        Attends with the up-projections absorbed (:func:`attnzoo.functional.latent.absorbed_latent_attention`):
        no key or value is expanded from the cache."""
        self._check_input("x_t", x_t)
        if x_t.shape[1] != 1:
            raise ValueError(f"step takes one position: x_t of shape (batch, 1, {self.dim}), got {tuple(x_t.shape)}")
        self._check_state(state, x_t)
        position = 0 if state is None else state.length
        q_content, q_rope = self._queries(x_t, position, None)
        rows = self._rows(x_t, position, None)
        cache = cache_append(None if state is None else state.cache, {"latent": rows[:, None]}, position)
        up_keys = self.k_up.weight.view(self.heads, self.head_dim, self.latent_dim)
        up_values = self.v_up.weight.view(self.heads, self.head_dim, self.latent_dim)
        latent_out = absorbed_latent_attention(absorbed_queries(q_content, up_keys), q_rope,
                                               cache["latent"][:, 0, : position + 1], self.scale)
        out = self._output(expand_latent_values(latent_out, up_values), x_t)
        return out, LatentAttentionState(cache, position + 1)

    def extra_repr(self) -> str:
        query = "" if self.q_latent_dim is None else f", q_latent_dim={self.q_latent_dim}"
        gated = ", output_gate=True" if self.gate_proj is not None else ""
        return (f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}, latent_dim={self.latent_dim}, "
                f"rope_dim={self.rope_dim}{query}{gated}")


__all__ = ["LATENT_BLOCK_OPTIONS", "LatentAttentionState", "MultiHeadLatentAttention", "latent_block_options",
           "latent_sizes"]
