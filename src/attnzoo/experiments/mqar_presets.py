"""The presets of ``attnzoo mqar``: the data, the schedules, widths and learning rates, and the training budget.

This table is the one place outside the mechanisms that names mechanisms: which ones Zoology compared (Arora et
al. 2024; its newer configurations ``zoology/experiments/models_repo.py``) is the experiment's data. Every
schedule is a ``--layers`` text (docs/hybrids.md); the model around it is the same for every cell of a preset.
"""

from __future__ import annotations

from typing import Any, Dict

# Zoology's learning rates, np.logspace(-3, -1.5, 4): the best of the four is reported per cell.
ZOOLOGY_LRS = (1e-3, 10 ** -2.5, 1e-2, 10 ** -1.5)

# The model of every cell: 2 layers and 2 heads (Zoology's attention and delta-rule layers), no positions
# (Zoology's max_position_embeddings=0), and the token shift in place of the short convolution (kernel 3)
# Zoology puts before every sequence mixer: both give each position the token before it, which the lookup
# needs. Weight decay 0.1 as Zoology's.
MODEL: Dict[str, Any] = dict(depth=2, heads=2, positional="none", token_shift=True, weight_decay=0.1)

PRESETS: Dict[str, Dict[str, Any]] = {
    # Sized for the tests and a first look on 2 CPU cores (24 cells of 200 steps; docs/hybrids.md has the
    # time): 8 pairs in 32 tokens of a 64-token vocabulary, where softmax learns at width 32 and linear
    # attention only at 64.
    "quick": dict(
        task_options=dict(vocab_size=64, seq_len=32, num_pairs=8, train_size=3000, validation_size=256,
                          test_size=256),
        schedules=("softmax", "linear"),
        widths=(16, 32, 64),
        lrs=ZOOLOGY_LRS,
        train=dict(batch_size=32, steps=200),
    ),
    # A setting that separates on 2 CPU cores (docs/hybrids.md has the time): 32 pairs in 128 tokens of a
    # 256-token vocabulary, at widths where a 2-head model's states hold about that many pairs (head dims 32
    # and 64), the pure mechanisms and both orders of the 2-layer hybrid, Zoology's four learning rates.
    "medium": dict(
        task_options=dict(vocab_size=256, seq_len=128, num_pairs=32, train_size=6000, validation_size=256,
                          test_size=256),
        schedules=("softmax", "gated_delta", "softmax,gated_delta", "gated_delta,softmax"),
        widths=(64, 128),
        lrs=ZOOLOGY_LRS,
        train=dict(batch_size=32, steps=800),
    ),
    # Zoology's hardest training setting (Figure 2: 64 pairs in 256 tokens, vocabulary 8,192), its widths and
    # learning rates, the mechanisms it compares that attnzoo has (attention; linear attention; Based; the gated
    # delta rule with its short convolution of 4; Mamba-2's SSD) and a 2-layer hybrid. Meant for a GPU.
    "full": dict(
        task_options=dict(vocab_size=8192, seq_len=256, num_pairs=64, train_size=20000, validation_size=1000,
                          test_size=1000),
        schedules=("softmax", "linear", "based", "gated_delta(conv_size=4)", "ssd",
                   "gated_delta(conv_size=4),softmax"),
        widths=(64, 128, 256),
        lrs=ZOOLOGY_LRS,
        train=dict(batch_size=64, steps=5000),
    ),
}
"""Each preset: ``task_options`` of ``mqar``, the ``schedules`` (``--layers`` texts), model ``widths`` and
learning rates ``lrs`` crossed into cells, and the ``train`` budget of each cell."""

# A cell that runs past its timeout is a row that says so (its checkpoint kept for the next run).
CELL_TIMEOUT_S = {"quick": 600.0, "medium": 1200.0, "full": 7200.0}
