"""Measurements of trained seq2seq runs that ``attnzoo train`` itself does not make (docs/seq2seq.md):

* :func:`compare_at_nat`: an autoregressive and a non-autoregressive model of one task, quality and decoding
  time per sentence side by side in one process (the NAT model also with the true target lengths);
* :func:`compare_decoders`: one model under several decoders (greedy, beam, monotonic), in one process;
* :func:`copy_breakdown`: on ``copy-names``, the share of the names and of the numbers reproduced apart;
* :func:`cross_attention_map`: the teacher-forced cross-attention of one test example (target x source).

Each takes a run directory written by ``attnzoo train`` (reloaded by :func:`attnzoo.training.load_trained`).
Times are wall time over whole batches divided by the sentences decoded; decoders that are compared take
turns, so that other load on the machine slows them alike.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..decoding import nat_decode
from ..models.cross_attention import CrossAttentionWeights
from ..models.monotonic import MonotonicInference
from ..training import DecoderSettings, evaluate, load_trained
from ..training.nat import nat_outputs, target_lengths
from ..training.decoders import timed_outputs
from ..training.evaluation import autocast
from ..training.seq2seq import decoded_metrics, rare_token_recall, strip_output

RunPath = Union[str, Path]

# The decoders compared on one model: label and settings.
DECODERS: List[Tuple[str, DecoderSettings]] = [
    ("greedy", DecoderSettings()),
    ("beam 4", DecoderSettings("beam", beam_size=4)),
    ("greedy, monotonic (ahead 3)", DecoderSettings(monotonic=MonotonicInference(ahead=3))),
    ("beam 4, monotonic (ahead 3)", DecoderSettings("beam", beam_size=4, monotonic=MonotonicInference(ahead=3))),
]


def greedy_outputs(model: torch.nn.Module, task: Any, source: Tensor, source_mask: Tensor) -> List[List[int]]:
    """Greedy decodes of a batch of sources (batch, seq_src), each cut at its END, as evaluation decodes them."""
    outputs, _ = timed_outputs(model, source, source_mask, bos_id=task.bos_id, eos_id=task.eos_id,
                               max_new_tokens=task.target_len)
    return outputs


def _in_precision(precision: str, decode: Callable[[Tensor], List[List[int]]]) -> Callable[[Tensor], List[List[int]]]:
    """``decode`` under a run's ``precision`` (bfloat16 autocast for a run trained in it), as evaluation decodes."""
    def decode_in_precision(index: Tensor) -> List[List[int]]:
        with autocast(precision):
            return decode(index)
    return decode_in_precision


def _batches(count: int, size: int) -> List[Tensor]:
    """Index tensors of consecutive batches of ``size`` over ``count`` examples (the last may be shorter)."""
    return [torch.arange(start, min(start + size, count)) for start in range(0, count, size)]


def compare_at_nat(at_run: RunPath, nat_run: RunPath, split: str = "test", batch_sizes: Sequence[int] = (1, 10, 100),
                   timed_sentences: int = 200, repeats: int = 5) -> Dict[str, Any]:
    """Greedy autoregressive decoding against one-pass NAT decoding (predicted lengths, and true lengths).

    Quality (exact match, token error rate) over the whole split, in batches of the largest batch size; time
    over the first ``timed_sentences`` sentences at each batch size, ``repeats`` rounds with the decoders
    alternating, the median kept. Returns {"task", "split", "timed_sentences", "parameters", "rows"}, one row
    per decoder and batch size with ``ms_per_sentence``, ``speedup`` (over AT greedy) and every round's
    ``seconds``."""
    at_model, task, at_config = load_trained(at_run)
    nat_model, _, nat_config = load_trained(nat_run)
    if nat_config.decoding != "non-autoregressive" or at_config.decoding != "autoregressive":
        raise ValueError("give the autoregressive run first, then the non-autoregressive one")
    if (at_config.task, at_config.task_options) != (nat_config.task, nat_config.task_options):
        raise ValueError("the two runs were trained on different tasks")
    data = task.split(split)
    references = [strip_output(row.tolist(), task.eos_id) for row in data.targets]

    def true_length_outputs(index: Tensor) -> List[List[int]]:
        decoded = nat_decode(nat_model, data.inputs[index], eos_id=task.eos_id,
                             source_padding_mask=data.padding_mask[index],
                             target_lengths=target_lengths(data.targets[index]))
        return [strip_output(row.tolist(), task.eos_id) for row in decoded]

    decoders: Dict[str, Callable[[Tensor], List[List[int]]]] = {
        "AT greedy": _in_precision(at_config.precision, lambda i: greedy_outputs(at_model, task, data.inputs[i],
                                                                                 data.padding_mask[i])),
        f"NAT ({nat_model.nat.length_mode} length)": _in_precision(
            nat_config.precision, lambda i: nat_outputs(nat_model, task, data.inputs[i], data.padding_mask[i])),
        "NAT (true length)": _in_precision(nat_config.precision, true_length_outputs),
    }
    parameters = {name: sum(p.numel() for p in model.parameters())
                  for name, model in (("AT", at_model), ("NAT", nat_model))}
    rows = []
    with torch.no_grad():
        quality = {name: decoded_metrics([row for index in _batches(len(data), max(batch_sizes))
                                          for row in decode(index)], references)
                   for name, decode in decoders.items()}
        timed = min(timed_sentences, len(data))
        for size in batch_sizes:
            seconds: Dict[str, List[float]] = {name: [] for name in decoders}
            for _ in range(repeats):
                for name, decode in decoders.items():  # alternating, so that load on the machine hits all alike
                    began = time.perf_counter()
                    for index in _batches(timed, size):
                        decode(index)
                    seconds[name].append(time.perf_counter() - began)
            base = statistics.median(seconds["AT greedy"])
            for name in decoders:
                median = statistics.median(seconds[name])
                rows.append({"decoder": name, "batch_size": size, **quality[name],
                             "ms_per_sentence": 1000 * median / timed, "speedup": base / median,
                             "seconds": seconds[name]})
    return {"task": task.name, "split": split, "sentences": len(data), "timed_sentences": timed,
            "parameters": parameters, "rows": rows}


