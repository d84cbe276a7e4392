"""A one-line progress indicator on stderr, drawn only when stderr is a terminal.

``with Progress("timing", total=20) as p: ... p.advance()`` draws a bar with a count;
without ``total`` it draws a spinner with the elapsed time (for steps of unknown length, such
as tracing). Nothing is drawn for steps shorter than ``delay`` seconds, and the line is
cleared at the end, so piped or captured output never contains it.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional, TextIO

__all__ = ["Progress"]

_SPINNER = "|/-\\"
_WIDTH = 24


class Progress:
    """Context manager showing ``label`` with a bar (``total`` given) or a spinner.

    ``enabled``: None (the default) draws only when ``stream`` is a terminal; True/False force it.
    """

    def __init__(self, label: str, total: Optional[int] = None, *, stream: Optional[TextIO] = None,
                 enabled: Optional[bool] = None, delay: float = 0.3, interval: float = 0.1):
        self.label = label
        self.total = total
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self.enabled = _is_tty(self.stream) if enabled is None else enabled
        self.delay = delay
        self.interval = interval
        self._start = 0.0
        self._drawn = False
        self._tick = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Progress":
        self._start = time.perf_counter()
        if self.enabled:
            self._thread = threading.Thread(target=self._spin, name="symtrace-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._drawn:
                self.stream.write("\r\x1b[K")  # clear the line
                self.stream.flush()

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more steps done and redraw."""
        self.done += n
        self._draw()

    def line(self) -> str:
        """The text drawn now (without the carriage return)."""
        elapsed = time.perf_counter() - self._start
        if self.total:
            filled = min(_WIDTH, _WIDTH * self.done // self.total)
            bar = "#" * filled + "." * (_WIDTH - filled)
            return f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:.1f}s"
        return f"{self.label} {_SPINNER[self._tick % len(_SPINNER)]} {elapsed:.1f}s"

    def _spin(self) -> None:
        if self._stop.wait(self.delay):
            return
        while not self._stop.is_set():
            self._tick += 1
            self._draw()
            self._stop.wait(self.interval)

    def _draw(self) -> None:
        if not self.enabled or time.perf_counter() - self._start < self.delay:
            return
        with self._lock:
            if self._stop.is_set() and self._thread is not None:
                return
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.stream.flush()
            self._drawn = True


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real file
        return False
