"""ListOps (Nangia & Bowman 2018), as generated for the Long Range Arena (Tay et al. 2021).

Nested lists of operations on the digits 0-9, e.g. ``[MAX 2 9 [MIN 4 7 ] 0 ]`` = 9, written as a flat token
sequence; the task is the value of the expression (10 classes). The generator follows LRA's published
algorithm: a tree grows from depth 1; each node is a leaf digit with probability 0.75 (always at depth
``max_depth``), otherwise an operator (MIN, MAX, MED = median truncated to an int, SM = sum mod 10, each
equally likely) with 2 to ``max_args`` arguments, drawn uniformly. An operator node is the tokens
``[OP``, its arguments, ``]``. Trees are drawn until their token count L satisfies
``min_length < L < max_length`` (a tree is abandoned as soon as it is sure to reach ``max_length``, which
only saves time: the accepted trees are distributed exactly as if they had been grown in full), duplicates
are dropped, and the distinct expressions, in the order drawn, fill train, validation and test.

Each input is CLS followed by the expression, padded with PAD to ``seq_len = max_length``: with L at most
``max_length - 1``, CLS and the expression always fit, and the longest inputs have no padding.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .._validation import check_number, check_positive_int
from .base import Split, Task, register

PAD, CLS = 0, 1
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
OPERATOR_IDS = (2, 3, 4, 5)
CLOSE = 6
DIGIT_0 = 7  # digit d is token DIGIT_0 + d
VOCAB = ("<pad>", "<cls>") + OPERATORS + ("]",) + tuple(str(d) for d in range(10))
"""Token strings by id: pad 0, CLS 1, [MIN 2, [MAX 3, [MED 4, [SM 5, ] 6, digits 0-9 at 7-16."""

LEAF_PROBABILITY = 0.75
MAX_ATTEMPTS_PER_SEQUENCE = 200
"""Draws allowed per wanted sequence before the options are declared unable to produce enough distinct
sequences (the defaults accept about one draw in three)."""


def apply_operator(operator: int, args: Sequence[int]) -> int:
    """The value of operator token ``operator`` on the digit values ``args``."""
    if operator == OPERATOR_IDS[0]:
        return min(args)
    if operator == OPERATOR_IDS[1]:
        return max(args)
    if operator == OPERATOR_IDS[2]:
        ordered = sorted(args)
        middle = len(ordered) // 2
        # An even count's median is the mean of the two middle values, truncated (as int(np.median) does).
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) // 2
    return sum(args) % 10


def sample_expression(
    rng: random.Random, max_depth: int, max_args: int, max_length: int
) -> Optional[Tuple[List[int], int, int]]:
    """Grow one tree in token order and evaluate it as it closes.

    Returns (tokens, value, depth), the depth being that of the deepest node (the root is at depth 1), or
    None once the tree is sure to have ``max_length`` tokens or more.
    """
    draw = rng.random  # random() rather than randrange(): the same draws, several times faster (below)
    tokens: List[int] = []
    # The open operators, innermost last: their tokens, how many of their arguments are not yet complete, and
    # the values of those that are.
    operators: List[int] = []
    remaining: List[int] = []
    arguments: List[List[int]] = []
    # Sum of `remaining`. Every open operator below the innermost one has exactly one argument in progress
    # (the operator above it), whose tokens are already counted; every other incomplete argument needs at
    # least one more token, as does each closing bracket: the finished tree will have at least
    # len(tokens) + len(operators) + pending - (len(operators) - 1) tokens. Abandoning a tree as soon as that
    # reaches max_length cuts the time spent on trees that would be rejected anyway.
    pending = 0
    deepest = 0
    while True:
        depth = len(operators) + 1
        deepest = max(deepest, depth)
        # int(u * n) is uniform on 0..n-1 up to n / 2**53, and cheaper than randrange(n) in this loop, which
        # is most of the cost of building the task.
        if depth < max_depth and draw() >= LEAF_PROBABILITY:
            operator = OPERATOR_IDS[int(draw() * len(OPERATOR_IDS))]
            count = 2 + int(draw() * (max_args - 1))
            tokens.append(operator)
            operators.append(operator)
            remaining.append(count)
            arguments.append([])
            pending += count
        else:
            value = int(draw() * 10)
            tokens.append(DIGIT_0 + value)
            # Close every operator whose last argument this was; its value is an argument of the one below.
            while operators:
                arguments[-1].append(value)
                remaining[-1] -= 1
                pending -= 1
                if remaining[-1]:
                    break
                remaining.pop()
                tokens.append(CLOSE)
                value = apply_operator(operators.pop(), arguments.pop())
            else:
                return (tokens, value, deepest) if len(tokens) < max_length else None
        if len(tokens) + 1 + pending >= max_length:
            return None


def check_expression_options(
    min_length: object, max_length: object, max_depth: object, max_args: object
) -> Tuple[int, int, int, int]:
    """The expression options, checked (errors name the option) and returned: ``min_length`` an int >= 0,
    ``max_length`` an int >= ``min_length + 2`` (``min_length < L < max_length`` leaves a length to draw only
    then), ``max_depth`` an int >= 1, ``max_args`` an int >= 2."""
    min_length = check_number("min_length", min_length, integer=True, minimum=0)
    max_length = check_number("max_length", max_length, integer=True, minimum=min_length + 2)
    max_depth = check_positive_int("max_depth", max_depth)
    max_args = check_number("max_args", max_args, integer=True, minimum=2)
    return min_length, max_length, max_depth, max_args


def generate_listops(
    count: int, *, min_length: int, max_length: int, max_depth: int, max_args: int, rng: random.Random
) -> Tuple[List[List[int]], List[int], List[int]]:
    """``count`` distinct expressions with ``min_length < len < max_length`` tokens: (token lists, values,
    depths), in the order drawn. ``count`` is an int >= 1, the options as :func:`check_expression_options`
    takes them, ``rng`` a ``random.Random``; anything else is refused naming the argument, before anything is
    drawn. Raises ValueError if the options cannot produce that many."""
    count = check_positive_int("count", count)
    min_length, max_length, max_depth, max_args = check_expression_options(min_length, max_length, max_depth,
                                                                           max_args)
    if not isinstance(rng, random.Random):
        raise TypeError(f"rng must be a random.Random (random.Random(seed)), got {rng!r} ({type(rng).__name__})")
    seen = set()
    expressions, values, depths = [], [], []
    for _ in range(MAX_ATTEMPTS_PER_SEQUENCE * count):
        sample = sample_expression(rng, max_depth, max_args, max_length)
        if sample is None or len(sample[0]) <= min_length:
            continue
        key = bytes(sample[0])  # token ids are < 256
        if key in seen:
            continue
        seen.add(key)
        expressions.append(sample[0])
        values.append(sample[1])
        depths.append(sample[2])
        if len(expressions) == count:
            return expressions, values, depths
    raise ValueError(
        f"listops found only {len(expressions)} distinct expressions of the {count} wanted in "
        f"{MAX_ATTEMPTS_PER_SEQUENCE * count} draws with min_length={min_length}, max_length={max_length}, "
        f"max_depth={max_depth}, max_args={max_args}: widen the length range or ask for fewer sequences"
    )


def encode(expressions: List[List[int]], seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """CLS + each expression, padded with PAD to ``seq_len``: (inputs, padding_mask), both (n, seq_len)."""
    inputs = torch.full((len(expressions), seq_len), PAD, dtype=torch.int64)
    for row, expression in enumerate(expressions):
        inputs[row, 0] = CLS
        inputs[row, 1 : 1 + len(expression)] = torch.tensor(expression, dtype=torch.int64)
    lengths = torch.tensor([1 + len(e) for e in expressions], dtype=torch.int64)
    padding_mask = torch.arange(seq_len)[None, :] >= lengths[:, None]
    return inputs, padding_mask


def to_text(tokens: Sequence[int]) -> str:
    """The token ids as text, padding dropped: ``<cls> [MAX 2 9 [MIN 4 7 ] 0 ]``."""
    return " ".join(VOCAB[t] for t in tokens if t != PAD)


@register
class ListOps(Task):
    """ListOps: the value (0-9) of a nested list of MIN / MAX / MED / SM operations on digits."""

    name = "listops"
    kind = "classify"
    metric = "accuracy"
    needs_causal = False
    summary = "value (0-9) of nested MIN/MAX/MED/SM lists of digits, as in the Long Range Arena"

    def __init__(
        self,
        *,
        seed: int = 0,
        train_size: int = 5000,
        validation_size: int = 500,
        test_size: int = 1000,
        min_length: int = 32,
        max_length: int = 256,
        max_depth: int = 10,
        max_args: int = 10,
    ) -> None:
        self.seed = self._check_seed(seed)
        self._set_split_sizes(train_size, validation_size, test_size)
        self.min_length, self.max_length, self.max_depth, self.max_args = check_expression_options(
            min_length, max_length, max_depth, max_args)

        self.vocab_size = len(VOCAB)
        self.seq_len = self.max_length
        self.num_classes = 10
        self.pad_id = PAD

        sizes = {"train": self.train_size, "validation": self.validation_size, "test": self.test_size}
        expressions, values, depths = generate_listops(
            sum(sizes.values()), min_length=self.min_length, max_length=self.max_length,
            max_depth=self.max_depth, max_args=self.max_args, rng=random.Random(self.seed),
        )
        inputs, padding_mask = encode(expressions, self.seq_len)
        targets = torch.tensor(values, dtype=torch.int64)
        # Depth of each expression's deepest node (root = 1), train then validation then test: the tests
        # compare it with the depth their own parser finds.
        self.depths = torch.tensor(depths, dtype=torch.int64)
        splits: Dict[str, Split] = {}
        start = 0
        for split_name, size in sizes.items():
            rows = slice(start, start + size)
            splits[split_name] = Split(inputs[rows], targets[rows], padding_mask[rows])
            start += size
        self._set_splits(splits)

    def _describe_extra(self) -> List[str]:
        test = self.split("test")
        shortest = int((~test.padding_mask).sum(dim=1).argmin())
        return [
            f"expressions of {self.min_length + 1}..{self.max_length - 1} tokens after CLS, depth <= "
            f"{self.max_depth}, 2..{self.max_args} arguments per operator; seed {self.seed}",
            f"shortest test example: {to_text(test.inputs[shortest].tolist())}  ->  {int(test.targets[shortest])}",
        ]
