"""Training tasks: data sets in three splits ("train", "validation", "test"), built deterministically from a seed.

``load(name, **options)`` builds a registered task; ``available()`` lists them:

* ``listops``: the value of nested MIN/MAX/MED/SM lists of digits (classify, 10 classes), LRA's ListOps.
* ``pathfinder``: are two markers on one curve, from an image read pixel by pixel (classify, 2 classes),
  LRA's Pathfinder.
* ``bytes``: next-byte prediction on the Python standard library's source files (lm, bits per byte).
* ``recall``: multi-query associative recall (tag, a value per query position).

Only the standard library, numpy, torch and the option checks of :mod:`attnzoo._validation` are used here:
tasks know nothing of models or mechanisms.
"""

from .base import IGNORE_INDEX, SPLITS, Split, Task, available, load, register, task_class, task_options
from .byte_lm import Bytes
from .listops import ListOps
from .pathfinder import Pathfinder
from .recall import Recall

__all__ = [
    "IGNORE_INDEX",
    "SPLITS",
    "Bytes",
    "ListOps",
    "Pathfinder",
    "Recall",
    "Split",
    "Task",
    "available",
    "load",
    "register",
    "task_class",
    "task_options",
]
