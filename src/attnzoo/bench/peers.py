"""Adapters that put the attention of other PyPI libraries (the ``peers`` extra) behind the benchmark's shape.

Each adapter returns either a :class:`PeerAttention` module called as ``fn(q, k, v, causal) -> out`` on
(batch, heads, seq, head_dim) tensors, or a string saying why it cannot run (package missing,
configuration unsupported).
Where a library only ships a whole attention layer, its input and output projections are replaced by
slices/identities, so what is timed is the library's attention itself on our q, k and v. Hyper-parameters
(feature count, projected length, landmarks, window, bucket size) follow the default of the attnzoo
counterpart when it is registered, so rows compare like with like.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..mechanisms import available, mechanism_options


class PeerAttention(nn.Module):
    """A peer's module with the call that adapts it to ``(q, k, v, causal) -> out`` on (batch, heads, seq, dim).

    Being a module, it moves to the benchmark's device and dtype with ``.to()`` like attnzoo's mechanisms.
    """

    def __init__(self, inner: nn.Module, call: Callable[[nn.Module, Tensor, Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        self.inner = inner
        self.call = call

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        return self.call(self.inner, q, k, v)


Options = Dict[str, Any]
"""The options given to the attnzoo counterpart (``attnzoo compare --set``), which its peer follows."""

Adapter = Callable[[int, int, int, bool, Options], Union[PeerAttention, str]]


@dataclass(frozen=True)
class Peer:
    """One peer library: how to find it, what it is compared with, and how to build it."""

    name: str  # the row's name: the PyPI distribution, or ``fla-<function family>`` for fla's references
    module: str  # the import name that tells whether it is installed
    counterparts: Tuple[str, ...]  # attnzoo mechanisms it implements, the first registered one is used
    build: Adapter
    distribution: Optional[str] = None  # what pip installs, where it differs from ``name``
    cuda_only: bool = False  # its kernels run on a CUDA device only (fla's Triton kernels)
    half_only: bool = False  # its kernels refuse float32 and float64 (fla's Triton delta rule)

    @property
    def installs(self) -> str:
        return self.distribution or self.name

    def counterpart(self) -> Optional[str]:
        registered = set(available())
        return next((name for name in self.counterparts if name in registered), None)


def _option(given: Dict[str, Any], counterparts: Sequence[str], names: Sequence[str], fallback: int) -> int:
    """The first of ``names`` among the options ``given`` to the attnzoo counterpart (``--set``), else the
    default of the first matching integer option of a registered counterpart, else ``fallback``."""
    for name in names:
        if isinstance(given.get(name), int) and not isinstance(given.get(name), bool):
            return int(given[name])
    registered = set(available())
    for mechanism in counterparts:
        if mechanism not in registered:
            continue
        options = mechanism_options(mechanism)
        for name in names:
            if isinstance(options.get(name), int) and not isinstance(options.get(name), bool):
                return int(options[name])
    return fallback


class _Slice(nn.Module):
    """Stands in for a projection layer: takes a block of features from the concatenated q|k|v input."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__()
        self.start, self.stop = start, stop

    def forward(self, x: Tensor) -> Tensor:
        return x[..., self.start : self.stop]


