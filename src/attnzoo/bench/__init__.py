"""Benchmarking attention mechanisms side by side: the machinery behind ``attnzoo compare``.

    from attnzoo.bench import CompareConfig, run_compare
    result = run_compare(CompareConfig.from_preset("quick", lengths=[256, 1024]), argv=["my-script"])
    result.rows  # one dict per (mechanism, length): times, peak memory, error, ratios, status and reason
"""

from .compare import PRESETS, CompareConfig, CompareResult, run_compare
from .results import crossover_length, load_accuracy, write_results

__all__ = ["PRESETS", "CompareConfig", "CompareResult", "crossover_length", "load_accuracy", "run_compare",
           "write_results"]
