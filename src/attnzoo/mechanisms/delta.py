"""The delta rule: ``delta`` (DeltaNet), ``gated_delta`` (Gated DeltaNet), ``kda`` (Kimi Delta Attention) and
``delta_product`` (Gated DeltaProduct: n_h delta-rule steps per position, each step's key, value and beta from
learned per-head maps of the position's key and value; :class:`DeltaProductAttention`, docs/delta_product.md).

A linear-attention state ``S`` (d_k x d_v) that each position *corrects*: the key reads what the state holds
for it and the state moves a fraction beta of the way to the new value (Schlag et al. 2021, Yang et al.
2024)::

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(d)

with ``a_t = 1`` for ``delta``, a data-dependent decay for ``gated_delta`` (Yang et al. 2025), and for ``kda``
(Kimi Team 2025) one decay per key channel, ``S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t
v_t^T``; ``delta_product`` applies n_h such corrections per position after ``gated_delta``'s decay. Queries
and keys are L2-normalised, as in the papers, so ``I - beta k k^T`` is a contraction for beta in [0, 1].

The mechanism sees only q, k and v (not the layer input the papers project beta and the gate from), so beta
and the decay are computed from the (raw, unnormalised) keys, as ``gla`` computes its gate:
``beta_t = sigmoid(k_t . w_beta + b_beta)``, one scalar per head and position.

Option ``conv_size`` (0, off, by default): DeltaNet's and Gated DeltaNet's short convolution (fla's
``ShortConvolution``): q, k and v each go through their own causal depthwise convolution of ``conv_size`` taps
per head channel and a SiLU (:mod:`attnzoo.functional.short_convolution`) before q and k are L2-normalised.
beta and the decay are still computed from the raw keys (a projection of the position's own input, as the
papers' gates are). The convolution looks back only, in either mode.

Capabilities: causal (each query reads the state after its own position) and non-causal (every query reads
the state after the whole sequence, as non-causal linear attention reads the sum over every key; the writes
still happen in sequence order). Self-attention only (the order of the writes is the keys' sequence order).
Padded positions write nothing and do not decay the state; with the convolution they enter it as zeros.
Decoding carries the (d_k x d_v) state, and with ``conv_size >= 2`` the last ``conv_size - 1`` q, k and v.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_bool, check_number, check_positive_int
from ..functional.delta import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PRODUCT_CHUNK_SIZE,
    delta_product_reference,
    delta_product_step_unchecked,
    delta_product_unchecked,
    delta_rule_reference,
    delta_rule_step_unchecked,
    delta_rule_unchecked,
)
from ..functional.gated import key_gate_logits
from ..functional.norms import unit_rows
from ..functional.short_convolution import (
    short_conv_reference,
    short_conv_state_unchecked,
    short_conv_step_unchecked,
    short_conv_unchecked,
)
from .base import OWN, PACKED_SPLIT, REPEAT_KV, Capabilities, Mechanism, StateLayout
from .registry import register

_CONVOLVED = ("q", "k", "v")

_COMPLEXITY = "time O(N c d + N d^2), memory O(N c + N d^2 / c); c = chunk_size; decoding O(d^2) per token"


class _DeltaRuleMechanism(Mechanism):
    """Shared wiring: the optional short convolutions, L2-normalised q and k, beta (and a decay) from the keys,
    the chunked, step and prefill forms of :mod:`attnzoo.functional.delta`. Decoding state:
    ``{"state": (batch, heads, head_dim, head_dim_v)}``, and with ``conv_size >= 2`` ``{"q_conv", "k_conv",
    "v_conv"}`` of (batch, conv_size - 1, heads, head_dim), the last inputs of each convolution; all in the
    working dtype (float32 for half-precision inputs)."""

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int, conv_size: int) -> None:
        super().__init__(heads, head_dim)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.conv_size = check_number("conv_size", conv_size, integer=True, minimum=0)
        self.beta_weight = nn.Parameter(torch.randn(heads, head_dim) / math.sqrt(head_dim))
        self.beta_bias = nn.Parameter(torch.zeros(heads))
        if self.conv_size:
            # torch.nn.Conv1d's default initialisation (fla's ShortConvolution keeps it): U(-1/sqrt(K), 1/sqrt(K)).
            bound = 1.0 / math.sqrt(self.conv_size)
            for name in _CONVOLVED:
                weight = torch.empty(heads, head_dim, self.conv_size).uniform_(-bound, bound)
                self.register_parameter(f"{name}_conv", nn.Parameter(weight))
            # The v convolution has one weight per channel of head_dim (the rule itself takes any value width).
            if self.capabilities.any_value_width:
                self.capabilities = self.capabilities.narrowed(f"conv_size={self.conv_size}", any_value_width=False)

    # The functional core's forms (the delta rule's; Gated DeltaProduct's take the same arguments).
    core = staticmethod(delta_rule_unchecked)
    core_step = staticmethod(delta_rule_step_unchecked)
    core_reference = staticmethod(delta_rule_reference)

    def log_decay(self, k: Tensor) -> Optional[Tensor]:
        """The log decay from the (masked, raw) keys: (B, H, N), or (B, H, N, head_dim) with one decay per key
        channel; None for the plain delta rule."""
        return None

    def write_strengths(self, k: Tensor) -> Tensor:
        """beta (B, H, N) from the (masked, raw) keys: ``sigmoid(k . w + b)``."""
        return torch.sigmoid(key_gate_logits(k, self.beta_weight, self.beta_bias))

    def written_keys_values(self, unit_k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]
                            ) -> Tuple[Tensor, Tensor]:
        """What the core writes, from the unit keys and the (convolved) values: here the keys and values
        themselves."""
        return unit_k, v

    def _conv_weights(self) -> List[Tensor]:
        """The (heads, head_dim, conv_size) weights of the q, k and v convolutions."""
        return [getattr(self, f"{name}_conv") for name in _CONVOLVED]

    def _gated_inputs(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], convolve: Callable[..., Tensor]
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
        """(unit q, unit k, v, beta, log decay) in the working dtype (v as given without the convolution).
        Padded keys are zeroed first, so that a NaN or inf they hold reaches neither beta, nor the decay, nor a
        gradient. ``convolve`` is the short convolution's form (fast, or the float64 reference), called on
        (batch, seq, heads, head_dim) views as ``convolve(name, x, weight, key_padding_mask)``, name "q", "k" or "v"."""
        dtype = working_dtype(q.dtype)
        q, k = q.to(dtype), k.to(dtype)
        if key_padding_mask is not None:
            k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        beta = self.write_strengths(k)
        log_decay = self.log_decay(k)
        if self.conv_size:
            q, k, v = (convolve(name, x.to(dtype).transpose(1, 2), weight, key_padding_mask).transpose(1, 2)
                       for name, x, weight in zip(_CONVOLVED, (q, k, v), self._conv_weights()))
        k, v = self.written_keys_values(unit_rows(k), v, key_padding_mask)
        return unit_rows(q), k, v, beta, log_decay

    @staticmethod
    def _fast_conv(name: str, x: Tensor, weight: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        return short_conv_unchecked(x, weight, None, True, key_padding_mask, None)

    @staticmethod
    def _reference_conv(name: str, x: Tensor, weight: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        return short_conv_reference(x, weight, silu=True, key_padding_mask=key_padding_mask)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        unit_q, unit_k, v_, beta, log_decay = self._gated_inputs(q, k, v, key_padding_mask, self._fast_conv)
        out, _ = self.core(unit_q, unit_k, v_, beta, log_decay, key_padding_mask, None, causal, self.chunk_size)
        return out.to(q.dtype)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """The per-position recurrence in float64 (:func:`attnzoo.functional.delta.delta_rule_reference`),
        with the convolutions (:func:`~attnzoo.functional.short_convolution.short_conv_reference`), beta and
        the decay computed from the float64 inputs by the same definitions."""
        unit_q, unit_k, v_, beta, log_decay = self._gated_inputs(q.double(), k.double(), v.double(),
                                                                 key_padding_mask, self._reference_conv)
        return self.core_reference(unit_q, unit_k, v_, beta, log_decay, causal=causal,
                                   key_padding_mask=key_padding_mask)

    def state_layout(self, dtype: torch.dtype, value_width: Optional[int] = None) -> StateLayout:
        working = working_dtype(dtype)
        layout = {"state": ((self.heads, self.head_dim, self.value_width(value_width)), working)}
        if self.conv_size > 1:
            window = (self.conv_size - 1, self.heads, self.head_dim)
            layout.update({f"{name}_conv": (window, working) for name in _CONVOLVED})
        return layout

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        unit_q, unit_k, v_, beta, log_decay = self._gated_inputs(q, k, v, None, self._fast_conv)
        out, state = self.core(unit_q, unit_k, v_, beta, log_decay, None, None, True, self.chunk_size)
        tensors = {"state": state}
        if self.conv_size > 1:
            dtype = working_dtype(q.dtype)
            tensors.update({f"{name}_conv": short_conv_state_unchecked(x.to(dtype).transpose(1, 2), self.conv_size)
                            for name, x in zip(_CONVOLVED, (q, k, v))})
        return out.to(q.dtype), tensors

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        windows: Dict[str, Tensor] = {}

        def convolve_step(name: str, x: Tensor, weight: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
            previous = None if tensors is None or self.conv_size == 1 else tensors[f"{name}_conv"]
            out, windows[name] = short_conv_step_unchecked(x, previous, weight, None, True)
            return out

        unit_q, unit_k, v_, beta, log_decay = self._gated_inputs(q_t, k_t, v_t, None, convolve_step)
        previous = None if tensors is None else tensors["state"]
        out, state = self.core_step(unit_q, unit_k, v_, beta, log_decay, previous)
        new = {"state": state}
        if self.conv_size > 1:
            new.update({f"{name}_conv": window for name, window in windows.items()})
        return out.to(q_t.dtype), new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}" + (
            f", conv_size={self.conv_size}" if self.conv_size else "")


@register
class DeltaNetAttention(_DeltaRuleMechanism):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule on L2-normalised queries and keys, with
    ``beta_t = sigmoid(k_t . w_h + b_h)`` from the key (see the module docstring), chunked by the WY / UT
    representation, O(d^2) per decoded token.

    Options:
        chunk_size: chunk length of the parallel form.
        conv_size: taps of the short causal convolutions on q, k and v (with SiLU) before the normalisation,
            as the paper's layer has them (4 there); 0 (the default): none.
    """

    name = "delta"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity=_COMPLEXITY,
        summary="DeltaNet: the delta rule on a linear-attention state, chunked WY form (Yang et al. 2024)",
        # beta is learned per query head, so a key/value head's state differs per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_SPLIT,
    )
    test_options = {"chunk_size": 4}  # the suite's lengths cross several chunk boundaries
    test_variants = ({"chunk_size": 4, "conv_size": 3},)

    def __init__(
        self, heads: int, head_dim: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE, conv_size: int = 0
    ) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size, conv_size=conv_size)


