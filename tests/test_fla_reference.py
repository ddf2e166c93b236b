"""attnzoo's functional cores (and the mechanisms around them) equal flash-linear-attention's pure-PyTorch
references (``fla.ops.<name>.naive``) at equal settings: same inputs, gates and scales mapped across, to 1e-5
in float32 and 1e-10 in float64 where the reference computes in float64.

Runs where the ``peers`` extra is installed (``scripts/install-peers.sh``); skipped otherwise, like the other
peer checks. What is shared, and how a mechanism adds its case in a line, is in ``tests/fla_reference.py``.

Where the definitions differ on purpose, the case maps one onto the other and says so:

* ``gla``: attnzoo's gate is one scalar per head and position (docs/gated.md); fla's GLA has one per key
  dimension, so the scalar is broadcast over the key dimensions (and equals fla's ``simple_gla`` as is).
  attnzoo's ``gla`` and ``retention`` normalise rows RetNet's way by default (``normalize=True``); fla's
  references do not normalise, so the comparison is with ``normalize=False`` / ``normalizer="none"``.
* ``linear``: fla's ``normalize=True`` divides by ``q . sum_j k_j + 1e-10`` on whatever features it is
  given; attnzoo's ``linear`` applies its feature map (elu + 1) itself, so fla gets the features, and
  the scale, which cancels in the ratio, only shifts fla's 1e-10 guard.
"""

import pytest
import torch
import torch.nn.functional as F

from attnzoo.functional import delta_rule, elu_plus_one, gated_delta_rule, kernel_attention, linear_attention
from attnzoo.mechanisms import build_mechanism
from fla_reference import FlaCase, assert_matches, from_fla, to_fla

pytest.importorskip("fla", reason='flash-linear-attention (fla-core) is in the "peers" extra: scripts/install-peers.sh')

from fla.ops.delta_rule.naive import delta_rule_chunkwise, delta_rule_recurrence  # noqa: E402
from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.gla.naive import naive_recurrent_gla  # noqa: E402
from fla.ops.linear_attn.naive import naive_chunk_linear_attn, naive_recurrent_linear_attn  # noqa: E402
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



@pytest.mark.parametrize("mechanism, peer", [("delta", "fla-delta_rule"), ("gated_delta", "fla-gated_delta_rule"),
                                             ("linear", "fla-linear_attn")])
def test_compare_peers_compute_what_their_counterparts_compute(mechanism, peer):
    """`attnzoo compare --peers` times fla's references at equal settings: built under one seed, the peer row
    and the attnzoo row give the same outputs."""
    from attnzoo.bench.peers import build_peer

    torch.manual_seed(0)
    ours = build_mechanism(mechanism, 2, 16)
    torch.manual_seed(0)
    theirs = build_peer(peer, 2, 16, 128, True)
    q, k, v = torch.randn(3, 1, 2, 128, 16, generator=torch.Generator().manual_seed(1)).unbind(0)
    with torch.no_grad():
        torch.testing.assert_close(ours(q, k, v, causal=True), theirs(q, k, v, True), rtol=0, atol=1e-5)
