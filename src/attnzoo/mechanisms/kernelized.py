"""Kernelized attention: ``phi(q) (phi(k)^T v)`` in O(N) time and memory, and an RNN at decoding time.

``performer`` (FAVOR+ random features for the softmax kernel), ``linear`` (elu + 1) and ``rfa`` (random
feature attention, optionally gated). All share :class:`KernelizedMechanism`, which the decayed/gated family
in :mod:`attnzoo.mechanisms.gated` builds on too.
"""

from __future__ import annotations

import math
from typing import ClassVar, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_bool, check_choice, check_number, check_positive_int
from ..feature_maps import (
    EluFeatureMap,
    FavorPositiveFeatures,
    FavorTrigFeatures,
    FeatureMap,
    HedgehogFeatureMap,
    RandomFeatureMap,
    ReluFeatureMap,
)
from ..functional.gated import key_gate_logits, rfa_gates
from ..functional.grouped import grouped_query_attention, grouped_rows, per_query_group, ungrouped_rows
from ..functional.norms import unit_rows
from ..functional.shrinkage import shrunk_kernel_attention_reference, shrunk_kernel_attention_unchecked
from ..functional.state_scan import LinearTerms
from ..functional.linear import (
    DEFAULT_CHUNK_SIZE,
    SIGNED_DENOMINATOR_EPS,
    kernel_attention_prefill_unchecked,
    kernel_attention_reference,
    kernel_attention_step_unchecked,
    kernel_attention_unchecked,
    packed_causal_kernel_attention_unchecked,
)
from .base import (
    APPROXIMATE,
    NATIVE_KV,
    OWN,
    PACKED_NATIVE,
    PACKED_SPLIT,
    REPEAT_KV,
    Capabilities,
    Mechanism,
    StateLayout,
    seeded_generator,
)
from .registry import register


