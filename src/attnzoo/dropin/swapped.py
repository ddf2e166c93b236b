"""The module a swap puts in place of ``nn.MultiheadAttention``: its call signature around attnzoo's
:class:`~attnzoo.MultiHeadAttention`.

Self- or cross-attention is read from the call, as torch's own modules call attention: ``attn(x, x, x)`` (the
same tensor three times) is self-attention, anything else cross-attention (keys and values from ``key`` and
``value``), which needs a mechanism with cross-attention.

An exact mechanism (``Capabilities.kind == "exact"``: it computes softmax attention itself) takes any mask
torch takes, adding what attnzoo has no name for to the logits as torch does, and returns the attention weights
when ``need_weights=True``; the other mechanisms form no logits matrix and no weights, so an arbitrary mask is
refused (an :class:`~attnzoo.UnsupportedOptionError` naming ``attn_mask`` or ``key_padding_mask``), and so is
``need_weights=True`` unless the swap was made with ``attention_weights="none"``, which returns None in place of
the weights. :mod:`attnzoo.dropin.masks` translates the masks.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validation import check_bool, check_choice
from ..attention import MultiHeadAttention
from ..functional.masks import zero_padded
from ..mechanisms.base import UnsupportedOptionError
from ..mechanisms.registry import available, capabilities
from .masks import TranslatedMasks, translate_masks

SELF = "self-attention"
CROSS = "cross-attention"
EITHER = "self- or cross-attention, read from each call"
ROLES = (SELF, CROSS, EITHER)

WEIGHTS_CHOICES = ("error", "none")
"""``attention_weights``: what ``need_weights=True`` does with a mechanism that forms no weight matrix."""


def exact_mechanisms() -> List[str]:
    """The registered mechanisms that compute exact softmax attention (``Capabilities.kind == "exact"``): the
    ones that honour any mask and return the attention weights."""
    return [name for name in available() if capabilities(name).exact]


class SwappedAttention(nn.Module):
    """``nn.MultiheadAttention``'s interface around an attnzoo :class:`~attnzoo.MultiHeadAttention`.

    Made by :func:`swap_attention`; ``attention`` holds the projections (copied from the module it replaced) and
    the mechanism. Called as ``nn.MultiheadAttention`` is: ``(query, key, value, key_padding_mask=None,
    need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False)`` with inputs (batch, seq,
    embed_dim) when ``batch_first`` (else (seq, batch, embed_dim), or unbatched (seq, embed_dim)); returns
    ``(output, weights or None)`` shaped as torch returns them. The module docstring says how masks and
    ``need_weights`` are handled.
    """

    # No packed input projection exists here: these None values are what torch's encoder layer reads to decide
    # against its fast path (torch._transformer_encoder_layer_fwd reads the packed weights and would bypass
    # this module's forward).
    in_proj_weight: Optional[Tensor] = None
    in_proj_bias: Optional[Tensor] = None
    _qkv_same_embed_dim = False

    def __init__(
        self,
        attention: MultiHeadAttention,
        *,
        batch_first: bool,
        role: str = EITHER,
        attention_weights: str = "error",
    ) -> None:
        super().__init__()
        if not isinstance(attention, MultiHeadAttention):
            raise TypeError(f"attention must be an attnzoo MultiHeadAttention, got {type(attention).__name__}")
        self.attention = attention
        self.batch_first = check_bool("batch_first", batch_first)
        self.role = check_choice("role", role, ROLES)
        self.attention_weights = check_choice("attention_weights", attention_weights, WEIGHTS_CHOICES)
        self.embed_dim = attention.dim
        self.num_heads = attention.heads
        self.kdim = self.vdim = attention.context_dim
        self.head_dim = attention.head_dim
        # A checkpoint of the nn.MultiheadAttention this module replaced loads into it (torch's key names).
        self.register_load_state_dict_pre_hook(_torch_keys_to_swapped)

    @property
    def mechanism_name(self) -> str:
        return self.attention.mechanism_name

    def _is_exact(self) -> bool:
        """Whether the mechanism computes exact softmax attention (as narrowed by its options), which can take
        any mask and give the weights."""
        return self.attention.mechanism.capabilities.exact

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """As ``nn.MultiheadAttention.forward``. Output: (batch, seq_q, embed_dim) when ``batch_first`` (else
        (seq_q, batch, embed_dim); unbatched (seq_q, embed_dim)), and the weights (batch, seq_q, seq_kv), or
        (batch, heads, seq_q, seq_kv) with ``average_attn_weights=False``, or None."""
        check_bool("need_weights", need_weights)
        check_bool("average_attn_weights", average_attn_weights)
        check_bool("is_causal", is_causal)
        # The call says which attention it is, as torch's layers make it: attn(x, x, x) is self-attention.
        self_attention = key is query and value is query
        batched = _check_batched(query, key, value)
        if batched:
            if not self.batch_first:
                query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        else:
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0).flatten(0, 1)  # (heads, L, S) of the one batch entry
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"key and value must share (batch, seq), got {tuple(key.shape)} and {tuple(value.shape)}")
        if key.shape[0] != query.shape[0]:
            raise ValueError(f"key batch {key.shape[0]} does not match query batch {query.shape[0]}")
        masks = translate_masks(
            attn_mask, key_padding_mask, is_causal, batch=query.shape[0], heads=self.num_heads, q_len=query.shape[1],
            k_len=key.shape[1], dtype=query.dtype,
        )
        out, weights = self._attend(query, key, value, masks, self_attention, need_weights)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if batched and not self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _attend(
        self, query: Tensor, key: Tensor, value: Tensor, masks: TranslatedMasks, self_attention: bool,
        need_weights: bool,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """(batch, seq_q, embed_dim) outputs of batch-first inputs, and the weights (batch, heads, seq_q, seq_kv)
        when asked for and formed."""
        exact = self._is_exact()
        # An exact mechanism forms the weights whenever asked; the others refuse, or give None if swapped to.
        weights_wanted = need_weights and exact
        if not exact:
            self._refuse_what_only_exact_attention_does(masks, need_weights)
        if exact and (masks.additive is not None or weights_wanted):
            return self._exact_with_bias(query, key, value, masks, weights_wanted)
        attention = self.attention
        if self_attention:
            out = attention(query, causal=masks.causal, key_padding_mask=masks.key_padding_mask)
        elif key is value:
            out = attention(query, key, causal=masks.causal, key_padding_mask=masks.key_padding_mask)
        else:
            out = self._cross_attention(query, key, value, masks)
        return out, None

    def _refuse_what_only_exact_attention_does(self, masks: TranslatedMasks, need_weights: bool) -> None:
        """Raise for an arbitrary mask, and for ``need_weights=True`` unless swapped with
        ``attention_weights="none"``: this mechanism has no logits to add a mask to and no weights to return."""
        if masks.additive is not None:
            takers = " or ".join(f"mechanism={name!r}" for name in exact_mechanisms())
            raise UnsupportedOptionError(
                f"{self.mechanism_name} cannot honour an arbitrary {' or '.join(masks.arbitrary)}: it maps only "
                f"the causal mask (or is_causal=True) and a padding key_padding_mask (bool, or float 0 / -inf)"
                + (f"; {takers} takes any mask" if takers else "")
            )
        if need_weights and self.attention_weights == "error":
            raise UnsupportedOptionError(
                f"need_weights=True: {self.mechanism_name} forms no attention weight matrix; call with "
                f"need_weights=False, or swap with attention_weights='none' to return None in its place"
            )

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Per-head q (batch, heads, seq_q, head_dim), k and v (batch, heads, seq_kv, head_dim)."""
        attention = self.attention
        attention._check_input("query", query, attention.dim)
        for name, x in (("key", key), ("value", value)):
            attention._check_input(name, x, attention.context_dim)

        def split(x: Tensor) -> Tensor:
            return x.view(x.shape[0], x.shape[1], attention.heads, attention.head_dim).transpose(1, 2)

        return split(attention.q_proj(query)), split(attention.k_proj(key)), split(attention.v_proj(value))

    def _output(self, out: Tensor) -> Tensor:
        """(batch, heads, seq_q, head_dim) -> (batch, seq_q, embed_dim) through dropout and the output projection."""
        merged = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
        return self.attention.out_proj(self.attention.dropout(merged))

    def _cross_attention(self, query: Tensor, key: Tensor, value: Tensor, masks: TranslatedMasks) -> Tensor:
        """Keys and values from two different tensors (attnzoo's ``context`` is one): projected here."""
        self.attention._require_cross(query.shape[1], key.shape[1])
        q, k, v = self._project(query, key, value)
        out = self.attention.mechanism(q, k, v, masks.causal, masks.key_padding_mask, cross=True)
        return self._output(out)

    def _exact_with_bias(
        self, query: Tensor, key: Tensor, value: Tensor, masks: TranslatedMasks, need_weights: bool
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Exact attention under every mask at once as one additive bias, as torch computes it (a row whose
        keys are all masked is NaN there, as in torch); the weights (batch, heads, seq_q, seq_kv) too when
        asked for."""
        if not (key is query and value is query):
            self.attention._require_cross(query.shape[1], key.shape[1])
        q, k, v = self._project(query, key, value)
        k_len = k.shape[2]
        bias = torch.zeros(1, 1, q.shape[2], k_len, dtype=q.dtype, device=q.device)
        if masks.causal:
            bias = bias.masked_fill(~torch.ones(q.shape[2], k_len, dtype=torch.bool, device=q.device).tril(), -math.inf)
        if masks.key_padding_mask is not None:
            # Zeroed as well as masked, so that whatever a padded position holds reaches no output.
            k, v = zero_padded(k, masks.key_padding_mask), zero_padded(v, masks.key_padding_mask)
            bias = bias.masked_fill(masks.key_padding_mask[:, None, None, :], -math.inf)
        if masks.additive is not None:
            bias = bias + masks.additive
        logit_scale = self.attention.mechanism.logit_scale()
        if not need_weights:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=logit_scale)
            return self._output(out), None
        scale = 1.0 / math.sqrt(q.shape[-1]) if logit_scale is None else logit_scale
        weights = torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1)
        return self._output(weights @ v), weights

    def extra_repr(self) -> str:
        return f"batch_first={self.batch_first}, role={self.role!r}, attention_weights={self.attention_weights!r}"



_TORCH_TO_SWAPPED = {
    "q_proj_weight": "attention.q_proj.weight",
    "k_proj_weight": "attention.k_proj.weight",
    "v_proj_weight": "attention.v_proj.weight",
    "out_proj.weight": "attention.out_proj.weight",
    "out_proj.bias": "attention.out_proj.bias",
}
"""``nn.MultiheadAttention``'s state-dict keys -> a swapped module's, besides the packed ``in_proj_*``."""


def _torch_keys_to_swapped(
    module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool, missing_keys: List[str],
    unexpected_keys: List[str], error_msgs: List[str],
) -> None:
    """Load-state-dict pre-hook: rename ``nn.MultiheadAttention``'s keys under ``prefix`` to this module's
    (the packed ``in_proj_weight`` (3 * embed_dim, embed_dim) and ``in_proj_bias`` split into the query, key
    and value projections), so that a checkpoint of the unswapped model loads. Keys already in this module's
    form are left alone; the mechanism's own parameters are not in such a checkpoint (``strict=False``)."""
    for packed, field in (("in_proj_weight", "weight"), ("in_proj_bias", "bias")):
        tensor = state_dict.get(prefix + packed)
        if tensor is None or prefix + f"attention.q_proj.{field}" in state_dict:
            continue
        del state_dict[prefix + packed]
        for name, part in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3)):
            state_dict[prefix + f"attention.{name}.{field}"] = part
    for old, new in _TORCH_TO_SWAPPED.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


def _check_batched(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether the call is batched (3-D inputs) or unbatched (2-D), all three alike; raises naming the input."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    batched = query.dim() == 3
    if not batched and query.dim() != 2:
        raise ValueError(f"query must have 3 dims (batched) or 2 (unbatched), got shape {tuple(query.shape)}")
    if key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"query, key and value must all be batched or all unbatched, got shapes {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    return batched


__all__ = ["CROSS", "EITHER", "ROLES", "SELF", "WEIGHTS_CHOICES", "SwappedAttention", "exact_mechanisms"]
