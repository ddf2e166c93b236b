"""attnzoo's functional cores (and the mechanisms around them) equal flash-linear-attention's pure-PyTorch
references (``fla.ops.<name>.naive``) at equal settings: same inputs, gates and scales mapped across, to 1e-5
in float32 and 1e-10 in float64 where the reference computes in float64.

Runs where the ``peers`` extra is installed (``scripts/install-peers.sh``); skipped otherwise, like the other
peer checks. What is shared, and how a mechanism adds its case in a line, is in ``tests/support/fla_reference.py``.

Where the definitions differ on purpose, the case maps one onto the other and says so:

* ``gla``: attnzoo's gate is one scalar per head and position (docs/gated.md); fla's GLA has one per key
  dimension, so the scalar is broadcast over the key dimensions (and equals fla's ``simple_gla`` as is).
  attnzoo's ``gla`` and ``retention`` normalise rows RetNet's way by default (``normalize=True``); fla's
  references do not normalise, so the comparison is with ``normalize=False`` / ``normalizer="none"``.
* ``linear``: fla's ``normalize=True`` divides by ``q . sum_j k_j + 1e-10`` on whatever features it is
  given; attnzoo's ``linear`` applies its feature map (elu + 1) itself, so fla gets the features, and
  the scale, which cancels in the ratio, only shifts fla's 1e-10 guard.
* ``ssd``: Mamba-2's SSD is fla's ``simple_gla`` with ``q = C``, ``k = dt B``, ``v = x``, ``g = dt A`` and
  ``scale=1.0`` (SSD has no query scale; fla's default is ``head_dim ** -0.5``); fla has no groups of B and C
  and no skip ``D``, so they are repeated over the heads and ``D x`` added to its output.
* ``forgetting``: the same definition; fla's ``g`` (batch, seq, heads) is attnzoo's ``log_forget``.
* ``nsa``: ``naive_nsa`` needs a GPU (Triton mean pooling, flash-attn's window), so its branches are composed
  here as it composes them, the pooling written out and the window taken from ``naive_forgetting_attn`` with
  every gate 1. They compute attnzoo's NSA only with one block size (``compress_block = compress_stride =
  select_block``), identity compression maps and ``top_k >= 3`` (``NSA_SETTINGS``); docs/nsa.md lists what
  cannot be matched.
* ``kda``: fla's ``g`` (batch, seq, heads, d_k) is attnzoo's per-channel ``log_decay``; its references compute in
  float32 whatever they are given (``float64=False``, 1e-5). The mechanism's gate comes from the raw key
  (docs/kda.md), so the written-out mechanism computes it from the key and passes fla the decay.
* ``delta_product``: fla's ``naive_recurrent_gated_delta_product`` takes each position's n_h keys, values and
  betas interleaved along the sequence, (batch, seq * n_h, heads, ...), a position's steps in order; attnzoo's
  (batch, heads, seq, n_h, ...) is the same order. The reference casts to float32 whatever it is given, so
  the cases run in float32 only (1e-5). The steps' keys, values and betas are made from the shared inputs
  here; the mechanism's case writes out its maps of the key and value (docs/delta_product.md).
* ``based``: fla's ``naive_parallel_based`` divides by ``z + 1e-6``, attnzoo by ``z``: equal in float32, and in
  float64 once fla's numerator and ``z`` are taken apart (``use_norm=False`` on values with a column of ones).
  fla's Based has no window; the mechanism's window part is checked against ``naive_forgetting_attn`` with
  every gate 1 and ``window_size``.
* ``dplr`` / ``rwkv7``: fla's ``generalized_delta_rule.dplr.naive`` (``dplr_recurrence``, ``dplr_chunkwise``)
  is the reference: its ``alpha`` is attnzoo's read vector ``a`` and its ``beta`` the write vector ``b``
  (``S_t = (diag(exp(gk_t)) + beta_t alpha_t^T) S_{t-1} + k_t v_t^T``), its ``gk`` the per-channel log decay,
  and its query scale ``d_k ** -0.5`` fixed. It casts to float32, so the cases are float32 only (1e-5).
  RWKV-7 maps onto it as fla's ``rwkv7/chunk.py`` maps it (``a = -kappa``, ``b = kappa * alpha``); fla's
  ``fused_recurrent_rwkv7`` is a Triton kernel with no pure-PyTorch path, so it is not run here.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from attnzoo.functional import (
    delta_product,
    delta_rule,
    dplr_delta_rule,
    elu_plus_one,
    forgetting_attention,
    gated_delta_rule,
    kernel_attention,
    linear_attention,
    ssd,
)
from attnzoo.functional.based import based_features
from attnzoo.functional.nsa import NSABlocks, nsa_attention
from attnzoo.mechanisms import build_mechanism
from fla_reference import FlaCase, assert_matches, from_fla, to_fla

pytest.importorskip("fla", reason='flash-linear-attention (fla-core) is in the "peers" extra: scripts/install-peers.sh')

from fla.ops.based.naive import naive_parallel_based  # noqa: E402
from fla.ops.delta_rule.naive import delta_rule_chunkwise, delta_rule_recurrence  # noqa: E402
from fla.ops.generalized_delta_rule.dplr.naive import dplr_chunkwise, dplr_recurrence  # noqa: E402
from fla.ops.forgetting_attn.naive import naive_forgetting_attn  # noqa: E402
from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product  # noqa: E402
from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.gla.naive import naive_recurrent_gla  # noqa: E402
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda  # noqa: E402
from fla.ops.linear_attn.naive import naive_chunk_linear_attn, naive_recurrent_linear_attn  # noqa: E402
from fla.ops.nsa.naive import naive_nsa_compression, naive_nsa_selection, naive_nsa_topk  # noqa: E402
from fla.ops.retention.naive import naive_retention  # noqa: E402
from fla.ops.simple_gla.naive import naive_chunk_simple_gla, naive_recurrent_simple_gla  # noqa: E402


def _fla(function, *tensors, **options):
    """Call a reference that takes (batch, seq, heads, ...) and returns out or (out, state); out in attnzoo's
    layout."""
    result = function(*(to_fla(t) for t in tensors), **options)
    return from_fla(result[0] if isinstance(result, tuple) else result)


def _in_dtype(out, like):
    """References that compute in float32 return float32 whatever they were given; their float64 cases are
    not run (``float64=False``), so this only restores the dtype for the shared assertion in float32."""
    return out.to(like.dtype)


def _seeded(name, heads, head_dim, **options):
    torch.manual_seed(1)
    return build_mechanism(name, heads, head_dim, **options)


def _delta_mechanism(x):
    return _seeded("delta", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)(x.q, x.k, x.v, causal=True)


def _delta_mechanism_in_fla(x):
    """The ``delta`` mechanism written out: L2-normalised q and k, ``beta = sigmoid(k . w + b)`` from the raw
    keys, then fla's chunkwise core."""
    module = _seeded("delta", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)
    beta = torch.sigmoid(torch.einsum("bhnd,hd->bhn", x.k, module.beta_weight) + module.beta_bias[:, None])
    with torch.no_grad():
        return delta_rule_chunkwise(F.normalize(x.q, dim=-1), F.normalize(x.k, dim=-1), x.v, beta, chunk_size=64)[0]