class KernelizedMechanism(Mechanism):
    """Shared wiring of the kernelized family: subclasses say how to get features and (optionally) decays.

    Subclasses implement :meth:`features` and may override :meth:`log_decay`, or ``_keys`` to weight each key
    by a gate as well (returning the weighted key features and the log decays, as gated ``rfa`` does). The
    parallel, chunked-causal, prefill and step paths then all follow from the same functions of
    :mod:`attnzoo.functional.linear`, so step equals parallel by construction.

    Decoding state: ``{"kv": (batch, heads, m, head_dim_v + 1), "log_scale": (batch, heads, 1, 1)}`` (float32
    for half-precision inputs), of constant size whatever the context length; m = :attr:`feature_dim`.

    Grouped keys/values (``kv_heads`` < ``heads``, for a subclass declaring ``grouped_kv="native"``: its key
    features and decays depend on the key head alone): one ``phi(k)^T [v, 1]`` state per key/value head, which
    its query heads read (:mod:`attnzoo.functional.grouped`); the decoding state holds ``kv_heads`` heads.
    """

    normalizer: str = "sum"

    def __init__(self, heads: int, head_dim: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(heads, head_dim)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)

    # -- what subclasses define -------------------------------------------------------------------------------
    @property
    def feature_dim(self) -> int:
        """m, the number of features per query and key (the width of the decoding state)."""
        return self.head_dim

    def features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], cross: bool = False
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """(phi_q (B, H, Nq, m), phi_k (B, H, Nk, m), key log scale (B, H, 1, 1) or None). ``cross`` says
        whether k comes from another sequence than q (features fitted to both need to know)."""
        raise NotImplementedError

    def log_decay(self, k: Tensor) -> Optional[Tensor]:
        """(B, H, N) per-position log decay, or None for plain linear attention."""
        return None

    def reference_features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, cross: bool = False
    ) -> Tuple[Tensor, Tensor]:
        """Unstabilised float64 features (phi_q, phi_k) for :meth:`reference`, from the definitions."""
        raise NotImplementedError

    @property
    def denominator_eps(self) -> float:
        return 0.0

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        """Quadratic float64 form: the (seq_q, seq_kv) matrix of ``phi(q_i) . phi(k_j)`` times the decays,
        masked, normalised (:func:`attnzoo.functional.kernel_attention_reference`)."""
        q, k, v = q.double(), k.double(), v.double()
        phi_q, phi_k = self.reference_features(q, k, key_padding_mask, cross)
        phi_k, log_decay = self._keys(k, phi_k)
        return kernel_attention_reference(
            phi_q,
            phi_k,
            v,
            causal,
            key_padding_mask,
            log_decay=log_decay,
            normalizer=self.normalizer,
            denominator_eps=self.denominator_eps,
        )

    def attend_linear_terms(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor]) -> LinearTerms:
        phi_q, phi_k, key_log_scale = self.features(q, k, key_padding_mask)
        phi_k, log_decay = self._keys(k, phi_k)
        return LinearTerms(phi_q, phi_k, key_log_scale, log_decay, self.normalizer, self.chunk_size,
                           self.denominator_eps)

    # -- shared paths -----------------------------------------------------------------------------------------
    def _keys(self, k: Tensor, phi_k: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """Hook for mechanisms that weight each key by a gate: returns (phi_k, log_decay)."""
        return phi_k, self.log_decay(k)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        phi_q, phi_k, _ = self.features(q, k, key_padding_mask, cross)
        phi_k, log_decay = self._keys(k, phi_k)

        # Inputs were checked by forward(); the features and decays are computed from them.
        def attend_features(queries: Tensor, masked: bool) -> Tensor:
            return kernel_attention_unchecked(
                queries, phi_k, v, masked, key_padding_mask, log_decay, self.normalizer, self.chunk_size,
                self.denominator_eps,
            )

        if k.shape[1] != q.shape[1]:
            return grouped_query_attention(attend_features, phi_q, k.shape[1], causal)
        return attend_features(phi_q, causal)

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]]) -> Tensor:
        # "native": causal, one chunked pass over the row with the state reset at document starts. Non-causal,
        # and for features fitted to the whole row (performer's stabiliser): each document alone.
        if not causal or self.capabilities.packing != PACKED_NATIVE:
            return super().attend_packed(q, k, v, causal, spans)
        phi_q, phi_k, _ = self.features(q, k, None)
        phi_k, log_decay = self._keys(k, phi_k)
        return packed_causal_kernel_attention_unchecked(
            phi_q, phi_k, v, spans, log_decay, self.normalizer, self.chunk_size, self.denominator_eps
        )

    def state_layout(
        self, dtype: torch.dtype, kv_heads: Optional[int] = None, value_width: Optional[int] = None
    ) -> StateLayout:
        kv_heads = self.heads if kv_heads is None else kv_heads
        return {
            "kv": ((kv_heads, self.feature_dim, self.value_width(value_width) + 1), working_dtype(dtype)),
            "log_scale": ((kv_heads, 1, 1), working_dtype(dtype)),
        }

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        phi_q, phi_k, key_log_scale = self.features(q, k, None)
        phi_k, log_decay = self._keys(k, phi_k)
        states = []

        def prefill(queries: Tensor) -> Tensor:
            out, state = kernel_attention_prefill_unchecked(
                queries, phi_k, v, key_log_scale, log_decay, self.normalizer, self.chunk_size, self.denominator_eps
            )
            states.append(state)  # the same state for every query head of a group: it reads the keys alone
            return out

        if k.shape[1] != q.shape[1]:
            return per_query_group(prefill, phi_q, k.shape[1]), states[-1]
        return prefill(phi_q), states[-1]

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        phi_q, phi_k, key_log_scale = self.features(q_t, k_t, None)
        phi_k, log_decay = self._keys(k_t, phi_k)
        heads, kv_heads = q_t.shape[1], k_t.shape[1]
        # One position: a group's queries read their key/value head's state as rows of one query.
        out, state = kernel_attention_step_unchecked(
            grouped_rows(phi_q, kv_heads), phi_k, v_t, tensors, key_log_scale, log_decay, self.normalizer,
            self.denominator_eps,
        )
        return ungrouped_rows(out, heads), state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"


