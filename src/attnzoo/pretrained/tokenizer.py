"""The tokenizer stored in a GGUF file or a Hugging Face model directory, through transformers.

transformers rebuilds a fast tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata (vocabulary, merges,
special tokens, chat template) with ``PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)``: the
simplest route that handles every tokenizer kind llama.cpp stores (BPE and SentencePiece alike), read from the
file itself, nothing downloaded. ``AutoTokenizer`` gives the same tokenizer but first reads the whole file again
to build a model configuration it does not need here (about 8 of its 8.5 seconds for SmolLM2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .extras import require


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer of the GGUF file at ``path`` (a transformers ``PreTrainedTokenizerFast``)."""
    transformers = require("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_tokenizer(directory: Path) -> Any:
    """The tokenizer saved in the Hugging Face model directory ``directory`` (``AutoTokenizer``, local files
    only)."""
    transformers = require("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
