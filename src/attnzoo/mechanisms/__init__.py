"""Attention mechanisms. Importing this package registers every built-in mechanism."""

from .base import (
    Capabilities,
    Mechanism,
    State,
    UnsupportedOptionError,
    available,
    build_mechanism,
    capabilities,
    mechanism_class,
    mechanism_options,
    register,
)
from .softmax import SoftmaxAttention
from .kernelized import LinearAttention, PerformerAttention, RandomFeatureAttention
from .gated import GatedLinearAttention, RetentionAttention

__all__ = [
    "Capabilities",
    "Mechanism",
    "State",
    "UnsupportedOptionError",
    "available",
    "build_mechanism",
    "capabilities",
    "mechanism_class",
    "mechanism_options",
    "register",
    "SoftmaxAttention",
    "LinearAttention",
    "PerformerAttention",
    "RandomFeatureAttention",
    "GatedLinearAttention",
    "RetentionAttention",
]
