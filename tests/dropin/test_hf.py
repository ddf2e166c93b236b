"""attnzoo.dropin.hf: transformers models (built from tiny configs, random weights, nothing downloaded) run attnzoo
through transformers' attention-function registry; softmax reproduces them, generate() keeps working, and a
refused swap leaves the model as it was. Skipped without the optional extra (pip install "attnzoo[hf]")."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason='transformers is an optional extra: pip install "attnzoo[hf]"')

from attnzoo import UnsupportedOptionError  # noqa: E402
from attnzoo.dropin.hf import IMPLEMENTATION, MECHANISM_ATTRIBUTE, use_attnzoo  # noqa: E402

VOCAB = 50


def bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=32, max_position_embeddings=32)
    return transformers.BertModel(config).double().eval()


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config).double().eval()


def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).double().eval()


def randomize(model, scale=0.5):
    """Larger random weights than the initialiser's 0.02, so attention is far from uniform and differences show."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale
                                / parameter.shape[-1] ** 0.5)
    return model


def batch():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding, as generate() wants it
    return ids, mask


def test_bert_softmax_matches_outputs_and_gradients():
    theirs = randomize(bert())
    ours = copy.deepcopy(theirs)
    report = use_attnzoo(ours, "softmax")
    assert [path for path, _ in report.modules] == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    assert ours.config._attn_implementation == IMPLEMENTATION and theirs.config._attn_implementation != IMPLEMENTATION
    ids, mask = batch()
    results = []
    for model in (theirs, ours):
        out = model(ids, attention_mask=mask).last_hidden_state
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append((out, model.embeddings.word_embeddings.weight.grad))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama-gqa"])
def test_decoders_on_softmax_match_and_generate_alike(build):
    theirs = randomize(build())
    ours = copy.deepcopy(theirs)
    use_attnzoo(ours, "softmax")
    ids, mask = batch()
    keep = mask.bool()
    torch.testing.assert_close(ours(ids, attention_mask=mask).logits[keep], theirs(ids, attention_mask=mask).logits[keep],
                               atol=1e-12, rtol=1e-10)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), theirs.generate(ids, **kwargs))


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama-gqa"])
@pytest.mark.parametrize("mechanism,options", [("linear", {}), ("performer", {"nb_features": 16, "seed": 0}),
                                               ("gla", {}), ("retention", {}), ("lolcats", {"window": 3}),
                                               ("lolcats", {"window": 2, "sparse_cache": 2})])
def test_other_mechanisms_generate_from_the_cache_as_without_it(build, mechanism, options):
    theirs = randomize(build())
    model = copy.deepcopy(theirs)
    use_attnzoo(model, mechanism, **options)
    ids, mask = batch()
    keep = mask.bool()
    # the mechanism runs: the logits are no longer softmax's
    assert not torch.allclose(model(ids, attention_mask=mask).logits[keep], theirs(ids, attention_mask=mask).logits[keep])
    # a decoding step over the KV cache gives the logits of the full pass
    full = model(ids, attention_mask=mask).logits[:, -1]
    prefix = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
    step = model(ids[:, -1:], attention_mask=mask, past_key_values=prefix.past_key_values).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-10, rtol=1e-8)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_mechanism_parameters_belong_to_the_model():
    model = llama()
    use_attnzoo(model, "gla")
    names = [name for name in model.state_dict() if MECHANISM_ATTRIBUTE in name]
    assert "model.layers.0.self_attn.attnzoo_mechanism.gate_weight" in names
    assert all(p.dtype == torch.float64 for n, p in model.named_parameters() if MECHANISM_ATTRIBUTE in n)


def test_lolcats_takes_the_models_scaling_and_trains_its_own_parameters():
    """A Llama converted to lolcats: each layer's mechanism takes the module's logit scale, and its learned
    parameters (the two Hedgehog maps, the window factor), what attention transfer trains, are the model's."""
    model = llama()
    use_attnzoo(model, "lolcats", window=3)
    mechanism = getattr(model.model.layers[0].self_attn, MECHANISM_ATTRIBUTE)
    assert mechanism.logit_scale() == model.model.layers[0].self_attn.scaling == 4 ** -0.5
    prefix = "model.layers.1.self_attn.attnzoo_mechanism."
    names = {name for name, _ in model.named_parameters() if name.startswith(prefix)}
    assert names == {prefix + name for name in ("query_map.weight", "query_map.bias", "key_map.weight",
                                                "key_map.bias", "window_factor")}