def _initial_decay(heads: int) -> Tuple[Tensor, Tensor]:
    """Mamba-2's starting decay parameters over the heads: ``A_log = log(linspace(1, 16))`` and ``dt_bias``, the
    inverse softplus of steps from 0.001 to 0.1 (geometric), so heads start with memories from about a thousand
    positions down to a few."""
    steps = torch.logspace(math.log10(0.001), math.log10(0.1), heads)
    return torch.linspace(1.0, 16.0, heads).log(), steps + torch.log(-torch.expm1(-steps))


class _GatedDeltaRuleMechanism(_DeltaRuleMechanism):
    """The delta rule with Gated DeltaNet's decay from the keys (:class:`GatedDeltaNetAttention` has its
    parametrisation and initialisation)."""

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int, conv_size: int) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size, conv_size=conv_size)
        self.decay_weight = nn.Parameter(torch.randn(heads, head_dim) / math.sqrt(head_dim))
        a_log, dt_bias = _initial_decay(heads)
        self.A_log, self.dt_bias = nn.Parameter(a_log), nn.Parameter(dt_bias)  # softplus(dt_bias): the steps

    def log_decay(self, k: Tensor) -> Tensor:
        # softplus(z) written as -logsigmoid(-z) (the same numbers): softplus's backward fails under
        # torch.compile's AOTAutograd for gates computed from permuted keys.
        minus_step = F.logsigmoid(-key_gate_logits(k, self.decay_weight, self.dt_bias))
        return self.A_log.to(minus_step.dtype).exp().unsqueeze(-1) * minus_step


