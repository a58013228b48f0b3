"""What a plan's rank 0 is doing, passed from its spawned process to the process that shows it.

Rank 0 appends one JSON line per event to a file in the run's folder (:func:`event_writer`); the
process that spawned it polls the file while it waits and shows each event on a
:class:`~stratagem.progress.Progress` (:class:`EventRelay`): the spawn (until rank 0's process
group is up), the build (model, plan, optimizer) and every warm-up and measured step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stratagem.progress import Phase, Progress
from stratagem.units import format_seconds

__all__ = ["EVENTS_FILE", "EventRelay", "event_writer"]

EVENTS_FILE = "events.jsonl"


def event_writer(out: Path) -> Callable[..., None]:
    """``write(kind, **fields)``: one event appended to ``out``'s events file."""
    path = out / EVENTS_FILE

    def write(kind: str, **fields: Any) -> None:
        with path.open("a", encoding="utf-8") as file:
            file.write(json.dumps({"kind": kind, **fields}) + "\n")

    return write


class EventRelay:
    """Shows the events rank 0 writes to ``out`` on ``display``: ``joined`` ends the spawn phase
    (begun here, for ``ranks`` ranks) and begins the build, ``built`` ends it, each ``step`` is a
    line with its seconds."""

    def __init__(self, out: Path, display: Progress, *, ranks: int) -> None:
        self._path = out / EVENTS_FILE
        self._display = display
        self._read = 0
        self._phase: Phase | None = display.begin("spawn", f"{ranks} rank{'s' if ranks > 1 else ''}")

    def poll(self) -> None:
        """Show the events written since the last poll (whole lines only: one being written waits)."""
        try:
            data = self._path.read_bytes()[self._read:]
        except FileNotFoundError:
            return
        complete = data.rfind(b"\n") + 1
        self._read += complete
        for line in data[:complete].decode("utf-8").splitlines():
            self._show(json.loads(line))

    def finish(self, *, ok: bool) -> None:
        """Show what is left; a phase still open ended when the run did (failed unless ``ok``)."""
        self.poll()
        if self._phase is not None:
            self._phase.done() if ok else self._phase.failed()
            self._phase = None

    def _show(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "joined" and self._phase is not None:
            self._phase.done()
            self._phase = self._display.begin("build", "model, plan and optimizer")
        elif kind == "built" and self._phase is not None:
            self._phase.done(seconds=event["seconds"])
            self._phase = None
        elif kind == "step":
            self._display.note(event["phase"], f"step {event['index']}/{event['total']}: "
                               f"{format_seconds(event['seconds'])}")
