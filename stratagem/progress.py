"""What a long command is doing while it does it, on stderr (stdout keeps the results).

On a terminal, rich's live display shows the phase under way with a spinner and its elapsed
time, and each finished phase stays as one line; elsewhere (a pipe, a CI log) every phase prints
``name: what …`` when it starts and ``name: what … (done in 1.2 s)`` when it ends, and notes
print as they come. Only the standard library is imported until a terminal needs rich.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["Phase", "Progress"]


class Phase:
    """One phase under way: :meth:`done` or :meth:`failed` ends it (the first call counts)."""

    def __init__(self, progress: Progress, name: str, what: str) -> None:
        self.text = f"{name}: {what} …"
        self._progress = progress
        self._started = time.perf_counter()
        self._task: Any = None
        self.ended = False
        progress._begin(self)

    @property
    def seconds(self) -> float:
        """Seconds since the phase began."""
        return time.perf_counter() - self._started

    def done(self, result: str = "", *, seconds: float | None = None) -> None:
        """End the phase: ``… (done in 1.2 s)``, with ``result`` after the time when given;
        ``seconds`` where the work's own clock knows better (another process's)."""
        took = self.seconds if seconds is None else seconds
        self._end(f"done in {_seconds(took)}" + (f": {result}" if result else ""))

    def failed(self) -> None:
        """End the phase as failed: ``… (failed after 1.2 s)``."""
        self._end(f"failed after {_seconds(self.seconds)}")

    def _end(self, how: str) -> None:
        if not self.ended:
            self.ended = True
            self._progress._end(self, f"{self.text} ({how})")


class Progress:
    """Phases and notes of one command on ``stream`` (default: stderr); nothing at all when not
    ``enabled`` (ranks other than 0). ``live`` (default: whether ``stream`` is a terminal) picks
    rich's live display over plain lines. Use it as a context manager, or :meth:`close` it."""

    def __init__(self, *, enabled: bool = True, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.enabled = enabled
        self._stream = stream
        self._live = live
        self._rich: Any = None  # rich.progress.Progress while the live display runs

    def begin(self, name: str, what: str) -> Phase:
        """Start the phase ``name: what``; end it with :meth:`Phase.done`."""
        return Phase(self, name, what)

    @contextmanager
    def phase(self, name: str, what: str) -> Iterator[Phase]:
        """A phase over a ``with`` block: done when the block ends (unless the block ended it),
        failed when it raises."""
        phase = self.begin(name, what)
        try:
            yield phase
        except BaseException:
            phase.failed()
            raise
        phase.done()

    def note(self, name: str, what: str) -> None:
        """One line, ``name: what``, at once."""
        self.line(f"{name}: {what}")

    def line(self, text: str) -> None:
        """``text`` as one line (above the live display on a terminal)."""
        if not self.enabled:
            return
        if self._is_live():
            self._display().console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self._out(), flush=True)

    def close(self) -> None:
        """Stop the live display (finished lines stay)."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def _begin(self, phase: Phase) -> None:
        if not self.enabled:
            return
        if self._is_live():
            phase._task = self._display().add_task(phase.text, total=None)
            self._rich.refresh()
        else:
            print(phase.text, file=self._out(), flush=True)

    def _end(self, phase: Phase, text: str) -> None:
        if self.enabled and self._rich is not None and phase._task is not None:
            self._rich.remove_task(phase._task)
            self._rich.refresh()  # the live display drops the phase before its line prints
        self.line(text)

    def _out(self) -> TextIO:
        return self._stream or sys.stderr  # read when writing: tests and callers may swap stderr

    def _is_live(self) -> bool:
        if self._live is None:
            isatty = getattr(self._out(), "isatty", None)
            self._live = bool(isatty and isatty())
        return self._live

    def _display(self) -> Any:
        """The rich live display, started on first use (rich is imported here only)."""
        if self._rich is None:
            from rich.console import Console
            from rich.progress import Progress as RichProgress
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

            console = Console(file=self._out(), force_terminal=True)
            self._rich = RichProgress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                                      TimeElapsedColumn(), console=console, transient=True)
            self._rich.start()
        return self._rich


def _seconds(seconds: float) -> str:
    """``1.2 s``, ``45 ms``: a phase's duration, to a tenth of a second from a second up."""
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"
