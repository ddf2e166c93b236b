"""The log of a training run's metrics: ``metrics.csv``, and TensorBoard when it is installed."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Dict, List, Optional

METRICS_CSV = "metrics.csv"
CSV_FIELDS = ["step", "split", "loss", "accuracy", "bits_per_byte", "lr", "tokens_per_s", "elapsed_s",
              "exact_match", "token_error_rate", "guide_loss", "length_loss", "rare_token_recall", "bleu",
              "ms_per_sentence"]


class MetricsLog:
    """metrics.csv (and TensorBoard when it is installed). A resumed run drops the rows past its checkpoint."""

    def __init__(self, output: Optional[Path], resumed_step: Optional[int]) -> None:
        self.path = None if output is None else output / METRICS_CSV
        self.rows: List[Dict[str, Any]] = []
        self.board = None
        if self.path is None:
            return
        kept: List[Dict[str, str]] = []
        if resumed_step is not None and self.path.exists():
            with open(self.path, newline="") as handle:
                kept = [row for row in csv.DictReader(handle) if int(row["step"]) <= resumed_step]
        with open(self.path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
            writer.writeheader()
            writer.writerows(kept)
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package
        except Exception:  # noqa: BLE001 - any failure to import just means no TensorBoard log
            SummaryWriter = None
        if SummaryWriter is not None:
            self.board = SummaryWriter(log_dir=str(output / "tensorboard"), purge_step=resumed_step)

    def write(self, row: Dict[str, Any]) -> None:
        row = {key: row.get(key, "") for key in CSV_FIELDS}
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a", newline="") as handle:
                csv.DictWriter(handle, fieldnames=CSV_FIELDS).writerow(row)
        if self.board is not None:
            for key in ("loss", "accuracy", "bits_per_byte", "lr", "tokens_per_s"):
                if row[key] != "":
                    self.board.add_scalar(f"{row['split']}/{key}", float(row[key]), int(row["step"]))

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
