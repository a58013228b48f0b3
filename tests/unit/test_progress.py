"""What long commands show while they work: :class:`~stratagem.progress.Progress` and the events a
plan's rank 0 passes to the process that shows them."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.progress import Progress
from stratagem.verify.events import EVENTS_FILE, EventRelay, event_writer


def test_without_a_terminal_each_phase_is_a_line_as_it_starts_and_ends() -> None:
    out = io.StringIO()
    with Progress(stream=out) as display:
        with display.phase("calibrate", "matmuls"):
            pass
        with display.phase("search", "plans") as phase:
            phase.done("3 to run")
        with pytest.raises(RuntimeError), display.phase("spawn", "2 ranks"):
            raise RuntimeError
        display.note("warm-up", "step 1/3: 2 ms")
    lines = out.getvalue().splitlines()
    assert lines[0] == "calibrate: matmuls …" and lines[1].startswith("calibrate: matmuls … (done in ")
    assert lines[3].startswith("search: plans … (done in ") and lines[3].endswith(": 3 to run)")
    assert lines[5].startswith("spawn: 2 ranks … (failed after ") and lines[6] == "warm-up: step 1/3: 2 ms"


def test_on_a_terminal_finished_phases_stay_as_lines_under_a_live_display() -> None:
    out = io.StringIO()
    with Progress(stream=out, live=True) as display, display.phase("calibrate", "matmuls [fp32]"):
        pass
    text = out.getvalue()
    assert "calibrate: matmuls [fp32] … (done in " in text and "\x1b[" in text  # rich drew it


def test_a_disabled_progress_prints_nothing() -> None:
    out = io.StringIO()
    display = Progress(enabled=False, stream=out)
    with display.phase("calibrate", "matmuls"):
        display.note("warm-up", "step 1/3")
    assert out.getvalue() == ""


def test_importing_progress_loads_neither_rich_nor_torch() -> None:
    code = "import sys, stratagem.progress; print(sorted({'rich', 'torch'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_rank_0_s_events_are_shown_as_they_come_whole_lines_only(tmp_path: Path) -> None:
    out = io.StringIO()
    relay = EventRelay(tmp_path, Progress(stream=out), ranks=2)
    relay.poll()  # nothing written yet
    write = event_writer(tmp_path)
    write("joined")
    write("built", seconds=0.25)
    write("step", phase="warm-up", index=1, total=2, seconds=0.5)
    with (tmp_path / EVENTS_FILE).open("a") as file:
        file.write('{"kind": "step", "phase": "meas')  # being written: waits for the next poll
    relay.poll()
    lines = out.getvalue().splitlines()
    assert lines[0] == "spawn: 2 ranks …" and lines[1].startswith("spawn: 2 ranks … (done in ")
    assert lines[2:] == ["build: model, plan and optimizer …", "build: model, plan and optimizer … (done in 250 ms)",
                         "warm-up: step 1/2: 500 ms"]  # the build's time is the rank's own
    with (tmp_path / EVENTS_FILE).open("a") as file:
        file.write('ured", "index": 1, "total": 1, "seconds": 0.125}\n')
    relay.finish(ok=True)
    assert out.getvalue().splitlines()[-1] == "measured: step 1/1: 125 ms"


def test_a_run_that_fails_ends_its_open_phase_as_failed(tmp_path: Path) -> None:
    out = io.StringIO()
    EventRelay(tmp_path, Progress(stream=out), ranks=1).finish(ok=False)
    assert out.getvalue().splitlines()[-1].startswith("spawn: 1 rank … (failed after ")