def snapshot(model):
    return ({name: value.clone() for name, value in model.state_dict().items()}, [type(m) for m in model.modules()],
            model.config._attn_implementation)


@pytest.mark.parametrize(
    "build,mechanism,options,error,match",
    [
        (lambda: transformers.DistilBertModel(transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=16, n_layers=1, n_heads=4, hidden_dim=32)), "softmax", {}, ValueError,
         "no attention module attnzoo supports"),
        (gpt2, "nystrom", {"landmarks": 2}, UnsupportedOptionError, "causal"),
        (llama, "performer", {"nb_features": -1}, ValueError, "nb_features"),
        (bert, "performer", {"nb_feature": 8}, TypeError, "nb_feature"),
        (bert, "nope", {}, ValueError, "unknown mechanism"),
        (lambda: transformers.BertModel(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
            is_decoder=True, add_cross_attention=True)), "softmax", {}, ValueError, "cross-attention"),
    ],
)
def test_refused_swaps_leave_the_model_as_it_was(build, mechanism, options, error, match):
    model = build()
    state, types, implementation = snapshot(model)
    with pytest.raises(error, match=match):
        use_attnzoo(model, mechanism, **options)
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[name], state[name]) for name in state)
    assert [type(m) for m in model.modules()] == types
    assert model.config._attn_implementation == implementation


def test_a_plain_module_is_refused():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        use_attnzoo(torch.nn.Linear(2, 2), "softmax")


# -- static caches, save and load, scaling, compile, more architectures, attention weights ------------------------
def mistral(window=4):
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=window, bos_token_id=1, eos_token_id=2)
    return transformers.MistralForCausalLM(config).double().eval()


def qwen2():
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=1, eos_token_id=2)
    return transformers.Qwen2ForCausalLM(config).double().eval()


def swapped(build, mechanism, **options):
    theirs = randomize(build())
    ours = copy.deepcopy(theirs)
    use_attnzoo(ours, mechanism, **options)
    return theirs, ours


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama-gqa"])
@pytest.mark.parametrize("mechanism,options", [("softmax", {}), ("performer", {"nb_features": 16, "seed": 0})])
def test_static_cache_generates_what_the_dynamic_cache_generates(build, mechanism, options):
    """The static cache's unfilled slots are never attended to: with left padding too."""
    theirs, ours = swapped(build, mechanism, **options)
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    dynamic = ours.generate(ids, **kwargs)
    assert torch.equal(ours.generate(ids, cache_implementation="static", **kwargs), dynamic)
    if mechanism == "softmax":
        assert torch.equal(dynamic, theirs.generate(ids, **kwargs))
    # a step over an explicit StaticCache gives the full pass's logits
    cache = transformers.StaticCache(config=ours.config, max_cache_len=20)
    ours(ids[:, :-1], attention_mask=mask[:, :-1], past_key_values=cache, use_cache=True)
    step = ours(ids[:, -1:], attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, ours(ids, attention_mask=mask).logits[:, -1], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("mechanism,options", [("performer", {"nb_features": 16, "seed": 0}), ("gla", {})])
def test_save_and_load_restore_the_mechanism_and_its_tensors(tmp_path, build, mechanism, options):
    from attnzoo.dropin.hf import from_pretrained

    _, model = swapped(build, mechanism, **options)
    with torch.no_grad():  # tensors a fresh build would not draw again: only the saved ones make logits equal
        for name, tensor in model.state_dict().items():
            if MECHANISM_ATTRIBUTE in name and tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(1), dtype=tensor.dtype))
    assert model.config.attnzoo == {"mechanism": mechanism, "options": options}
    model.save_pretrained(tmp_path)
    ids, mask = batch()
    reloaded = from_pretrained(type(model), tmp_path, dtype=torch.float64).eval()
    assert reloaded.config._attn_implementation == IMPLEMENTATION
    torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                               atol=1e-12, rtol=1e-10)
    plain = type(model).from_pretrained(tmp_path, dtype=torch.float64)  # not silently sdpa: it says what to call
    with pytest.raises(RuntimeError, match=r"attnzoo\.dropin\.hf\.from_pretrained"):
        plain(ids, attention_mask=mask)


@pytest.mark.parametrize("setting", [{}, {"scale_attn_weights": False}, {"scale_attn_by_inverse_layer_idx": True},
                                     {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True}])
