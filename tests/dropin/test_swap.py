"""swap_attention: torch models keep their outputs and gradients under softmax, take other mechanisms with the
masks they can honour, refuse the rest, and are left exactly as they were when the swap fails."""

import copy
import math

import pytest
import torch
from torch import nn

from attnzoo import MultiHeadAttention, UnsupportedOptionError
from attnzoo.dropin import SwappedAttention, swap_attention, translate_masks

DIM, HEADS, FF = 16, 4, 24


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def randomize(model: nn.Module, seed: int = 1) -> nn.Module:
    """Random values in every parameter (torch starts the input biases at zero: make them count)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.3)
    return model


def padding(batch, seq):
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[0, -2:] = True
    mask[-1, :1] = True
    return mask


def encoder(batch_first=True, norm_first=False, layers=2):
    layer = nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    return randomize(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).double())


def torch_grads(model):
    """Gradients by parameter, with torch's packed input projection split as attnzoo holds it."""
    grads = {}
    for name, parameter in model.named_parameters():
        if name.endswith("in_proj_weight") or name.endswith("in_proj_bias"):
            kind = "weight" if name.endswith("weight") else "bias"
            prefix = name.rsplit(".", 1)[0]
            for proj, grad in zip(("q_proj", "k_proj", "v_proj"), parameter.grad.chunk(3)):
                grads[f"{prefix}.attention.{proj}.{kind}"] = grad
        elif ".out_proj." in name and ("self_attn" in name or "multihead_attn" in name):
            prefix, rest = name.split(".out_proj.")
            grads[f"{prefix}.attention.out_proj.{rest}"] = parameter.grad
        else:
            grads[name] = parameter.grad
    return grads


def assert_same_grads(theirs, ours):
    expected = torch_grads(theirs)
    got = {name: parameter.grad for name, parameter in ours.named_parameters()}
    assert set(expected) == set(got)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-11, rtol=1e-9, msg=name)


def causal_float(n):
    return nn.Transformer.generate_square_subsequent_mask(n, dtype=torch.float64)


def arbitrary_bool(q_len, k_len, seed=3):
    mask = torch.rand(q_len, k_len, generator=torch.Generator().manual_seed(seed)) < 0.3
    mask[:, 0] = False  # every row keeps a key (a row with none is NaN in torch)
    return mask


MASKINGS = ["none", "padding", "causal-float", "causal-bool", "causal+padding", "arbitrary-bool", "arbitrary-float",
            "per-head"]


def masks_for(masking, batch, n):
    attn_mask, pad = None, None
    if "padding" in masking:
        pad = padding(batch, n)
    if masking.startswith("causal-float") or masking == "causal+padding":
        attn_mask = causal_float(n)
    elif masking == "causal-bool":
        attn_mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    elif masking == "arbitrary-bool":
        attn_mask = arbitrary_bool(n, n)
    elif masking == "arbitrary-float":
        attn_mask = randn(n, n, seed=4)
    elif masking == "per-head":
        attn_mask = torch.stack([arbitrary_bool(n, n, seed=s) for s in range(batch * HEADS)])
    return attn_mask, pad


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_softmax_encoder_keeps_outputs_and_gradients(masking, batch_first):
    theirs = encoder(batch_first, norm_first=masking == "padding")
    ours = copy.deepcopy(theirs)
    report = swap_attention(ours, "softmax")
    assert report.paths == ["layers.0.self_attn", "layers.1.self_attn"]
    assert all(isinstance(layer.self_attn, SwappedAttention) for layer in ours.layers)
    batch, n = 3, 7
    attn_mask, pad = masks_for(masking, batch, n)
    x = randn(batch, n, DIM, seed=2)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    outputs = []
    for model in (theirs, ours):
        xi = x.clone().requires_grad_()
        out = model(xi, mask=attn_mask, src_key_padding_mask=pad)
        (out * randn(*out.shape, seed=5)).sum().backward()
        outputs.append((out, xi.grad))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], atol=1e-12, rtol=1e-10)
    assert_same_grads(theirs, ours)