def _merge_heads(t: Tensor) -> Tensor:
    """(batch, heads, seq, dim) -> (batch, seq, heads * dim)."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def _split_heads(t: Tensor, heads: int) -> Tensor:
    """(batch, seq, heads * dim) -> (batch, heads, seq, dim)."""
    b, n, hd = t.shape
    return t.reshape(b, n, heads, hd // heads).transpose(1, 2)


def _concatenated_call(heads: int) -> Callable[[nn.Module, Tensor, Tensor, Tensor], Tensor]:
    """Feeds a layer-level module q|k|v concatenated on the feature axis, (batch, seq, 3 * heads * dim)."""

    def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        x = torch.cat([_merge_heads(q), _merge_heads(k), _merge_heads(v)], dim=-1)
        return _split_heads(module(x), heads)

    return call


# -- adapters ------------------------------------------------------------------------------------------------
_PERFORMER = ("performer",)
_LINFORMER = ("linformer",)
_NYSTROM = ("nystrom", "nystromformer")
_LOCAL = ("local", "sliding_window", "window", "sparse")
_REFORMER = ("reformer", "lsh")
_LINEAR = ("linear",)
_DELTA = ("delta",)
_GATED_DELTA = ("gated_delta",)
_SSD = ("ssd",)
_FORGETTING = ("forgetting",)
_BASED = ("based",)
_NSA = ("nsa",)


def _performer(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    from performer_pytorch import FastAttention

    features = _option(options, _PERFORMER, ("nb_features", "num_features", "features"), 256)
    return PeerAttention(FastAttention(dim_heads=head_dim, nb_features=features, causal=causal),
                         lambda m, q, k, v: m(q, k, v))


def _linformer(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    if causal:
        return "unsupported: linformer has no causal mode"
    from linformer import LinformerSelfAttention

    inner = heads * head_dim
    rank = _option(options, _LINFORMER, ("k", "proj_dim", "rank", "projected_length"), 256)
    module = LinformerSelfAttention(dim=3 * inner, seq_len=length, k=rank, heads=heads, dim_head=head_dim)
    # q|k|v arrive concatenated on the feature axis; each former projection takes its own block.
    module.to_q, module.to_k, module.to_v = _Slice(0, inner), _Slice(inner, 2 * inner), _Slice(2 * inner, 3 * inner)
    module.to_out = nn.Identity()

    return PeerAttention(module, _concatenated_call(heads))


def _nystrom(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    if causal:
        return "unsupported: nystrom-attention has no causal mode"
    from nystrom_attention import NystromAttention

    landmarks = _option(options, _NYSTROM, ("landmarks", "num_landmarks", "n_landmarks"), 64)
    # residual=False: the optional depth-wise convolution on v is not attention; attnzoo's nystrom leaves it off
    # by default (conv_kernel=None).
    module = NystromAttention(dim=heads * head_dim, dim_head=head_dim, heads=heads, num_landmarks=landmarks,
                              residual=False)
    module.to_qkv = nn.Identity()  # chunk(3) of the concatenated q|k|v then yields ours unchanged
    module.to_out = nn.Identity()

    return PeerAttention(module, _concatenated_call(heads))


def _local(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    from local_attention import LocalAttention

    window = _option(options, _LOCAL, ("window", "window_size", "block_size"), 128)
    module = LocalAttention(window_size=window, causal=causal, look_backward=1, look_forward=0 if causal else 1,
                            autopad=True)
    return PeerAttention(module, lambda m, q, k, v: m(q, k, v))


def _reformer(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    from reformer_pytorch.reformer_pytorch import LSHAttention

    bucket = _option(options, _REFORMER, ("bucket_size",), 64)
    hashes = _option(options, _REFORMER, ("n_hashes", "hashes", "num_hashes"), 4)
    if length % (2 * bucket):
        return f"unsupported: reformer-pytorch needs the length to be a multiple of 2 x bucket_size = {2 * bucket}"

    def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # Reformer shares queries and keys by design: k is not used.
        b, h, n, d = q.shape
        out, _, _ = module(q.reshape(b * h, n, d), v.reshape(b * h, n, d))
        return out.reshape(b, h, n, d)

    return PeerAttention(LSHAttention(bucket_size=bucket, n_hashes=hashes, causal=causal), call)


def _fast_transformers(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    from fast_transformers.masking import FullMask, LengthMask, TriangularCausalMask

    if causal:
        from fast_transformers.attention.causal_linear_attention import CausalLinearAttention as Layer
    else:
        from fast_transformers.attention.linear_attention import LinearAttention as Layer

    def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, h, n, d = q.shape
        mask = TriangularCausalMask(n, device=q.device) if causal else FullMask(N=n, device=q.device)
        lengths = LengthMask(torch.full((b,), n, dtype=torch.long, device=q.device), max_len=n)
        # The library works on (batch, seq, heads, dim).
        out = module(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, lengths, lengths)
        return out.transpose(1, 2)

    return PeerAttention(Layer(head_dim), call)


def _x_transformers(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    from x_transformers.attend import Attend

    return PeerAttention(Attend(causal=causal), lambda m, q, k, v: m(q, k, v)[0])


class _DeltaRuleGates(nn.Module):
    """The inputs attnzoo's delta-rule mechanisms give their core, in plain torch: L2-normalised q and k,
    ``beta = sigmoid(k . w + b)`` and, gated, Mamba-2's decay ``-exp(A_log) softplus(k . w + dt_bias)``, all
    from the raw keys, with parameters of the same shapes, created in the same order and way: built under the
    same seed, the two rows compute the same outputs (the error column shows it). Only the core differs."""

    def __init__(self, heads: int, head_dim: int, gated: bool) -> None:
        super().__init__()
        self.beta_weight = nn.Parameter(torch.randn(heads, head_dim) / head_dim ** 0.5)
        self.beta_bias = nn.Parameter(torch.zeros(heads))
        self.gated = gated
        if gated:
            self.decay_weight = nn.Parameter(torch.randn(heads, head_dim) / head_dim ** 0.5)
            self.A_log = nn.Parameter(torch.linspace(1.0, 16.0, heads).log())
            steps = torch.logspace(-3.0, -1.0, heads)  # softplus(dt_bias) from 0.001 to 0.1, geometric
            self.dt_bias = nn.Parameter(steps + torch.log(-torch.expm1(-steps)))

    def forward(self, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        beta = torch.sigmoid(torch.einsum("bhnd,hd->bhn", k, self.beta_weight) + self.beta_bias[:, None])
        log_decay = None
        if self.gated:
            step = F.softplus(torch.einsum("bhnd,hd->bhn", k, self.decay_weight) + self.dt_bias[:, None])
            log_decay = -self.A_log.exp()[:, None] * step
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), beta, log_decay


def _fla_delta_rule(gated: bool) -> Adapter:
    """fla's pure-PyTorch chunked delta rule (``delta_rule_chunkwise``, or ``naive_chunk_gated_delta_rule``),
    at the chunk size of attnzoo's counterpart, behind the same gates."""
    counterparts = _GATED_DELTA if gated else _DELTA

    def build(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
        if not causal:
            return "unsupported: fla's delta-rule references are causal only"
        chunk = _option(options, counterparts, ("chunk_size",), 64)
        if not gated and length % chunk:
            return f"unsupported: fla's delta_rule_chunkwise needs the length to be a multiple of chunk_size = {chunk}"
        from fla.ops.delta_rule.naive import delta_rule_chunkwise
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

        def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            unit_q, unit_k, beta, log_decay = module(q, k)
            if log_decay is None:
                return delta_rule_chunkwise(unit_q, unit_k, v, beta, chunk_size=chunk)[0]
            # The gated reference works on (batch, seq, heads, dim); it computes in float32.
            inputs = [x.transpose(1, 2) for x in (unit_q, unit_k, v, log_decay, beta)]
            return naive_chunk_gated_delta_rule(*inputs, chunk_size=chunk)[0].transpose(1, 2).to(q.dtype)

        return PeerAttention(_DeltaRuleGates(heads, head_dim, gated), call)

    return build


def _fla_linear_attn(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    """fla's pure-PyTorch chunked linear attention, normalised, on attnzoo's default features (elu + 1)."""
    if not causal:
        return "unsupported: fla's naive_chunk_linear_attn is causal only"
    if length % 64:
        return "unsupported: fla's naive_chunk_linear_attn needs the length to be a multiple of its chunk, 64"
    from fla.ops.linear_attn.naive import naive_chunk_linear_attn

    def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        phi_q, phi_k = (F.elu(x.transpose(1, 2)) + 1 for x in (q, k))
        return naive_chunk_linear_attn(phi_q, phi_k, v.transpose(1, 2), normalize=True).transpose(1, 2)

    return PeerAttention(nn.Identity(), call)


def _settings(given: Options, counterparts: Sequence[str], fallback: Options) -> Options:
    """The options of the attnzoo counterpart: those ``given`` (``--set``) over its defaults (the first registered
    one of ``counterparts``) over ``fallback``."""
    registered = set(available())
    defaults = next((mechanism_options(name) for name in counterparts if name in registered), {})
    return {**fallback, **{name: value for name, value in defaults.items() if value is not None}, **given}


def _heads_last(*tensors: Tensor) -> List[Tensor]:
    """(batch, heads, seq, ...) -> fla's (batch, seq, heads, ...)."""
    return [t.transpose(1, 2) for t in tensors]


def _key_gate_logits(k: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``k_t . weight_h + bias_h`` (batch, heads, seq) in float32 from keys (batch, heads, seq, dim)."""
    return torch.einsum("bhnd,hd->bhn", k.float(), weight.float()) + bias.float()[:, None]


class _StepSizeGates(nn.Module):
    """The parameters of attnzoo's ``ssd``, same shapes, order and initialisation: ``dt_weight``, ``dt_bias``
    (inverse softplus of steps 0.001 to 0.1, geometric), ``A_log`` (log of 1 to 16)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.dt_weight = nn.Parameter(torch.randn(heads, head_dim) / head_dim ** 0.5)
        steps = torch.logspace(-3.0, -1.0, heads)
        self.dt_bias = nn.Parameter(steps + torch.log(-torch.expm1(-steps)))
        self.A_log = nn.Parameter(torch.linspace(1.0, 16.0, heads).log())


def _fla_simple_gla(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    """fla's pure-PyTorch chunked simple GLA as Mamba-2's SSD: ``q = C``, ``k = dt B``, ``v = x``, ``g = dt A``,
    scale 1, with the step size ``dt = softplus(k . w + dt_bias)`` from the raw keys as attnzoo's ``ssd``."""
    if not causal:
        return "unsupported: fla's naive_chunk_simple_gla is causal only"
    chunk = _option(options, _SSD, ("chunk_size",), 64)
    from fla.ops.simple_gla.naive import naive_chunk_simple_gla

    def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        dt = F.softplus(_key_gate_logits(k, module.dt_weight, module.dt_bias))
        log_decay = -module.A_log.float().exp()[:, None] * dt
        inputs = _heads_last(q, k * dt.unsqueeze(-1).to(k.dtype), v, log_decay)
        return naive_chunk_simple_gla(*inputs, chunk_size=chunk, scale=1.0)[0].transpose(1, 2).to(q.dtype)

    return PeerAttention(_StepSizeGates(heads, head_dim), call)


class _ForgetGates(nn.Module):
    """The parameters of attnzoo's ``forgetting``: ``gate_weight`` (heads, head_dim), ``gate_bias`` (heads,)."""

    def __init__(self, heads: int, head_dim: int, bias: float) -> None:
        super().__init__()
        self.gate_weight = nn.Parameter(torch.randn(heads, head_dim) / head_dim ** 0.5)
        self.gate_bias = nn.Parameter(torch.full((heads,), float(bias)))


def _fla_forgetting_attn(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    """fla's pure-PyTorch forgetting attention (the full (N, N) logits), ``g = log sigmoid(k . w + b)`` from the
    raw keys, at the counterpart's scale and gate bias."""
    if not causal:
        return "unsupported: fla's naive_forgetting_attn is causal only"
    settings = _settings(options, _FORGETTING, {"scale": None, "gate_bias_init": 5.0})
    from fla.ops.forgetting_attn.naive import naive_forgetting_attn

    def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        g = F.logsigmoid(_key_gate_logits(k, module.gate_weight, module.gate_bias))
        out = naive_forgetting_attn(*_heads_last(q, k, v, g), scale=settings["scale"])
        return out.transpose(1, 2).to(q.dtype)

    return PeerAttention(_ForgetGates(heads, head_dim, settings["gate_bias_init"]), call)


def _causal_window(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """Softmax over the last ``window`` keys by fla's pure-PyTorch forgetting attention with every gate 1 (its
    NSA reference calls flash-attn, GPU-only, for this); float32, attnzoo's layout."""
    from fla.ops.forgetting_attn.naive import naive_forgetting_attn

    no_forgetting = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    return naive_forgetting_attn(*_heads_last(q, k, v, no_forgetting), window_size=window).transpose(1, 2)


class _Projections(nn.Module):
    """The parameters of attnzoo's ``based``: ``q_proj``, ``k_proj`` (heads, head_dim, feature_dim)."""

    def __init__(self, heads: int, head_dim: int, features: int) -> None:
        super().__init__()
        self.q_proj = nn.Parameter(torch.randn(heads, head_dim, features) / head_dim ** 0.5)
        self.k_proj = nn.Parameter(torch.randn(heads, head_dim, features) / head_dim ** 0.5)


def _fla_based(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    """fla's pure-PyTorch quadratic Based (``naive_parallel_based``, normalised) on the counterpart's projected
    queries and keys, plus its exact window part by fla's windowed forgetting attention with gates 1."""
    if not causal:
        return "unsupported: fla's naive_parallel_based is causal only"
    settings = _settings(options, _BASED, {"feature_dim": 16, "window": 64})
    from fla.ops.based.naive import naive_parallel_based

    def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        projected_q = torch.einsum("bhnd,hdm->bhnm", q, module.q_proj.to(q.dtype))
        projected_k = torch.einsum("bhnd,hdm->bhnm", k, module.k_proj.to(k.dtype))
        linear = naive_parallel_based(projected_q, projected_k, v)
        return (linear + _causal_window(q, k, v, settings["window"]).to(linear.dtype)).to(q.dtype)

    return PeerAttention(_Projections(heads, head_dim, settings["feature_dim"]), call)


class _BranchGates(nn.Module):
    """The gate parameters of attnzoo's ``nsa``: ``gate_weight`` (heads, 3, head_dim), ``gate_bias`` (heads, 3)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.gate_weight = nn.Parameter(torch.randn(heads, 3, head_dim) / head_dim ** 0.5)
        self.gate_bias = nn.Parameter(torch.zeros(heads, 3))


def _nsa_settings_refusal(settings: Options) -> Optional[str]:
    """Why fla's NSA reference cannot compute what attnzoo's ``nsa`` does at these settings, or None."""
    block = settings["select_block"]
    if not settings["compress_block"] == settings["compress_stride"] == block:
        return ("unsupported: fla's NSA reference has one block_size; set compress_block = compress_stride = "
                "select_block")
    if settings["top_k"] < 3:
        return "unsupported: fla's NSA reference always selects three blocks (first, previous, own); top_k >= 3"
    if settings["selection_group"] != 1:
        return "unsupported: fla's NSA reference shares a selection per key/value head only"
    return None


def _fla_nsa(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
    """fla's pure-PyTorch NSA branches (``naive_nsa_compression``, ``naive_nsa_topk``, ``naive_nsa_selection``)
    composed as ``naive_nsa`` composes them, its two GPU-only pieces in plain torch (mean pooling; the window by
    :func:`_causal_window`), gated as attnzoo's ``nsa`` at the start (``sigmoid(q . w + c)``, identity
    compression maps). Only at settings where the two compute the same thing."""
    if not causal:
        return "unsupported: fla's NSA reference is causal only"
    settings = _settings(options, _NSA, {"compress_block": 32, "compress_stride": 16, "select_block": 64,
                                         "top_k": 16, "window": 512, "selection_group": 1})
    refusal = _nsa_settings_refusal(settings)
    if refusal is not None:
        return refusal
    from fla.ops.nsa.naive import naive_nsa_compression, naive_nsa_selection, naive_nsa_topk

    block, scale = settings["select_block"], head_dim ** -0.5

    def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        pooled_k, pooled_v = (torch.stack([b.mean(2) for b in x.split(block, dim=2)], dim=2) for x in (k, v))
        fla_q, fla_k, fla_v, k_cmp, v_cmp = _heads_last(q, k, v, pooled_k, pooled_v)
        compressed = naive_nsa_compression(fla_q, k_cmp, v_cmp, block, scale)[0].transpose(1, 2)
        chosen = naive_nsa_topk(fla_q, k_cmp, settings["top_k"], block, scale)
        selected = naive_nsa_selection(fla_q, fla_k, fla_v, chosen, block, scale).transpose(1, 2)
        window = _causal_window(q, k, v, settings["window"]).to(q.dtype)
        logits = torch.einsum("bhnd,hgd->bhng", q, module.gate_weight.to(q.dtype))
        gates = torch.sigmoid(logits + module.gate_bias.to(q.dtype)[None, :, None, :])
        return gates[..., 0:1] * compressed + gates[..., 1:2] * selected + gates[..., 2:3] * window

    return PeerAttention(_BranchGates(heads, head_dim), call)


def _fla_triton(family: str) -> Adapter:
    """fla's fused Triton kernel of ``family`` (``chunk_delta_rule``, ``chunk_gated_delta_rule``,
    ``chunk_simple_gla``, ``chunk_linear_attn``) behind the same gates as its pure-PyTorch reference row: what a
    user with a GPU would pick instead. Causal only, CUDA only (:func:`build_peer` refuses other devices)."""

    def build(heads: int, head_dim: int, length: int, causal: bool, options: Options) -> Union[PeerAttention, str]:
        if not causal:
            return f"unsupported: fla's chunk_{family} is causal only"
        from fla import ops

        kernel = getattr(ops, f"chunk_{family}")
        if family in ("delta_rule", "gated_delta_rule"):
            def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                unit_q, unit_k, beta, log_decay = module(q, k)
                gates = () if log_decay is None else (log_decay.transpose(1, 2).float(),)
                out = kernel(*_heads_last(unit_q, unit_k, v), *gates, beta.transpose(1, 2).to(q.dtype))[0]
                return out.transpose(1, 2)

            return PeerAttention(_DeltaRuleGates(heads, head_dim, family == "gated_delta_rule"), call)
        if family == "simple_gla":
            def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                dt = F.softplus(_key_gate_logits(k, module.dt_weight, module.dt_bias))
                log_decay = -module.A_log.float().exp()[:, None] * dt
                inputs = _heads_last(q, k * dt.unsqueeze(-1).to(k.dtype), v)
                return kernel(*inputs, g=log_decay.transpose(1, 2), scale=1.0)[0].transpose(1, 2)

            return PeerAttention(_StepSizeGates(heads, head_dim), call)

        def call(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            phi_q, phi_k = (F.elu(x) + 1 for x in (q, k))
            return kernel(*_heads_last(phi_q, phi_k, v), normalize=True)[0].transpose(1, 2)

        return PeerAttention(nn.Identity(), call)

    return build


PEERS: Dict[str, Peer] = {
    peer.name: peer
    for peer in [
        Peer("performer-pytorch", "performer_pytorch", _PERFORMER, _performer),
        Peer("linformer", "linformer", _LINFORMER, _linformer),
        Peer("nystrom-attention", "nystrom_attention", _NYSTROM, _nystrom),
        Peer("local-attention", "local_attention", _LOCAL, _local),
        Peer("reformer-pytorch", "reformer_pytorch", _REFORMER, _reformer),
        Peer("pytorch-fast-transformers", "fast_transformers", _LINEAR, _fast_transformers),
        Peer("x-transformers", "x_transformers", ("softmax",), _x_transformers),
        # flash-linear-attention's pure-PyTorch references.
        Peer("fla-delta_rule", "fla", _DELTA, _fla_delta_rule(gated=False), distribution="fla-core"),
        Peer("fla-gated_delta_rule", "fla", _GATED_DELTA, _fla_delta_rule(gated=True), distribution="fla-core"),
        Peer("fla-linear_attn", "fla", _LINEAR, _fla_linear_attn, distribution="fla-core"),
        Peer("fla-simple_gla", "fla", _SSD, _fla_simple_gla, distribution="fla-core"),
        Peer("fla-forgetting_attn", "fla", _FORGETTING, _fla_forgetting_attn, distribution="fla-core"),
        Peer("fla-based", "fla", _BASED, _fla_based, distribution="fla-core"),
        Peer("fla-nsa", "fla", _NSA, _fla_nsa, distribution="fla-core"),
        # Its fused Triton kernels, on a CUDA device only.
        Peer("fla-triton-delta_rule", "fla", _DELTA, _fla_triton("delta_rule"), "fla-core", cuda_only=True,
             half_only=True),
        Peer("fla-triton-gated_delta_rule", "fla", _GATED_DELTA, _fla_triton("gated_delta_rule"), "fla-core",
             cuda_only=True),
        Peer("fla-triton-simple_gla", "fla", _SSD, _fla_triton("simple_gla"), "fla-core", cuda_only=True),
        Peer("fla-triton-linear_attn", "fla", _LINEAR, _fla_triton("linear_attn"), "fla-core", cuda_only=True),
    ]
}


def peer_installed(name: str) -> bool:
    return importlib.util.find_spec(PEERS[name].module) is not None


def installed_peers() -> Tuple[List[str], List[Dict[str, str]]]:
    """(names of installed peers, [{"name", "reason"}] for the missing ones)."""
    present, missing = [], []
    for name in PEERS:
        if peer_installed(name):
            present.append(name)
        else:
            missing.append({"name": name, "reason": f"not installed (pip install {PEERS[name].installs}, or "
                                                     "scripts/install-peers.sh)"})
    return present, missing


def build_peer(
    name: str, heads: int, head_dim: int, length: int, causal: bool, options: Optional[Options] = None,
    device: str = "cpu", dtype: torch.dtype = torch.float32,
) -> Union[PeerAttention, str]:
    """The peer's attention callable, or a reason it cannot run in this configuration. ``options``: those
    given to its attnzoo counterpart, whose hyper-parameters (rank, landmarks, ...) the peer takes; ``device``
    and ``dtype``: where and in what it will run (a CUDA-only or half-precision-only peer is refused
    elsewhere)."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; valid choices: {', '.join(PEERS)}")
    if not peer_installed(name):
        return f"not installed (pip install {PEERS[name].installs})"
    if PEERS[name].cuda_only and not str(device).startswith("cuda"):
        return f"unsupported: {name} runs on a CUDA device only (--device cuda)"
    if PEERS[name].half_only and dtype not in (torch.bfloat16, torch.float16):
        return f"unsupported: {name} takes bfloat16 or float16 only (--dtype bfloat16), not {dtype}"
    try:
        return PEERS[name].build(heads, head_dim, length, causal, dict(options or {}))
    except ImportError as error:
        return f"import failed: {error}"
