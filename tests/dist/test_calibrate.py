"""``stratagem calibrate`` on two real gloo processes, then ``advise`` and ``hardware`` using it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jobs import torchrun

from stratagem.advisor.calibrate import Calibration
from stratagem.advisor.calibrate.calibration import COLLECTIVES


def _stratagem(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stratagem", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_calibrate_then_advise_uses_it(tmp_path: Path) -> None:
    env = {**os.environ, "STRATAGEM_CACHE_DIR": str(tmp_path)}
    done = _stratagem("calibrate", "--quick", "--nproc", "2", env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "saved to" in done.stdout and "all_reduce intra ×2" in done.stdout
    # Piped, every benchmark is a line on stderr as it starts and one as it ends (rank 0's alone).
    lines = done.stderr.splitlines()
    assert "calibrate: spawning 2 ranks (gloo); rank 0 shows each benchmark" in lines
    for what in ("framework memory", "matmuls and operators (fp32, bf16)", "memory bandwidth", "optimizer steps",
                 "collectives after compute", "all_reduce intra ×2", "p2p intra ×2", "overlap of collectives"):
        started = [i for i, line in enumerate(lines) if line.startswith(f"calibrate: {what}") and line.endswith("…")]
        ended = [i for i, line in enumerate(lines) if line.startswith(f"calibrate: {what}") and "(done in " in line]
        assert len(started) == len(ended) == 1 and started[0] < ended[0], done.stderr[-3000:]
    assert "calibrate:" not in done.stdout
    assert "rows off 16 bytes (fp32)" in done.stdout
    (path,) = (tmp_path / "calibration").glob("*.json")
    calibration = Calibration.load(path)
    assert (calibration.backend, calibration.world_size) == ("gloo", 2)
    assert set(calibration.links["intra"]) == set(COLLECTIVES)
    assert calibration.matmul_rate("fp32") > 0 and calibration.memory_bandwidth > 0
    assert set(calibration.unaligned_matmul) == set(calibration.matmul)
    assert all(0 < share <= 1 for share in calibration.unaligned_matmul.values())

    advised = _stratagem("advise", "--model", "llama-tiny", "--cluster", "2xcpu", "--global-batch-size", "8",
                         "--seq-len", "32", "--precision", "fp32", env=env)
    assert advised.returncode == 0, advised.stderr[-3000:]
    assert "calibrated: measured on this cluster" in " ".join(advised.stdout.split())
    shown = _stratagem("hardware", "--cluster", "2xcpu", env=env)
    assert f"{calibration.matmul_rate('fp32') / 1e12:.3g} TFLOP/s" in shown.stdout
    catalog = _stratagem("advise", "--model", "llama-tiny", "--cluster", "2xcpu", "--global-batch-size", "8",
                         "--seq-len", "32", "--precision", "fp32", "--no-calibration", env=env)
    assert "calibrated" not in catalog.stdout


def test_calibrate_on_one_process_measures_all_but_collectives_and_says_so(tmp_path: Path) -> None:
    """One GPU's case: compute, memory and optimizer figures are measured; collectives, which need
    two processes, keep the catalog's figures, and the table and the file say so."""
    env = {**os.environ, "STRATAGEM_CACHE_DIR": str(tmp_path)}
    done = _stratagem("calibrate", "--nproc", "1", "--quick", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "were not measured" in " ".join(done.stdout.split())
    (path,) = (tmp_path / "calibration").glob("*.json")
    calibration = Calibration.load(path)
    assert calibration.world_size == 1 and calibration.links == {} and calibration.overlap is None
    assert calibration.matmul_rate("fp32") > 0 and calibration.notes
    refused = _stratagem("calibrate", "--nproc", "0", env=env)
    assert refused.returncode == 2 and "--nproc: must be at least 1" in refused.stderr


BAD_REFERENCE = """
import stratagem.advisor.calibrate.benchmarks as benchmarks
from stratagem.cli import main

benchmarks.BYTES_REFERENCE = ("no-such-model", 2, 128)  # also in the spawned rank, which imports this
if __name__ == "__main__":
    raise SystemExit(main(["calibrate", "--nproc", "1", "--quick"]))
"""


def test_bad_input_found_in_a_spawned_rank_is_a_usage_error_not_a_traceback(tmp_path: Path) -> None:
    """As torch 2.11 refused to profile calibrate's grouped-query reference model on a GPU
    machine: the rank's message, exit status 2."""
    script = tmp_path / "bad_reference.py"
    script.write_text(BAD_REFERENCE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "STRATAGEM_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 2 and "unknown model 'no-such-model'" in done.stderr
    assert "Traceback" not in done.stderr


def test_calibrate_in_a_two_node_job_measures_across_the_nodes(tmp_path: Path) -> None:
    """Two torchrun agents, one rank each, as two nodes launch: the links between the nodes are
    measured, and node 0's rank alone stores and reports."""
    first, second = torchrun("-m", "stratagem", "calibrate", "--quick", cwd=tmp_path, nodes=2, per_node=1,
                             env={**os.environ, "STRATAGEM_CACHE_DIR": str(tmp_path)})
    assert first.returncode == second.returncode == 0, first.stderr[-3000:] + second.stderr[-3000:]
    assert "all_reduce inter ×2" in first.stdout and second.stdout == ""
    (path,) = (tmp_path / "calibration").glob("*.json")
    calibration = Calibration.load(path)
    assert calibration.hardware.startswith("2x1xcpu") and set(calibration.links) == {"inter"}


def test_calibrate_in_a_job_refuses_nproc(tmp_path: Path) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "STRATAGEM_CACHE_DIR": str(tmp_path)}
    done = _stratagem("calibrate", "--nproc", "2", env=env)
    assert done.returncode == 2 and "--nproc-per-node sets the ranks" in done.stderr
