"""Grouped-query heads in the Seq2SeqTransformer: encoder self-attention, decoder self- and cross-attention."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.attention import MultiHeadAttention
from attnzoo.models import Seq2SeqTransformer
from attnzoo.models.cross_attention import CrossAttentionWeights

HEADS, KV_HEADS, DIM = 4, 2, 32


def _repeat_into(full: MultiHeadAttention, grouped: MultiHeadAttention) -> None:
    """Make ``full`` (heads key/value heads) compute what ``grouped`` (kv_heads) computes."""
    head_dim, groups = grouped.head_dim, grouped.heads // grouped.kv_heads
    for name in ("q_proj", "out_proj"):
        getattr(full, name).load_state_dict(getattr(grouped, name).state_dict())
    for name in ("k_proj", "v_proj"):
        source, target = getattr(grouped, name), getattr(full, name)
        width = source.in_features
        target.weight.copy_(source.weight.view(grouped.kv_heads, head_dim, width).repeat_interleave(groups, 0)
                            .reshape(-1, width))
        target.bias.copy_(source.bias.view(grouped.kv_heads, head_dim).repeat_interleave(groups, 0).reshape(-1))


def _pair(mechanism: str):
    torch.manual_seed(0)
    options = dict(encoder_self_attention=mechanism, decoder_self_attention=mechanism, max_length=16)
    grouped = Seq2SeqTransformer(11, 13, DIM, HEADS, kv_heads=KV_HEADS, **options).double().eval()
    full = Seq2SeqTransformer(11, 13, DIM, HEADS, **options).double().eval()
    full_state = full.state_dict()
    grouped_state = grouped.state_dict()
    full.load_state_dict({k: v for k, v in grouped_state.items() if k in full_state and v.shape == full_state[k].shape},
                         strict=False)
    with torch.no_grad():
        for name, module in grouped.named_modules():
            if isinstance(module, MultiHeadAttention):
                _repeat_into(full.get_submodule(name), module)
    return grouped, full


@pytest.mark.parametrize("mechanism", ["softmax", "linear"])
def test_grouped_seq2seq_equals_repeated_heads_forward_and_decoding(mechanism):
    grouped, full = _pair(mechanism)
    attentions = [m for m in grouped.modules() if isinstance(m, MultiHeadAttention)]
    assert len(attentions) == 6 and all(m.kv_heads == KV_HEADS for m in attentions)  # 2 enc, 2 dec self, 2 cross
    src, tgt = torch.randint(0, 11, (2, 7)), torch.randint(0, 13, (2, 5))
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 5:] = True
    expected = full(src, tgt, src_padding_mask=mask)
    torch.testing.assert_close(grouped(src, tgt, src_padding_mask=mask), expected, rtol=0, atol=1e-10)
    logits, state = grouped.prefill(src, tgt[:, :3], src_padding_mask=mask)
    tensors = []
    attnzoo.state.map_tensors(state, lambda t: tensors.append(t) or t)
    assert all(t.shape[1] == KV_HEADS for t in tensors if t.dim() == 4)  # caches and projected memory
    assert all(layer.memory_k.shape == (2, KV_HEADS, 7, DIM // HEADS) for layer in state.layers)
    for t in (3, 4):
        step_logits, state = grouped.step(tgt[:, t], state)
        torch.testing.assert_close(step_logits, expected[:, t], rtol=0, atol=1e-10)


def test_grouped_cross_attention_weights_are_recorded_per_query_head():
    grouped, full = _pair("softmax")
    src, tgt = torch.randint(0, 11, (1, 6)), torch.randint(0, 13, (1, 4))
    recorded = []
    for model in (grouped, full):
        with CrossAttentionWeights(model, "the test") as recorder:
            model(src, tgt)
        recorded.append(recorder.weights)
    for mine, theirs in zip(*recorded):
        assert mine.shape == (1, HEADS, 4, 6)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_seq2seq_refuses_kv_heads_not_dividing_heads():
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        Seq2SeqTransformer(11, 13, DIM, HEADS, kv_heads=3)


def test_attnzoo_train_takes_kv_heads_on_a_seq2seq_task(tmp_path):
    from attnzoo.cli import main

    code = main(["train", "copy", "--kv-heads", "2", "--steps", "1", "--dim", "16", "--heads", "4",
                 "--task-options", "train_size=8,validation_size=4,test_size=4,length=4", "--batch-size", "4",
                 "--output", str(tmp_path / "run"), "--quiet"])
    assert code == 0
    from attnzoo.training import load_trained

    model, _, config = load_trained(tmp_path / "run")
    assert config.kv_heads == 2 and model.encoder.layers[0].self_attention.kv_heads == 2
    assert model.decoder.layers[0].cross_attention.kv_heads == 2
