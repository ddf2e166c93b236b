"""A converted model on disk, and back: :func:`save_converted` and :func:`load_converted`.

The folder holds ``model.json`` (the layers' mechanisms and options, the adapters' rank and scale and which
projections carry them, the teacher's GGUF file or Hugging Face directory with its size and SHA-256) and
``weights.safetensors`` (only what the conversion trained: the mechanisms' parameters and the adapters). Loading
reads the teacher's weights from its file or directory again, refusing one whose digest differs, and adds the
trained tensors: the loaded model computes exactly what the converted one did.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .._validation import check_bool
from ..mechanisms import build_mechanism
from ..pretrained import CausalLM, ModelSource, Pretrained
from .config import ConversionConfig
from .lora import add_lora, lora_state, merge_lora
from .student import load_tensors, mechanism_state

MODEL_JSON = "model.json"
WEIGHTS = "weights.safetensors"
FORMAT = 1


def files_digest(paths: Sequence[Union[str, "os.PathLike[str]"]]) -> str:
    """SHA-256 of the files' contents one after another, hex (for one file, the file's own SHA-256)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def teacher_source(source: ModelSource) -> Dict[str, Any]:
    """What names a teacher: its absolute path (under ``gguf`` for a GGUF file, ``directory`` for a Hugging Face
    model directory), and the size and SHA-256 of the files it is read from (:meth:`ModelSource.files`)."""
    files = source.files()
    key = "gguf" if source.gguf is not None else "directory"
    return {key: str(source.path.resolve()), "bytes": sum(Path(f).stat().st_size for f in files),
            "sha256": files_digest(files)}


