"""A one-line progress bar on stderr, redrawn in place with a carriage return.

Drawn only when stderr is a terminal: in a log file the redraws would pile up
as one enormous line, and the periodic eval lines already show progress there.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    WIDTH = 24
    MIN_REDRAW_S = 0.1  # a redraw per step would cost more than a tiny step itself

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool | None = None):
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last_draw = 0.0
        self._drawn = False

    @staticmethod
    def render(step: int, total: int, loss: float, tokens_per_s: float | None, width: int = WIDTH) -> str:
        filled = int(width * step / max(total, 1))
        bar = "#" * filled + "-" * (width - filled)
        rate = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
        return f"[{bar}] step {step}/{total}  loss {loss:.4f}  {rate} tok/s"

    def update(self, step: int, loss: float, tokens_per_s: float | None, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.MIN_REDRAW_S and step < self.total:
            return
        self._last_draw = now
        self.stream.write("\r\033[K" + self.render(step, self.total, loss, tokens_per_s))
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        """Erase the bar so a normal line can be printed; the next update redraws it."""
        if self.enabled and self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