def _gated_delta_mechanism(x):
    return _seeded("gated_delta", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)(x.q, x.k, x.v, causal=True)


def _gated_delta_mechanism_in_fla(x):
    """The ``gated_delta`` mechanism written out: Mamba-2's decay ``-exp(A_log) softplus(k . w + dt_bias)``."""
    module = _seeded("gated_delta", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)
    beta = torch.sigmoid(torch.einsum("bhnd,hd->bhn", x.k, module.beta_weight) + module.beta_bias[:, None])
    step = F.softplus(torch.einsum("bhnd,hd->bhn", x.k, module.decay_weight) + module.dt_bias[:, None])
    log_decay = -module.A_log.exp()[:, None] * step
    with torch.no_grad():
        q, k = F.normalize(x.q, dim=-1), F.normalize(x.k, dim=-1)
        return _in_dtype(_fla(naive_chunk_gated_delta_rule, q, k, x.v, log_decay, beta, chunk_size=64), x.q)


def _channel_decay(x):
    """A seeded log decay per key channel, (batch, heads, seq, d_k), between -0.5 and 0."""
    return -0.5 * torch.rand(*x.k.shape, generator=torch.Generator().manual_seed(7), dtype=x.k.dtype)


def _kda_ours(x):
    return gated_delta_rule(x.q, x.k, x.v, x.beta, _channel_decay(x), chunk_size=32)


def _kda_in_fla(reference, **options):
    def theirs(x):
        return _in_dtype(_fla(reference, x.q, x.k, x.v, _channel_decay(x), x.beta, **options), x.q)
    return theirs


def _kda_mechanism(x):
    return _seeded("kda", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)(x.q, x.k, x.v, causal=True)


def _kda_mechanism_in_fla(x):
    """The ``kda`` mechanism written out: KDA's gate ``-exp(A_log) softplus(k W_down W_up + dt_bias)`` per
    channel and beta from the raw keys, then fla's chunked KDA on L2-normalised q and k."""
    module = _seeded("kda", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)
    beta = torch.sigmoid(torch.einsum("bhnd,hd->bhn", x.k, module.beta_weight) + module.beta_bias[:, None])
    low_rank = torch.einsum("bhnd,hdr,hre->bhne", x.k, module.gate_down, module.gate_up)
    log_decay = -module.A_log.exp()[:, None, None] * F.softplus(low_rank + module.dt_bias[:, None, :])
    with torch.no_grad():
        q, k = F.normalize(x.q, dim=-1), F.normalize(x.k, dim=-1)
        return _in_dtype(_fla(naive_chunk_kda, q, k, x.v, log_decay, beta, chunk_size=64), x.q)


