"""Shared by the model tests: logits computed the incremental way, to compare with a full forward pass."""

import torch

from attnzoo import Seq2SeqTransformer


def incremental_logits(model, prompt_len, sequence, **prefill_args):
    """Logits of every position computed by prefill over a prefix and then one step per token."""
    if isinstance(model, Seq2SeqTransformer):
        logits, state = model.prefill(prefill_args["src"], sequence[:, :prompt_len],
                                      src_padding_mask=prefill_args.get("src_padding_mask"))
    else:
        logits, state = model.prefill(sequence[:, :prompt_len])
    rows = [logits]
    for t in range(prompt_len, sequence.shape[1]):
        logits_t, state = model.step(sequence[:, t], state)
        rows.append(logits_t[:, None])
    return torch.cat(rows, dim=1)