@register
class GatedDeltaNetAttention(_GatedDeltaRuleMechanism):
    """Gated DeltaNet (Yang et al. 2025): the delta rule with a data-dependent scalar decay per head and
    position, ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``.

    The decay follows Mamba-2's parametrisation, as Gated DeltaNet does, computed from the raw key (the
    mechanism sees only q, k, v): ``log a_t = -exp(A_log_h) * softplus(k_t . w_h + dt_bias_h)``, so
    ``a_t`` is in (0, 1] for any parameters. ``A_log`` starts at ``log(linspace(1, 16))`` over the heads and
    ``dt_bias`` at the inverse softplus of steps from 0.001 to 0.1 (geometric over the heads), so heads start
    with memories from about a thousand positions down to a few; both are learned. beta as in ``delta``.

    Options:
        chunk_size: chunk length of the parallel form.
        conv_size: taps of the short causal convolutions on q, k and v (with SiLU) before the normalisation,
            as the paper's layer has them (4 there); 0 (the default): none.
    """

    name = "gated_delta"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity=_COMPLEXITY,
        summary="Gated DeltaNet: the delta rule with a data-dependent decay, chunked WY form (Yang et al. 2025)",
        # beta and the decay are learned per query head, so a key/value head's state differs per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_SPLIT,
    )
    test_options = {"chunk_size": 4}  # the suite's lengths cross several chunk boundaries
    test_variants = ({"chunk_size": 4, "conv_size": 3},)

    def __init__(
        self, heads: int, head_dim: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE, conv_size: int = 0
    ) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size, conv_size=conv_size)


