"""Attention mechanisms. Importing this package registers every built-in mechanism."""

from .base import (
    APPROXIMATE,
    EXACT,
    GROUPED_KV,
    KINDS,
    NATIVE_KV,
    NO_GROUPED_KV,
    OWN,
    REPEAT_KV,
    CallInput,
    Capabilities,
    Mechanism,
    State,
    UnsupportedOptionError,
    shapes_only,
)
from .registry import (
    available,
    build_mechanism,
    capabilities,
    check_option_names,
    mechanism_class,
    mechanism_options,
    register,
)
from .softmax import SoftmaxAttention
from .kernelized import LinearAttention, PerformerAttention, RandomFeatureAttention
from .gated import GatedLinearAttention, RetentionAttention
# Low-rank, landmark, synthesized and attention-free families: importing a module registers its mechanisms.
from . import aft, efficient, fnet, linformer, nystrom, sinkhorn, synthesizer  # noqa: E402,F401
# Sparse and hashed families.
from . import clustered, reformer, sparse  # noqa: E402,F401
# Gated and quantized linear-time designs.
from .gau import GauAttention  # noqa: E402
from .mixed_chunk import MixedChunkAttention  # noqa: E402
from .vq import VQAttention, update_codebooks  # noqa: E402
# The delta rule.
from .delta import DeltaNetAttention, DeltaProductAttention, GatedDeltaNetAttention  # noqa: E402
from .rwkv7 import RWKV7Attention  # noqa: E402  (the generalized delta rule, DPLR)
from .ssd import StateSpaceDualityAttention  # noqa: E402  (Mamba-2's SSD)
from . import differential, forgetting  # noqa: E402,F401 - the softmax family: a forget gate, two maps' difference
# Hybrids of the linear and the blockwise sparse cores.
from . import based, nsa  # noqa: E402,F401
# Conversion of pretrained softmax models: a sliding window plus learned linear attention beyond it.
from .lolcats import LolcatsAttention  # noqa: E402
from .liger import LigerAttention  # noqa: E402  (Liger's: gated linear attention from q and k, plus a window)
# The training hooks over a whole model (a training loop's, or one written by hand).
from . import hooks  # noqa: E402
from .hooks import after_optimizer_step, auxiliary_loss  # noqa: E402

__all__ = [
    "APPROXIMATE",
    "EXACT",
    "GROUPED_KV",
    "KINDS",
    "NATIVE_KV",
    "NO_GROUPED_KV",
    "OWN",
    "REPEAT_KV",
    "CallInput",
    "Capabilities",
    "Mechanism",
    "State",
    "UnsupportedOptionError",
    "available",
    "build_mechanism",
    "check_option_names",
    "capabilities",
    "mechanism_class",
    "mechanism_options",
    "register",
    "shapes_only",
    "SoftmaxAttention",
    "LinearAttention",
    "LolcatsAttention",
    "LigerAttention",
    "PerformerAttention",
    "RandomFeatureAttention",
    "GatedLinearAttention",
    "RetentionAttention",
    "GauAttention",
    "MixedChunkAttention",
    "VQAttention",
    "after_optimizer_step",
    "auxiliary_loss",
    "hooks",
    "update_codebooks",
]