class _FeatureMapMechanism(KernelizedMechanism):
    """A kernelized mechanism whose features come from one :class:`FeatureMap` module."""

    feature_map: FeatureMap

    def key_map(self) -> FeatureMap:
        """The map of the keys: :attr:`feature_map`, which the queries use too, unless a subclass learns a
        map of each."""
        return self.feature_map

    def features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], cross: bool = False
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        phi_k, key_log_scale = self.key_map().key_features(k, key_padding_mask)
        return self.feature_map.query_features(q), phi_k, key_log_scale

    def reference_features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, cross: bool = False
    ) -> Tuple[Tensor, Tensor]:
        return self.feature_map(q), self.key_map()(k)

    @property
    def denominator_eps(self) -> float:
        return 0.0 if self.feature_map.positive else SIGNED_DENOMINATOR_EPS


class _RandomFeatureMechanism(_FeatureMapMechanism):
    """Explicit, seeded control of the random projection; nothing changes it during a forward pass."""

    feature_map: RandomFeatureMap

    @property
    def feature_dim(self) -> int:
        return self.feature_map.nb_features

    def update_after_step(self, step: int, seed: int) -> None:
        """The training hook: count the step on the feature map, which redraws every ``redraw_interval`` steps
        from a generator seeded by ``(seed, step)``
        (:meth:`~attnzoo.feature_maps.RandomFeatureMap.after_optimizer_step`)."""
        self.feature_map.after_optimizer_step(step, seed)


