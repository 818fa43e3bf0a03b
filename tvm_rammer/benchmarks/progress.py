"""A one-line progress bar on stderr (own code, no dependency).

On a terminal it redraws one line: ``[#####-----] 3/12 resnext29: lower tvm-rammer  12.3 s``; when
stderr is not a terminal (a log file, a pipe) it prints one plain line per new stage instead.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """``total`` steps; ``stage(text)`` names what runs now, ``advance()`` finishes a step."""

    def __init__(self, total: int, stream=None, width: int = 20, enabled: bool = True):
        self.total, self.done, self.width = max(1, total), 0, width
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.text, self.started = "", time.perf_counter()
        self._last_len = 0

    def line(self) -> str:
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        return (f"[{bar}] {self.done}/{self.total} {self.text}  "
                f"{time.perf_counter() - self.started:6.1f} s")

    def stage(self, text: str) -> None:
        if text == self.text:
            return self.tick()
        self.text, self.started = text, time.perf_counter()
        if self.tty:
            self._draw()
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {text}", file=self.stream, flush=True)

    def tick(self) -> None:
        """Redraw the elapsed time of the current stage (terminal only)."""
        if self.tty:
            self._draw()

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self.tick()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self.stream.flush()

    def _draw(self) -> None:
        text = self.line()
        pad = max(0, self._last_len - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._last_len = len(text)
