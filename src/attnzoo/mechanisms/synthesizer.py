"""Synthesizer (Tay et al. 2021, "Synthesizer: Rethinking Self-Attention in Transformer Models"): attention
weights synthesised from each position alone, or learned outright, instead of computed from query-key pairs."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_bool, check_choice, check_number, check_positive_int
from ..functional.synthesizer import (
    DEFAULT_CHUNK_SIZE,
    MODES,
    dense_synthesizer_factors,
    factored_synthesizer_attention_unchecked,
    factorized_dense_synthesizer_logits,
    factorized_random_synthesizer_factors,
    factorized_split,
    random_synthesizer_logits,
    synthesized_logits_reference,
    synthesizer_attention_reference,
    synthesizer_attention_unchecked,
)
from ..functional.ties import tied_to_unused
from .base import NO_GROUPED_KV, OWN, PACKED_SPLIT, Capabilities, Mechanism
from .capabilities import PADDED_RIGHT
from .registry import register

RANDOM_MODES = ("random", "factorized_random")
"""The modes whose logits do not depend on the input (and may be ``fixed``)."""
FACTORED_MODES = ("dense", "factorized_random")
"""The modes whose (N, N) logits are a product of (N, r) factors, attended without materialising them."""


def _uniform(*shape: int, fan_in: int) -> nn.Parameter:
    """``nn.Linear``'s default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), from the global RNG."""
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))