# -- delta_product: n_h steps per position, interleaved along fla's sequence ------------------------------------
def _product_steps(x, steps, beta_range=1.0):
    """Each position's ``steps`` unit keys, values and betas in attnzoo's (batch, heads, seq, n_h, ...) layout,
    made from the shared inputs: step j's key mixes k and q, its value is v turned by j channels, its beta
    ``beta_range`` times beta or 1 - beta alternately."""
    keys = torch.stack([F.normalize(x.k + 0.5 * j * x.q, dim=-1) for j in range(steps)], dim=3)
    values = torch.stack([x.v.roll(j, dims=-1) for j in range(steps)], dim=3)
    betas = torch.stack([x.beta if j % 2 == 0 else 1 - x.beta for j in range(steps)], dim=3) * beta_range
    return keys, values, betas


def _interleaved_for_fla(x):
    """(batch, heads, seq, n_h, ...) -> fla's (batch, seq * n_h, heads, ...)."""
    return to_fla(x.flatten(2, 3))


def _product_ours(steps, gated=True, beta_range=1.0):
    def ours(x):
        k, v, beta = _product_steps(x, steps, beta_range)
        return delta_product(x.q, k, v, beta, x.log_decay if gated else None, chunk_size=16)
    return ours


def _product_in_fla(steps, gated=True, beta_range=1.0):
    def theirs(x):
        k, v, beta = _product_steps(x, steps, beta_range)
        out = naive_recurrent_gated_delta_product(
            to_fla(x.q), _interleaved_for_fla(k), _interleaved_for_fla(v), to_fla(x.log_decay) if gated else None,
            _interleaved_for_fla(beta), x.scale, num_householder=steps)[0]
        return _in_dtype(from_fla(out), x.q)
    return theirs


def _delta_product_mechanism(x):
    module = _seeded("delta_product", x.q.shape[1], x.q.shape[3], chunk_size=16, negative_eigenvalues=True)
    return module.to(x.q.dtype)(x.q, x.k, x.v, causal=True)


def _delta_product_mechanism_in_fla(x):
    """The ``delta_product`` mechanism written out: the first step's key ``normalize(k)`` and value ``v``, step
    j's ``normalize(W_j k)`` and ``U_j v``, beta ``2 sigmoid(k . w_j + b_j)`` (negative eigenvalues),
    gated_delta's decay, L2-normalised q."""
    module = _seeded("delta_product", x.q.shape[1], x.q.shape[3], chunk_size=16, negative_eigenvalues=True)
    module = module.to(x.q.dtype)
    steps = module.householder_steps
    with torch.no_grad():
        beta = 2 * torch.sigmoid(torch.einsum("bhnd,hjd->bhnj", x.k, module.beta_weight) + module.beta_bias[:, None])
        step = F.softplus(torch.einsum("bhnd,hd->bhn", x.k, module.decay_weight) + module.dt_bias[:, None])
        log_decay = -module.A_log.exp()[:, None] * step
        mapped_keys = F.normalize(torch.einsum("hjed,bhnd->bhnje", module.key_maps, x.k), dim=-1)
        keys = torch.cat([F.normalize(x.k, dim=-1).unsqueeze(3), mapped_keys], dim=3)
        values = torch.cat([x.v.unsqueeze(3), torch.einsum("hjed,bhnd->bhnje", module.value_maps, x.v)], dim=3)
        out = naive_recurrent_gated_delta_product(
            to_fla(F.normalize(x.q, dim=-1)), _interleaved_for_fla(keys), _interleaved_for_fla(values),
            to_fla(log_decay), _interleaved_for_fla(beta), x.scale, num_householder=steps)[0]
    return _in_dtype(from_fla(out), x.q)


def _retention_in_fla(x):
    return naive_retention(x.q, x.k, x.v)


def _scalar_gate_kernel(x):
    """attnzoo's decayed kernel attention with identity features and the scale on the queries: ``gla``'s core."""
    return kernel_attention(x.q * x.scale, x.k, x.v, causal=True, log_decay=x.log_decay, normalizer="none")


def _gla_in_fla(x):
    per_key_dimension = x.log_decay.unsqueeze(-1).expand_as(x.k)  # one scalar gate broadcast over d_k
    return _in_dtype(_fla(naive_recurrent_gla, x.q, x.k, x.v, per_key_dimension), x.q)


def _linear_in_fla(function):
    def theirs(x):
        return _fla(function, elu_plus_one(x.q), elu_plus_one(x.k), x.v, normalize=True)
    return theirs


def _unnormalised_linear(x):
    return kernel_attention(elu_plus_one(x.q) * x.scale, elu_plus_one(x.k), x.v, causal=True, normalizer="none")


def _chunk_linear_unnormalised(x):
    return _fla(naive_chunk_linear_attn, elu_plus_one(x.q), elu_plus_one(x.k), x.v)