def gguf_source(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """:func:`teacher_source` of the checkpoint at ``path`` (a GGUF file: its absolute path, size and SHA-256)."""
    from ..pretrained.loader import open_model

    return teacher_source(open_model(path))


def teacher_path(description: Mapping[str, Any]) -> str:
    """Where a converted model's teacher was read from (a GGUF file or a Hugging Face directory)."""
    source = description["source"]
    return source["gguf"] if "gguf" in source else source["directory"]


def save_converted(
    folder: Union[str, "os.PathLike[str]"], model: CausalLM, plan: Sequence[Tuple[str, Mapping[str, Any]]],
    config: ConversionConfig, source: Mapping[str, Any],
) -> Path:
    """Write a converted model (its trained tensors and how to rebuild it) to ``folder``; returns it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    adapters = sorted({name.rsplit(".", 1)[0] for name in lora_state(model)})
    tensors = {name: t.contiguous() for name, t in {**mechanism_state(model), **lora_state(model)}.items()}
    save_file(tensors, str(folder / WEIGHTS))
    description = {
        "format": FORMAT, "source": dict(source), "layer_mechanisms": [[name, dict(options)] for name, options in plan],
        "lora": {"rank": config.lora_rank, "alpha": config.lora_alpha, "modules": adapters},
        "conversion": config.to_dict(),
    }
    (folder / MODEL_JSON).write_text(json.dumps(description, indent=2))
    return folder


def read_converted(folder: Union[str, "os.PathLike[str]"]) -> Tuple[Path, Dict[str, Any]]:
    """The folder of a converted model (a conversion's output folder or its ``model/``) and its ``model.json``,
    the format checked; no weight is read. FileNotFoundError or ValueError saying what is wrong."""
    folder = Path(folder)
    if (folder / "model" / MODEL_JSON).exists():
        folder = folder / "model"
    if not (folder / MODEL_JSON).exists():
        raise FileNotFoundError(f"{str(folder)!r} holds no converted model ({MODEL_JSON} is missing)")
    description = json.loads((folder / MODEL_JSON).read_text())
    if description.get("format") != FORMAT:
        raise ValueError(f"{folder / MODEL_JSON} has format {description.get('format')!r}, this attnzoo reads {FORMAT}")
    return folder, description


def check_inference_options(description: Mapping[str, Any], options: Optional[Mapping[str, Any]]) -> None:
    """Refuse ``options`` for the converted layers of ``description`` that the mechanism does not take or that
    change its parameters (the saved tensors would not fit): an error naming them. Built on two heads of 64, so
    nothing of the model is read; where the saved options themselves need other sizes, the model's own build
    checks them instead."""
    if not options:
        return
    target = description["conversion"]["target"]
    saved = dict(description["conversion"]["target_options"])

    def shapes(layer: Mapping[str, Any]) -> Dict[str, Tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in build_mechanism(target, 2, 64, **layer).state_dict().items()}

    try:
        before = shapes(saved)
    except (TypeError, ValueError):
        return
    if before != shapes({**saved, **options}):
        raise ValueError(f"options {dict(options)} change the parameters of the converted {target} layers, so the "
                         f"saved tensors do not fit them; set at inference only options that add no parameter")


def converted_layers(description: Mapping[str, Any], options: Optional[Mapping[str, Any]] = None,
                     ) -> List[Tuple[str, Dict[str, Any]]]:
    """The layers' (mechanism, options) of a converted model's description; ``options`` set on every layer of
    the conversion's target (the layers kept softmax left as they are)."""
    target = description["conversion"]["target"]
    return [(name, {**layer, **(options or {})} if name == target else dict(layer))
            for name, layer in description["layer_mechanisms"]]


def check_teacher(source: ModelSource, description: Mapping[str, Any]) -> None:
    """Refuse a teacher that is not the one the model was converted from (by the SHA-256 of its files)."""
    digest = description["source"]["sha256"]
    if files_digest(source.files()) != digest:
        raise ValueError(f"{source.path} is not the model the conversion read (its SHA-256 differs from "
                         f"{digest[:12]}...)")


def build_converted(teacher: CausalLM, folder: Path, description: Mapping[str, Any], merged: bool = False,
                    options: Optional[Mapping[str, Any]] = None) -> CausalLM:
    """The converted model from its teacher's weights (``teacher``, left as it is) and the trained tensors in
    ``folder`` (as :func:`read_converted` returns it), frozen, in eval mode; ``merged``: the adapters folded
    into their projections (:func:`~attnzoo.conversion.merge_lora`); ``options``: as :func:`load_converted`
    takes them."""
    from safetensors.torch import load_file

    model = CausalLM(teacher.config, layer_mechanisms=converted_layers(description, options))
    model.load_state_dict(teacher.state_dict(), strict=False)
    lora = description["lora"]
    add_lora(model, lora["modules"], lora["rank"], lora["alpha"], seed=0)
    saved = load_file(str(folder / WEIGHTS))
    expected = set(mechanism_state(model)) | set(lora_state(model))
    if set(saved) != expected:
        missing, extra = sorted(expected - set(saved)), sorted(set(saved) - expected)
        raise ValueError(f"{folder / WEIGHTS} does not fit {MODEL_JSON}: missing {missing[:3]}, unexpected {extra[:3]}")
    load_tensors(model, saved)
    if merged:
        merge_lora(model)
    return model.requires_grad_(False).eval()


def load_converted(
    folder: Union[str, "os.PathLike[str]"], *, gguf: Optional[Union[str, "os.PathLike[str]"]] = None,
    tokenizer: bool = True, merged: bool = False, options: Optional[Mapping[str, Any]] = None,
) -> Pretrained:
    """The converted model saved in ``folder`` (a conversion's output folder or its ``model/``), and its
    tokenizer, in eval mode.

    ``gguf``: the teacher's GGUF file or Hugging Face directory, when it has moved from where the conversion read
    it (the SHA-256 of its files must match).
    ``merged``: each low-rank adapter folded into its projection (``W + scale B A``, one product where the
    adapter takes three: what decoding wants; the logits equal the unmerged model's up to float32 rounding).
    False (the default) keeps them as :class:`~attnzoo.conversion.LoRALinear`, the model exactly as trained.
    ``options``: mechanism options set on every converted layer, for what a layer does at inference without
    other parameters, e.g. ``{"sparse_cache": 64}`` (``lolcats``: LoLA's sparse cache, which needs no
    training); an option that changes the layers' parameters is refused (the saved tensors no longer fit).
    """
    from ..pretrained.loader import load_source, open_model

    check_bool("merged", merged)
    folder, description = read_converted(folder)
    check_inference_options(description, options)
    source = open_model(gguf if gguf is not None else teacher_path(description))
    check_teacher(source, description)
    teacher, loaded_tokenizer = load_source(source, tokenizer=tokenizer)
    return Pretrained(build_converted(teacher, folder, description, merged, options), loaded_tokenizer)
