"""Converting a pretrained softmax model to another attention, LoLCATs' way (Zhang et al. 2024).

::

    from attnzoo import conversion, pretrained
    teacher, tokenizer = pretrained.smollm2()
    result = conversion.convert(teacher, train_windows, selection_windows, "out/", conversion.ConversionConfig())
    model, tokenizer = conversion.load_converted("out/")

Stage 1, attention transfer (:mod:`.transfer`): each converted layer's mechanism (e.g. ``lolcats``: Hedgehog
feature maps and a sliding window) learns to reproduce the frozen teacher layer's output. Stage 2
(:mod:`.finetune`): low-rank adapters (:mod:`.lora`) on the converted layers' projections, trained on the text.
A hybrid keeps in softmax the layers whose transfer error is largest. :mod:`.run` drives it with checkpoints
and exact resume; :mod:`.saved` writes and reads the result. ``attnzoo convert`` is the command.
"""

from .config import FINETUNE_LOSSES, ConversionConfig
from .finetune import finetune_loss, mean_token_nll, perplexity
from .lora import LoRALinear, add_lora, merge_lora
from .run import ConversionResult, convert
from .saved import gguf_source, load_converted, save_converted, teacher_source
from .student import build_student, layer_plan
from .transfer import held_out_errors, layers_to_keep, relative_error, transfer_losses

__all__ = [
    "FINETUNE_LOSSES",
    "ConversionConfig",
    "ConversionResult",
    "LoRALinear",
    "add_lora",
    "build_student",
    "convert",
    "finetune_loss",
    "gguf_source",
    "held_out_errors",
    "layer_plan",
    "layers_to_keep",
    "load_converted",
    "mean_token_nll",
    "merge_lora",
    "perplexity",
    "relative_error",
    "save_converted",
    "teacher_source",
    "transfer_losses",
]
