"""Train a tiny character-level LanguageModel on a string, then decode it back.

    python examples/train_tiny_lm.py --mechanism softmax --steps 300
    python examples/train_tiny_lm.py --text "to be or not to be, " --positional learned

Every mechanism with a recurrent step (see ``attnzoo list``) can decode; others can still train.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import attnzoo


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default="hello attnzoo, hello world. ", help="the string to learn")
    parser.add_argument("--mechanism", default="softmax", choices=attnzoo.available())
    parser.add_argument("--positional", default="rotary", choices=["sinusoidal", "learned", "rotary", "none"])
    parser.add_argument("--dim", type=int, default=48)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="training sequence = text repeated this often")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny matrices: 1 is fastest)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    # Characters are the tokens.
    chars = sorted(set(args.text))
    to_id = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([[to_id[c] for c in args.text * args.repeats]])  # (1, seq)
    inputs, targets = data[:, :-1], data[:, 1:]

    model = attnzoo.LanguageModel(
        len(chars), dim=args.dim, heads=args.heads, depth=args.depth, positional=args.positional,
        max_length=data.shape[1], self_attention=args.mechanism,
    )
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, mechanism={args.mechanism}, "
          f"positional={args.positional}, {len(chars)} characters")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        logits = model(inputs)  # (1, seq - 1, vocab)
        loss = F.cross_entropy(logits.transpose(1, 2), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 50 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - start:.1f}s")

    model.eval()
    prompt = data[:, :1]
    new_tokens = len(args.text) * 2 - 1

    def text(ids: torch.Tensor) -> str:
        return "".join(chars[i] for i in ids.tolist())

    results = {
        "greedy": attnzoo.greedy_decode(model, prompt, new_tokens)[0],
        "sample (T=0.3)": attnzoo.sample_decode(
            model, prompt, new_tokens, temperature=0.3, generator=torch.Generator().manual_seed(args.seed)
        )[0],
        "beam search (3)": attnzoo.beam_search(model, prompt, new_tokens, beam_size=3).best[0],
    }
    expected = text(data[0, : len(args.text) * 2])
    for name, ids in results.items():
        decoded = text(ids)
        print(f"{name:>16}: {decoded!r} {'ok' if decoded == expected else 'differs'}")


if __name__ == "__main__":
    main()
