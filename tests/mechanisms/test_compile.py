"""torch.compile on MultiHeadAttention: compiled forward and backward equal eager, on CPU.

Inductor (the real backend, generating and compiling C++) on a representative set: exact softmax on SDPA and the
causal path of linear attention (whose hand-written eager kernel gives way to plain operations when compiled),
some 30 s each on two busy cores, cold. A few mechanisms through dynamo and AOTAutograd (backend ``aot_eager``:
the same graphs without code generation, seconds instead of tens of seconds each) in every form of the call, each
to one graph (``fullgraph=True``), as docs/dropin.md says; every registered mechanism alone is compiled by the
conformance suite (tests/conformance/test_tracing.py)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import attnzoo
from attnzoo.functional.linear import causal_chunks
from attnzoo.mechanisms import mechanism_class

DIM, HEADS = 16, 2

@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles new modules of shared classes: without a reset, dynamo's recompilation limit would
    # quietly fall back to eager after a few of them.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def build(name, seed=0):
    options = dict(mechanism_class(name).test_options)
    torch.manual_seed(seed)
    return attnzoo.MultiHeadAttention(DIM, HEADS, name, **options).eval()


def length_for(name, wanted=12):
    multiple = mechanism_class(name).capabilities.length_multiple
    return wanted if multiple is None else max(multiple, wanted - wanted % multiple)


def calls(name, n, every=False):
    """How a mechanism is called: with padding, causal where it can be; ``every`` adds the non-causal and the
    cross-attention forms (each a compilation of its own, so the inductor tests, tens of seconds each, take one)."""
    caps = mechanism_class(name).capabilities
    pad = torch.zeros(2, n, dtype=torch.bool)
    pad[1, -3:] = True
    context = torch.randn(2, n, DIM, generator=torch.Generator().manual_seed(7))
    kinds = [{"causal": True, "key_padding_mask": pad}] if caps.causal else [{"key_padding_mask": pad}]
    if every and caps.causal:
        kinds.append({"key_padding_mask": pad})
    if every and caps.cross:
        kinds.append({"context": context, "key_padding_mask": pad})
    return kinds


def forward_backward(module, x, kwargs):
    x = x.clone().requires_grad_()
    out = module(x, **kwargs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    module.zero_grad(set_to_none=True)
    return [out.detach(), x.grad] + grads


def assert_compiled_matches_eager(name, backend, atol, every=False):
    module = build(name)
    n = length_for(name)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    x = torch.randn(2, n, DIM, generator=torch.Generator().manual_seed(1))
    for kwargs in calls(name, n, every):
        expected = forward_backward(module, x, kwargs)
        got = forward_backward(compiled, x, kwargs)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=atol, rtol=atol)
    assert counter.frame_count >= 1, "nothing was compiled"


@pytest.mark.parametrize("name", ["softmax", pytest.param("linear", marks=pytest.mark.slow)])
def test_inductor_matches_eager(name):
    assert_compiled_matches_eager(name, "inductor", atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax", "performer"])
def test_multi_head_attention_compiles_every_form_of_the_call(name):
    # Each form (causal, not, cross-attention) is a compilation of its own. Every mechanism alone compiles to one
    # graph in the conformance suite (tests/conformance/test_tracing.py).
    assert_compiled_matches_eager(name, "aot_eager", atol=1e-6, every=True)


def test_traceable_causal_chunks_match_the_kernel(monkeypatch):
    """The plain form compiled graphs take equals the hand-written kernel, over several groups of chunks
    (a shorter group than usual: several spans per head and a ragged last chunk), with an initial state:
    outputs, final state and every gradient."""
    monkeypatch.setattr(causal_chunks, "GROUP_ROWS", 8)
    generator = torch.Generator().manual_seed(3)
    shapes = [(2, 2, 23, 3), (2, 2, 23, 3), (2, 2, 23, 4), (2, 2, 3, 5)]
    inputs = [torch.rand(*shape, generator=generator, dtype=torch.float64) for shape in shapes]
    weights = [torch.randn(2, 2, 23, 5, generator=generator, dtype=torch.float64),
               torch.randn(2, 2, 3, 5, generator=generator, dtype=torch.float64)]
    results = []
    for run in (causal_chunks._CausalChunks.apply, causal_chunks.causal_chunks_traceable):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out, final = run(*leaves, 4)
        ((out * weights[0]).sum() + (final * weights[1]).sum()).backward()
        results.append([out.detach(), final.detach()] + [leaf.grad for leaf in leaves])
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_a_swapped_torch_encoder_compiles():
    """swap_attention's mask translation reads the masks' values (graph breaks), and still compiles."""
    from torch import nn

    from attnzoo.swap import swap_attention

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(DIM, HEADS, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    swap_attention(encoder, "linear")
    x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, -2:] = True
    mask = nn.Transformer.generate_square_subsequent_mask(8)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(encoder, backend=counter)
    results = []
    for model in (encoder, compiled):
        xi = x.clone().requires_grad_()
        out = model(xi, mask=mask, src_key_padding_mask=pad)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert counter.frame_count >= 1
