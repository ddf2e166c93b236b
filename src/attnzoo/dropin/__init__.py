"""attnzoo's mechanisms inside models built elsewhere.

* :mod:`~attnzoo.dropin.swap`: :func:`swap_attention` replaces every ``torch.nn.MultiheadAttention`` of any model
  by a :class:`SwappedAttention` (``nn.MultiheadAttention``'s call signature around attnzoo's attention), with
  :mod:`~attnzoo.dropin.masks` translating torch's masks and :mod:`~attnzoo.dropin.swapped` holding the module.
* :mod:`~attnzoo.dropin.hf`: :func:`use_attnzoo` runs Hugging Face ``transformers`` models on a mechanism through
  that library's attention-function registry (``transformers`` is imported only when it is called), with
  :mod:`~attnzoo.dropin.hf_attention` (the functions registered there) and :mod:`~attnzoo.dropin.hf_save`
  (a saved swap's tensors read back by :func:`~attnzoo.dropin.hf.from_pretrained`).

docs/dropin.md has the semantics, the exceptions and measurements.
"""

from .hf import HFSwapReport, use_attnzoo
from .masks import TranslatedMasks, translate_masks
from .swap import SwapReport, SwappedModule, swap_attention
from .swapped import SwappedAttention

__all__ = [
    "HFSwapReport",
    "SwapReport",
    "SwappedAttention",
    "SwappedModule",
    "TranslatedMasks",
    "swap_attention",
    "translate_masks",
    "use_attnzoo",
]
