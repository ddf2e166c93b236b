"""Per-layer schedules (hybrid stacks, docs/hybrids.md): the compact text form, the checks naming the schedule and
its item, and mixed stacks that equal their layers built alone, decode step by step as their forward, pack,
group key/value heads, and build in every model."""

from __future__ import annotations

import pytest
import torch

from attnzoo import UnsupportedOptionError
from attnzoo.models import (
    BlockConfig,
    LanguageModel,
    ModelConfig,
    Seq2SeqTransformer,
    SequenceClassifier,
    SequenceTagger,
)
from attnzoo.models.config import BLOCKS, AttentionSpec
from attnzoo.models.layers import DecoderLayer
from attnzoo.models.mamba2 import Mamba2DecoderLayer
from attnzoo.models.schedule import LayerSpec, format_schedule, parse_schedule

GATED, SOFTMAX, LOCAL = "gated_delta", "softmax", "local"
SMALL = dict(vocab_size=23, dim=16, heads=2)
MAMBA = {"state_dim": 8, "chunk_size": 4}


def tokens(batch=2, length=9, seed=0):
    return torch.randint(0, SMALL["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


# -- the text form -------------------------------------------------------------------------------------------
def test_the_text_form_reads_counts_options_and_blocks_and_writes_them_back():
    specs = parse_schedule(f"{GATED}*3, {LOCAL}(window=4,sink_tokens=1), mamba2(state_dim=8)", BLOCKS)
    assert specs == (LayerSpec(GATED),) * 3 + (LayerSpec(LOCAL, {"window": 4, "sink_tokens": 1}),
                                                LayerSpec(options={"state_dim": 8}, block="mamba2"))
    text = format_schedule(specs)
    assert text == f"{GATED}*3,{LOCAL}(window=4,sink_tokens=1),block:mamba2(state_dim=8)"
    assert parse_schedule(text, BLOCKS) == specs
    # A name that is both a mechanism and a block is the mechanism; block: says the block.
    assert parse_schedule("flash_gau,block:flash_gau(chunk_size=8)", BLOCKS) == (
        LayerSpec("flash_gau"), LayerSpec(options={"chunk_size": 8}, block="flash_gau"))


@pytest.mark.parametrize("layers, message", [
    ("nope,softmax", r"^layers item 'nope': unknown mechanism or block 'nope'; mechanisms: .*; blocks: gau"),
    ("block:lstm", r"^layers item 'block:lstm': unknown block 'lstm'"),
    ("softmax*0", r"^layers item 'softmax\*0': the count after \* must be an integer >= 1"),
    ("local(window 4)", r"^layers item 'local\(window 4\)': expected OPTION=VALUE"),
    ("local((window=4))", r"^layers 'local\(\(window=4\)\)': unbalanced or nested parentheses"),
    ("local(window=4", r"^layers 'local\(window=4': a parenthesis is not closed"),
    ("softmax,", r"^layers item '': expected MECHANISM or block:BLOCK"),
    ("softmax*3", r"^layers has 3 items \(softmax\*3\), which does not divide depth=4"),
    ("block:mamba2(state_dimm=8),softmax", r"^layers item 'block:mamba2\(state_dimm=8\)': block_options: unknown"),
    ("local(window=0),softmax", r"^layers item 'local\(window=0\)' \(layer 0\): window must be an integer >= 1"),
    ("local(windw=4),softmax", r"^layers item 'local\(windw=4\)' \(layer 0\): .*unknown option\(s\) windw"),
])
def test_bad_schedules_are_one_line_errors_naming_the_item(layers, message):
    with pytest.raises((TypeError, ValueError)) as caught:
        LanguageModel(ModelConfig(**SMALL, depth=4, layers=layers))
    assert len(str(caught.value).splitlines()) == 1 and __import__("re").search(message, str(caught.value)), \
        str(caught.value)


def test_a_schedule_replaces_the_fields_that_say_what_every_layer_is():
    with pytest.raises(ValueError, match="^layers gives each layer's mechanism or block, so self_attention="):
        ModelConfig(**SMALL, layers=[LayerSpec(GATED)], self_attention=LOCAL)
    with pytest.raises(ValueError, match="^layers gives each layer's .* block='mamba2'"):
        ModelConfig(**SMALL, layers=[LayerSpec(GATED)], block="mamba2")
    with pytest.raises(TypeError, match="^layers items must be LayerSpec"):
        ModelConfig(**SMALL, layers=[(GATED, {})])
    with pytest.raises(ValueError, match="^layers item 'block:mamba2': a block='mamba2' item has no mechanism"):
        ModelConfig(**SMALL, layers=[LayerSpec(GATED, block="mamba2")])
    # kv_heads and grouped-query refusals name the item; a stack of blocks alone refuses kv_heads as block= does.
    with pytest.raises(UnsupportedOptionError, match="^layers item 'linformer': kv_heads=1"):
        ModelConfig(**SMALL, layers="linformer,softmax", kv_heads=1)
    with pytest.raises(ValueError, match="^layers item 'block:mamba2': kv_heads=1 cannot be used"):
        ModelConfig(**SMALL, layers="mamba2", kv_heads=1)
    with pytest.raises(ValueError, match="reversible=True needs block='attention'"):
        ModelConfig(**SMALL, layers="softmax,mamba2", reversible=True)


def test_no_schedule_keeps_the_config_and_model_as_they_were():
    config = ModelConfig(**SMALL, depth=2)
    assert config.layers is None and config.layer_configs is None and config.layer_kinds == ("attention",) * 2
    torch.manual_seed(0)
    plain = LanguageModel(config).state_dict()
    torch.manual_seed(0)
    same = LanguageModel(ModelConfig(**SMALL, depth=2, layers=f"{SOFTMAX}*2")).state_dict()
    assert plain.keys() == same.keys() and all(torch.equal(plain[key], same[key]) for key in plain)


# -- mixed stacks ----------------------------------------------------------------------------------------------
def test_a_mixed_stack_equals_its_layers_built_alone():
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**SMALL, depth=4, layers=f"{GATED},{SOFTMAX},mamba2(state_dim=8)*2",
                                      positional="rotary", kv_heads=1)).eval()
    kinds = [(type(layer).__name__, getattr(getattr(layer, "self_attention", None), "mechanism", None))
             for layer in model.decoder.layers]
    assert [kind for kind, _ in kinds] == ["DecoderLayer", "DecoderLayer", "Mamba2DecoderLayer", "Mamba2DecoderLayer"]
    assert [mechanism.name for _, mechanism in kinds[:2]] == [GATED, SOFTMAX]
    base = BlockConfig(16, 2, rotary=True, kv_heads=1)
    alone = [DecoderLayer(BlockConfig(16, 2, rotary=True, kv_heads=1, self_attention=AttentionSpec(GATED))),
             DecoderLayer(base),
             Mamba2DecoderLayer(BlockConfig(16, 2, block="mamba2", block_options={"state_dim": 8})),
             Mamba2DecoderLayer(BlockConfig(16, 2, block="mamba2", block_options={"state_dim": 8}))]
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    mixed = x
    for ours, theirs in zip(model.decoder.layers, alone):
        theirs.load_state_dict(ours.state_dict())  # the same parameter names: a layer is what it is alone
        expected = theirs.eval()(mixed)
        mixed = ours(mixed)
        torch.testing.assert_close(mixed, expected, rtol=0, atol=0)


