"""The attention function and the mask function :mod:`attnzoo.dropin.hf` registers in ``transformers``.

The mask function runs once per forward, before any layer, and hands every layer one 4-D bool tensor (True =
attend), whose form depends on the mechanism (read from the model's ``config.attnzoo`` record):

* an exact mechanism (``Capabilities.kind == "exact"``) gets ``transformers``' own mask, (batch, 1, seq_q,
  seq_kv), made by its ``sdpa_mask`` from the same mask pattern (causal, bidirectional, sliding window) and
  the same positions (the KV cache's, a static cache's unfilled slots included) as for ``sdpa``: the attention
  function runs softmax under it, so whatever ``sdpa`` gets right, this gets right, and it compiles
  (``fullgraph=True``) with any cache;
* any other mechanism gets the key mask (batch, 1, 1, L), True = a token: the padding mask over the L keys that
  hold tokens. Causality comes from the attention module (``is_causal``), aligned bottom-right: query i is
  the i-th of the last ``seq_q`` positions of those L keys. With a dynamic cache (or none) L is the keys' own
  length; with a static cache (keys of the cache's full length, filled from the start) L is the number of
  filled slots, and the attention function drops the unfilled ones, which makes the call exactly the
  dynamic-cache call. Reading L from a static cache reads a tensor (the cache position), so that case runs
  eagerly (a graph break under ``torch.compile``); a layout it cannot map (a static sliding-window cache,
  whose slots wrap around) is refused before any layer runs.

A 4-D mask the user passes in (``transformers`` hands it to the layers as it is) reaches an exact mechanism
as a mask it honours, bool or additive; any other mechanism refuses it unless it is a bool key mask
(batch, 1, 1, seq_kv), naming ``attention_mask``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional.grouped import per_query_group, repeat_kv
from ..mechanisms.base import NATIVE_KV, Mechanism, UnsupportedOptionError
from ..mechanisms.registry import build_mechanism

IMPLEMENTATION = "attnzoo"
"""The name under which the attention and mask functions are registered in ``transformers``."""

MECHANISM_ATTRIBUTE = "attnzoo_mechanism"
"""The attribute (a submodule) of each attention module that holds its mechanism."""

RECORD_ATTRIBUTE = "attnzoo"
"""The attribute of a swapped model's config that records the swap: ``{"mechanism": name, "options": {...}}``
(and ``"layers": [...]`` for a swap of some layers only); ``save_pretrained`` writes it to config.json."""

KEY_MASK_ONLY = "attnzoo_key_mask_only"
"""The attribute (a bool) of an attention module that a swap of some layers kept on softmax while the others run
an inexact mechanism: the mask it is handed is then the key mask, so its exact softmax runs like any other
mechanism (causal from the module, over the key padding) instead of under the mask."""

_HF: Dict[str, Any] = {}
"""``transformers``' own ``sdpa_mask`` and its output collector, filled in when the functions are registered
(``transformers`` is imported only then)."""


def load_hint(config: Any) -> str:
    """What to call to get a working model: the record's mechanism when the config has one."""
    record = getattr(config, RECORD_ATTRIBUTE, None)
    if isinstance(record, dict) and "mechanism" in record:
        return (f"this model was saved running attnzoo mechanism {record['mechanism']!r}: load it with "
                f"attnzoo.dropin.hf.from_pretrained(ModelClass, path), which restores the mechanism and its tensors")
    return "call attnzoo.dropin.hf.use_attnzoo(model, mechanism) on the model"


@lru_cache(maxsize=64)
def _record_is_exact(mechanism: str, options_repr: str, options: Tuple[Tuple[str, Any], ...]) -> bool:
    """Whether the recorded mechanism, with its options, computes exact softmax attention (an option may narrow
    it, e.g. a null key). Built once per record, tiny, on the CPU."""
    return build_mechanism(mechanism, heads=1, head_dim=1, **dict(options)).capabilities.exact


def config_is_exact(config: Any) -> bool:
    """Whether the mechanism recorded in ``config`` is exact; raises for a config without a record."""
    record = getattr(config, RECORD_ATTRIBUTE, None)
    if not isinstance(record, dict) or "mechanism" not in record:
        raise RuntimeError(f"attn_implementation={IMPLEMENTATION!r} without an attnzoo record in the config: "
                           + load_hint(config))
    options = record.get("options") or {}
    items = tuple(sorted(options.items()))
    try:
        return _record_is_exact(record["mechanism"], repr(items), items)
    except TypeError:  # an unhashable option value (a list of decays): build it uncached
        return build_mechanism(record["mechanism"], heads=1, head_dim=1, **options).capabilities.exact


