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
                                               ("gla", {}), ("retention", {})])
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
