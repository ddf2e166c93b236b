"""Feature maps phi for kernelized attention: ``softmax(q k^T) v`` is replaced by ``phi(q) (phi(k)^T v)``.

Each map is a small ``nn.Module`` taking (batch, heads, seq, head_dim) to (batch, heads, seq, nb_features),
usable on its own or through :func:`attnzoo.functional.linear_attention`.

Three entry points per map:

* ``forward(x)``: the features as defined mathematically (for random features, ``forward(q) . forward(k)``
  is the unbiased estimate of the kernel). May overflow for large inputs; used by the float64 references.
* ``query_features(x)``: the features up to a positive factor per query row, which cancels in the
  normalised output (numerator and normaliser of one row share it). Numerically safe.
* ``key_features(x, key_padding_mask)``: ``(features, log_scale)`` with ``true features = features *
  exp(log_scale)``; ``log_scale`` is one number per (batch, head), shared by every key, so it too cancels in
  the normalised output, and a recurrent state can carry it to merge later keys exactly. ``None`` when the
  map needs no rescaling.

Random-feature maps keep their projection in a registered buffer (saved in the ``state_dict``, so a reloaded
model gives identical outputs) and change it only when asked, never as a side effect of a forward pass: by the
training hook :meth:`RandomFeatureMap.after_optimizer_step` (every ``redraw_interval`` optimiser steps, seeded by
the run's seed and the step), which the mechanisms holding a map pass on to it, or at once by
:meth:`RandomFeatureMap.redraw`.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ._dtypes import working_dtype
from ._validation import check_bool, check_floating, check_number, check_positive_int
from .functional.features import (  # noqa: F401  (samplers and exp_features are also public here)
    elu_plus_one,
    exp_features,
    gaussian_projection,
    hedgehog_features_unchecked,
    orthogonal_projection,
    relu_features,
)



# -- base classes ---------------------------------------------------------------------------------------------
class FeatureMap(nn.Module):
    """Base of every feature map: (batch, heads, seq, head_dim) -> (batch, heads, seq, nb_features).

    Attributes:
        positive: every feature is >= 0, so the normaliser ``phi(q) . sum_j phi(k_j)`` never changes sign.
    """

    positive: bool = True

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def query_features(self, x: Tensor) -> Tensor:
        """Features up to a positive factor per row (cancels in normalised attention)."""
        return self(x)

    def key_features(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """``(features, log_scale)``: true features are ``features * exp(log_scale)``, ``log_scale`` of shape
        (batch, heads, 1, 1) or None. Padded keys (``key_padding_mask`` (batch, seq) True) must not influence
        the scale; the attention core zeroes their features, and maps whose features could overflow for them
        (the exponential ones) return zeros there themselves."""
        return self(x), None


class EluFeatureMap(FeatureMap):
    """``elu(x) + 1`` (Katharopoulos et al. 2020): positive, cheap, deterministic."""

    def forward(self, x: Tensor) -> Tensor:
        return elu_plus_one(x)


class ReluFeatureMap(FeatureMap):
    """``relu(x)``: non-negative; a query orthogonal to every key gets a zero normaliser and outputs zeros."""

    def forward(self, x: Tensor) -> Tensor:
        return relu_features(x)


class HedgehogFeatureMap(FeatureMap):
    """Hedgehog's learned feature map (Zhang et al. 2024, "The Hedgehog & the Porcupine"): per head h,
    ``y = x W_h + b_h`` and ``phi(x) = [softmax(y), softmax(-y)]`` (2 * ``feature_dim`` features, positive; the
    maths in :func:`attnzoo.functional.features.hedgehog_features`).

    Trainable: ``weight`` (heads, head_dim, feature_dim) and ``bias`` (heads, feature_dim), the parameters
    attention transfer fits to a softmax teacher. ``weight`` starts as the identity of each head when
    ``feature_dim == head_dim`` (the default; Hedgehog's initialisation), else ``N(0, 1 / head_dim)`` drawn
    from ``generator`` (the global generator when None); ``bias`` starts at zero.

    Softmax features never overflow, so :meth:`key_features` needs no rescaling (``log_scale`` None). Inputs
    must have ``heads`` heads of ``head_dim`` channels: grouped keys are repeated to the query heads first.
    """

    def __init__(self, heads: int, head_dim: int, feature_dim: Optional[int] = None, *,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        self.heads = check_positive_int("heads", heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.feature_dim = head_dim if feature_dim is None else check_positive_int("feature_dim", feature_dim)
        if self.feature_dim == head_dim:
            weight = torch.eye(head_dim).expand(heads, head_dim, head_dim).clone()
        else:
            weight = torch.randn(heads, head_dim, self.feature_dim, generator=generator) / math.sqrt(head_dim)
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(heads, self.feature_dim))

    @property
    def nb_features(self) -> int:
        """Features per position: ``2 * feature_dim``."""
        return 2 * self.feature_dim

    def forward(self, x: Tensor) -> Tensor:
        check_floating("x", x)
        if x.dim() != 4 or x.shape[1] != self.heads or x.shape[3] != self.head_dim:
            raise ValueError(f"HedgehogFeatureMap: input must have shape (batch, heads={self.heads}, seq, "
                             f"head_dim={self.head_dim}), got {tuple(x.shape)}")
        return hedgehog_features_unchecked(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"


class RandomFeatureMap(FeatureMap):
    """Shared machinery of maps built on a random projection ``W`` of shape (nb_projections, head_dim).

    Args:
        head_dim: width of the inputs; inputs of another width raise an error naming ``head_dim``.
        nb_projections: rows of ``W``.
        orthogonal: block-orthogonal rows (lower variance) instead of iid Gaussian rows.
        input_scale: inputs are multiplied by it before projecting; ``head_dim ** -0.25`` on both queries and
            keys turns the kernel ``exp(q . k)`` into the softmax kernel ``exp(q . k / sqrt(head_dim))``.
        redraw_interval: draw a new projection every that many optimiser steps taken in training mode
            (:meth:`after_optimizer_step`); None: only explicit :meth:`redraw` calls change it.
        generator: RNG for the initial projection (the global RNG when None).
    """

    def __init__(
        self,
        head_dim: int,
        nb_projections: int,
        *,
        orthogonal: bool = True,
        input_scale: Optional[float] = None,
        redraw_interval: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__()
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.nb_projections = nb_projections
        self.orthogonal = check_bool("orthogonal", orthogonal)
        input_scale = check_number("input_scale", input_scale, minimum=0.0, exclusive_minimum=True, optional=True)
        self.input_scale = head_dim ** -0.25 if input_scale is None else input_scale
        if redraw_interval is not None:
            check_positive_int("redraw_interval", redraw_interval)
        self.redraw_interval = redraw_interval
        self.register_buffer("projection", self.sample_projection(generator))
        # Persistent so that a resumed training run keeps the same redraw schedule.
        self.register_buffer("calls_since_redraw", torch.zeros((), dtype=torch.long))

    def sample_projection(self, generator: Optional[torch.Generator] = None) -> Tensor:
        sampler = orthogonal_projection if self.orthogonal else gaussian_projection
        return sampler(self.nb_projections, self.head_dim, generator=generator)

    @torch.no_grad()
    def redraw(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw a new projection (in place, keeping the buffer's device and dtype)."""
        new = self.sample_projection(generator)
        self.projection.copy_(new.to(self.projection.dtype))
        self.calls_since_redraw.zero_()

    @torch.no_grad()
    def after_optimizer_step(self, step: int, seed: int) -> bool:
        """The training hook of a mechanism holding this map (it delegates here), after optimiser step ``step``
        of a run seeded ``seed`` (ints >= 0): count the step and, once ``redraw_interval`` of them have passed,
        redraw from :func:`redraw_generator` of ``(seed, step)``. Nothing in eval mode or without a
        ``redraw_interval``. Returns whether it redrew."""
        step = check_number("step", step, integer=True, minimum=0)
        seed = check_number("seed", seed, integer=True, minimum=0)
        if self.redraw_interval is None or not self.training:
            return False
        self.calls_since_redraw += 1
        if int(self.calls_since_redraw) >= self.redraw_interval:
            self.redraw(redraw_generator(seed, step))
            return True
        return False

    def check_input(self, x: Tensor) -> None:
        check_floating("x", x)
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{type(self).__name__}: input has last dim {x.shape[-1]}, but the projection was drawn for "
                f"head_dim={self.head_dim}"
            )

    def project(self, x: Tensor, projection_scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """``(s x' @ W^T, |x'|^2 / 2)`` with ``x' = input_scale * x``, in at least float32.

        Shapes: (batch, heads, seq, head_dim) -> ((batch, heads, seq, nb_projections), (batch, heads, seq, 1)).
        ``projection_scale`` s: an optional (batch, heads, 1, 1) factor on the projection only (FAVOR++).
        """
        self.check_input(x)
        dtype = working_dtype(x.dtype)
        x = x.to(dtype)
        # The scales go into the small (m, d) matrix or over the (N, d) input, never over the (N, m) logits.
        scaled = x if projection_scale is None else x * projection_scale.to(dtype)
        projected = scaled @ (self.projection.to(dtype).T * self.input_scale)
        half_norm = (0.5 * self.input_scale**2) * x.pow(2).sum(-1, keepdim=True)
        return projected, half_norm

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, nb_features={self.nb_features}, orthogonal={self.orthogonal}, "
            f"input_scale={self.input_scale:.4g}, redraw_interval={self.redraw_interval}"
        )


