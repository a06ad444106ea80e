"""Peak resident memory of this process, sampled in a background thread."""
from __future__ import annotations

import os
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss() -> int:
    """Resident set size in bytes (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class PeakRSS:
    """Context manager recording the peak RSS while it is open (sampled every ``period`` s)."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.peak = 0
        self.start = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            time.sleep(self.period)

    @property
    def growth(self) -> int:
        """Peak minus the RSS when the context opened: what this run added on top."""
        return max(0, self.peak - self.start)

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = current_rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, current_rss())