@register
class SynthesizerAttention(Mechanism):
    """Synthesized attention: ``softmax(S) v`` with logits ``S`` (N x N per head) that are not query-key dot
    products.

    Shapes: q, k, v (batch, heads, N, head_dim) -> (batch, heads, N, head_dim), with N <= ``max_seq_len``.
    Self-attention only: the logits are indexed by the positions of one sequence, so keys from another
    sequence (``cross=True``) are refused. ``k`` is used only by the mixture, ``q`` by the dense modes and the
    mixture; an unused input gets a zero gradient.

    Options:
        mode: how the logits are made, per head:
            ``"dense"``: row i from its own query, a two-layer MLP ``relu(q_i W1 + b1) W2 + b2`` (head_dim ->
            hidden -> max_seq_len), of which the first N columns are used;
            ``"random"``: a learned (max_seq_len, max_seq_len) logit table, the same for every input;
            ``"factorized_dense"``: the MLP gives ``a = factor`` and ``b = ceil(max_seq_len / a)`` values
            ``A_i``, ``B_i``; logit (i, j) = ``A_i[j // b] * B_i[j % b]``;
            ``"factorized_random"``: ``R1 R2^T`` with R1, R2 of shape (max_seq_len, factor), rank ``factor``.
        max_seq_len: the longest sequence (the logits' size); also this instance's ``max_length``.
        factor: ``a`` of factorized_dense, the rank k of factorized_random (unused by the other modes);
            at least 1.
        hidden: width of the dense modes' hidden layer; ``head_dim`` by default.
        fixed: the random modes' tables are fixed at their initial values (buffers, saved in the state dict,
            not trained): the paper's fixed random synthesizer. Only for the random modes.
        mix: the paper's mixture with dot-product attention, ``softmax(w_s S + w_d q k^T / sqrt(head_dim))``,
            with per-head weights ``(w_s, w_d) = softmax(mix_logits)`` learned from (0, 0), i.e. 1/2 each.
        chunk_size: rows per block of the causal path of the random and factorized_dense modes (each block
            meets only the keys up to its last row); changes speed, not results.

    Parameters per head (L = max_seq_len, d = head_dim, e = hidden): dense ``d e + e + e L + L``;
    factorized_dense ``d e + e + (e + 1)(a + b)``; random ``L^2`` (none trainable when fixed);
    factorized_random ``2 L k`` (idem); plus 2 with ``mix``. Initialised from the global RNG like
    ``nn.Linear`` (the MLP), standard normal (the random table), normal with standard deviation k^-1/4 (R1,
    R2, so that the entries of R1 R2^T have variance 1).

    Causal: the logits of later keys are masked (row i of every mode depends on nothing after i). Key padding:
    padded keys' logits are masked and their keys and values zeroed; a row that sees no key outputs zeros.

    Cost, per head: time O(N^2). The dense and factorized_random logits are products of (N, r) factors, so
    they go through one fused ``scaled_dot_product_attention`` call with the factors as queries and keys
    (memory O(N (r + head_dim)), no (N, N) tensor). The random table and the factorized_dense logits are
    materialised, (N, N) per head (shared by the batch for the random modes without padding), then an
    explicit softmax.
    """

    name = "synthesizer"
    capabilities = Capabilities(
        # Its attention weights are learned (or drawn) per position counted from the row's start.
        padding_invariance=PADDED_RIGHT,
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=False,
        kind=OWN,
        complexity="time O(N^2), memory O(N) (dense, factorized_random) to O(N^2) (random, factorized_dense)",
        summary="Synthesizer: logits from each position alone (dense) or learned per position pair (random), "
        "optionally factorised or mixed with dot products (Tay et al. 2021)",
        # Logits learned per head and position pair stand in for each head's keys: no sharing.
        grouped_kv=NO_GROUPED_KV,
        packing=PACKED_SPLIT,
    )
    length_option = "max_seq_len"
    # chunk_size 4: the suite's causal calls cross block boundaries of the materialised-logits path.
    test_options = {"max_seq_len": 12}
    test_variants = (
        {"max_seq_len": 12, "mode": "random", "chunk_size": 4},
        {"max_seq_len": 12, "mode": "random", "fixed": True, "mix": True, "chunk_size": 4},
        {"max_seq_len": 12, "mode": "factorized_dense", "factor": 5, "hidden": 6, "chunk_size": 4},
        {"max_seq_len": 12, "mode": "factorized_random", "factor": 3},
        {"max_seq_len": 12, "mix": True},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        mode: str = "dense",
        max_seq_len: int = 512,
        factor: int = 8,
        hidden: Optional[int] = None,
        fixed: bool = False,
        mix: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__(heads, head_dim)
        self.mode = check_choice("mode", mode, MODES)
        self.max_seq_len = check_positive_int("max_seq_len", max_seq_len)
        self.factor = check_positive_int("factor", factor)
        hidden = check_number("hidden", hidden, integer=True, minimum=1, optional=True)
        self.hidden = head_dim if hidden is None else hidden
        self.fixed = check_bool("fixed", fixed)
        self.mix = check_bool("mix", mix)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        if self.fixed and self.mode not in RANDOM_MODES:
            raise ValueError(
                f"fixed=True needs mode 'random' or 'factorized_random' (a fixed logit table), got mode={mode!r}, "
                f"whose logits come from a learned MLP"
            )

        length = self.max_seq_len
        if self.mode in ("dense", "factorized_dense"):
            outputs = length if self.mode == "dense" else self.factor + factorized_split(length, self.factor)
            self.w1 = _uniform(heads, head_dim, self.hidden, fan_in=head_dim)
            self.b1 = _uniform(heads, self.hidden, fan_in=head_dim)
            self.w2 = _uniform(heads, self.hidden, outputs, fan_in=self.hidden)
            self.b2 = _uniform(heads, outputs, fan_in=self.hidden)
        elif self.mode == "random":
            self._table("table", torch.randn(heads, length, length))
        else:
            std = self.factor ** -0.25
            self._table("left", torch.randn(heads, length, self.factor) * std)
            self._table("right", torch.randn(heads, length, self.factor) * std)
        # Softmax-normalised (w_s, w_d) = (1/2, 1/2) at the start.
        self.mix_logits = nn.Parameter(torch.zeros(heads, 2)) if self.mix else None

    def _table(self, name: str, value: Tensor) -> None:
        """A random mode's table: a parameter, or with ``fixed`` a buffer (kept in the state dict, not trained)."""
        if self.fixed:
            self.register_buffer(name, value)
        else:
            setattr(self, name, nn.Parameter(value))

    @property
    def max_length(self) -> Optional[int]:
        return self.max_seq_len

    # -- maths -------------------------------------------------------------------------------------------------
    def factors(self, q: Tensor) -> Tuple[Tensor, Tensor]:
        """For the modes whose logits are a product (dense, factorized_random): ``(left, right)`` with
        ``left @ right^T`` the logits, (batch, heads, N, r) / (heads, N, r). In float32 for half-precision q."""
        work = working_dtype(q.dtype)
        if self.mode == "dense":
            return dense_synthesizer_factors(q.to(work), *(p.to(work) for p in (self.w1, self.b1, self.w2, self.b2)))
        if self.mode == "factorized_random":
            return factorized_random_synthesizer_factors(self.left.to(work), self.right.to(work), q.shape[2])
        raise ValueError(f"mode={self.mode!r} has no factored logits")

    def logits(self, q: Tensor) -> Tensor:
        """The synthesised logits for queries q (batch, heads, N, head_dim), materialised: (batch, heads, N, N)
        for the dense modes, (heads, N, N) shared by the batch for the random ones. In float32 for
        half-precision q."""
        work = working_dtype(q.dtype)
        if self.mode in FACTORED_MODES:
            left, right = self.factors(q)
            return torch.matmul(left, right.transpose(-1, -2))
        if self.mode == "factorized_dense":
            params = (p.to(work) for p in (self.w1, self.b1, self.w2, self.b2))
            return factorized_dense_synthesizer_logits(q.to(work), *params, self.factor)
        return random_synthesizer_logits(self.table.to(work), q.shape[2])

    def mix_weights(self, dtype: torch.dtype = torch.float32) -> Optional[Tensor]:
        """(heads, 2) weights of (synthesised, dot-product) logits, summing to one, in ``dtype``; None without
        ``mix``."""
        return None if self.mix_logits is None else torch.softmax(self.mix_logits.to(dtype), dim=-1)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        mix = self.mix_weights(working_dtype(q.dtype))
        # forward() checked the inputs: the unchecked cores validate nothing twice.
        if self.mode in FACTORED_MODES:
            # The logits are a product of two thin factors: one fused attention call, no (N, N) tensor.
            left, right = self.factors(q)
            out = factored_synthesizer_attention_unchecked(q, k, v, left, right, causal, key_padding_mask, mix)
        else:
            logits = self.logits(q)
            out = synthesizer_attention_unchecked(q, k, v, logits, causal, key_padding_mask, mix, self.chunk_size)
        return out if self.mix else tied_to_unused(out, q, k)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """float64 logits from their per-element definitions, then an explicit masked, max-shifted softmax
        (:func:`attnzoo.functional.synthesizer.synthesizer_attention_reference`)."""
        params = {name: getattr(self, name) for name in ("w1", "b1", "w2", "b2", "table", "left", "right")
                  if hasattr(self, name)}
        logits = synthesized_logits_reference(self.mode, q, factor=self.factor, **params)
        mix = None
        if self.mix_logits is not None:
            w = self.mix_logits.double()
            mix = torch.exp(w) / torch.exp(w).sum(-1, keepdim=True)
        out = synthesizer_attention_reference(q, k, v, logits, causal, key_padding_mask, mix=mix)
        return out if self.mix else tied_to_unused(out, q.double(), k.double())

    def extra_repr(self) -> str:
        extra = f", factor={self.factor}" if self.mode.startswith("factorized") else ""
        extra += "" if self.mode in FACTORED_MODES else f", chunk_size={self.chunk_size}"
        hidden = f", hidden={self.hidden}" if self.mode.endswith("dense") else ""
        return (f"{super().extra_repr()}, mode={self.mode!r}, max_seq_len={self.max_seq_len}{extra}{hidden}, "
                f"fixed={self.fixed}, mix={self.mix}")