@register
class PerformerAttention(_RandomFeatureMechanism):
    """Performer (Choromanski et al. 2021): FAVOR+ positive random features approximating softmax attention.

    Options:
        nb_features: number of random features m (cost grows linearly in it, error falls as 1/sqrt(m)).
        orthogonal: block-orthogonal projections (lower variance than iid Gaussian ones).
        symmetric: antithetic pairs ``exp(w.x), exp(-w.x)`` (the paper's hyperbolic features), using
            ``nb_features / 2`` projections: lower error at the same cost. ``nb_features`` must then be even.
        redraw_interval: redraw the projection every that many optimiser steps taken in training mode (the
            training hook :meth:`after_optimizer_step`, which a training loop calls); None: only an explicit
            ``feature_map.redraw(generator)`` changes it.
        seed: seed of the initial projection (the global RNG when None).
        chunk_size: chunk length of the causal path.
        shrinkage: shrink each output row towards the mean of the values by the noise of the estimate,
            measured from two independent halves of the features (positive-part James-Stein, see
            :mod:`attnzoo.functional.shrinkage`). A biased estimator with much lower error where the
            unbiased one is noisy (higher temperatures, fewer features); it reads the whole key sequence, so
            with it the mechanism is non-causal only (no causal=True, no step or prefill).
        optimal_features: FAVOR++ (Likhosherstov et al. 2022): the free parameter of the positive features
            is chosen per batch and head from the statistics of q and k to minimise the variance of the kernel
            estimate (:meth:`attnzoo.feature_maps.FavorPositiveFeatures.optimal_quadratic`). Still unbiased,
            lower error at the same cost; the statistics cover the whole sequence, so non-causal only.

    The projection is a buffer: saved with the model, identical after reloading. The stabiliser divides
    each query row by its largest feature and all keys of a head by their largest feature; both cancel
    exactly in the output, so it never flattens attention towards uniform as an added constant would.

    Measured error (``scripts/favor_error_table.py``, docs/benchmarks.md): relative to exact softmax, 256
    features, N=1024, head dim 64, logits of standard deviation 0.25 / 0.5 / 1: 0.39 / 1.61 / 4.19 by
    default, 0.20 / 0.63 / 1.81 with ``optimal_features=True, shrinkage=True``; uniform attention (the mean
    of v) scores 0.24 / 0.45 / 0.80 there.
    """

    name = "performer"
    capabilities = Capabilities(
        causal=True,
        cross=True,
        key_padding=True,
        recurrent_step=True,
        kind=APPROXIMATE,
        complexity="time O(N m d), memory O(N (m + d)); m = nb_features; decoding O(m d) per token",
        summary="FAVOR+ positive orthogonal random features for the softmax kernel (Choromanski et al. 2021)",
        grouped_kv=NATIVE_KV,
        packing=PACKED_SPLIT,
        causal_rows=True,
        linear_recurrence=True,
    )
    sweep_option = "nb_features"
    test_options: ClassVar[Dict[str, object]] = {"nb_features": 32, "seed": 0, "chunk_size": 4}
    test_variants: ClassVar[Tuple[Dict[str, object], ...]] = (
        {"nb_features": 32, "seed": 0, "chunk_size": 4, "shrinkage": True},
        {"nb_features": 32, "seed": 0, "chunk_size": 4, "optimal_features": True},
        {"nb_features": 32, "seed": 0, "chunk_size": 4, "optimal_features": True, "shrinkage": True},
        # redraw_interval: the training hooks' conformance checks see a redraw (eval-mode checks never do).
        {"nb_features": 32, "seed": 0, "chunk_size": 4, "orthogonal": False, "symmetric": False,
         "redraw_interval": 1},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        nb_features: int = 256,
        orthogonal: bool = True,
        symmetric: bool = True,
        redraw_interval: Optional[int] = None,
        seed: Optional[int] = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        shrinkage: bool = False,
        optimal_features: bool = False,
    ) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size)
        self.shrinkage = check_bool("shrinkage", shrinkage)
        self.optimal_features = check_bool("optimal_features", optimal_features)
        self.feature_map = FavorPositiveFeatures(
            head_dim,
            nb_features,
            symmetric=check_bool("symmetric", symmetric),
            orthogonal=check_bool("orthogonal", orthogonal),
            redraw_interval=redraw_interval,
            generator=seeded_generator(seed),
        )
        if self.shrinkage:
            self.feature_map.second_half()  # fails now, naming nb_features, if there are too few to split
        # Both options read the whole sequence, so neither a causal mask nor a recurrent step can honour them.
        whole_sequence = [f"{name}=True" for name in ("shrinkage", "optimal_features") if getattr(self, name)]
        if whole_sequence:
            # Their statistics (FAVOR++'s per-head coefficient, shrinkage's halves) pair each query head with
            # its own keys: grouped keys/values are repeated for them.
            self.capabilities = self.capabilities.narrowed(
                " and ".join(whole_sequence), causal=False, recurrent_step=False, grouped_kv=REPEAT_KV
            )

    def _quadratic(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Optional[Tensor]:
        """FAVOR++'s coefficient A (batch, heads, 1, 1) with ``optimal_features``, else None (FAVOR+)."""
        if not self.optimal_features:
            return None
        return self.feature_map.optimal_quadratic(q, k, key_padding_mask, self_attention=not cross)

    def features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], cross: bool = False
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        quadratic = self._quadratic(q, k, key_padding_mask, cross)
        phi_k, key_log_scale = self.feature_map.key_features(k, key_padding_mask, quadratic)
        return self.feature_map.query_features(q, quadratic), phi_k, key_log_scale

    def reference_features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, cross: bool = False
    ) -> Tuple[Tensor, Tensor]:
        quadratic = self._quadratic(q, k, key_padding_mask, cross)
        return self.feature_map(q, quadratic), self.feature_map(k, quadratic)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        if not self.shrinkage:
            return super().attend(q, k, v, causal, key_padding_mask, cross)
        phi_q, phi_k, _ = self.features(q, k, key_padding_mask, cross)
        return shrunk_kernel_attention_unchecked(phi_q, phi_k, v, self.feature_map.second_half(), key_padding_mask)

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        if not self.shrinkage:
            return super().attend_reference(q, k, v, causal, key_padding_mask, cross)
        phi_q, phi_k = self.reference_features(q.double(), k.double(), key_padding_mask, cross)
        return shrunk_kernel_attention_reference(phi_q, phi_k, v, self.feature_map.second_half(), key_padding_mask)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shrinkage={self.shrinkage}, optimal_features={self.optimal_features}"


