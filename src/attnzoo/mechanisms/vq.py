"""Transformer-VQ (Lingle 2023): softmax attention over keys quantized to a learned codebook, linear in the
sequence length, with a decoding state of constant size.

The maths is in :mod:`attnzoo.functional.vq`. This module holds the codebook and its training:

* **Codebook.** One per head, ``codebook`` (heads, codebook_size, head_dim), a buffer: it is not trained by the
  optimizer but by exponential moving averages (EMA) of the keys assigned to each codeword, as in VQ-VAE
  (van den Oord et al. 2017). Drawn N(0, 1) at construction (from ``seed`` when given).
* **When it changes.** Only in :meth:`VQAttention.update_codebook`, which a training loop calls after its
  optimizer step (through the training hook :meth:`~attnzoo.Mechanism.after_optimizer_step`;
  :func:`update_codebooks` calls it on every ``vq`` mechanism of a model). A forward pass
  in training mode only *records* the statistics of its keys (assignment counts, key sums and a
  deterministic sample of keys for restarts); the output of a forward never depends on earlier forwards, and
  an eval-mode forward changes nothing at all.
* **Update.** ``N_s <- decay N_s + (1 - decay) n_s``, ``m_s <- decay m_s + (1 - decay) sum of keys assigned
  to s``, codeword ``m_s / N_s`` (counts smoothed so that none is zero). Dead codes (``N_s`` below
  ``restart_threshold``) restart at keys drawn from the recorded sample by a generator seeded with
  ``seed + number of updates so far`` (``seed`` 0 when None): the same training run gives the same codebook.
  EMA counts start at 1, so with the default threshold (1) every codeword that no key chose in the first
  update restarts at a recorded key: the codebook is initialised from the data.
* **Commitment loss.** A training-mode forward sets ``beta * mean |k - sg(codeword)|^2`` over its unpadded
  keys (``commitment`` = beta), the auxiliary loss that keeps keys near their codewords, which the training
  hook :meth:`VQAttention.auxiliary_loss` hands to the training loop once; :func:`attnzoo.mechanisms.hooks.
  auxiliary_loss` sums (and takes) every mechanism's over a model, for a loop written by hand too.
* **Packed rows** (``cu_seqlens``): each document runs alone (equal lengths batched), and a training-mode
  forward records the statistics of the whole row once (counts, key sums, commitment loss, key sample), equal
  to those of the same documents as one padded batch.
* **Data parallelism.** Refused (:meth:`VQAttention.data_parallel_reasons`): the EMA statistics are per rank.
* **Gradients.** In training mode the keys of each block's exact window get the attention's gradient by the
  straight-through estimator (keys in the codeword cache get none, as in the paper); in eval mode the
  output is piecewise constant in the keys, and their gradient through the attention is zero.

With a codebook holding every distinct key, the output is exact softmax attention.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._dtypes import working_dtype
from .._validation import check_number, check_positive_int
from ..functional.masks import zero_padded
from ..functional.packing import attend_per_document
from ..functional.ties import tied_to_unused
from ..functional.vq import (
    code_aggregates,
    codewords,
    quantize,
    vq_attention_reference,
    vq_attention_step,
    vq_attention_unchecked,
)
from .base import APPROXIMATE, PACKED_SPLIT, Capabilities, Mechanism, StateLayout, seeded_generator
from .registry import register


@register
class VQAttention(Mechanism):
    """Transformer-VQ attention (Lingle 2023): keys quantized to a per-head codebook, exact softmax attention
    over the quantized keys, causal in linear time by a cache of codeword counts and value sums (blocks of
    ``block_size`` positions; the current and previous block key by key).

    Options:
        codebook_size: S, codewords per head (512 in the paper), at least 2.
        block_size: L, positions per block of the causal form.
        decay: EMA decay of the codebook statistics, in (0, 1).
        commitment: beta of the commitment loss, >= 0.
        restart_threshold: a codeword whose EMA count falls below it restarts at a recorded key, >= 0
            (0: never).
        seed: seeds the initial codebook and the restarts; None draws the codebook from the global generator
            (restarts then use seed 0).

    Decoding state, of constant size: ``{"counts": (batch, heads, S), "sums": (batch, heads, S, head_dim_v)}``,
    how many keys so far each codeword stands for and the sum of their values.
    """

    name = "vq"
    capabilities = Capabilities(
        causal=True,
        cross=False,
        key_padding=True,
        recurrent_step=True,
        kind=APPROXIMATE,
        complexity="time O(N S d + N L d), memory O(N S + (N / L) S d); S = codebook_size, L = block_size; "
                   "decoding O(S d) per token",
        summary="Transformer-VQ: keys quantized to an EMA-trained codebook, exact softmax over the quantized keys, "
                "causal in linear time by a codeword cache (Lingle 2023)",
        packing=PACKED_SPLIT,
    )
    sweep_option = "codebook_size"
    test_options = {"codebook_size": 8, "block_size": 4, "seed": 0}
    # A codebook longer than the suite's sequences: the dense path (N <= S) instead of the codeword cache.
    test_variants = ({"codebook_size": 2, "block_size": 1, "seed": 1},
                     {"codebook_size": 32, "block_size": 4, "seed": 2})

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        codebook_size: int = 512,
        block_size: int = 128,
        decay: float = 0.99,
        commitment: float = 0.25,
        restart_threshold: float = 1.0,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__(heads, head_dim)
        self.codebook_size = check_number("codebook_size", codebook_size, integer=True, minimum=2)
        self.block_size = check_positive_int("block_size", block_size)
        self.decay = check_number("decay", decay, minimum=0.0, maximum=1.0, exclusive_minimum=True,
                                  exclusive_maximum=True)
        self.commitment = check_number("commitment", commitment, minimum=0.0)
        self.restart_threshold = check_number("restart_threshold", restart_threshold, minimum=0.0)
        generator = seeded_generator(seed)
        self.seed = 0 if seed is None else seed
        codebook = torch.randn(heads, self.codebook_size, head_dim, generator=generator)
        self.register_buffer("codebook", codebook)
        self.register_buffer("ema_counts", torch.ones(heads, self.codebook_size))
        self.register_buffer("ema_sums", codebook.clone())
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))
        # Statistics of the training-mode forwards since the last update: not part of a checkpoint.
        self.register_buffer("pending_counts", torch.zeros(heads, self.codebook_size), persistent=False)
        self.register_buffer("pending_sums", torch.zeros(heads, self.codebook_size, head_dim), persistent=False)
        self.register_buffer("pending_keys", torch.zeros(heads, self.codebook_size, head_dim), persistent=False)
        self.register_buffer("pending_key_count", torch.zeros((), dtype=torch.long), persistent=False)
        self.commitment_loss: Optional[Tensor] = None

    def __getstate__(self) -> Dict[str, object]:
        # A copy or pickle leaves the commitment loss behind: it belongs to one forward's autograd graph (which
        # deepcopy refuses to copy), not to the module.
        state = self.__dict__.copy()
        state["commitment_loss"] = None
        return state

    # -- forward -------------------------------------------------------------------------------------------
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        out, keys, codes = self._attend_only(q, k, v, causal, key_padding_mask)
        if self.training:
            self._record(keys, codes, key_padding_mask)
        return out

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, spans: List[Tuple[int, int]]) -> Tensor:
        """Each document alone (equal lengths batched), its blocks counted from its own start; a training-mode
        forward records the statistics of the whole row once, as the documents as one padded batch would."""
        out = attend_per_document(lambda *qkv: self._attend_only(*qkv, causal, None)[0], q, k, v, spans)
        if self.training:
            keys = k.to(working_dtype(k.dtype))
            self._record(keys, quantize(keys.detach(), self.codebook), None)
        return out

    def _attend_only(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """The output, recording nothing; with the working-dtype keys and their codes, for :meth:`_record`."""
        keys = zero_padded(k, key_padding_mask).to(working_dtype(k.dtype))
        codes = quantize(keys.detach(), self.codebook)
        training = self.training and torch.is_grad_enabled()
        out = vq_attention_unchecked(q, k, v, self.codebook, codes, self.block_size, causal, key_padding_mask,
                                     training)
        if not training:
            out = tied_to_unused(out, k)  # piecewise constant in k: its gradient is zero, not missing
        return out, keys, codes

    def _record(self, keys: Tensor, codes: Tensor, key_padding_mask: Optional[Tensor]) -> None:
        """Set the commitment loss of this forward and add its key statistics to the pending update."""
        batch, heads, length, dim = keys.shape
        valid = torch.ones(batch, length, dtype=torch.bool, device=keys.device) if key_padding_mask is None \
            else ~key_padding_mask
        weight = valid[:, None, :].to(keys.dtype)
        quantized = codewords(self.codebook.to(keys.dtype), codes)
        error = (keys - quantized.detach()).square().sum(-1)
        self.commitment_loss = self.commitment * (error * weight).sum() / (weight.sum() * heads * dim).clamp_min(1.0)
        with torch.no_grad():
            flat = lambda x: x.transpose(0, 1).reshape(heads, batch * length, *x.shape[3:])  # noqa: E731
            counts, sums = code_aggregates(flat(codes), flat(keys), flat(valid[:, None].expand(-1, heads, -1)),
                                           self.codebook_size)
            self.pending_counts += counts.to(self.pending_counts.dtype)
            self.pending_sums += sums.to(self.pending_sums.dtype)
            # A deterministic sample of this forward's keys, evenly spaced over the unpadded ones, for restarts.
            positions = torch.nonzero(valid.reshape(-1)).squeeze(-1)
            if positions.numel():
                chosen = positions[torch.linspace(0, positions.numel() - 1, self.codebook_size,
                                                  device=positions.device).round().long()]
                self.pending_keys.copy_(flat(keys)[:, chosen].to(self.pending_keys.dtype))
                self.pending_key_count.fill_(min(positions.numel(), self.codebook_size))

    @torch.no_grad()
    def update_codebook(self) -> None:
        """Apply the pending statistics of the training-mode forwards since the last update (see the module
        docstring): EMA of counts and key sums, new codewords, seeded restarts of dead codes; then clear them.
        Without any recorded forward, nothing changes."""
        if int(self.pending_key_count) == 0 and float(self.pending_counts.sum()) == 0.0:
            return
        decay = self.decay
        self.ema_counts.mul_(decay).add_(self.pending_counts.to(self.ema_counts.dtype), alpha=1 - decay)
        self.ema_sums.mul_(decay).add_(self.pending_sums.to(self.ema_sums.dtype), alpha=1 - decay)
        total = self.ema_counts.sum(-1, keepdim=True)
        epsilon = 1e-5
        smoothed = (self.ema_counts + epsilon) / (total + self.codebook_size * epsilon) * total
        self.codebook.copy_(self.ema_sums / smoothed.unsqueeze(-1))
        available = int(self.pending_key_count)
        if available and self.restart_threshold > 0:
            generator = torch.Generator().manual_seed(self.seed + int(self.updates))
            picks = torch.randint(0, available, (self.heads, self.codebook_size), generator=generator)
            picks = picks.to(self.codebook.device)
            candidates = torch.gather(self.pending_keys, 1, picks.unsqueeze(-1).expand(-1, -1, self.head_dim))
            dead = (self.ema_counts < self.restart_threshold).unsqueeze(-1)
            self.codebook.copy_(torch.where(dead, candidates.to(self.codebook.dtype), self.codebook))
            self.ema_sums.copy_(torch.where(dead, self.codebook, self.ema_sums))
            self.ema_counts.copy_(torch.where(dead.squeeze(-1), torch.ones_like(self.ema_counts), self.ema_counts))
        self.updates += 1
        self.pending_counts.zero_()
        self.pending_sums.zero_()
        self.pending_key_count.zero_()

    # -- training hooks --------------------------------------------------------------------------------------
    def auxiliary_loss(self) -> Optional[Tensor]:
        """The commitment loss of the latest training-mode forward, taken (None until the next one)."""
        loss, self.commitment_loss = self.commitment_loss, None
        return loss

    def update_after_step(self, step: int, seed: int) -> None:
        """The codebook's EMA update (:meth:`update_codebook`); its restarts draw from ``seed`` (the option) and
        the count of updates, which a checkpoint holds, so neither argument is needed."""
        self.update_codebook()

    def data_parallel_reasons(self) -> List[str]:
        return [f"mechanism {self.name!r} updates its codebooks from per-rank EMA statistics, which data "
                "parallelism does not combine: train it in one process"]

    def attend_reference(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Optional[Tensor], cross: bool
    ) -> Tensor:
        through = self.training and torch.is_grad_enabled()
        out = vq_attention_reference(q, k, v, self.codebook, self.block_size, causal, key_padding_mask,
                                     straight_through=through)
        return out if through else tied_to_unused(out, k)

    # -- decoding ------------------------------------------------------------------------------------------
    def state_layout(self, dtype: torch.dtype, value_width: Optional[int] = None) -> StateLayout:
        compute = working_dtype(dtype)
        return {"counts": ((self.heads, self.codebook_size), compute),
                "sums": ((self.heads, self.codebook_size, self.value_width(value_width)), compute)}

    def attend_step(
        self, q_t: Tensor, k_t: Tensor, v_t: Tensor, tensors: Optional[Dict[str, Tensor]], length: int
    ) -> Tuple[Tensor, Dict[str, Tensor]]:
        compute = working_dtype(q_t.dtype)
        codes = quantize(k_t.to(compute), self.codebook)
        counts, sums = code_aggregates(codes, v_t.to(compute), torch.ones_like(codes, dtype=torch.bool),
                                       self.codebook_size)
        if tensors is not None:
            counts, sums = tensors["counts"] + counts, tensors["sums"] + sums
        out = vq_attention_step(q_t, self.codebook, counts, sums)
        return tied_to_unused(out.to(q_t.dtype), k_t), {"counts": counts, "sums": sums}

    def attend_prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        out = self.attend(q, k, v, True, None, False)
        compute = working_dtype(q.dtype)
        codes = quantize(k.to(compute).detach(), self.codebook)
        counts, sums = code_aggregates(codes, v.to(compute), torch.ones_like(codes, dtype=torch.bool),
                                       self.codebook_size)
        return out, {"counts": counts, "sums": sums}

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, codebook_size={self.codebook_size}, block_size={self.block_size}, "
                f"decay={self.decay}, commitment={self.commitment}")


# -- what a training loop calls ------------------------------------------------------------------------------
def update_codebooks(model: nn.Module) -> int:
    """Apply :meth:`VQAttention.update_codebook` to every ``vq`` mechanism in ``model`` (after the optimizer
    step); returns how many there were."""
    found = [module for module in model.modules() if isinstance(module, VQAttention)]
    for module in found:
        module.update_codebook()
    return len(found)


__all__ = ["VQAttention", "update_codebooks"]