# -- ssd: Mamba-2's names on the shared inputs ----------------------------------------------------------------
def _ssd_gates(x):
    """x = v, C = q, B = k (one group per head), positive step sizes dt in (0.05, 1.05) from beta, and per-head
    rates A from -0.05 to -1: returns (dt (batch, heads, seq), A (heads,))."""
    return 0.05 + x.beta, -torch.linspace(0.05, 1.0, x.q.shape[1], dtype=x.q.dtype)


def _ssd_ours(x):
    dt, A = _ssd_gates(x)
    return ssd(x.v, dt, A, x.k, x.q, chunk_size=32)


def _ssd_in_fla(function):
    """SSD is simple GLA with q = C, k = dt B, v = x, g = dt A and no query scale (fla's default is
    head_dim ** -0.5, so ``scale=1.0`` is passed)."""
    def theirs(x):
        dt, A = _ssd_gates(x)
        log_decay = dt * A[:, None]
        return _in_dtype(_fla(function, x.q, x.k * dt[..., None], x.v, log_decay, scale=1.0), x.q)
    return theirs


def _ssd_grouped_ours(x):
    """One group of B and C shared by every head, and the skip D."""
    dt, A = _ssd_gates(x)
    skip = torch.linspace(0.5, 1.5, x.q.shape[1], dtype=x.q.dtype)
    return ssd(x.v, dt, A, x.k[:, :1], x.q[:, :1], D=skip, chunk_size=32)


def _ssd_grouped_in_fla(x):
    """fla has no groups and no skip: B and C repeated over the heads, ``D x`` added to its output."""
    dt, A = _ssd_gates(x)
    skip = torch.linspace(0.5, 1.5, x.q.shape[1], dtype=x.q.dtype)
    C, B = x.q[:, :1].expand_as(x.q), x.k[:, :1].expand_as(x.k)
    out = _fla(naive_chunk_simple_gla, C, B * dt[..., None], x.v, dt * A[:, None], scale=1.0)
    return _in_dtype(out, x.q) + skip[:, None, None] * x.v


def _ssd_mechanism(x):
    return _seeded("ssd", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)(x.q, x.k, x.v, causal=True)


def _ssd_mechanism_in_fla(x):
    """The ``ssd`` mechanism written out: ``dt = softplus(k . w + dt_bias)`` from the raw keys, ``A = -exp(A_log)``,
    then fla's chunked simple GLA with keys ``dt k``, log decay ``dt A`` and scale 1."""
    module = _seeded("ssd", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)
    with torch.no_grad():
        dt = F.softplus(torch.einsum("bhnd,hd->bhn", x.k, module.dt_weight) + module.dt_bias[:, None])
        log_decay = -module.A_log.exp()[:, None] * dt
        out = _fla(naive_chunk_simple_gla, x.q, x.k * dt[..., None], x.v, log_decay, scale=1.0)
    return _in_dtype(out, x.q)


# -- forgetting: fla's g is attnzoo's log_forget --------------------------------------------------------------
def _forgetting_in_fla(x, kv_heads=None, scale=None):
    k, v = (x.k, x.v) if kv_heads is None else (x.k[:, :kv_heads], x.v[:, :kv_heads])
    return _in_dtype(_fla(naive_forgetting_attn, x.q, k, v, x.log_decay, scale=scale), x.q)


def _forgetting_mechanism(x):
    module = _seeded("forgetting", x.q.shape[1], x.q.shape[3], block_size=32).to(x.q.dtype)
    return module(x.q, x.k, x.v, causal=True)


def _forgetting_mechanism_in_fla(x):
    """The ``forgetting`` mechanism written out: ``g = log sigmoid(k . w + b)`` from the raw keys."""
    module = _seeded("forgetting", x.q.shape[1], x.q.shape[3], block_size=32).to(x.q.dtype)
    with torch.no_grad():
        g = F.logsigmoid(torch.einsum("bhnd,hd->bhn", x.k, module.gate_weight) + module.gate_bias[:, None])
        return _in_dtype(_fla(naive_forgetting_attn, x.q, x.k, x.v, g), x.q)


def _window_in_fla(q, k, v, window):
    """Causal softmax over the last ``window`` keys: fla's forgetting attention with every gate 1 (g = 0) and
    its ``window_size`` (the pure-PyTorch form of the ``flash_attn_func(..., window_size=(window - 1, 0))``
    that fla's NSA reference calls for its window branch)."""
    no_forgetting = torch.zeros(q.shape[:3], dtype=q.dtype)
    return _in_dtype(_fla(naive_forgetting_attn, q, k, v, no_forgetting, window_size=window), q)


# -- nsa: the branches of fla.ops.nsa.naive.naive_nsa, composed as it composes them ----------------------------
NSA_BLOCK, NSA_TOP_K, NSA_WINDOW = 16, 4, 24
NSA_SETTINGS = dict(compress_block=NSA_BLOCK, compress_stride=NSA_BLOCK, select_block=NSA_BLOCK, top_k=NSA_TOP_K,
                    window=NSA_WINDOW)