@register
class KimiDeltaAttention(_DeltaRuleMechanism):
    """Kimi Delta Attention (KDA; Kimi Team 2025, "Kimi Linear"): the gated delta rule with one decay per key
    channel, ``S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t v_t^T``, chunked by the WY / UT
    representation (:mod:`attnzoo.functional.delta`, the per-channel products in its ``channels`` module).

    KDA's gate, computed from the raw key (the mechanism sees only q, k, v; the paper's layer projects it from
    the layer input): a low-rank map per head, ``z_t = k_t W_down W_up`` (head_dim -> ``gate_rank`` ->
    head_dim), then ``log a_t = -exp(A_log_h) * softplus(z_t + dt_bias_h)``, per channel, so every ``a_t`` is in
    (0, 1]. ``A_log`` and ``dt_bias`` start as in ``gated_delta`` (the same value for every channel of a head);
    beta as in ``delta``.

    Options:
        chunk_size: chunk length of the parallel form.
        conv_size: taps of the short causal convolutions on q, k and v (with SiLU) before the normalisation,
            as the paper's layer has them (4 there); 0 (the default): none.
        gate_rank: the rank of the gate's map from the key (fla's layer uses the value head width, from the
            whole hidden state; here the map is per head, from head_dim channels).
    """

    name = "kda"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N c d log c + N d^2), memory O(N c + N d^2 / c); c = chunk_size; decoding O(d^2) per token",
        summary="Kimi Delta Attention: the gated delta rule with a decay per key channel, chunked (Kimi Team 2025)",
        # beta and the decay are learned per query head, so a key/value head's state differs per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_SPLIT,
    )
    test_options = {"chunk_size": 4, "gate_rank": 3}  # the suite's lengths cross several chunk boundaries
    test_variants = ({"chunk_size": 4, "gate_rank": 3, "conv_size": 3},)

    def __init__(
        self, heads: int, head_dim: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE, conv_size: int = 0,
        gate_rank: int = 16,
    ) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size, conv_size=conv_size)
        self.gate_rank = check_positive_int("gate_rank", gate_rank)
        self.gate_down = nn.Parameter(torch.randn(heads, head_dim, self.gate_rank) / math.sqrt(head_dim))
        self.gate_up = nn.Parameter(torch.randn(heads, self.gate_rank, head_dim) / math.sqrt(self.gate_rank))
        a_log, dt_bias = _initial_decay(heads)
        self.A_log = nn.Parameter(a_log)
        self.dt_bias = nn.Parameter(dt_bias.unsqueeze(-1).repeat(1, head_dim))

    def log_decay(self, k: Tensor) -> Tensor:
        """(B, H, N, head_dim) log decay per key channel from the (masked, raw) keys."""
        dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
        down, up = self.gate_down.to(dtype), self.gate_up.to(dtype)
        # softplus(z) written as -logsigmoid(-z), as in gated_delta (softplus's backward fails under
        # torch.compile's AOTAutograd for gates computed from permuted keys). -z is formed directly, the up map
        # and dt_bias negated (small tensors) and added in place: the same numbers, as a negation is exact, with
        # no pass over the (B, H, N, d) logits to negate them nor their gradient.
        minus_logits = torch.einsum("bhnr,hrd->bhnd", torch.einsum("bhnd,hdr->bhnr", k.to(dtype), down), -up)
        minus_step = F.logsigmoid(minus_logits.add_(-self.dt_bias.to(dtype).unsqueeze(1)))
        return self.A_log.to(dtype).exp()[:, None, None] * minus_step

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gate_rank={self.gate_rank}"


