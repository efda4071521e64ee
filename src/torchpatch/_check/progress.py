"""Progress of ``torchpatch check`` on a terminal: one status line on stderr, rewritten in place,
cleared when the check ends. Where stderr is not a terminal (a pipe, a file, CI logs) it says nothing."""

from __future__ import annotations

import shutil
import time
from typing import IO

INTERVAL = 0.1  # seconds between redraws


class Progress:
    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.shown = stream.isatty()
        self._width = 0
        self._last = 0.0

    def say(self, text: str) -> None:
        """Show ``text`` as the status line (at most every :data:`INTERVAL` seconds)."""
        now = time.monotonic()
        if not self.shown or now - self._last < INTERVAL:
            return
        self._last = now
        line = f"torchpatch check: {text}"[:shutil.get_terminal_size().columns - 1]  # one row: \r goes back
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()

    def done(self) -> None:
        """Clear the status line."""
        if self.shown and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