@pytest.mark.parametrize("layers", [f"{GATED},{SOFTMAX}", f"{SOFTMAX},mamba2(state_dim=8,chunk_size=4)",
                                    f"{GATED},block:flash_gau(chunk_size=4,shared_dim=8)"])
@pytest.mark.parametrize("kv_heads", [None, 1])
def test_decoding_step_by_step_equals_the_forward_of_a_mixed_stack(layers, kv_heads):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**SMALL, depth=4, layers=layers, kv_heads=kv_heads)).double().eval()
    ids = tokens(length=10)
    full = model(ids)
    logits, state = model.prefill(ids[:, :3])
    steps = [logits]
    for position in range(3, ids.shape[1]):
        logits_t, state = model.step(ids[:, position], state)
        steps.append(logits_t[:, None])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)


def test_a_packed_batch_gives_each_document_what_it_gives_alone_on_a_mixed_stack():
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**SMALL, depth=2, layers=f"{GATED},mamba2(state_dim=8,chunk_size=4)",
                                      kv_heads=1)).double().eval()
    first, second = tokens(1, 5, seed=1), tokens(1, 7, seed=2)
    packed = model(torch.cat([first, second], dim=1), cu_seqlens=torch.tensor([0, 5, 12]))
    torch.testing.assert_close(packed[:, :5], model(first), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(packed[:, 5:], model(second), rtol=1e-9, atol=1e-9)


def test_classifier_and_taggers_build_mixed_stacks():
    config = ModelConfig(**SMALL, depth=2, layers=f"{SOFTMAX},mamba2(state_dim=8)")
    classifier = SequenceClassifier(config, 3, pooling="cls")  # an attention layer reads the whole sequence
    assert classifier(tokens()).shape == (2, 3)
    with pytest.raises(UnsupportedOptionError, match="pooling='cls'"):
        SequenceClassifier(ModelConfig(**SMALL, depth=2, layers="mamba2(state_dim=8)"), 3, pooling="cls")
    for causal in (False, True):
        tagger = SequenceTagger(config, 4, causal=causal)
        assert tagger(tokens()).shape == (2, 9, 4)
        assert [type(layer).__name__ for layer in tagger.encoder.layers][1].startswith("Mamba2")


def test_seq2seq_sides_take_schedules_and_decode_step_by_step():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(11, 12, 16, 2, encoder_depth=2, decoder_depth=4, kv_heads=1,
                               encoder_layers=f"{GATED},mamba2(state_dim=8)",
                               decoder_layers=[LayerSpec(GATED), SOFTMAX]).double().eval()
    assert [layer.self_attention.mechanism.name for layer in model.decoder.layers] == [GATED, SOFTMAX] * 2
    src, tgt = torch.randint(0, 11, (2, 5)), torch.randint(0, 12, (2, 6))
    full = model(src, tgt)
    logits, state = model.prefill(src, tgt[:, :2])
    steps = [logits]
    for position in range(2, 6):
        logits_t, state = model.step(tgt[:, position], state)
        steps.append(logits_t[:, None])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="^decoder_layers item 'block:mamba2': block 'mamba2' has no cross"):
        Seq2SeqTransformer(11, 12, 16, 2, decoder_layers="mamba2,softmax")
    with pytest.raises(ValueError, match="^encoder_layers has 3 items"):
        Seq2SeqTransformer(11, 12, 16, 2, encoder_layers="softmax*3")
    with pytest.raises(ValueError, match="^decoder_layers gives each decoder layer's mechanism"):
        Seq2SeqTransformer(11, 12, 16, 2, decoder_layers=SOFTMAX, decoder_self_attention=LOCAL)
