"""attnzoo against independent implementations in torch.nn, with copied weights (float64, eval mode)."""

import pytest
import torch
from torch import nn

from attnzoo import Decoder, Encoder, MultiHeadAttention

DIM, HEADS = 16, 4


def copy_attention(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        if theirs._qkv_same_embed_dim:
            q_w, k_w, v_w = theirs.in_proj_weight.chunk(3)
        else:
            q_w, k_w, v_w = theirs.q_proj_weight, theirs.k_proj_weight, theirs.v_proj_weight
        q_b, k_b, v_b = theirs.in_proj_bias.chunk(3)
        for proj, weight, bias in ((ours.q_proj, q_w, q_b), (ours.k_proj, k_w, k_b), (ours.v_proj, v_w, v_b)):
            proj.weight.copy_(weight)
            proj.bias.copy_(bias)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)


def attention_pair(kdim=None):
    theirs = nn.MultiheadAttention(DIM, HEADS, batch_first=True, kdim=kdim, vdim=kdim).double().eval()
    with torch.no_grad():  # torch initializes the input biases to zero: make them count
        theirs.in_proj_bias.normal_()
    ours = MultiHeadAttention(DIM, HEADS, "softmax", context_dim=kdim).double().eval()
    copy_attention(ours, theirs)
    return ours, theirs


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def padding(batch, seq):
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[0, -2:] = True
    mask[-1, :1] = True
    return mask


@pytest.mark.parametrize("masking", ["none", "key_padding", "causal", "causal+key_padding"])
def test_self_attention_matches_torch(masking):
    ours, theirs = attention_pair()
    x = randn(3, 7, DIM)
    mask = padding(3, 7) if "key_padding" in masking else None
    causal = "causal" in masking
    attn_mask = torch.triu(torch.ones(7, 7, dtype=torch.bool), diagonal=1) if causal else None
    expected, _ = theirs(x, x, x, key_padding_mask=mask, attn_mask=attn_mask, need_weights=False)
    torch.testing.assert_close(ours(x, causal=causal, key_padding_mask=mask), expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("kdim", [None, 10])
@pytest.mark.parametrize("padded", [False, True])
def test_cross_attention_matches_torch(kdim, padded):
    ours, theirs = attention_pair(kdim)
    x, context = randn(3, 5, DIM, seed=1), randn(3, 9, kdim or DIM, seed=2)
    mask = padding(3, 9) if padded else None
    expected, _ = theirs(x, context, context, key_padding_mask=mask, need_weights=False)
    torch.testing.assert_close(ours(x, context, key_padding_mask=mask), expected, atol=1e-12, rtol=1e-10)
    k, v = ours.project_context(context)
    torch.testing.assert_close(ours.attend_projected(x, k, v, key_padding_mask=mask), expected, atol=1e-12, rtol=1e-10)


def copy_block(sublayer, norm: nn.LayerNorm) -> None:
    sublayer.norm.load_state_dict(norm.state_dict())


def copy_feed_forward(ours, linear1: nn.Linear, linear2: nn.Linear) -> None:
    ours.in_proj.load_state_dict(linear1.state_dict())
    ours.out_proj.load_state_dict(linear2.state_dict())


def randomize(module: nn.Module) -> None:
    """Give every parameter (layer norms included) random values so that copying mistakes show."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.shape[0] == DIM else 0.0))


@pytest.mark.parametrize("norm_first, activation", [(False, "relu"), (True, "gelu")])
@pytest.mark.parametrize("padded", [False, True])
def test_encoder_matches_torch_transformer_encoder(norm_first, activation, padded):
    torch_layer = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=24, dropout=0.0, activation=activation,
                                             batch_first=True, norm_first=norm_first)
    final_norm = nn.LayerNorm(DIM) if norm_first else None
    theirs = nn.TransformerEncoder(torch_layer, num_layers=2, norm=final_norm, enable_nested_tensor=False)
    theirs = theirs.double().eval()
    randomize(theirs)
    ours = Encoder(DIM, HEADS, 2, ff_dim=24, activation=activation, norm_first=norm_first).double().eval()
    for our_layer, their_layer in zip(ours.layers, theirs.layers):
        copy_attention(our_layer.self_attention, their_layer.self_attn)
        copy_feed_forward(our_layer.feed_forward, their_layer.linear1, their_layer.linear2)
        copy_block(our_layer.attention_block, their_layer.norm1)
        copy_block(our_layer.feed_forward_block, their_layer.norm2)
    if norm_first:
        ours.norm.load_state_dict(theirs.norm.state_dict())

    x = randn(3, 6, DIM, seed=3)
    mask = padding(3, 6) if padded else None
    expected = theirs(x, src_key_padding_mask=mask)
    got = ours(x, key_padding_mask=mask)
    # torch's fast path may zero padded positions: compare the real ones.
    keep = torch.ones(3, 6, dtype=torch.bool) if mask is None else ~mask
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-10, rtol=1e-10)


def test_post_norm_decoder_matches_torch_transformer_decoder():
    torch_layer = nn.TransformerDecoderLayer(DIM, HEADS, dim_feedforward=24, dropout=0.0, activation="relu",
                                             batch_first=True)
    theirs = nn.TransformerDecoder(torch_layer, num_layers=2).double().eval()
    randomize(theirs)
    ours = Decoder(DIM, HEADS, 2, ff_dim=24, activation="relu", norm_first=False).double().eval()
    for our_layer, their_layer in zip(ours.layers, theirs.layers):
        copy_attention(our_layer.self_attention, their_layer.self_attn)
        copy_attention(our_layer.cross_attention, their_layer.multihead_attn)
        copy_feed_forward(our_layer.feed_forward, their_layer.linear1, their_layer.linear2)
        copy_block(our_layer.attention_block, their_layer.norm1)
        copy_block(our_layer.cross_attention_block, their_layer.norm2)
        copy_block(our_layer.feed_forward_block, their_layer.norm3)

    x, memory = randn(2, 5, DIM, seed=4), randn(2, 7, DIM, seed=5)
    memory_mask = padding(2, 7)
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    expected = theirs(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=memory_mask)
    torch.testing.assert_close(ours(x, memory, memory_padding_mask=memory_mask), expected, atol=1e-10, rtol=1e-10)