"""Where attnzoo's NSA and fla's compute the same thing: non-overlapping compressed blocks as long as the
selectable ones (fla has one ``block_size``), and ``top_k >= 3`` (fla always selects the first, previous and
own blocks)."""


def _block_means(x):
    """fla's ``mean_pooling`` (a Triton kernel) written out on (batch, heads, seq, dim): the mean of each block of
    ``NSA_BLOCK`` positions, a shorter last block averaged over its own positions."""
    return torch.stack([block.mean(2) for block in x.split(NSA_BLOCK, dim=2)], dim=2)


def _nsa_gates(x, branches=(1.0, 1.0, 1.0)):
    """(batch, heads, seq, 3) in (0, 1): compressed, selected, window; each multiplied by ``branches``."""
    gates = torch.stack([x.beta, torch.sigmoid(4 * x.log_decay + 1), 1 - x.beta], dim=-1)
    return gates * torch.tensor(branches, dtype=x.q.dtype)


def _nsa_ours(branches=(1.0, 1.0, 1.0), kv_heads=None):
    """attnzoo's NSA on the shared inputs; with ``kv_heads``, keys and values of that many heads repeated over
    the query heads and one selection per group of heads (``selection_group``), the paper's sharing."""
    def ours(x):
        k, v, group = x.k, x.v, 1
        if kv_heads is not None:
            group = x.q.shape[1] // kv_heads
            k, v = (t[:, :kv_heads].repeat_interleave(group, dim=1) for t in (x.k, x.v))
        blocks = NSABlocks(**NSA_SETTINGS, selection_group=group)
        return nsa_attention(x.q, k, v, _nsa_gates(x, branches), blocks)
    return ours


def _nsa_composed_in_fla(x, gates, k, v):
    """fla's ``naive_nsa`` without its two GPU-only pieces: compression (``naive_nsa_compression`` over mean-pooled
    blocks), ``naive_nsa_topk`` choosing ``NSA_TOP_K`` blocks for ``naive_nsa_selection``, and the window; gated
    and summed as it sums them. k, v may have fewer heads than q (fla's group shares one selection)."""
    scale = x.scale
    q, fla_k, fla_v = to_fla(x.q), to_fla(k), to_fla(v)
    k_cmp, v_cmp = to_fla(_block_means(k)), to_fla(_block_means(v))
    compressed = naive_nsa_compression(q, k_cmp, v_cmp, NSA_BLOCK, scale)[0]
    chosen = naive_nsa_topk(q, k_cmp, NSA_TOP_K, NSA_BLOCK, scale)
    selected = naive_nsa_selection(q, fla_k, fla_v, chosen, NSA_BLOCK, scale)
    branches = [from_fla(compressed), from_fla(selected)]
    groups = x.q.shape[1] // k.shape[1]
    window = _window_in_fla(x.q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), NSA_WINDOW)
    return sum(gates[..., i:i + 1] * _in_dtype(branch, x.q) for i, branch in enumerate(branches + [window]))


def _nsa_in_fla(branches=(1.0, 1.0, 1.0), kv_heads=None):
    def theirs(x):
        k, v = (x.k, x.v) if kv_heads is None else (x.k[:, :kv_heads], x.v[:, :kv_heads])
        return _nsa_composed_in_fla(x, _nsa_gates(x, branches), k, v)
    return theirs


def _nsa_mechanism(x):
    return _seeded("nsa", x.q.shape[1], x.q.shape[3], **NSA_SETTINGS).to(x.q.dtype)(x.q, x.k, x.v, causal=True)


def _nsa_mechanism_in_fla(x):
    """The ``nsa`` mechanism written out: gates ``sigmoid(q . w + c)`` per branch from the queries, its
    compression maps at their start (the identity: mean pooling, fla's)."""
    module = _seeded("nsa", x.q.shape[1], x.q.shape[3], **NSA_SETTINGS).to(x.q.dtype)
    with torch.no_grad():
        gates = torch.sigmoid(torch.einsum("bhnd,hgd->bhng", x.q, module.gate_weight) + module.gate_bias[:, None])
        return _nsa_composed_in_fla(x, gates, x.k, x.v)


# -- based: the Taylor part against naive_parallel_based, the window against forgetting attention with g = 0 ---
BASED_FEATURES, BASED_WINDOW = 4, 16


def _based_projections(x):
    """Per-head maps (heads, head_dim, feature_dim) of queries and keys, seeded."""
    g = torch.Generator().manual_seed(2)
    heads, dim = x.q.shape[1], x.q.shape[3]
    return [torch.randn(heads, dim, BASED_FEATURES, generator=g, dtype=x.q.dtype) / dim ** 0.5 for _ in range(2)]


def _based_linear_ours(x):
    """attnzoo's Taylor part: ``phi(q') . phi(k') = 1 + s + s^2 / 2`` on the kernelized core, exact normaliser."""
    q_proj, k_proj = _based_projections(x)
    return kernel_attention(*based_features(x.q, x.k, q_proj, k_proj), x.v, causal=True)