def compare_decoders(run: RunPath, split: str = "test", repeats: int = 2,
                     decoders: Sequence[Tuple[str, DecoderSettings]] = tuple(DECODERS)) -> Dict[str, Any]:
    """The decoded metrics of one model under each of ``decoders``, ``repeats`` rounds in rotation over the
    same loaded model: the metrics of the first round (these decoders are deterministic), the fastest
    round's ``ms_per_sentence`` (the one least disturbed by other work). Returns {"task", "split",
    "sentences", "batch_size", "rows"}, one row per decoder."""
    model, task, config = load_trained(run)
    results: Dict[str, Dict[str, float]] = {}
    for _ in range(repeats):
        for name, settings in decoders:
            metrics = evaluate(model, task, split, batch_size=config.batch_size, precision=config.precision,
                               decoding=settings)
            if name in results:
                metrics = {**results[name], "ms_per_sentence": min(results[name]["ms_per_sentence"],
                                                                   metrics["ms_per_sentence"])}
            results[name] = metrics
    return {"task": task.name, "split": split, "sentences": len(task.split(split)), "batch_size": config.batch_size,
            "rows": [{"decoder": name, **results[name]} for name, _ in decoders]}


def copy_breakdown(run: RunPath, split: str = "test", batch_size: int = 64) -> Dict[str, Any]:
    """{"names", "numbers", "rare"}: the share of each kind of rare token of the answers that the greedy
    output of the ``copy-names`` run reproduces (``rare`` is evaluation's ``rare_token_recall``), with the
    run's ``copy_mechanism`` and ``steps``."""
    model, task, config = load_trained(run)
    data = task.split(split)
    predictions: List[List[int]] = []
    decode = _in_precision(config.precision, lambda i: greedy_outputs(model, task, data.inputs[i],
                                                                      data.padding_mask[i]))
    with torch.no_grad():
        for index in _batches(len(data), batch_size):
            predictions += decode(index)
    references = [strip_output(row.tolist(), task.eos_id) for row in data.targets]
    return {"run": str(run), "copy_mechanism": config.copy_mechanism, "steps": config.steps, "split": split,
            **{kind: round(rare_token_recall(predictions, references, ids), 4)
               for kind, ids in (("names", task.name_ids), ("numbers", task.number_ids), ("rare", task.rare_ids))}}


def pick_example(lengths: Sequence[int], minimum_length: int) -> int:
    """The index of the first example at least ``minimum_length`` long (else the longest): an example whose
    attention map has room to show a diagonal, chosen the same way for every model."""
    for index, length in enumerate(lengths):
        if length >= minimum_length:
            return index
    return max(range(len(lengths)), key=lambda i: lengths[i])


def cross_attention_map(run: RunPath, split: str = "test", minimum_length: int = 8) -> Dict[str, Any]:
    """The cross-attention of the teacher-forced pass over one example of ``split`` (:func:`pick_example`),
    averaged over heads and decoder layers (as the guide loss and monotonic inference read it).

    Returns {"index", "source" (source token names), "target" (the target token each row predicts, END last),
    "weights" (target x source nested lists, each row summing to 1)}."""
    model, task, config = load_trained(run)
    data = task.split(split)
    source_lengths = (~data.padding_mask).sum(dim=1).tolist()
    index = pick_example(source_lengths, minimum_length)
    source_length = source_lengths[index]
    target_length = int(target_lengths(data.targets[index:index + 1])[0])
    with torch.no_grad(), autocast(config.precision), CrossAttentionWeights(model, "the attention map") as recorder:
        model(data.inputs[index:index + 1], data.decoder_inputs[index:index + 1],
              src_padding_mask=data.padding_mask[index:index + 1])
    # (layers, heads, seq_tgt, seq_src) -> (seq_tgt, seq_src), cut to the true lengths.
    weights = torch.stack([w[0] for w in recorder.weights]).mean(dim=(0, 1))[:target_length, :source_length]
    names = (*task.target_tokens, *task.extended_tokens)
    return {"index": index,
            "source": [task.source_tokens[t] for t in data.inputs[index, :source_length].tolist()],
            "target": [names[t] for t in data.targets[index, :target_length].tolist()],
            "weights": weights.tolist()}