def redraw_generator(seed: int, step: int) -> torch.Generator:
    """The generator a redraw after optimiser step ``step`` of a run seeded ``seed`` draws from. Seeded rather
    than the global generator so that a resumed run redraws exactly as an uninterrupted one, and so that the
    replicas of a data-parallel run, whose global generators differ (dropout), all draw the same projection
    without communicating."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step + 15_485_863) % 2**63)


def _key_scale(log_features: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """Max of log-features over keys and features, per (batch, head), ignoring padded keys: (batch, heads, 1, 1).

    Detached: the scale cancels in the normalised output, so it carries no gradient information."""
    log_features = log_features.detach()
    if key_padding_mask is not None:
        log_features = log_features.masked_fill(key_padding_mask[:, None, :, None], -math.inf)
    scale = log_features.amax(dim=(2, 3), keepdim=True)
    # A sequence made only of padding: any finite scale will do, its features are zeroed anyway.
    return torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))


def _padded_to_infinity(log_offset: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """``log_offset`` (batch, heads, seq, 1) with +inf at padded keys, so that ``exp(logit - offset)`` is
    exactly 0 there, with a zero gradient, whatever their values: a padded key's feature overflowing to inf,
    even though the attention core zeroes it, would turn the backward into inf * 0 = NaN."""
    if key_padding_mask is None:
        return log_offset
    return log_offset.masked_fill(key_padding_mask[:, None, :, None], math.inf)


def _projections_for(nb_features: int, paired: Optional[str]) -> int:
    """Projections needed for ``nb_features`` output features; ``paired`` names the pairing, if any."""
    check_positive_int("nb_features", nb_features)
    if paired is None:
        return nb_features
    if nb_features % 2:
        raise ValueError(f"nb_features must be even with {paired}, got {nb_features}")
    return nb_features // 2


class FavorPositiveFeatures(RandomFeatureMap):
    """FAVOR+ positive random features for the softmax kernel (Choromanski et al. 2021).

    ``phi(x) = exp(-|x|^2 / 2) / sqrt(m) * [exp(w_i . x)]_i`` gives ``E[phi(q) . phi(k)] = exp(q . k)`` with
    positive features, so the normaliser stays positive and the estimate has low variance where the kernel is
    small. With ``symmetric=True`` (the "hyperbolic" variant) each projection ``w`` is used as ``w`` and
    ``-w``: ``phi(x) = exp(-|x|^2 / 2) / sqrt(m) * [exp(w_i . x), exp(-w_i . x)]_i`` with ``m / 2``
    projections, an antithetic pair that lowers the variance at the same number of output features m.

    Stabiliser without any additive constant: query rows are divided by their own largest feature, keys by
    the largest feature over the whole (unpadded) key sequence of the head. Both factors cancel exactly in the
    normalised output, so unlike an added epsilon they never flatten the attention towards uniform.

    FAVOR++ (optimal positive random features, Likhosherstov et al. 2022): every feature method also takes an
    optional ``quadratic`` coefficient A of shape (batch, heads, 1, 1), giving
    ``phi(x) = D / sqrt(m) * exp(A |w|^2 + B w . x - |x|^2 / 2)`` with ``B = sqrt(1 - 4A)`` and
    ``D = (1 - 4A)^(d/4)``: still unbiased for every A < 1/8, with a variance that :meth:`optimal_quadratic`
    minimises for given queries and keys. A = 0 (or None) is FAVOR+.

    Args:
        head_dim: input width.
        nb_features: number of output features (even when ``symmetric``).
        symmetric: use antithetic pairs ``w, -w`` (``nb_features / 2`` projections).
        Other arguments: see :class:`RandomFeatureMap`.
    """

    def __init__(
        self,
        head_dim: int,
        nb_features: int = 256,
        *,
        symmetric: bool = True,
        orthogonal: bool = True,
        input_scale: Optional[float] = None,
        redraw_interval: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        symmetric = check_bool("symmetric", symmetric)
        super().__init__(
            head_dim,
            _projections_for(nb_features, "symmetric features (pairs w, -w)" if symmetric else None),
            orthogonal=orthogonal,
            input_scale=input_scale,
            redraw_interval=redraw_interval,
            generator=generator,
        )
        self.nb_features = nb_features
        self.symmetric = symmetric

    def _row_max(self, projected: Tensor, bias: Optional[Tensor]) -> Tensor:
        """Largest logit of each row, over [p + b, -p + b] when symmetric: (..., 1), detached."""
        projected = projected.detach()
        if bias is not None:
            return ((projected.abs() if self.symmetric else projected) + bias.detach()).amax(-1, keepdim=True)
        if not self.symmetric:
            return projected.amax(-1, keepdim=True)
        low, high = torch.aminmax(projected, dim=-1, keepdim=True)
        return torch.maximum(high, -low)

    def _log_normaliser(self) -> float:
        return -0.5 * math.log(self.nb_features)

    def optimal_quadratic(
        self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, *, self_attention: bool
    ) -> Tensor:
        """FAVOR++'s variance-minimising coefficient A for these queries and keys: (batch, heads, 1, 1).

        One feature's second moment relative to the squared kernel is
        ``((1 - 4A)^2 / (1 - 8A))^(d/2) exp(|q' + k'|^2 / (1 - 8A))`` (q', k' the scaled inputs, d = head_dim).
        Its log, averaged over every query-key pair of a (batch, head), is smallest at
        ``A = (1 - 2 rho - sqrt((2 rho + 1)^2 + 8 rho)) / 16`` with ``rho = mean |q'_i + k'_j|^2 / d``; A <= 0,
        and A = 0 (FAVOR+) when q' and k' are 0. Padded keys do not count; in self-attention
        (``self_attention=True``, said by the caller, never guessed from the lengths) the padded positions do
        not count as queries either. Whatever excluded positions hold (NaN or inf included) leaves A unchanged. Every output row thus
        depends, through A, on every (unpadded) query: weakly, as A only steers the variance. The result keeps
        its gradient, so the backward pass is the exact derivative of the forward one.
        """
        check_bool("self_attention", self_attention)
        self.check_input(q)
        self.check_input(k)
        if self_attention and q.shape[2] != k.shape[2]:
            raise ValueError(
                f"self_attention=True needs queries and keys of one sequence, got {q.shape[2]} and {k.shape[2]}"
            )
        dtype = working_dtype(q.dtype)
        q, k = (self.input_scale * x.to(dtype) for x in (q, k))
        keep = torch.ones(k.shape[:3], dtype=torch.bool, device=k.device)
        if key_padding_mask is not None:
            keep = ~key_padding_mask[:, None, :].expand(k.shape[:3])
        # Self-attention: a padded position is a padded query too (its output is discarded).
        keep_q = keep if self_attention else torch.ones(q.shape[:3], dtype=torch.bool, device=q.device)

        def masked_moments(x: Tensor, kept: Tensor) -> Tuple[Tensor, Tensor]:
            """(mean |x|^2 (B, H), mean x (B, H, d)) over the kept rows; the others are replaced, not
            multiplied by zero, so that a NaN or inf there cannot leak in."""
            x = x.masked_fill(~kept.unsqueeze(-1), 0.0)
            count = kept.sum(-1).clamp_min(1).to(dtype)
            return x.pow(2).sum((-1, -2)) / count, x.sum(-2) / count.unsqueeze(-1)

        (q_sq, q_mean), (k_sq, k_mean) = masked_moments(q, keep_q), masked_moments(k, keep)
        # mean over pairs of |q_i + k_j|^2 = mean |q|^2 + mean |k|^2 + 2 mean(q) . mean(k)
        pair_sq = q_sq + k_sq + 2.0 * (q_mean * k_mean).sum(-1)
        rho = pair_sq.clamp_min(0.0) / self.head_dim
        quadratic = (1.0 - 2.0 * rho - torch.sqrt((2.0 * rho + 1.0) ** 2 + 8.0 * rho)) / 16.0
        return quadratic[..., None, None]

    def _logits(self, x: Tensor, quadratic: Optional[Tensor]) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
        """(B w . x', |x'|^2 / 2, per-feature bias A |w|^2 or None, log D) for FAVOR+ or FAVOR++."""
        if quadratic is None:
            projected, half_norm = self.project(x)
            return projected, half_norm, None, torch.zeros((), dtype=projected.dtype, device=projected.device)
        if not bool((quadratic < 0.125).all()):
            raise ValueError(
                "quadratic (FAVOR++'s A) must be finite and below 1/8 everywhere (above, the variance is infinite); "
                "a NaN here comes from non-finite queries or keys"
            )
        widening = 1.0 - 4.0 * quadratic
        projected, half_norm = self.project(x, widening.sqrt())
        bias = quadratic.to(projected.dtype) * self.projection.to(projected.dtype).pow(2).sum(-1)
        return projected, half_norm, bias, (0.25 * self.head_dim) * widening.log().to(projected.dtype)

    def second_half(self) -> Tensor:
        """(nb_features,) bool: the features of the second half of the projections.

        Each half is an estimator on its own (a pair ``w, -w`` stays within one half), which is what
        :func:`attnzoo.functional.shrunk_kernel_attention` needs to estimate the noise of the whole.
        """
        if self.nb_projections < 2:
            raise ValueError(
                f"splitting the features into two halves needs at least 2 projections, got nb_features="
                f"{self.nb_features}{' (symmetric: nb_features / 2 projections)' if self.symmetric else ''}"
            )
        by_projection = torch.arange(self.nb_projections, device=self.projection.device) >= self.nb_projections // 2
        return torch.cat([by_projection, by_projection]) if self.symmetric else by_projection

    def forward(self, x: Tensor, quadratic: Optional[Tensor] = None) -> Tensor:
        projected, half_norm, bias, log_d = self._logits(x, quadratic)
        return exp_features(projected, half_norm - log_d - self._log_normaliser(), self.symmetric, bias)

    def query_features(self, x: Tensor, quadratic: Optional[Tensor] = None) -> Tensor:
        projected, _, bias, _ = self._logits(x, quadratic)
        # exp(-|x|^2/2), D and 1/sqrt(m) are per-row factors too, so they are dropped with the row maximum.
        return exp_features(projected, self._row_max(projected, bias), self.symmetric, bias)

    def key_features(
        self, x: Tensor, key_padding_mask: Optional[Tensor] = None, quadratic: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        projected, half_norm, bias, log_d = self._logits(x, quadratic)
        # exp(-|k|^2/2) differs from key to key, so it stays (with its gradient); only the shared shift goes.
        shift = _key_scale(self._row_max(projected, bias) - half_norm, key_padding_mask)
        offset = _padded_to_infinity(half_norm + shift, key_padding_mask)
        features = exp_features(projected, offset, self.symmetric, bias)
        return features, shift + log_d + self._log_normaliser()


class FavorTrigFeatures(RandomFeatureMap):
    """FAVOR trigonometric random features for the softmax kernel (Performer's first estimator).

    ``phi(x) = exp(|x|^2 / 2) / sqrt(m) * [sin(w_i . x), cos(w_i . x)]_i`` with ``m = nb_features / 2``
    projections gives ``E[phi(q) . phi(k)] = exp(q . k)``. Features can be negative, so the normaliser can
    come close to zero: the attention core guards its magnitude (see ``denominator_eps`` in
    :func:`attnzoo.functional.kernel_attention`). Prefer :class:`FavorPositiveFeatures` for the softmax
    kernel; this map serves RFA (Peng et al. 2021), whose inputs are unit vectors, where the ``exp(|x|^2/2)``
    factors are constant.
    """

    positive = False

    def __init__(
        self,
        head_dim: int,
        nb_features: int = 256,
        *,
        orthogonal: bool = True,
        input_scale: Optional[float] = None,
        redraw_interval: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__(
            head_dim,
            _projections_for(nb_features, "trigonometric features (pairs sin, cos)"),
            orthogonal=orthogonal,
            input_scale=input_scale,
            redraw_interval=redraw_interval,
            generator=generator,
        )
        self.nb_features = nb_features

    def _unit_features(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        projected, half_norm = self.project(x)
        return torch.cat([torch.sin(projected), torch.cos(projected)], dim=-1), half_norm

    def forward(self, x: Tensor) -> Tensor:
        features, half_norm = self._unit_features(x)
        return features * torch.exp(half_norm - 0.5 * math.log(self.nb_projections))

    def query_features(self, x: Tensor) -> Tensor:
        return self._unit_features(x)[0]

    def key_features(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        features, half_norm = self._unit_features(x)
        shift = _key_scale(half_norm, key_padding_mask)
        scale = torch.exp(-_padded_to_infinity(shift - half_norm, key_padding_mask))
        return features * scale, shift - 0.5 * math.log(self.nb_projections)


_NAMED_MAPS = {"elu": EluFeatureMap, "relu": ReluFeatureMap}


def resolve_feature_map(feature_map: object) -> FeatureMap:
    """``"elu"``, ``"relu"`` or a :class:`FeatureMap` instance -> a :class:`FeatureMap`."""
    if isinstance(feature_map, FeatureMap):
        return feature_map
    if isinstance(feature_map, str) and feature_map in _NAMED_MAPS:
        return _NAMED_MAPS[feature_map]()
    raise ValueError(
        f"feature_map must be one of {', '.join(repr(n) for n in _NAMED_MAPS)} or a FeatureMap instance, "
        f"got {feature_map!r}"
    )