def _projected(x, q_proj, k_proj):
    return torch.einsum("bhnd,hdm->bhnm", x.q, q_proj), torch.einsum("bhnd,hdm->bhnm", x.k, k_proj)


def _based_linear_in_fla(x):
    """fla's ``naive_parallel_based`` with ``use_norm=True`` divides by ``z + 1e-6``; attnzoo by ``z`` (z >= 1/2
    per visible key), so the two differ by at most 2e-6 of an output: within float32's 1e-5."""
    return naive_parallel_based(*_projected(x, *_based_projections(x)), x.v, use_norm=True)


def _based_linear_exact_in_fla(x):
    """``use_norm=False`` on the values with a column of ones appended gives fla's numerator and normaliser
    ``z`` without the 1e-6: their ratio is attnzoo's output to float64's precision."""
    ones = torch.ones_like(x.v[..., :1])
    both = naive_parallel_based(*_projected(x, *_based_projections(x)), torch.cat([x.v, ones], -1), use_norm=False)
    return both[..., :-1] / both[..., -1:]


def _based_mechanism(x):
    module = _seeded("based", x.q.shape[1], x.q.shape[3], feature_dim=BASED_FEATURES, window=BASED_WINDOW,
                     chunk_size=32).to(x.q.dtype)
    return module(x.q, x.k, x.v, causal=True)


def _based_mechanism_in_fla(x):
    """The ``based`` mechanism written out: its projections into ``naive_parallel_based`` (whose default scale,
    ``feature_dim ** -0.5`` on the projected queries, is attnzoo's), plus the window part."""
    module = _seeded("based", x.q.shape[1], x.q.shape[3], feature_dim=BASED_FEATURES, window=BASED_WINDOW,
                     chunk_size=32).to(x.q.dtype)
    with torch.no_grad():
        linear = naive_parallel_based(*_projected(x, module.q_proj, module.k_proj), x.v)
        return linear + _window_in_fla(x.q, x.k, x.v, BASED_WINDOW)


# -- dplr / rwkv7: fla's alpha is attnzoo's a (the read), its beta attnzoo's b (the write) ----------------------
def _dplr_vectors(x):
    """RWKV-7's vectors on the shared inputs: a = -kappa, b = kappa * alpha (kappa a unit key, alpha in (0, 1)
    per channel) and a per-channel log decay from the shared one, each (batch, heads, seq, d_k)."""
    kappa = F.normalize(x.q - x.k, dim=-1)
    alpha = torch.sigmoid(3 * x.q)
    log_decay = x.log_decay.unsqueeze(-1) * torch.linspace(0.2, 2.0, x.k.shape[-1], dtype=x.k.dtype)
    return -kappa, kappa * alpha, log_decay


def _dplr_ours(x):
    return dplr_delta_rule(x.q, x.k, x.v, *_dplr_vectors(x), chunk_size=32)


def _dplr_in_fla(function, **options):
    def theirs(x):
        a, b, log_decay = _dplr_vectors(x)
        with torch.no_grad():
            return _in_dtype(function(x.q, x.k, x.v, a, b, log_decay, **options)[0], x.q)
    return theirs


def _rwkv7_mechanism(x):
    return _seeded("rwkv7", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)(x.q, x.k, x.v, causal=True)


def _rwkv7_mechanism_in_fla(x):
    """The ``rwkv7`` mechanism written out: its LoRAs and per-channel maps of the raw keys, then fla's DPLR."""
    module = _seeded("rwkv7", x.q.shape[1], x.q.shape[3], chunk_size=32).to(x.q.dtype)
    with torch.no_grad():
        decay_hidden = torch.tanh(torch.einsum("bhnd,hdr->bhnr", x.k, module.w1))
        decay_logits = torch.einsum("bhnr,hrd->bhnd", decay_hidden, module.w2) + module.w0[:, None]
        log_decay = -math.exp(-0.5) * torch.sigmoid(decay_logits)
        alpha = torch.sigmoid(torch.einsum("bhnr,hrd->bhnd", torch.einsum("bhnd,hdr->bhnr", x.k, module.a1),
                                           module.a2) + module.a0[:, None])
        kappa = F.normalize(x.k * module.k_k[:, None], dim=-1)
        k = x.k * (1 + (alpha - 1) * module.k_a[:, None])
        out = dplr_recurrence(x.q, k, x.v, -kappa, kappa * alpha, log_decay)[0]
    return _in_dtype(out, x.q)


