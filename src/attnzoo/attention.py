"""``MultiHeadAttention``: input projections, any registered mechanism, output projection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ._validation import check_bool, check_choice, check_floating, check_number, check_positive_int, check_probability
from .mechanisms.base import UnsupportedOptionError, shapes_only
from .mechanisms.registry import build_mechanism
from .mechanisms.state_checks import check_state_made_here
from .state import DecodingState
from .positional import ROTARY_PAIRS, RotaryEmbedding


@dataclass(frozen=True)
class AttentionState:
    """Decoding state of one self-attention layer: its mechanism's state."""

    mechanism: DecodingState

    @property
    def position(self) -> int:
        """The next position (rotary embeddings rotate by it): the positions decoded so far."""
        return self.mechanism.length


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a swappable mechanism.

    Args:
        dim: model width of the input x (batch, seq, dim) and of the output.
        heads: number of (query) heads.
        mechanism: a name from :func:`attnzoo.available`.
        kv_heads: number of key/value heads, dividing ``heads`` (grouped-query attention, as in Llama: query head
            h uses key/value head ``h // (heads // kv_heads)``; 1 is multi-query attention); ``heads`` by default.
            The key and value projections are ``kv_heads * head_dim`` wide. A mechanism declaring
            ``grouped_kv="none"`` refuses ``kv_heads < heads`` here, naming it.
        head_dim: per-head width, ``dim // heads`` by default.
        context_dim: width of ``context`` for cross-attention, ``dim`` by default.
        bias: biases in the four projections.
        dropout: dropout on the attention output (before the output projection), a probability in [0, 1).
        rotary: rotate queries and keys with a :class:`RotaryEmbedding` (self-attention only).
        rotary_base: the base of the rotary angles, ``position * rotary_base^(-2i/head_dim)`` (10000 by default,
            RoFormer's; pretrained models name their own, e.g. Llama 3's 500000); a finite number > 1, only with
            ``rotary=True``.
        rotary_pairs: which channels the rotary embedding turns together, ``"interleaved"`` (x[2i], x[2i+1]), the
            default, or ``"halves"`` (x[i], x[i + head_dim/2]), the layout of transformers' Llama-type
            checkpoints (see :class:`RotaryEmbedding`); only with ``rotary=True``.
        output_gate: gated attention (Qiu et al. 2025, as in Qwen3-Next): each head's output is multiplied,
            channel by channel, by ``sigmoid(x W_g + b_g)`` computed from the layer input x (the queries' input
            in cross-attention), before the output projection. It works with any mechanism and adds a
            ``gate_proj`` of ``dim -> heads * head_dim`` (with a bias when ``bias``). False: no gate, no
            parameters added.
        **mechanism_options: passed to the mechanism; an option it does not take raises a TypeError that
            lists the valid ones (see :func:`attnzoo.mechanism_options`).

    Shapes:
        x: (batch, seq, dim); context: (batch, seq_c, context_dim); key_padding_mask: (batch, seq_kv) bool,
        True marks padding. Output: (batch, seq, dim).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        mechanism: str = "softmax",
        *,
        head_dim: Optional[int] = None,
        kv_heads: Optional[int] = None,
        context_dim: Optional[int] = None,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: bool = False,
        rotary_base: Optional[float] = None,
        rotary_pairs: Optional[str] = None,
        output_gate: bool = False,
        **mechanism_options: Any,
    ) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("heads", heads)
        if head_dim is None:
            if dim % heads:
                raise ValueError(f"dim={dim} is not divisible by heads={heads}; pass head_dim explicitly")
            head_dim = dim // heads
        check_positive_int("head_dim", head_dim)
        kv_heads = heads if kv_heads is None else check_positive_int("kv_heads", kv_heads)
        if heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must divide heads={heads} (grouped-query attention)")
        self.dim, self.heads, self.head_dim, self.kv_heads = dim, heads, head_dim, kv_heads
        self.context_dim = dim if context_dim is None else check_positive_int("context_dim", context_dim)
        check_bool("bias", bias)
        check_bool("rotary", rotary)
        check_bool("output_gate", output_gate)
        rotary_settings: Dict[str, Any] = {}
        for name, value in (("rotary_base", rotary_base), ("rotary_pairs", rotary_pairs)):
            if value is not None and not rotary:
                raise ValueError(f"{name}={value!r} given but rotary=False: there is no rotation to use it")
        if rotary_base is not None:
            rotary_settings["base"] = check_number("rotary_base", rotary_base, minimum=1.0, exclusive_minimum=True)
        if rotary_pairs is not None:
            rotary_settings["pairs"] = check_choice("rotary_pairs", rotary_pairs, ROTARY_PAIRS)
        inner = heads * head_dim
        self.q_proj = nn.Linear(dim, inner, bias=bias)
        self.k_proj = nn.Linear(self.context_dim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(self.context_dim, kv_heads * head_dim, bias=bias)
        self.out_proj = nn.Linear(inner, dim, bias=bias)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.rotary = RotaryEmbedding(head_dim, **rotary_settings) if rotary else None
        self.mechanism = build_mechanism(mechanism, heads=heads, head_dim=head_dim, **mechanism_options)
        # A mechanism that rotates itself (capability own_rotary) gets the embedding and unrotated q and k.
        self._rotates = self.rotary is not None and not self.mechanism.capabilities.own_rotary
        if self.rotary is not None and not self._rotates:
            self.mechanism.use_rotary(self.rotary)
        # Registered after every other part, so that a model without the gate keeps its parameter order.
        self.gate_proj = nn.Linear(dim, inner, bias=bias) if output_gate else None
        refused = self.mechanism.grouping_reason(kv_heads)
        if refused:
            raise UnsupportedOptionError(f"kv_heads={kv_heads}: {refused}")

    @property
    def mechanism_name(self) -> str:
        return self.mechanism.name

    def _split_heads(self, x: Tensor) -> Tensor:
        """(batch, seq, n * head_dim) -> (batch, n, seq, head_dim): n = heads for queries, kv_heads for keys."""
        batch, seq, width = x.shape
        return x.view(batch, seq, width // self.head_dim, self.head_dim).transpose(1, 2)

    def _merge_heads(self, x: Tensor) -> Tensor:
        batch, _, seq, _ = x.shape
        return x.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)

    def _output(self, heads_out: Tensor, x: Tensor) -> Tensor:
        """The layer's output from the mechanism's (batch, heads, seq, head_dim) and the layer input x (batch,
        seq, dim): heads merged, gated by ``sigmoid(gate_proj(x))`` when there is a gate, dropout, projection."""
        merged = self._merge_heads(heads_out)
        if self.gate_proj is not None:
            merged = merged * torch.sigmoid(self.gate_proj(x))
        return self.out_proj(self.dropout(merged))

    def _check_input(self, name: str, x: Tensor, width: int) -> None:
        check_floating(name, x)
        if x.dim() != 3 or x.shape[-1] != width:
            raise ValueError(f"{name} must have shape (batch, seq, {width}), got {tuple(x.shape)}")
        if x.shape[1] == 0:
            raise ValueError(f"{name} must have at least one position, got seq=0")
        weight = self.q_proj.weight
        if x.dtype != weight.dtype:
            raise TypeError(
                f"{name} is {x.dtype} but the module's parameters are {weight.dtype}: convert one to the other "
                f"(e.g. module.to({x.dtype}) or {name}.to({weight.dtype}))"
            )
        if x.device != weight.device:
            raise ValueError(f"{name} is on {x.device} but the module's parameters are on {weight.device}")

    def forward(
        self,
        x: Tensor,
        context: Optional[Tensor] = None,
        *,
        causal: bool = False,
        key_padding_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[Tensor] = None,
        **call_inputs: Optional[Tensor],
    ) -> Tensor:
        """Self-attention over x, or cross-attention from x to ``context`` (batch, seq_c, context_dim).

        ``**call_inputs``: the per-call inputs the mechanism declares (:attr:`~attnzoo.Mechanism.call_inputs`,
        e.g. a (batch, seq) bool ``global_mask``), passed on to it; a name it does not declare is refused, naming
        it, before anything is projected.

        ``cu_seqlens``: a packed batch, x of batch 1 holding documents back to back: int64 offsets ``[0, ...,
        seq]``, each document attending only within itself (rotary positions restart at each document);
        for a mechanism whose ``capabilities.packing`` accepts it, refused naming it for any other."""
        self._check_input("x", x, self.dim)
        options: Dict[str, Any] = self.mechanism.check_call_inputs(call_inputs)
        spans = None
        if cu_seqlens is not None:
            if context is not None:
                raise UnsupportedOptionError("cu_seqlens describes packed self-attention: it cannot be used with "
                                             "context=...")
            # Checked before projecting; (batch, 1, seq, dim) reads as q's (batch, heads, seq, dim).
            spans = self.mechanism.check_packing(x.unsqueeze(1), key_padding_mask, False, cu_seqlens)
            options["cu_seqlens"] = cu_seqlens
        source = x
        if context is not None:
            self._check_input("context", context, self.context_dim)
            if context.shape[0] != x.shape[0]:
                raise ValueError(f"context batch {context.shape[0]} does not match x batch {x.shape[0]}")
            self._require_cross(x.shape[1], context.shape[1])
            source = context
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(source))
        v = self._split_heads(self.v_proj(source))
        if self._rotates:
            q, k = self._rotate(q, spans), self._rotate(k, spans)
        out = self.mechanism(q, k, v, causal=causal, key_padding_mask=key_padding_mask, cross=context is not None,
                             **options)
        return self._output(out, x)

    def _rotate(self, x: Tensor, spans: Optional[List[Tuple[int, int]]]) -> Tensor:
        """Rotary embeddings of x (batch, heads, seq, head_dim): positions from 0, or from 0 in each document
        (start, end) of a packed row, so a document is rotated as it would be alone."""
        assert self.rotary is not None
        if spans is None:
            return self.rotary(x)
        return torch.cat([self.rotary(x[:, :, start:end]) for start, end in spans], dim=2)

    def _require_cross(self, q_len: int, context_len: int) -> None:
        """Refuse cross-attention (``context=``) before projecting anything, with every reason the mechanism
        gives (:meth:`~attnzoo.Mechanism.unsupported_reasons`)."""
        if self.rotary is not None:
            raise UnsupportedOptionError("rotary=True applies to self-attention only, not with context=...")
        shapes = shapes_only(1, self.heads, q_len, context_len, self.head_dim, kv_heads=self.kv_heads)
        reasons = self.mechanism.unsupported_reasons(*shapes, cross=True)
        if reasons:
            raise UnsupportedOptionError("context=...: " + "; ".join(reasons))

    # -- cross-attention to a fixed context, projected once -------------------------------------------------
    def project_context(self, context: Tensor) -> Tuple[Tensor, Tensor]:
        """Project ``context`` (batch, seq_c, context_dim) to per-head keys and values, each
        (batch, kv_heads, seq_c, head_dim), so that decoding steps reuse them instead of re-projecting."""
        self._check_input("context", context, self.context_dim)
        self._require_cross(1, context.shape[1])
        return self._split_heads(self.k_proj(context)), self._split_heads(self.v_proj(context))

    def attend_projected(
        self, x: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None
    ) -> Tensor:
        """Cross-attention from x (batch, seq, dim) to keys and values from :meth:`project_context`.

        Equals ``forward(x, context, key_padding_mask=key_padding_mask)``. Output: (batch, seq, dim).
        """
        self._check_input("x", x, self.dim)
        q = self._split_heads(self.q_proj(x))
        out = self.mechanism(q, k, v, causal=False, key_padding_mask=key_padding_mask, cross=True)
        return self._output(out, x)

    # -- incremental decoding (causal self-attention) ------------------------------------------------------
    def prefill(self, x: Tensor) -> Tuple[Tensor, AttentionState]:
        """Causal self-attention over a prompt x (batch, seq, dim); returns the output and the decoding state."""
        self._check_input("x", x, self.dim)
        q, k, v = (self._split_heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self._rotates:
            q, k = self.rotary(q), self.rotary(k)
        out, state = self.mechanism.prefill(q, k, v)
        return self._output(out, x), AttentionState(state)

    def prefill_packed(self, x: Tensor, cu_seqlens: Tensor) -> Tuple[Tensor, List[AttentionState]]:
        """:meth:`prefill` of a packed row x (1, seq, dim) of prompts at offsets ``cu_seqlens``: the output, each
        prompt alone, and one decoding state per prompt (batch 1), in order."""
        self._check_input("x", x, self.dim)
        spans = self.mechanism.check_packing(x.unsqueeze(1), None, False, cu_seqlens)
        q, k, v = (self._split_heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self._rotates:
            q, k = self._rotate(q, spans), self._rotate(k, spans)
        out, states = self.mechanism.prefill_packed(q, k, v, cu_seqlens=cu_seqlens)
        return self._output(out, x), [AttentionState(state) for state in states]

    def step(self, x_t: Tensor, state: Optional[AttentionState]) -> Tuple[Tensor, AttentionState]:
        """One decoding step: x_t (batch, 1, dim) -> (y_t (batch, 1, dim), new state). Start with state=None."""
        self._check_input("x_t", x_t, self.dim)
        if x_t.shape[1] != 1:
            raise ValueError(f"step takes one position: x_t of shape (batch, 1, {self.dim}), got {tuple(x_t.shape)}")
        if state is not None and not isinstance(state, AttentionState):
            raise TypeError(
                f"state must be None (to start) or the AttentionState that prefill or step returned, got "
                f"{type(state).__name__}"
            )
        inner = None if state is None else state.mechanism
        q, k, v = (self._split_heads(proj(x_t)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        self.mechanism.require_recurrent_step()
        if inner is not None:  # before its length sets the rotary position (the mechanism's step checks its tensors)
            check_state_made_here(inner, self.mechanism.name)
        position = 0 if inner is None else inner.length
        if self.mechanism.max_length is not None and position >= self.mechanism.max_length:
            raise ValueError(f"{self.mechanism.name}: decoding past max_length={self.mechanism.max_length}")
        if self._rotates:
            q, k = self.rotary(q, start=position), self.rotary(k, start=position)
        out, mechanism_state = self.mechanism.step(q, k, v, inner)
        return self._output(out, x_t), AttentionState(mechanism_state)

    def extra_repr(self) -> str:
        grouped = f", kv_heads={self.kv_heads}" if self.kv_heads != self.heads else ""
        gated = ", output_gate=True" if self.gate_proj is not None else ""
        return (f"dim={self.dim}, heads={self.heads}{grouped}, head_dim={self.head_dim}, "
                f"mechanism={self.mechanism.name!r}{gated}")
