"""The measurements of a pretrained causal language model (a :class:`~attnzoo.pretrained.CausalLM`), behind
``attnzoo lm-eval``: perplexity, greedy continuation (for passkey retrieval, :mod:`.passkey`), decoding speed and
the size of the decoding state, and which mechanisms can take the pretrained attention's place.

Everything runs under ``torch.inference_mode``. The LM head is applied in chunks of positions, so that an 8K-token
window never holds its whole (tokens x vocabulary) logits at once (8,192 x 49,152 float32 would be 1.6 GB).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ..mechanisms import NO_GROUPED_KV, Capabilities, available, capabilities
from ..state import map_tensors
from .causal_lm import CausalLM, CausalLMState
from .config import CausalLMConfig

HEAD_CHUNK = 1024
"""Positions whose logits are computed at once when scoring a window."""


def _layers(model: CausalLM, tokens: Tensor, keep_state: bool) -> Tuple[Tensor, Optional[CausalLMState]]:
    """The final-norm hidden states (batch, seq, dim) of ``tokens`` (batch, seq), and with ``keep_state`` the
    decoding state after them (the model's prefill, without its full logits)."""
    x = model.embedding(tokens)
    states = []
    for layer in model.layers:
        if keep_state:
            x, state = layer.prefill(x)
            states.append(state)
        else:
            x = layer(x)
    return model.norm(x), (CausalLMState(states, tokens.shape[1]) if keep_state else None)


def _check_model(model: Any) -> None:
    if not isinstance(model, CausalLM):
        raise TypeError(f"model must be an attnzoo.pretrained.CausalLM, got {type(model).__name__}")


def _check_windows(name: str, tokens: Any, vocab_size: int, minimum: int = 2) -> Tensor:
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"{name} must be a (count, length) int64 tensor, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__}")
    if tokens.shape[0] < 1 or tokens.shape[1] < minimum:
        raise ValueError(f"{name} must hold at least one window of {minimum} tokens, got {tuple(tokens.shape)}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"{name} holds ids outside the vocabulary [0, {vocab_size})")
    return tokens


@torch.inference_mode()
def token_nll(model: CausalLM, tokens: Tensor) -> Tensor:
    """The negative log-likelihood (nats, float64) of every token after the first: tokens (batch, seq) ->
    (batch, seq - 1), entry t the loss of predicting ``tokens[:, t + 1]`` from ``tokens[:, :t + 1]``."""
    _check_model(model)
    _check_windows("tokens", tokens, model.vocab_size)
    hidden, _ = _layers(model, tokens, keep_state=False)
    losses = []
    for start in range(0, tokens.shape[1] - 1, HEAD_CHUNK):
        stop = min(start + HEAD_CHUNK, tokens.shape[1] - 1)
        logits = model.head(hidden[:, start:stop]).double()
        targets = tokens[:, start + 1:stop + 1]
        losses.append(F.cross_entropy(logits.transpose(1, 2), targets, reduction="none"))
    return torch.cat(losses, dim=1)


@dataclass(frozen=True)
class Perplexity:
    """Perplexity of windows: ``exp(nll / tokens)``, the mean negative log-likelihood (nats) per predicted token
    over every window (each window's first token is predicted from nothing and not counted)."""

    perplexity: float
    nll: float
    tokens: int
    windows: int
    seconds: float

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens


def perplexity(model: CausalLM, windows: Tensor) -> Perplexity:
    """The perplexity of ``model`` on ``windows`` (count, length) int64, scored one window at a time."""
    _check_model(model)
    _check_windows("windows", windows, model.vocab_size)
    start = time.perf_counter()
    total, count = 0.0, 0
    for window in windows:
        losses = token_nll(model, window[None])
        total += float(losses.sum())
        count += losses.numel()
    return Perplexity(math.exp(total / count), total, count, windows.shape[0], time.perf_counter() - start)


def state_bytes(state: Any) -> int:
    """Bytes of every tensor in a decoding state (a :class:`~attnzoo.pretrained.CausalLMState`, or any state tree)."""
    sizes: List[int] = []
    map_tensors(state, lambda tensor: sizes.append(tensor.numel() * tensor.element_size()) or tensor)
    return sum(sizes)


def decodes(model: CausalLM) -> Optional[str]:
    """None when ``model`` decodes incrementally (prefill, then one step per token); else why not."""
    _check_model(model)
    mechanism = model.layers[0].attention.mechanism
    if not mechanism.capabilities.recurrent_step:
        return f"{model.mechanism_name} has no incremental decoding (capability recurrent_step)"
    return None


@dataclass(frozen=True)
class Continuation:
    """What :func:`greedy_continue` returns: the new tokens of each prompt, and the timing and state of the
    decoding."""

    sequences: List[List[int]]  # the new tokens, one list per prompt of the batch
    context: int  # tokens of each prompt
    prefill_seconds: float
    step_seconds: float
    steps: int
    state_bytes: int  # the whole batch's state

    @property
    def tokens(self) -> List[int]:
        """The new tokens of a single prompt (a batch of one)."""
        if len(self.sequences) != 1:
            raise ValueError(f"tokens is the continuation of one prompt; this is a batch of {len(self.sequences)}: "
                             f"read sequences")
        return self.sequences[0]

    @property
    def batch(self) -> int:
        """Prompts decoded together."""
        return len(self.sequences)

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed: tokens made per second after the prefill, over the batch (each step feeds every
        sequence one token and yields its next)."""
        return self.batch * self.steps / self.step_seconds if self.step_seconds > 0 else float("inf")

    @property
    def state_bytes_per_token(self) -> float:
        """The decoding state's bytes per token of context, measured after the prefill."""
        return self.state_bytes / (self.batch * self.context)


@torch.inference_mode()
def greedy_continue(model: CausalLM, prompt: Tensor, new_tokens: int) -> Continuation:
    """Greedy decoding of ``new_tokens`` after ``prompt``: one sequence (seq,) or (1, seq), or a batch (batch,
    seq) of equal-length prompts decoded together (their steps share every weight read). One prefill (only the
    last position's logits computed), then ``new_tokens - 1`` timed steps. The state's size is measured after
    the prefill."""
    _check_model(model)
    reason = decodes(model)
    if reason is not None:
        raise ValueError(reason)
    prompt = prompt[None] if prompt.dim() == 1 else prompt
    _check_windows("prompt", prompt, model.vocab_size, minimum=1)
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ValueError(f"new_tokens must be an integer >= 1, got {new_tokens!r}")
    start = time.perf_counter()
    hidden, state = _layers(model, prompt, keep_state=True)
    token = model.head(hidden[:, -1]).argmax(dim=-1)
    prefill_seconds = time.perf_counter() - start
    size = state_bytes(state)
    generated = [token]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        logits, state = model.step(token, state)
        token = logits.argmax(dim=-1)
        generated.append(token)
    step_seconds = time.perf_counter() - start
    return Continuation(torch.stack(generated, 1).tolist(), prompt.shape[1], prefill_seconds, step_seconds,
                        new_tokens - 1, size)


# -- which mechanisms can take a pretrained causal model's attention ------------------------------------------
def capability_refusal(caps: Capabilities, config: CausalLMConfig, length: int) -> Optional[str]:
    """None when a mechanism declaring ``caps`` can run in place of the causal self-attention of a model with
    ``config``, on ``length`` tokens; else why not, in a few words."""
    if not caps.causal:
        return "no causal masking (capability causal)"
    if config.kv_heads != config.heads and caps.grouped_kv == NO_GROUPED_KV:
        return f"refuses grouped key/value heads ({config.heads} query heads share {config.kv_heads}; grouped_kv none)"
    if config.sliding_window is not None and caps.window_option is None:
        return f"cannot attend within the model's sliding window of {config.sliding_window} (window_option none)"
    if caps.max_length is not None and length > caps.max_length:
        return f"at most {caps.max_length} tokens (max_length)"
    if caps.length_multiple is not None and length % caps.length_multiple:
        return f"lengths must be multiples of {caps.length_multiple} (length_multiple)"
    return None


def swap_refusal(name: str, config: CausalLMConfig, length: int) -> Optional[str]:
    """:func:`capability_refusal` of the registered mechanism ``name`` as its class declares it (default options)."""
    return capability_refusal(capabilities(name), config, length)


def swap_candidates(config: CausalLMConfig, length: int) -> Dict[str, Optional[str]]:
    """Every registered mechanism -> None if it can take the place of ``config``'s attention at ``length`` tokens
    (:func:`swap_refusal`), else the reason it cannot."""
    return {name: swap_refusal(name, config, length) for name in available()}


def swapped(model: CausalLM, mechanism: str, mechanism_options: Optional[Dict[str, Any]] = None,
            seed: int = 0) -> Tuple[CausalLM, int]:
    """A copy of ``model`` with ``mechanism`` in every attention slot and every pretrained weight kept: the "raw
    swap", no training. Parameters of the mechanism's own (which the pretrained model does not have) keep their
    initialisation, drawn with ``seed``. Returns (the model in eval mode, how many such parameters it has)."""
    _check_model(model)
    torch.manual_seed(seed)
    other = CausalLM(model.config, mechanism, mechanism_options)
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    if unexpected:
        raise ValueError(f"{mechanism}: the pretrained weights {', '.join(unexpected[:4])} have no place in it")
    parameters = dict(other.named_parameters())
    own = sum(parameters[name].numel() for name in missing if name in parameters)
    return other.eval(), own
