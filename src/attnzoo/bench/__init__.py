"""The kernel benchmark behind ``attnzoo compare``: every mechanism's attention call (and, optionally, its peer
library's) timed, measured for peak memory and for error against exact softmax at several lengths, each
configuration in a fresh process.

    from attnzoo.bench import CompareConfig, run_compare
    result = run_compare(CompareConfig.from_preset("quick", lengths=[256, 1024]), argv=["my-script"])
    result.rows  # one dict per (mechanism, length): times, peak memory, error, ratios, status and reason

Training experiments (``attnzoo lra``, ``attnzoo seq2seq-report``) are :mod:`attnzoo.experiments`.
"""

from .compare import PRESETS, CompareConfig, CompareResult, run_compare
from .results import crossover_length, load_accuracy, write_results

__all__ = ["PRESETS", "CompareConfig", "CompareResult", "crossover_length", "load_accuracy", "run_compare",
           "write_results"]