CASES = [
    # delta: functional.delta_rule, chunk 32 here against fla's chunk 64 and its per-token recurrence.
    FlaCase("delta/recurrence", lambda x: delta_rule(x.q, x.k, x.v, x.beta, chunk_size=32),
            lambda x: delta_rule_recurrence(x.q, x.k, x.v, x.beta)[0]),
    FlaCase("delta/chunkwise", lambda x: delta_rule(x.q, x.k, x.v, x.beta, chunk_size=32),
            lambda x: delta_rule_chunkwise(x.q, x.k, x.v, x.beta, chunk_size=64)[0], float64=True),
    FlaCase("delta/mechanism", _delta_mechanism, _delta_mechanism_in_fla, float64=True),
    # gated_delta: functional.gated_delta_rule; fla's g is attnzoo's log_decay.
    FlaCase("gated_delta/recurrence", lambda x: gated_delta_rule(x.q, x.k, x.v, x.beta, x.log_decay, chunk_size=32),
            lambda x: _in_dtype(_fla(naive_recurrent_gated_delta_rule, x.q, x.k, x.v, x.beta, x.log_decay), x.q)),
    FlaCase("gated_delta/chunk", lambda x: gated_delta_rule(x.q, x.k, x.v, x.beta, x.log_decay, chunk_size=32),
            lambda x: _in_dtype(_fla(naive_chunk_gated_delta_rule, x.q, x.k, x.v, x.log_decay, x.beta), x.q)),
    FlaCase("gated_delta/mechanism", _gated_delta_mechanism, _gated_delta_mechanism_in_fla),
    # kda: functional.gated_delta_rule with a log decay per key channel; fla's g is that log decay.
    FlaCase("kda/recurrent", _kda_ours, _kda_in_fla(naive_recurrent_kda)),
    FlaCase("kda/chunk", _kda_ours, _kda_in_fla(naive_chunk_kda, chunk_size=64)),
    FlaCase("kda/mechanism", _kda_mechanism, _kda_mechanism_in_fla),
    # delta_product: functional.delta_product (chunk 16 positions) against fla's per-token recurrence, which
    # computes in float32 only; n_h = 1 (the gated delta rule), 2 and 3, beta up to 2, no decay.
    FlaCase("delta_product/one_step", _product_ours(1), _product_in_fla(1)),
    FlaCase("delta_product/two_steps", _product_ours(2), _product_in_fla(2)),
    FlaCase("delta_product/three_steps_negative_eigenvalues", _product_ours(3, beta_range=2.0),
            _product_in_fla(3, beta_range=2.0)),
    FlaCase("delta_product/no_decay", _product_ours(2, gated=False), _product_in_fla(2, gated=False)),
    FlaCase("delta_product/mechanism", _delta_product_mechanism, _delta_product_mechanism_in_fla, sizes=dict(d_v=16)),
    # retention: RetNet's decays 1 - 2^(-5 - h) on both sides; attnzoo's row normalisation off.
    FlaCase("retention/mechanism",
            lambda x: _seeded("retention", x.q.shape[1], x.q.shape[3], normalize=False)(x.q, x.k, x.v, causal=True),
            _retention_in_fla),
    # gla and simple_gla: a scalar gate per head and position, unnormalised.
    FlaCase("gla/recurrent_gla", _scalar_gate_kernel, _gla_in_fla),
    FlaCase("gla/recurrent_simple_gla", _scalar_gate_kernel,
            lambda x: _in_dtype(_fla(naive_recurrent_simple_gla, x.q, x.k, x.v, x.log_decay), x.q)),
    FlaCase("gla/chunk_simple_gla", _scalar_gate_kernel,
            lambda x: _in_dtype(_fla(naive_chunk_simple_gla, x.q, x.k, x.v, x.log_decay), x.q)),
    # linear: elu + 1 features, normalised (attnzoo's linear_attention) and unnormalised.
    FlaCase("linear/recurrent", lambda x: linear_attention(x.q, x.k, x.v, causal=True),
            _linear_in_fla(naive_recurrent_linear_attn)),
    FlaCase("linear/chunk", lambda x: linear_attention(x.q, x.k, x.v, causal=True),
            _linear_in_fla(naive_chunk_linear_attn), float64=True),
    FlaCase("linear/chunk_unnormalised", _unnormalised_linear, _chunk_linear_unnormalised, float64=True),
    # ssd: Mamba-2's SSD as simple GLA: q = C, k = dt B, v = x, g = dt A, scale 1.
    FlaCase("ssd/recurrent_simple_gla", _ssd_ours, _ssd_in_fla(naive_recurrent_simple_gla)),
    FlaCase("ssd/chunk_simple_gla", _ssd_ours, _ssd_in_fla(naive_chunk_simple_gla)),
    FlaCase("ssd/groups_and_skip", _ssd_grouped_ours, _ssd_grouped_in_fla),
    FlaCase("ssd/mechanism", _ssd_mechanism, _ssd_mechanism_in_fla),
    # forgetting: fla's g (batch, seq, heads) is attnzoo's log_forget; grouped keys native on both sides.
    FlaCase("forgetting/functional", lambda x: forgetting_attention(x.q, x.k, x.v, x.log_decay, block_size=32),
            _forgetting_in_fla),
    FlaCase("forgetting/grouped_and_scaled",
            lambda x: forgetting_attention(x.q, x.k[:, :1], x.v[:, :1], x.log_decay, scale=0.7, block_size=32),
            lambda x: _forgetting_in_fla(x, kv_heads=1, scale=0.7)),
    FlaCase("forgetting/mechanism", _forgetting_mechanism, _forgetting_mechanism_in_fla),
    # nsa: each branch alone, then gated together; compress_block = compress_stride = select_block.
    FlaCase("nsa/compressed", _nsa_ours((1.0, 0.0, 0.0)), _nsa_in_fla((1.0, 0.0, 0.0))),
    FlaCase("nsa/selected", _nsa_ours((0.0, 1.0, 0.0)), _nsa_in_fla((0.0, 1.0, 0.0))),
    FlaCase("nsa/window", _nsa_ours((0.0, 0.0, 1.0)), _nsa_in_fla((0.0, 0.0, 1.0))),
    FlaCase("nsa/gated", _nsa_ours(), _nsa_in_fla()),
    FlaCase("nsa/gated_ragged_length", _nsa_ours(), _nsa_in_fla(), sizes=dict(length=120)),
    FlaCase("nsa/shared_selection", _nsa_ours(kv_heads=1), _nsa_in_fla(kv_heads=1)),
    FlaCase("nsa/mechanism", _nsa_mechanism, _nsa_mechanism_in_fla, sizes=dict(d_v=16)),
    # based: the Taylor part (fla's 1e-6 guard aside) and the mechanism with its window.
    FlaCase("based/linear", _based_linear_ours, _based_linear_in_fla),
    FlaCase("based/linear_exact_normaliser", _based_linear_ours, _based_linear_exact_in_fla, float64=True),
    FlaCase("based/mechanism", _based_mechanism, _based_mechanism_in_fla),
    # dplr and rwkv7: the generalized delta rule against fla's DPLR references (float32: they cast to it).
    FlaCase("dplr/recurrence", _dplr_ours, _dplr_in_fla(dplr_recurrence)),
    FlaCase("dplr/chunkwise", _dplr_ours, _dplr_in_fla(dplr_chunkwise, chunk_size=32)),
    FlaCase("rwkv7/mechanism", _rwkv7_mechanism, _rwkv7_mechanism_in_fla),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_equals_fla_reference_in_float32(case):
    assert_matches(case, torch.float32)


@pytest.mark.parametrize("case", [case for case in CASES if case.float64], ids=lambda case: case.name)
def test_equals_fla_reference_in_float64(case):
    assert_matches(case, torch.float64)


def test_a_wrong_mapping_is_caught():
    """The comparison can fail: fla's delta rule with beta halved is not attnzoo's."""
    case = FlaCase("delta/wrong beta", lambda x: delta_rule(x.q, x.k, x.v, x.beta),
                   lambda x: delta_rule_chunkwise(x.q, x.k, x.v, x.beta / 2, chunk_size=64)[0])
    with pytest.raises(AssertionError, match="wrong beta"):
        assert_matches(case, torch.float32)



PEER_OPTIONS = {"nsa": NSA_SETTINGS, "based": {"feature_dim": BASED_FEATURES, "window": BASED_WINDOW}}
"""Options given to both rows (``attnzoo compare --set``): NSA's where fla's reference computes the same thing,
Based's smaller than its defaults so that the window is narrower than the sequence."""


@pytest.mark.parametrize("mechanism, peer", [("delta", "fla-delta_rule"), ("gated_delta", "fla-gated_delta_rule"),
                                             ("linear", "fla-linear_attn"), ("ssd", "fla-simple_gla"),
                                             ("forgetting", "fla-forgetting_attn"), ("based", "fla-based"),
                                             ("nsa", "fla-nsa")])
def test_compare_peers_compute_what_their_counterparts_compute(mechanism, peer):
    """`attnzoo compare --peers` times fla's references at equal settings: built under one seed, the peer row
    and the attnzoo row give the same outputs."""
    from attnzoo.bench.peers import build_peer

    options = PEER_OPTIONS.get(mechanism, {})
    torch.manual_seed(0)
    ours = build_mechanism(mechanism, 2, 16, **options)
    torch.manual_seed(0)
    theirs = build_peer(peer, 2, 16, 128, True, options)
    assert not isinstance(theirs, str), theirs
    q, k, v = torch.randn(3, 1, 2, 128, 16, generator=torch.Generator().manual_seed(1)).unbind(0)
    with torch.no_grad():
        torch.testing.assert_close(ours(q, k, v, causal=True), theirs(q, k, v, True), rtol=0, atol=1e-5)


@pytest.mark.parametrize("options, refused", [
    ({}, "one block_size"),  # the defaults: overlapping compressed blocks, longer selectable ones
    (dict(NSA_SETTINGS, top_k=2), "top_k >= 3"),
    (dict(NSA_SETTINGS, selection_group=2), "selection per key/value head"),
])
def test_the_nsa_peer_refuses_settings_where_fla_computes_something_else(options, refused):
    from attnzoo.bench.peers import build_peer

    reason = build_peer("fla-nsa", 2, 16, 128, True, options)
    assert isinstance(reason, str) and reason.startswith("unsupported") and refused in reason, reason