def test_gpt2_scaling_is_honoured_or_refused(setting):
    build = lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(  # noqa: E731
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=64, **setting)).double().eval()
    ids, mask = batch()
    keep = mask.bool()
    for mechanism, options in (("local", {"window": 32}), ("softmax", {})):
        theirs, ours = swapped(build, mechanism, **options)
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits[keep],
                                   theirs(ids, attention_mask=mask).logits[keep], atol=1e-12, rtol=1e-10)
    if setting:
        with pytest.raises(UnsupportedOptionError, match=r"scales its logits.*linear has no logit scale"):
            use_attnzoo(build(), "linear")
    else:
        use_attnzoo(build(), "linear")


@pytest.mark.parametrize("build,mechanism,options", [(gpt2, "softmax", {}), (llama, "softmax", {}),
                                                     (llama, "local", {"window": 4})], ids=["gpt2", "llama", "local"])
def test_fullgraph_compile_equals_eager(build, mechanism, options):
    """dynamo traces the whole forward, mask function included, as one graph (backend="eager": the same graph
    run without code generation, so the test takes seconds)."""
    _, model = swapped(build, mechanism, **options)
    ids, mask = batch()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, attention_mask=mask, use_cache=False).logits,
                                   model(ids, attention_mask=mask, use_cache=False).logits, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("build,mechanism,options", [(lambda: mistral(window=4), "softmax", {}),
                                                     (lambda: mistral(window=64), "softmax", {}),
                                                     (lambda: mistral(window=4), "local", {}),
                                                     (qwen2, "softmax", {})],
                         ids=["mistral-window-4", "mistral-window-64", "mistral-local", "qwen2"])
def test_mistral_and_qwen2_match_their_own_attention(build, mechanism, options):
    theirs, ours = swapped(build, mechanism, **options)
    ids, mask = batch()
    keep = mask.bool()
    torch.testing.assert_close(ours(ids, attention_mask=mask).logits[keep],
                               theirs(ids, attention_mask=mask).logits[keep], atol=1e-10, rtol=0)
    if mechanism == "softmax":
        kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids, **kwargs), theirs.generate(ids, **kwargs))


@pytest.mark.parametrize("mechanism, options", [("performer", {"nb_features": 8}), ("based", {}), ("nsa", {})],
                         ids=["performer", "based", "nsa"])
def test_a_sliding_window_a_mechanism_cannot_honour_is_refused(mechanism, options):
    # based and nsa have a window option, but their other parts read beyond it: only a declared window_option
    # (exactly a sliding window) honours the model's.
    model = mistral(window=4)
    state, _, implementation = snapshot(model)
    with pytest.raises(UnsupportedOptionError, match=rf"sliding_window=4.*{mechanism} cannot honour"):
        use_attnzoo(model, mechanism, **options)
    assert model.config._attn_implementation == implementation and not hasattr(model.config, "attnzoo")


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_output_attentions_gives_softmax_weights_or_refuses(build):
    theirs, ours = swapped(build, "softmax")
    ids, mask = batch()
    got = ours(ids, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(got.logits, ours(ids, attention_mask=mask).logits, atol=1e-12, rtol=1e-10)
    assert len(got.attentions) == 2
    keep = mask.bool()
    for weights in got.attentions:  # (batch, heads, seq, seq): causal rows over the tokens, summing to one
        assert weights.shape == (2, 4, 9, 9) and not weights.isnan().any()
        assert torch.all(weights.triu(1) == 0) and torch.all(weights[1, :, :, :3] == 0)
        torch.testing.assert_close(weights.sum(-1)[keep[:, None, :].expand(2, 4, 9)],
                                   torch.ones(2 * 4 * 9 - 4 * 3, dtype=weights.dtype))
    if build is gpt2:  # eager attention returns the same weights (llama's eager gives NaN in padding rows)
        theirs.set_attn_implementation("eager")
        rows = keep[:, None, :, None]
        for g, e in zip(got.attentions, theirs(ids, attention_mask=mask, output_attentions=True).attentions):
            torch.testing.assert_close(g * rows, e * rows, atol=1e-12, rtol=1e-10)
    _, other = swapped(build, "performer", nb_features=8, seed=0)
    with pytest.raises(UnsupportedOptionError, match="output_attentions=True: performer"):
        other(ids, attention_mask=mask, output_attentions=True)


# -- layers=: some decoder layers swapped, the rest kept ---------------------------------------------------------
@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama-gqa"])
@pytest.mark.parametrize("mechanism,options", [("linear", {}), ("performer", {"nb_features": 16, "seed": 0})])
def test_layers_swaps_exactly_those_layers_and_keeps_the_others(tmp_path, build, mechanism, options):
    from attnzoo.dropin.hf import from_pretrained

    theirs = randomize(build())
    ours = copy.deepcopy(theirs)
    report = use_attnzoo(ours, mechanism, layers=[1], **options)
    paths = [path for path, module in ours.named_modules() if hasattr(module, MECHANISM_ATTRIBUTE)]
    assert [path for path, _ in report.modules] == paths[1:] and [path for path, _ in report.kept] == paths[:1]
    names = [getattr(ours.get_submodule(path), MECHANISM_ATTRIBUTE).name for path in paths]
    assert names == ["softmax", mechanism]
    assert ours.config.attnzoo == {"mechanism": mechanism, "options": options, "layers": [1]}
    ids, mask = batch()
    keep = mask.bool()
    got = ours(ids, attention_mask=mask, output_hidden_states=True)
    expected = theirs(ids, attention_mask=mask, output_hidden_states=True)
    # the kept layer gives what the model's own attention gives (left padding included); the swapped one differs
    torch.testing.assert_close(got.hidden_states[1][keep], expected.hidden_states[1][keep], atol=1e-10, rtol=0)
    assert not torch.allclose(got.logits[keep], expected.logits[keep])
    # decoding from the cache gives the full pass's logits, and generate() what it gives without the cache
    prefix = ours(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
    step = ours(ids[:, -1:], attention_mask=mask, past_key_values=prefix.past_key_values).logits[:, -1]
    torch.testing.assert_close(step, got.logits[:, -1], atol=1e-10, rtol=1e-8)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), ours.generate(ids, use_cache=False, **kwargs))
    ours.save_pretrained(tmp_path)
    reloaded = from_pretrained(type(ours), tmp_path, dtype=torch.float64).eval()
    assert reloaded.config.attnzoo["layers"] == [1]
    torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits, got.logits, atol=1e-12, rtol=1e-10)