def test_softmax_transformer_with_decoder_and_cross_attention():
    theirs = randomize(nn.Transformer(DIM, HEADS, 2, 2, FF, dropout=0.0, batch_first=True).double())
    ours = copy.deepcopy(theirs)
    report = swap_attention(ours, "softmax")
    roles = {module.path: module.role for module in report.replaced}
    assert roles["decoder.layers.0.multihead_attn"] == "cross-attention"
    assert roles["decoder.layers.1.self_attn"] == "self-attention"
    assert len(report.replaced) == 6
    src, tgt = randn(3, 9, DIM, seed=1), randn(3, 6, DIM, seed=2)
    kwargs = dict(tgt_mask=causal_float(6), src_key_padding_mask=padding(3, 9), memory_key_padding_mask=padding(3, 9),
                  tgt_key_padding_mask=padding(3, 6))
    outputs = []
    for model in (theirs, ours):
        s, t = src.clone().requires_grad_(), tgt.clone().requires_grad_()
        out = model(s, t, **kwargs)
        (out * randn(*out.shape, seed=3)).sum().backward()
        outputs.append((out, s.grad, t.grad))
    for got, expected in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    assert_same_grads(theirs, ours)


def _module_pair(**kwargs):
    theirs = randomize(nn.MultiheadAttention(DIM, HEADS, batch_first=True, **kwargs).double())
    holder = nn.ModuleDict({"attn": copy.deepcopy(theirs)})
    swap_attention(holder, "softmax")
    return theirs, holder["attn"]


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("attention_weights", ["error", "none"])
def test_softmax_returns_the_attention_weights(average, attention_weights):
    theirs = randomize(nn.MultiheadAttention(DIM, HEADS, batch_first=True).double())
    holder = nn.ModuleDict({"attn": copy.deepcopy(theirs)})
    swap_attention(holder, "softmax", attention_weights=attention_weights)  # softmax forms weights either way
    ours = holder["attn"]
    x = randn(2, 5, DIM)
    mask = arbitrary_bool(5, 5)
    expected = theirs(x, x, x, attn_mask=mask, key_padding_mask=padding(2, 5), average_attn_weights=average)
    got = ours(x, x, x, attn_mask=mask, key_padding_mask=padding(2, 5), average_attn_weights=average)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-12, rtol=1e-10)


def test_unbatched_cross_attention_with_separate_key_and_value_widths():
    theirs, ours = _module_pair(kdim=10, vdim=10)
    query, key, value = randn(5, DIM, seed=1), randn(8, 10, seed=2), randn(8, 10, seed=3)
    pad = torch.zeros(8, dtype=torch.bool)
    pad[-3:] = True
    expected, _ = theirs(query, key, value, key_padding_mask=pad, need_weights=False)
    got, weights = ours(query, key, value, key_padding_mask=pad, need_weights=False)
    assert weights is None
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    # key is value: attnzoo's own cross-attention path (context=...)
    expected, _ = theirs(query, key, key, need_weights=False)
    torch.testing.assert_close(ours(query, key, key, need_weights=False)[0], expected, atol=1e-12, rtol=1e-10)


def test_fast_path_is_switched_off_and_reported(monkeypatch):
    layer = nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=0.0, batch_first=True)
    theirs = randomize(nn.TransformerEncoder(layer, 2).double()).eval()
    assert theirs.use_nested_tensor
    ours = copy.deepcopy(theirs)
    x, pad = randn(3, 7, DIM), padding(3, 7)
    with torch.no_grad():
        expected = theirs(x, src_key_padding_mask=pad)  # torch's fused, nested-tensor path
    report = swap_attention(ours, "softmax")
    assert not ours.use_nested_tensor
    disabled = dict(report.fast_path_disabled)
    assert set(disabled) == {"<model>", "layers.0", "layers.1"} and "nested" in disabled["<model>"]

    def bypass(*args, **kwargs):
        raise AssertionError("the fused encoder kernel bypasses the swapped attention")

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", bypass)
    monkeypatch.setattr(torch, "_nested_tensor_from_mask", bypass)
    with torch.no_grad():
        got = ours(x, src_key_padding_mask=pad)
        single_layer = ours.layers[0](x)  # a layer on its own, in eval mode, without grad: the layer's fast path
    keep = ~pad
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-12, rtol=1e-10)
    assert single_layer.shape == x.shape


@pytest.mark.parametrize("mechanism,options", [("performer", {"nb_features": 16, "seed": 0}), ("linear", {}),
                                               ("retention", {}), ("local", {"window": 3})])