@register
class LinearAttention(_FeatureMapMechanism):
    """Linear transformer (Katharopoulos et al. 2020): ``phi(x) = elu(x) + 1``.

    Not an approximation of softmax attention but an attention of its own (``kind="own"``), with the positive
    kernel ``phi(q) . phi(k)``.

    Options: ``feature_map`` (``"elu"``, ``"relu"`` or ``"hedgehog"``), ``feature_dim`` (``"hedgehog"`` only),
    ``chunk_size`` (causal path).

    ``feature_map="hedgehog"`` (Zhang et al. 2024, "The Hedgehog & the Porcupine"): learned softmax features
    ``[softmax(x W_h + b_h), softmax(-(x W_h + b_h))]``, one :class:`~attnzoo.feature_maps.HedgehogFeatureMap`
    for the queries (``feature_map``) and one for the keys (``key_feature_map``), each of ``feature_dim``
    projections per head (head_dim by default, starting as the identity), so ``2 * feature_dim`` features and
    a decoding state of that many rows. The maps are per query head: grouped keys and values are repeated
    (``grouped_kv="repeat"``).
    """

    name = "linear"
    capabilities = Capabilities(
        causal=True,
        cross=True,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N d^2), memory O(N d); decoding O(d^2) per token",
        summary="linear transformer, elu(x)+1 feature map, chunked causal path (Katharopoulos et al. 2020)",
        grouped_kv=NATIVE_KV,
        packing=PACKED_NATIVE,
        causal_rows=True,
        linear_recurrence=True,
    )
    # chunk_size 4: the suite's lengths (up to 11) cross several chunk boundaries of the causal path.
    test_options: ClassVar[Dict[str, object]] = {"chunk_size": 4}
    test_variants: ClassVar[Tuple[Dict[str, object], ...]] = (
        {"feature_map": "relu", "chunk_size": 4},
        {"feature_map": "hedgehog", "chunk_size": 4},
        {"feature_map": "hedgehog", "feature_dim": 3, "chunk_size": 4},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        feature_map: str = "elu",
        feature_dim: Optional[int] = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size)
        maps = {"elu": EluFeatureMap, "relu": ReluFeatureMap}
        feature_dim = check_number("feature_dim", feature_dim, integer=True, minimum=1, optional=True)
        if check_choice("feature_map", feature_map, [*maps, "hedgehog"]) != "hedgehog":
            if feature_dim is not None:
                raise ValueError(f"feature_dim sets the projections of feature_map='hedgehog'; feature_map="
                                 f"{feature_map!r} has head_dim features, got feature_dim={feature_dim}")
            self.feature_map = maps[feature_map]()
            return
        self.feature_map = HedgehogFeatureMap(heads, head_dim, feature_dim)
        self.key_feature_map = HedgehogFeatureMap(heads, head_dim, feature_dim)
        # The learned maps are per query head: each query head's keys go through its own map.
        self.capabilities = self.capabilities.narrowed("feature_map='hedgehog'", grouped_kv=REPEAT_KV)

    def key_map(self) -> FeatureMap:
        return getattr(self, "key_feature_map", self.feature_map)

    @property
    def feature_dim(self) -> int:
        """Features per query and key: ``2 * feature_dim`` with Hedgehog's maps, head_dim otherwise."""
        if isinstance(self.feature_map, HedgehogFeatureMap):
            return self.feature_map.nb_features
        return self.head_dim