def test_layers_with_an_exact_mechanism_keep_the_others_under_the_models_mask():
    theirs = randomize(llama())
    ours = copy.deepcopy(theirs)
    use_attnzoo(ours, "softmax", layers=[0])
    ids, mask = batch()
    keep = mask.bool()
    torch.testing.assert_close(ours(ids, attention_mask=mask).logits[keep],
                               theirs(ids, attention_mask=mask).logits[keep], atol=1e-10, rtol=0)


@pytest.mark.parametrize("layers, error, match", [
    ([2], ValueError, r"^layers\[0\] = 2 is out of range: the model has 2 attention layers, 0 to 1"),
    ([-1], ValueError, r"^layers\[0\] = -1 is out of range"),
    ([1, 1], ValueError, r"^layers names layer 1 more than once"),
    ([], TypeError, r"^layers must be a non-empty list of layer indices"),
    ("1", TypeError, r"^layers must be a non-empty list"),
    ([0, 1.0], TypeError, r"^layers\[1\] must be an integer layer index, got 1.0 \(float\)"),
    ([True], TypeError, r"^layers\[0\] must be an integer layer index"),
])
def test_bad_layers_are_refused_and_leave_the_model_as_it_was(layers, error, match):
    model = llama()
    state, modules, implementation = snapshot(model)
    with pytest.raises(error, match=match):
        use_attnzoo(model, "linear", layers=layers)
    after = snapshot(model)
    assert after[1] == modules and after[2] == implementation and not hasattr(model.config, "attnzoo")
    assert all(torch.equal(state[name], after[0][name]) for name in state)


def test_a_kept_layer_under_a_sliding_window_needs_an_exact_mechanism():
    # local honours the window of the layer it serves, but the kept layer's window comes with the model's own
    # mask, which an inexact mechanism does not get.
    model = mistral(window=4)
    with pytest.raises(UnsupportedOptionError, match=r"^layers: model\.layers\.0\.self_attn is kept .*window=4"):
        use_attnzoo(model, "local", layers=[1])
    assert not hasattr(model.config, "attnzoo")
    theirs = randomize(mistral(window=4))
    ours = copy.deepcopy(theirs)
    use_attnzoo(ours, "softmax", layers=[1])  # exact: every layer keeps the model's mask, window included
    ids, mask = batch()
    keep = mask.bool()
    torch.testing.assert_close(ours(ids, attention_mask=mask).logits[keep],
                               theirs(ids, attention_mask=mask).logits[keep], atol=1e-10, rtol=0)