def test_other_mechanisms_take_causal_and_padding_masks(mechanism, options):
    model = encoder()
    report = swap_attention(model, mechanism, **options)
    assert report.mechanism == mechanism and report.options == options
    attention = model.layers[0].self_attn
    x, pad = randn(3, 8, DIM), padding(3, 8)
    # The causal mask in every convention torch uses, the float key padding nn.TransformerEncoder makes: all
    # mapped to attnzoo's causal=True and bool key_padding_mask.
    expected = attention.attention(x, causal=True, key_padding_mask=pad)
    for mask in (causal_float(8), torch.ones(8, 8, dtype=torch.bool).triu(1)):
        float_pad = torch.zeros(3, 8, dtype=torch.float64).masked_fill(pad, -math.inf)
        for key_padding_mask in (pad, float_pad):
            got, weights = attention(x, x, x, attn_mask=mask, key_padding_mask=key_padding_mask, need_weights=False)
            assert weights is None
            torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    got, _ = attention(x, x, x, attn_mask=causal_float(8), is_causal=True, need_weights=False)
    torch.testing.assert_close(got, attention.attention(x, causal=True), atol=1e-12, rtol=1e-10)
    out = model(x, mask=causal_float(8), src_key_padding_mask=pad)
    out.sum().backward()
    assert torch.isfinite(out).all()


def test_masks_a_mechanism_cannot_honour_are_refused_naming_them():
    model = encoder()
    swap_attention(model, "performer", nb_features=16)
    attention = model.layers[0].self_attn
    x = randn(2, 6, DIM)
    with pytest.raises(UnsupportedOptionError, match="attn_mask"):
        attention(x, x, x, attn_mask=arbitrary_bool(6, 6), need_weights=False)
    with pytest.raises(UnsupportedOptionError, match="key_padding_mask"):
        attention(x, x, x, key_padding_mask=randn(2, 6), need_weights=False)
    with pytest.raises(UnsupportedOptionError, match="need_weights"):
        attention(x, x, x)
    nystrom = encoder()
    swap_attention(nystrom, "nystrom", landmarks=2)
    with pytest.raises(UnsupportedOptionError, match="causal"):
        nystrom(x, mask=causal_float(6))
    # attention_weights="none": models that call attn(x, x, x)[0] keep working
    lenient = encoder()
    swap_attention(lenient, "linear", attention_weights="none")
    out, weights = lenient.layers[0].self_attn(x, x, x)
    assert weights is None and out.shape == x.shape


def test_translate_masks():
    n = 5
    masks = translate_masks(causal_float(n), None, False, batch=2, heads=HEADS, q_len=n, k_len=n, dtype=torch.float64)
    assert masks.causal and masks.additive is None and masks.key_padding_mask is None
    pad = padding(2, n)
    float_pad = torch.zeros(2, n).masked_fill(pad, -math.inf)
    masks = translate_masks(None, float_pad, False, batch=2, heads=HEADS, q_len=n, k_len=n, dtype=torch.float64)
    assert torch.equal(masks.key_padding_mask, pad) and not masks.causal
    masks = translate_masks(torch.zeros(n, n, dtype=torch.bool), None, False, batch=2, heads=HEADS, q_len=n, k_len=n,
                            dtype=torch.float64)
    assert masks.additive is None and not masks.causal  # a mask that masks nothing is dropped
    near_causal = causal_float(n)
    near_causal[3, 0] = -math.inf
    masks = translate_masks(near_causal, None, False, batch=2, heads=HEADS, q_len=n, k_len=n, dtype=torch.float64)
    assert not masks.causal and masks.arbitrary == ("attn_mask",)
    assert torch.equal(masks.additive[0, 0], near_causal)
    masks = translate_masks(near_causal, None, True, batch=2, heads=HEADS, q_len=n, k_len=n, dtype=torch.float64)
    assert masks.causal  # is_causal is a hint torch trusts; so do we
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        translate_masks(torch.zeros(n, n + 1), None, False, batch=2, heads=HEADS, q_len=n, k_len=n, dtype=torch.float64)
    with pytest.raises(ValueError, match="is_causal"):
        translate_masks(None, None, True, batch=2, heads=HEADS, q_len=n, k_len=n + 2, dtype=torch.float64)
    with pytest.raises(TypeError, match="is_causal"):
        translate_masks(None, None, 1, batch=2, heads=HEADS, q_len=n, k_len=n, dtype=torch.float64)


class UserModel(nn.Module):
    """A model of one's own: an attention module shared by two blocks, one nested in a list."""

    def __init__(self):
        super().__init__()
        self.shared = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(DIM, DIM)), nn.ModuleDict({"attn": self.shared})])
        self.cross = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.frozen = nn.MultiheadAttention(DIM, HEADS, batch_first=True, dropout=0.1)
        for parameter in self.frozen.parameters():
            parameter.requires_grad_(False)

    def forward(self, x, memory):
        x = self.blocks[0](x) + self.shared(x, x, x, need_weights=False)[0]
        x = x + self.blocks[1]["attn"](x, x, x, need_weights=False)[0]
        x = x + self.cross(x, memory, memory, need_weights=False)[0]
        return x + self.frozen(x, x, x, need_weights=False)[0]


