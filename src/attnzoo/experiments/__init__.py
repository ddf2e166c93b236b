"""Training experiments: many ``attnzoo train`` runs at one budget, each in a fresh process, and their report.

* :mod:`~attnzoo.experiments.cells`: the cell runner every experiment uses (:func:`train_cells`: a cell is one
  ``attnzoo train`` run in its own directory; finished cells are kept, interrupted ones resume);
* :mod:`~attnzoo.experiments.settings`: the checks they share (preset, ``--jobs``/``--threads``/``--cell-timeout``,
  names, mechanism options, the settings an interrupted run is continued with);
* :mod:`~attnzoo.experiments.lra`: ``attnzoo lra``, every mechanism on every task (the Long Range Arena table);
* :mod:`~attnzoo.experiments.mqar`: ``attnzoo mqar``, Zoology's multi-query associative recall swept over schedules,
  widths and learning rates (presets in :mod:`~attnzoo.experiments.mqar_presets`);
* :mod:`~attnzoo.experiments.seq2seq_report`: ``attnzoo seq2seq-report``, the comparisons of docs/seq2seq.md,
  measured by :mod:`~attnzoo.experiments.seq2seq_eval` and drawn by :mod:`~attnzoo.experiments.seq2seq_figures`.

The kernel benchmark behind ``attnzoo compare`` is :mod:`attnzoo.bench`, one layer below.

    from attnzoo.experiments import LraConfig, run_lra
    data = run_lra(LraConfig(preset="quick", tasks=["recall"]), Path("lra-results"), argv=["my-script"])
"""

from .cells import CELL_JSON, run_cell, run_cells, save_row, train_cells, train_command
from .lra import LraConfig, run_lra
from .seq2seq_report import ReportConfig, run_report

__all__ = ["CELL_JSON", "LraConfig", "ReportConfig", "run_cell", "run_cells", "run_lra", "run_report", "save_row",
           "train_cells", "train_command"]