# -- the mask function ----------------------------------------------------------------------------------------
def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Optional[Tensor] = None,
    config: Any = None,
    **kwargs: Any,
) -> Optional[Tensor]:
    """``transformers``' mask-function signature. For an exact mechanism: ``transformers``' own 4-D bool mask
    (batch, 1, q_length, kv_length). Otherwise the key mask (batch, 1, 1, L), True = a token, over the L keys
    that hold tokens, or None when nothing is padded and every key holds one (module docstring)."""
    device = kwargs.get("device", attention_mask.device if attention_mask is not None else "cpu")
    if config_is_exact(config):
        return _HF["sdpa_mask"](
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False, device=device,
        )
    static_layout = isinstance(q_offset, Tensor) or kv_offset + kv_length != q_offset + q_length
    if static_layout:
        if kv_offset != 0:
            raise UnsupportedOptionError(
                f"a cache whose slots do not start at position 0 (kv_offset={kv_offset}, e.g. a static "
                f"sliding-window cache) with a mechanism other than an exact one: use a dynamic cache "
                f"(cache_implementation='dynamic'), or an exact mechanism"
            )
        filled = int(q_offset) + q_length  # reads the static cache's position: eager only
    else:
        filled = kv_length
    if attention_mask is None:
        if not static_layout:
            return None
        return torch.ones(batch_size, 1, 1, filled, dtype=torch.bool, device=device)
    start = 0 if static_layout else kv_offset
    mask = attention_mask.to(torch.bool)
    if mask.shape[-1] < start + filled:  # tokens not yet in the 2-D mask are tokens
        mask = F.pad(mask, (0, start + filled - mask.shape[-1]), value=True)
    return mask[:, start : start + filled].reshape(batch_size, 1, 1, filled)


# -- the attention function -----------------------------------------------------------------------------------
def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    output_attentions: bool = False,
    **kwargs: Any,
) -> Tuple[Tensor, Optional[Tensor]]:
    """``transformers``' attention-function signature: query (batch, heads, seq_q, head_dim), key and value
    (batch, kv_heads, seq_kv, head_dim) (the cache included), ``attention_mask`` from :func:`padding_mask` (or
    the user's 4-D mask), ``scaling`` the module's logit scale. Returns ((batch, seq_q, heads, head_dim), the
    attention weights (batch, heads, seq_q, seq_kv) when ``output_attentions`` and the mechanism is exact, else
    None)."""
    mechanism = getattr(module, MECHANISM_ATTRIBUTE, None)
    if not isinstance(mechanism, Mechanism):
        raise RuntimeError(f"{type(module).__name__} has no attnzoo mechanism (attn_implementation="
                           f"{IMPLEMENTATION!r} set without it): " + load_hint(getattr(module, "config", None)))
    groups = query.shape[1] // key.shape[1]
    output_attentions = _weights_requested(output_attentions)
    # Grouped-query attention (each key/value head serving `groups` query heads) stays grouped for a mechanism
    # that shares key/value heads natively, and for exact attention's fused path; otherwise it is repeated.
    native = mechanism.capabilities.grouped_kv == NATIVE_KV
    under_mask = mechanism.capabilities.exact and attention_mask is not None and not getattr(module, KEY_MASK_ONLY,
                                                                                              False)
    exact_fused = under_mask and not output_attentions
    if groups > 1 and not (native or exact_fused):
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if under_mask:
        return _exact(module, mechanism, query, key, value, attention_mask, scaling, dropout, output_attentions)
    if output_attentions:
        raise UnsupportedOptionError(
            f"output_attentions=True: {mechanism.name} forms no attention weight matrix (only an exact mechanism "
            f"does); call the model with output_attentions=False"
        )
    padding = None
    if attention_mask is not None:
        key, value, padding = _key_padding(attention_mask, key, value, query.shape[0])
    query = _scaled_queries(mechanism, query, scaling)
    out = _mechanism_call(mechanism, query, key, value, bool(getattr(module, "is_causal", False)), padding)
    if dropout > 0.0 and module.training:
        out = F.dropout(out, p=dropout)
    return out.transpose(1, 2).contiguous(), None


def _weights_requested(output_attentions: bool) -> bool:
    """Whether the caller wants the attention weights: ``output_attentions`` when the model passes it on, or
    ``transformers``' output collector asking for ``attentions`` (GPT-2 does not pass the flag to its attention
    function; the collector is what gathers the weights). The collector is a context variable, which
    ``torch.compile`` does not trace: compiled, only the flag counts."""
    if output_attentions:
        return True
    collector = _HF.get("collector")
    if collector is None or torch.compiler.is_compiling():
        return False
    collected = collector.get()
    return isinstance(collected, dict) and "attentions" in collected