def test_user_model_shared_modules_flags_and_select():
    theirs = randomize(UserModel().double()).eval()
    ours = copy.deepcopy(theirs)
    report = swap_attention(ours, "softmax")
    assert sorted(report.paths) == ["blocks.1.attn", "cross", "frozen", "shared"]
    assert ours.shared is ours.blocks[1]["attn"]  # shared stays shared
    assert not ours.frozen.training and not any(p.requires_grad for p in ours.frozen.parameters())
    assert all(p.requires_grad for p in ours.shared.parameters())
    assert any("dropout" in note for module in report.replaced if module.path == "frozen" for note in module.notes)
    x, memory = randn(2, 5, DIM, seed=1), randn(2, 7, DIM, seed=2)
    torch.testing.assert_close(ours(x, memory), theirs(x, memory), atol=1e-12, rtol=1e-10)

    partial = copy.deepcopy(theirs)
    report = swap_attention(partial, "linear", select=lambda path: path == "cross")
    assert report.paths == ["cross"] and isinstance(partial.shared, nn.MultiheadAttention)
    with pytest.raises(TypeError, match="select must return"):
        swap_attention(copy.deepcopy(theirs), "linear", select=lambda path: "yes")


def test_swapping_again_keeps_the_projections():
    theirs = encoder()
    ours = copy.deepcopy(theirs)
    swap_attention(ours, "performer", nb_features=16)
    report = swap_attention(ours, "softmax")
    assert len(report.replaced) == 2 and all(m.role == "self-attention" for m in report.replaced)
    x = randn(2, 6, DIM)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-12, rtol=1e-10)


