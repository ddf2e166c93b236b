"""Interrupts a training run takes at the end of a step, so that the checkpoint written on the way out is whole."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Dict, Iterator, Optional


class Interrupts:
    """Ctrl-C or SIGTERM during a step is deferred to the end of that step, so the checkpoint written on the
    way out holds a consistent optimiser and model. A second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._previous: Dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    @contextlib.contextmanager
    def deferred(self) -> Iterator["Interrupts"]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield self
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