def _exact(
    module: nn.Module, mechanism: Mechanism, query: Tensor, key: Tensor, value: Tensor, mask: Tensor,
    scaling: Optional[float], dropout: float, output_attentions: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Exact softmax attention under a 4-D mask (bool, True = attend, or additive), as ``sdpa`` computes it; the
    weights (batch, heads, seq_q, seq_kv) too when asked for. The logit scale is the mechanism's
    (:meth:`~attnzoo.Mechanism.logit_scale`: the module's own unless the swap set another), else the module's
    ``scaling``."""
    if mask.dim() != 4:
        raise UnsupportedOptionError(f"attention_mask of shape {tuple(mask.shape)}: a 4-D mask (batch, 1, seq_q, "
                                     f"seq_kv) was expected from the mask function")
    scale = mechanism.logit_scale() or scaling or 1.0 / math.sqrt(query.shape[-1])
    p = dropout if module.training else 0.0
    if not output_attentions:
        def sdpa(queries: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(queries, key, value, attn_mask=mask, dropout_p=p, scale=scale)

        # Grouped keys/values: each query group member against the shared heads, never repeated.
        out = sdpa(query) if key.shape[1] == query.shape[1] else per_query_group(sdpa, query, key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    # The weights asked for are per query head: keys and values are repeated for them.
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    logits = query @ key.transpose(-1, -2) * scale
    logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask
    # A row with every key masked (a left-padding query) gets zeros, as sdpa gives it, not NaN.
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = F.dropout(weights, p=p) @ value
    return out.transpose(1, 2).contiguous(), weights


def _key_padding(mask: Tensor, key: Tensor, value: Tensor, batch: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(key, value, key_padding_mask (batch, L), True = padding) from a key mask (batch, 1, 1, L): keys beyond
    L (a static cache's unfilled slots) are dropped. Refuses any other mask, naming ``attention_mask``."""
    k_len = key.shape[2]
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.dtype != torch.bool \
            or mask.shape[-1] > k_len:
        raise UnsupportedOptionError(
            f"attention_mask of shape {tuple(mask.shape)} and dtype {mask.dtype}: a mechanism other than an exact "
            f"one takes only a bool key mask (batch, 1, 1, seq_kv) (padding); a custom 4-D mask is an arbitrary "
            f"pattern on the logits, which it does not form"
        )
    length = mask.shape[-1]
    if length < k_len:  # a static cache: only the first `length` slots are filled
        key, value = key[:, :, :length], value[:, :, :length]
    return key, value, ~mask.reshape(batch, length)


def _scaled_queries(mechanism: Mechanism, query: Tensor, scaling: Optional[float]) -> Tensor:
    """The queries scaled so that the mechanism's ``1/sqrt(head_dim)`` logit scale becomes the module's
    ``scaling`` (checked at swap time: :func:`attnzoo.dropin.hf.scaling_route`). A mechanism whose logit scale
    an option set (its ``scale_option``) took it at swap time."""
    if scaling is None or mechanism.logit_scale() is not None:
        return query
    factor = scaling * math.sqrt(query.shape[-1])
    return query if math.isclose(factor, 1.0, rel_tol=1e-12) else query * factor


def _mechanism_call(
    mechanism: Mechanism, query: Tensor, key: Tensor, value: Tensor, causal: bool, padding: Optional[Tensor]
) -> Tensor:
    """The mechanism over the keys (bottom-right aligned when causal): self-attention, cross-attention from the
    cache, or the last rows of a causal call of a mechanism declaring ``causal_rows``."""
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len == k_len:
        return mechanism(query, key, value, causal=causal, key_padding_mask=padding)
    if mechanism.capabilities.cross:
        # Decoding from the KV cache: the new positions are the last ones, causal bottom-right alignment.
        return mechanism(query, key, value, causal=causal, key_padding_mask=padding, cross=True)
    if causal and mechanism.capabilities.causal_rows and q_len < k_len:
        # Row i of such a causal attention reads only query i and the keys up to it: the new rows are the last
        # rows of a causal pass in which the earlier (uncached) queries are zeros.
        queries = torch.cat([query.new_zeros(*query.shape[:2], k_len - q_len, query.shape[3]), query], dim=2)
        return mechanism(queries, key, value, causal=True, key_padding_mask=padding)[:, :, k_len - q_len :]
    raise UnsupportedOptionError(
        f"{mechanism.name}: {q_len} queries over {k_len} cached keys needs cross-attention or a causal form whose "
        f"rows read only their own query (capability causal_rows); generate with use_cache=False, or pick such a "
        f"mechanism"
    )


def register() -> None:
    """Register :func:`attention_forward` and :func:`padding_mask` under :data:`IMPLEMENTATION` (idempotent).
    Needs ``transformers``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _HF["sdpa_mask"] = sdpa_mask
    try:  # where transformers gathers output_attentions (a context variable), read by _weights_requested
        from transformers.utils.output_capturing import _active_collector

        _HF["collector"] = _active_collector
    except ImportError:  # pragma: no cover - an older layout: the flag alone counts
        pass
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, padding_mask)


__all__ = ["IMPLEMENTATION", "KEY_MASK_ONLY", "MECHANISM_ATTRIBUTE", "RECORD_ATTRIBUTE", "attention_forward", "config_is_exact",
           "load_hint", "padding_mask", "register"]
