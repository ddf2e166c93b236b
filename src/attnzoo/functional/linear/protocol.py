"""What :func:`attnzoo.functional.linear.linear_attention` needs of a feature map, and the named feature
functions of :mod:`attnzoo.functional.features` seen as such maps."""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Tuple, Union

from torch import Tensor

from ..features import NAMED_FEATURES


class FeatureMapLike(Protocol):
    """What :func:`linear_attention` needs of a feature map; every :class:`attnzoo.feature_maps.FeatureMap`
    has it. ``__call__`` gives the unstabilised features (for the reference), the other two the stabilised
    ones described in :mod:`attnzoo.feature_maps`."""

    positive: bool

    def __call__(self, x: Tensor) -> Tensor: ...

    def query_features(self, x: Tensor) -> Tensor: ...

    def key_features(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]: ...


class _Pointwise:
    """A named feature function of :mod:`attnzoo.functional.features` seen as a :class:`FeatureMapLike`."""

    positive = True

    def __init__(self, function: Callable[[Tensor], Tensor]) -> None:
        self.function = function

    def __call__(self, x: Tensor) -> Tensor:
        return self.function(x)

    def query_features(self, x: Tensor) -> Tensor:
        return self.function(x)

    def key_features(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        return self.function(x), None


FeatureMapArg = Union[str, FeatureMapLike]


def resolve_features(feature_map: FeatureMapArg) -> FeatureMapLike:
    if isinstance(feature_map, str) and feature_map in NAMED_FEATURES:
        return _Pointwise(NAMED_FEATURES[feature_map])
    if not isinstance(feature_map, str) and all(
        hasattr(feature_map, name) for name in ("positive", "query_features", "key_features")
    ):
        return feature_map
    raise ValueError(
        f"feature_map must be one of {', '.join(repr(n) for n in NAMED_FEATURES)} or a FeatureMap instance, "
        f"got {feature_map!r}"
    )
