"""The token models on packed batches (``cu_seqlens``): each document's logits are those it has alone."""

from __future__ import annotations

import pytest
import torch

from attnzoo import UnsupportedOptionError
from attnzoo.models import LanguageModel, ModelConfig, SequenceClassifier, SequenceTagger

LENGTHS = (5, 17, 1, 9)
VOCAB = 23


def _documents(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    documents = [torch.randint(0, VOCAB, (1, n), generator=generator) for n in LENGTHS]
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return documents, torch.cat(documents, dim=1), offsets


def _config(mechanism: str, **fields) -> ModelConfig:
    fields.setdefault("positional", "sinusoidal")
    return ModelConfig(VOCAB, dim=16, heads=2, depth=2, self_attention=mechanism, max_length=32, **fields)


def _model(cls, config: ModelConfig, *args, **kwargs):
    torch.manual_seed(0)
    return cls.from_config(config, *args, **kwargs).double().eval()


@pytest.mark.parametrize("mechanism", ["softmax", "linear"])
@pytest.mark.parametrize("positional,token_shift", [("sinusoidal", False), ("learned", False), ("rotary", True)])
def test_language_model_packed_equals_alone(mechanism, positional, token_shift):
    documents, row, offsets = _documents()
    model = _model(LanguageModel, _config(mechanism, positional=positional, token_shift=token_shift))
    packed = model(row, cu_seqlens=offsets)
    alone = torch.cat([model(document) for document in documents], dim=1)
    assert packed.shape == (1, sum(LENGTHS), VOCAB)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)


def test_language_model_packed_gradients_equal_alone():
    documents, row, offsets = _documents(1)
    model = _model(LanguageModel, _config("softmax"))
    model(row, cu_seqlens=offsets).square().sum().backward()
    packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sum(model(document).square().sum() for document in documents).backward()
    for mine, theirs in zip(packed, (p.grad for p in model.parameters())):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mechanism", ["softmax", "linear"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_classifier_packed_gives_one_row_per_document(mechanism, pooling):
    documents, row, offsets = _documents(2)
    model = _model(SequenceClassifier, _config(mechanism, positional="learned"), 3, pooling=pooling)
    packed = model(row, cu_seqlens=offsets)
    alone = torch.cat([model(document) for document in documents])
    assert packed.shape == (len(LENGTHS), 3)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mechanism", ["softmax", "linear"])
def test_tagger_packed_equals_alone(mechanism):
    documents, row, offsets = _documents(3)
    model = _model(SequenceTagger, _config(mechanism, positional="rotary", token_shift=True), 4)
    torch.testing.assert_close(model(row, cu_seqlens=offsets), torch.cat([model(d) for d in documents], dim=1),
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("fields", [
    {"reversible": True},
    {"block": "flash_gau", "block_options": {"chunk_size": 4}},
    {"block": "mamba2", "block_options": {"state_dim": 4, "chunk_size": 4}},
])
def test_reversible_gated_and_mamba2_stacks_pack(fields):
    documents, row, offsets = _documents(4)
    model = _model(LanguageModel, _config("softmax", **fields))
    torch.testing.assert_close(model(row, cu_seqlens=offsets), torch.cat([model(d) for d in documents], dim=1),
                               rtol=0, atol=1e-10)


def test_a_row_run_unpacked_is_caught():
    """The check can fail: the row run unpacked (positions and attention running on across documents) differs."""
    documents, row, offsets = _documents()
    model = _model(LanguageModel, _config("linear"))
    alone = torch.cat([model(document) for document in documents], dim=1)
    assert (model(row) - alone).abs().max() > 1e-3


def test_mechanism_that_cannot_pack_is_refused_by_name_before_computation():
    _, row, offsets = _documents()
    model = _model(SequenceClassifier, _config("linformer", self_attention_options={"max_seq_len": 32, "rank": 8}), 3)
    calls = []
    model.embedding.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(UnsupportedOptionError, match="linformer.*cu_seqlens"):
        model(row, cu_seqlens=offsets)
    assert not calls


@pytest.mark.parametrize("offsets,match", [
    (torch.tensor([0, 5, 5, 32]), "strictly increasing"),
    (torch.tensor([0, 5, 31]), "end at the row length"),
    (torch.tensor([0.0, 32.0]), "int64"),
])
def test_bad_offsets_are_refused_naming_cu_seqlens(offsets, match):
    _, row, _ = _documents()
    model = _model(SequenceClassifier, _config("softmax"), 3)
    with pytest.raises((ValueError, TypeError), match=match):
        model(row, cu_seqlens=offsets)


def test_packed_with_padding_mask_is_refused():
    _, row, offsets = _documents()
    model = _model(SequenceTagger, _config("softmax"), 3)
    with pytest.raises(ValueError, match="cu_seqlens and padding_mask"):
        model(row, padding_mask=torch.zeros_like(row, dtype=torch.bool), cu_seqlens=offsets)