@register
class RandomFeatureAttention(_RandomFeatureMechanism):
    """Random feature attention (Peng et al. 2021), optionally gated.

    Queries and keys are scaled to unit length, so ``exp(s q.k)`` is a Gaussian kernel of width
    ``1/sqrt(s)`` (s = ``sharpness``, learned per head) that trigonometric random features estimate without
    the norm factors that make them unstable on raw inputs. It approximates softmax attention over the
    cosine similarities of q and k with a learned temperature, not over ``q . k / sqrt(d)``: an attention of its
    own (``kind="own"``), whose distance from exact softmax attention is no approximation error.

    Options:
        nb_features: number of features (sin and cos of ``nb_features / 2`` projections; must be even).
        orthogonal, redraw_interval, seed, chunk_size: as for ``performer``.
        sharpness: initial inverse temperature s of the cosine logits (learned per head), a finite number > 0.
            Small values keep the trigonometric estimate well conditioned (its noise grows as exp(s) against
            kernel values down to exp(-s)); training sharpens it where the data allows.
        gated: a learned recency gate ``g_t = sigmoid(k_t . w + b)`` per head and position, as in RFA-Gate:
            ``S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T``. With it the mechanism weights keys by their
            distance, so it needs queries and keys from one sequence: the instance's capabilities say
            ``cross=False``. Non-causal use applies the gates in both directions.
    """

    name = "rfa"
    capabilities = Capabilities(
        causal=True,
        cross=True,
        key_padding=True,
        recurrent_step=True,
        kind=OWN,
        complexity="time O(N m d), memory O(N (m + d)); m = nb_features; decoding O(m d) per token",
        summary="random feature attention: trigonometric features on unit q, k, optional gate (Peng et al. 2021)",
        # The learned sharpness (and gate) is per query head and scales the keys: one state per query head.
        grouped_kv=REPEAT_KV,
        packing=PACKED_NATIVE,
        causal_rows=True,
        linear_recurrence=True,
    )
    # Trigonometric features can sum to a normaliser near zero, where rounding is amplified; 64 features keep
    # the small test problems well conditioned.
    test_options: ClassVar[Dict[str, object]] = {"nb_features": 64, "seed": 0, "chunk_size": 4}
    test_variants: ClassVar[Tuple[Dict[str, object], ...]] = (
        {"nb_features": 64, "seed": 0, "chunk_size": 4, "gated": True},
        {"nb_features": 64, "seed": 0, "chunk_size": 4, "orthogonal": False, "redraw_interval": 1},
    )

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        nb_features: int = 128,
        orthogonal: bool = True,
        sharpness: float = 1.0,
        gated: bool = False,
        redraw_interval: Optional[int] = None,
        seed: Optional[int] = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__(heads, head_dim, chunk_size=chunk_size)
        sharpness = check_number("sharpness", sharpness, minimum=0.0, exclusive_minimum=True)
        self.feature_map = FavorTrigFeatures(
            head_dim,
            nb_features,
            orthogonal=check_bool("orthogonal", orthogonal),
            input_scale=1.0,
            redraw_interval=redraw_interval,
            generator=seeded_generator(seed),
        )
        self.log_sharpness = nn.Parameter(torch.full((heads,), math.log(sharpness)))
        self.gated = check_bool("gated", gated)
        if self.gated:
            self.gate_weight = nn.Parameter(torch.randn(heads, head_dim) / math.sqrt(head_dim))
            # Bias 2: gates start near sigmoid(2) = 0.88, a memory of about ten positions that training adjusts.
            self.gate_bias = nn.Parameter(torch.full((heads,), 2.0))
            # The gates weight keys by their position relative to the query: one sequence only.
            self.capabilities = self.capabilities.narrowed("gated=True", cross=False)

    def _unit(self, x: Tensor) -> Tensor:
        dtype = working_dtype(x.dtype)
        scale = torch.exp(0.5 * self.log_sharpness).to(dtype).view(1, -1, 1, 1)
        return unit_rows(x.to(dtype)) * scale

    def features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], cross: bool = False
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        return super().features(self._unit(q), self._unit(k), key_padding_mask, cross)

    def reference_features(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, cross: bool = False
    ) -> Tuple[Tensor, Tensor]:
        return super().reference_features(self._unit(q), self._unit(k), key_padding_mask, cross)

    def _keys(self, k: Tensor, phi_k: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        if not self.gated:
            return phi_k, None
        log_decay, key_weight = rfa_gates(key_gate_logits(k, self.gate_weight, self.gate_bias))
        return phi_k * key_weight.unsqueeze(-1), log_decay

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gated={self.gated}"