def test_float32_matches_too():
    layer = nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=0.0, batch_first=True)
    theirs = randomize(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    ours = copy.deepcopy(theirs)
    swap_attention(ours, "softmax")
    assert ours.layers[0].self_attn.attention.q_proj.weight.dtype == torch.float32
    x = randn(2, 6, DIM, dtype=torch.float32)
    torch.testing.assert_close(ours(x, mask=causal_float(6).float()), theirs(x, mask=causal_float(6).float()),
                               atol=1e-5, rtol=1e-5)


# -- bad input: a clear error and the model exactly as it was ------------------------------------------------
def snapshot(model):
    return {name: value.clone() for name, value in model.state_dict().items()}, [type(m) for m in model.modules()]


def assert_untouched(model, before):
    state, types = before
    after = model.state_dict()
    assert list(after) == list(state)
    for name in state:
        assert torch.equal(after[name], state[name]), name
    assert [type(m) for m in model.modules()] == types


@pytest.mark.parametrize(
    "model,mechanism,options,error,match",
    [
        (lambda: nn.Sequential(nn.Linear(4, 4)), "performer", {}, ValueError, "no torch.nn.MultiheadAttention"),
        (lambda: encoder(), "nope", {}, ValueError, "unknown mechanism"),
        (lambda: encoder(), "performer", {"nb_features": -1}, ValueError, "nb_features"),
        (lambda: encoder(), "performer", {"nb_feature": 8}, TypeError, "nb_feature"),
        (lambda: encoder(), "performer", {"shrinkage": "False"}, TypeError, "shrinkage"),
        (lambda: nn.Transformer(DIM, HEADS, 1, 1, FF), "retention", {}, UnsupportedOptionError, "cross"),
        (lambda: nn.ModuleList([nn.MultiheadAttention(DIM, HEADS), nn.MultiheadAttention(DIM, HEADS, add_bias_kv=True)]),
         "softmax", {}, ValueError, "add_bias_kv"),
        (lambda: nn.ModuleList([nn.MultiheadAttention(DIM, HEADS, add_zero_attn=True)]), "softmax", {}, ValueError,
         "add_zero_attn"),
        (lambda: nn.ModuleList([nn.MultiheadAttention(DIM, HEADS, kdim=6, vdim=8)]), "softmax", {}, ValueError, "vdim"),
        (lambda: nn.ModuleList([nn.MultiheadAttention(DIM, HEADS, kdim=6, vdim=6)]), "gla", {}, UnsupportedOptionError,
         "cross"),
        (lambda: encoder(), "performer", {"select": lambda path: False}, ValueError, "none selected"),
        (lambda: encoder(), "performer", {"attention_weights": "drop"}, ValueError, "attention_weights"),
    ],
)
def test_refused_swaps_leave_the_model_as_it_was(model, mechanism, options, error, match):
    model = model()
    before = snapshot(model)
    with pytest.raises(error, match=match):
        swap_attention(model, mechanism, **options)
    assert_untouched(model, before)


def test_a_model_that_is_an_attention_module_is_refused():
    with pytest.raises(ValueError, match="itself an attention module"):
        swap_attention(nn.MultiheadAttention(DIM, HEADS), "softmax")
    with pytest.raises(TypeError, match="model"):
        swap_attention("encoder", "softmax")


def test_adapter_validates_its_arguments():
    model = encoder()
    swap_attention(model, "softmax")
    attention = model.layers[0].self_attn
    x = randn(2, 6, DIM)
    with pytest.raises(TypeError, match="need_weights"):
        attention(x, x, x, need_weights=None)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        attention(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        attention(x, x, x, attn_mask=torch.zeros(6, 6, dtype=torch.long))
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        SwappedAttention(nn.Linear(2, 2), batch_first=True)
    assert isinstance(attention.attention, MultiHeadAttention)


def test_what_only_exact_attention_does_is_read_from_the_instances_kind():
    """softmax with quiet=True is no longer exact softmax attention: like any other mechanism it refuses an
    arbitrary mask and the weights, and the refusal names the mechanisms that take them."""
    from attnzoo.dropin.swapped import exact_mechanisms

    assert "softmax" in exact_mechanisms() and "performer" not in exact_mechanisms()
    model = encoder()
    swap_attention(model, "softmax", quiet=True)
    attention = model.layers[0].self_attn
    x = randn(2, 6, DIM)
    with pytest.raises(UnsupportedOptionError, match="attn_mask.*mechanism='softmax' takes any mask"):
        attention(x, x, x, attn_mask=arbitrary_bool(6, 6), need_weights=False)
    with pytest.raises(UnsupportedOptionError, match="need_weights"):
        attention(x, x, x)
    exact = encoder()
    swap_attention(exact, "softmax")
    out, weights = exact.layers[0].self_attn(x, x, x, attn_mask=arbitrary_bool(6, 6))
    assert weights.shape == (2, 6, 6) and torch.isfinite(out).all()


def test_add_zero_attn_is_refused_pointing_to_quiet_attention():
    with pytest.raises(ValueError, match="add_zero_attn.*mechanism='softmax' with quiet=True is the closest"):
        swap_attention(nn.ModuleList([nn.MultiheadAttention(DIM, HEADS, add_zero_attn=True)]), "linear")


def test_a_checkpoint_of_the_unswapped_model_loads_into_the_swapped_one():
    """torch's state-dict keys (packed in_proj_weight/in_proj_bias, separate q/k/v_proj_weight, out_proj) load into
    the swapped modules by a load hook, and give the original outputs under softmax."""
    original = encoder()
    swapped = randomize(encoder(), seed=9)  # other weights: only the loaded ones can make it equal
    swap_attention(swapped, "softmax")
    checkpoint = original.state_dict()
    assert any(key.endswith("in_proj_weight") for key in checkpoint)
    assert swapped.load_state_dict(checkpoint).missing_keys == []
    x, mask = randn(3, 7, DIM, seed=4), padding(3, 7)
    torch.testing.assert_close(swapped(x, src_key_padding_mask=mask), original(x, src_key_padding_mask=mask),
                               atol=1e-12, rtol=1e-10)
    separate = randomize(nn.MultiheadAttention(DIM, HEADS, kdim=12, vdim=12, batch_first=True).double())
    holder = nn.Sequential(copy.deepcopy(separate))
    holder[0].load_state_dict({k: torch.zeros_like(v) for k, v in holder[0].state_dict().items()})
    swap_attention(holder, "softmax")
    holder.load_state_dict(nn.Sequential(separate).state_dict())
    q, kv = randn(2, 5, DIM, seed=5), randn(2, 6, 12, seed=6)
    torch.testing.assert_close(holder[0](q, kv, kv)[0], separate(q, kv, kv)[0], atol=1e-12, rtol=1e-10)
    # the swapped module's own keys still load as they are
    assert swapped.load_state_dict(swapped.state_dict()).missing_keys == []
