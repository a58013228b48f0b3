"""What long commands show while they work: :class:`~stratagem.progress.Progress`."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from stratagem.progress import Progress


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
