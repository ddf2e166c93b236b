"""A swapped ``transformers`` model's mechanism tensors, read back from the checkpoint ``save_pretrained`` wrote.

``save_pretrained`` saves every tensor of the model's state dict, the mechanisms' own included (a performer's
random projection, gla's gates: they live under each attention module's ``attnzoo_mechanism``). A model loaded
by its class's ``from_pretrained`` has no mechanism yet, so ``transformers`` drops those tensors as unexpected;
:func:`load_mechanism_tensors` reads them from the checkpoint's safetensors files once the mechanisms are back.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

import torch
from torch import Tensor, nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _checkpoint_files(path: str) -> List[str]:
    """The safetensors files of a checkpoint directory (one file, or the shards its index names)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            shards = sorted(set(json.load(handle)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"path {path!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}: save the model with "
                     f"save_pretrained (safetensors) to restore its attnzoo mechanism tensors")


def _saved_tensors(path: str, marker: str) -> Dict[str, Tensor]:
    """Every tensor of the checkpoint whose key contains ``marker``."""
    from safetensors import safe_open

    tensors: Dict[str, Tensor] = {}
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                if marker in key:
                    tensors[key] = handle.get_tensor(key)
    return tensors


def load_mechanism_tensors(model: nn.Module, path: str, attribute: str) -> None:
    """Copy the tensors saved under each ``attribute`` submodule (the mechanisms) from the checkpoint at ``path``
    into ``model``, converted to the model's dtype and device. Raises ValueError naming the keys when the
    checkpoint and the model do not hold the same ones (a checkpoint saved with another mechanism or options)."""
    marker = f".{attribute}."
    saved = _saved_tensors(path, marker)
    state = model.state_dict()
    wanted = {key for key in state if marker in key}
    missing, unexpected = sorted(wanted - set(saved)), sorted(set(saved) - wanted)
    if missing or unexpected:
        raise ValueError(f"the checkpoint at {path!r} does not match the model's attnzoo mechanisms: missing "
                         f"{missing or 'none'}, unexpected {unexpected or 'none'}")
    with torch.no_grad():
        for key, tensor in saved.items():
            if tensor.shape != state[key].shape:
                raise ValueError(f"{key}: saved with shape {tuple(tensor.shape)}, the model's is "
                                 f"{tuple(state[key].shape)}")
            state[key].copy_(tensor)


__all__ = ["load_mechanism_tensors"]