@register
class DeltaProductAttention(_GatedDeltaRuleMechanism):
    """Gated DeltaProduct (Siems et al. 2025): Gated DeltaNet with ``householder_steps`` (n_h) delta-rule steps
    per position, the state decayed once and then corrected by each step in order,
    ``S_t = (prod_j (I - beta_{t,j} k_{t,j} k_{t,j}^T)) a_t S_{t-1} + ...`` (:mod:`attnzoo.functional.delta.product`).

    The paper projects each step's key, value and beta from the layer input; the mechanism sees q, k, v, so
    the later steps' come from learned per-head maps of the position's own key and value
    (docs/delta_product.md): the first step writes ``normalize(k_t)`` and ``v_t`` as ``gated_delta`` does (a
    map there would repeat the layer's own key and value projections), step j >= 2 ``k_{t,j} =
    normalize(W_j k_t)`` and ``v_{t,j} = U_j v_t`` (W_j, U_j (head_dim x head_dim) per head, after the short
    convolution; on the unit key, which the normalisation makes the same), every step
    ``beta_{t,j} = sigmoid(k_t . w_j + b_j)`` from the raw key, and the decay as ``gated_delta``. So
    ``householder_steps=1`` is ``gated_delta`` at equal parameters. The maps start at the identity plus
    Gaussian noise of std ``1 / sqrt(head_dim)``, so that the steps start distinct.

    Options:
        householder_steps: n_h, the delta-rule (generalised Householder) steps per position.
        negative_eigenvalues: beta in (0, 2) (``2 sigmoid``) instead of (0, 1), so each step's transition
            ``I - beta k k^T`` may reflect (eigenvalue down to -1), as fla's ``allow_neg_eigval``; the paper's
            state-tracking results use it. Off by default.
        chunk_size: positions per chunk of the parallel form (``chunk_size * householder_steps`` steps); 16 by
            default, 32 steps at two steps per position.
        conv_size: as ``gated_delta``: short causal convolutions on q, k and v (with SiLU); 0: none.
    """

    name = "delta_product"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N n_h c d + N n_h d^2), memory O(N n_h c + N n_h d^2 / c); n_h = householder_steps, "
                   "c = chunk_size; decoding O(n_h d^2) per token",
        summary="Gated DeltaProduct: n_h delta-rule steps per token on Gated DeltaNet's state (Siems et al. 2025)",
        # beta, the decay and the step maps are learned per query head: a key/value head's state differs per
        # query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_SPLIT,
    )
    # The suite's lengths cross several chunk boundaries with either chunk (of 4 and 3 positions).
    test_options = {"chunk_size": 4, "householder_steps": 2}
    test_variants = ({"chunk_size": 3, "householder_steps": 1},
                     {"chunk_size": 4, "householder_steps": 3, "conv_size": 3, "negative_eigenvalues": True})

    core = staticmethod(delta_product_unchecked)
    core_step = staticmethod(delta_product_step_unchecked)
    core_reference = staticmethod(delta_product_reference)

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        householder_steps: int = 2,
        negative_eigenvalues: bool = False,
        chunk_size: int = DEFAULT_PRODUCT_CHUNK_SIZE,
        conv_size: int = 0,
    ) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size, conv_size=conv_size)
        steps = self.householder_steps = check_positive_int("householder_steps", householder_steps)
        self.negative_eigenvalues = check_bool("negative_eigenvalues", negative_eigenvalues)
        # One row of beta weights per step (gated_delta's are the first step's).
        self.beta_weight = nn.Parameter(torch.randn(heads, steps, head_dim) / math.sqrt(head_dim))
        self.beta_bias = nn.Parameter(torch.zeros(heads, steps))
        if steps > 1:  # the maps W_j, U_j of steps 2 .. n_h
            for name in ("key_maps", "value_maps"):
                noise = torch.randn(heads, steps - 1, head_dim, head_dim) / math.sqrt(head_dim)
                self.register_parameter(name, nn.Parameter(torch.eye(head_dim) + noise))
            if self.capabilities.any_value_width:  # U_j maps v's channels: v must be head_dim wide
                self.capabilities = self.capabilities.narrowed(f"householder_steps={steps}", any_value_width=False)

    def write_strengths(self, k: Tensor) -> Tensor:
        """beta (B, H, N, n_h) from the (masked, raw) keys, in (0, 1), or (0, 2) with negative_eigenvalues."""
        logits = torch.einsum("bhnd,hjd->bhnj", k, self.beta_weight.to(k.dtype))
        logits = logits + self.beta_bias.to(k.dtype)[:, None]
        return 2 * torch.sigmoid(logits) if self.negative_eigenvalues else torch.sigmoid(logits)

    def written_keys_values(self, unit_k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]
                            ) -> Tuple[Tensor, Tensor]:
        """Each step's unit key (B, H, N, n_h, d): ``k`` then ``normalize(W_j k)``, and value (B, H, N, n_h, d_v):
        ``v`` then ``U_j v``."""
        if self.householder_steps == 1:
            return unit_k.unsqueeze(3), v.unsqueeze(3)
        if key_padding_mask is not None:  # a NaN there would reach U_j's gradient (0 * NaN)
            v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        v = v.to(unit_k.dtype)
        keys = unit_rows(torch.einsum("bhnd,hjed->bhnje", unit_k, self.key_maps.to(unit_k.dtype)))
        values = torch.einsum("bhnd,hjed->bhnje", v, self.value_maps.to(v.dtype))
        return torch.cat([unit_k.unsqueeze(3), keys], dim=3), torch.cat([v.unsqueeze(3), values], dim=3)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, householder_steps={self.householder_steps}" + (
            ", negative_eigenvalues=True" if self.negative_eigenvalues else "")
