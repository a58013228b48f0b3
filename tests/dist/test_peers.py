"""A rank lost mid-training is named: ``Trainer(strategy=AutoParallelStrategy(...))`` on two gloo
CPU ranks, one of which kills itself (SIGKILL) after a step; the other raises
:class:`~stratagem.errors.PeerLost` naming it within seconds, and no process of the job is left.
The same on a plain group of three ranks meeting at a store the test hosts (``host_store``).

As in ``test_lightning.py``, the Lightning test runs this file as the training script in a
subprocess (Lightning's launcher re-runs it for rank 1). Each rank writes its pid, and rank 0 the
pids of its children, to the output folder when training starts; the victim writes the time it
dies.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn import TIMEOUT

from stratagem.distributed import host_store, join_group, leave_spawned_process, naming_lost_peers
from stratagem.errors import PeerLost

# Lightning and the model are imported by the training script alone (main): the plain group's
# spawned ranks import this module too, and need neither.

KILL_AFTER = 1
"""Optimizer steps the victim takes before it kills itself."""
NAMED_WITHIN = 10.0
"""Seconds from the kill by which the survivor must have exited."""


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(path: Path, running: Callable[[], bool], timeout: float) -> None:
    """Wait until ``path`` exists, while ``running()``."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert running() or path.exists(), f"the job ended before {path.name} was written"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout:.0f} s"
        time.sleep(0.05)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_fit_is_named_and_no_process_is_left(tmp_path: Path, victim: int) -> None:
    """Rank 1 (rank 0's child: its socket resets) or rank 0 (the store's host: rank 1 is left an
    orphan and must end by itself)."""
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:  # files: an orphaned rank 1 keeps writing
        job = subprocess.Popen([sys.executable, __file__, str(tmp_path), "--victim", str(victim)],
                               cwd=tmp_path, stdout=stdout, stderr=stderr)
    try:
        _wait_for(tmp_path / "killed", lambda: job.poll() is None, timeout=240)
        killed = float((tmp_path / "killed").read_text())
        pids = {rank: int((tmp_path / f"pid-{rank}").read_text()) for rank in (0, 1)}
        children = [int(pid) for pid in (tmp_path / "children").read_text().split()]
        survivor = pids[1 - victim]
        while _alive(survivor) and time.time() < killed + 60:
            time.sleep(0.05)
        exited = time.time() - killed
    finally:
        if job.poll() is None:
            job.kill()
        job.wait(timeout=30)
    errors = err.read_text()
    assert exited < NAMED_WITHIN, f"the survivor ran {exited:.1f} s after the kill\n{errors[-5000:]}"
    assert f"PeerLost: rank {victim} of 2 stopped answering" in errors, errors[-5000:]
    assert "The job cannot continue" in errors and "HINT: start the job again" in errors
    left = [pid for pid in [job.pid, *pids.values(), *children] if _alive(pid)]
    assert not left, f"processes of the job still run: {left}"


def test_a_plain_group_names_a_lost_rank_0_while_its_store_lives_on(tmp_path: Path) -> None:
    """Three ranks all-reducing at a store this process hosts; rank 0 dies, ranks 1 and 2 name it
    from its heartbeat (the store, outside the group, still answers) and exit."""
    store = host_store()
    ranks = mp.start_processes(_all_reduce_until_lost, args=(store.port, tmp_path), nprocs=3, join=False,
                               start_method="spawn")
    try:
        _wait_for(tmp_path / "killed", ranks.processes[0].is_alive, timeout=120)
        killed = float((tmp_path / "killed").read_text())
        for process in ranks.processes[1:]:
            process.join(timeout=max(0.0, killed + 60 - time.time()))
        exited = time.time() - killed
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
    assert exited < NAMED_WITHIN, f"the survivors ran {exited:.1f} s after the kill"
    assert [process.exitcode for process in ranks.processes] == [-signal.SIGKILL, 0, 0]
    for rank in (1, 2):
        error = (tmp_path / f"error-{rank}.txt").read_text()
        assert error.startswith("rank 0 of 3 stopped answering: no heartbeat"), error
        assert f"after a collective of rank {rank} failed" in error and "The job cannot continue" in error


def _mark_killed(out: Path) -> None:
    """Write the kill's time to ``out/killed`` whole at once (renamed into place): the test polls
    for the file and reads it as soon as it exists, which a file still being written fails."""
    partial = out / "killed.partial"
    partial.write_text(str(time.time()))
    partial.replace(out / "killed")


def _all_reduce_until_lost(rank: int, port: int, out: Path) -> None:
    join_group("gloo", ("127.0.0.1", port), rank=rank, world_size=3, timeout=TIMEOUT)
    try:
        with naming_lost_peers():
            for step in itertools.count():
                if rank == 0 and step == 20:
                    _mark_killed(out)
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.all_reduce(torch.ones(8))
    except PeerLost as err:
        (out / f"error-{rank}.txt").write_text(str(err))
    leave_spawned_process()


def _kill_at(out: Path, victim: int) -> Any:
    """A callback recording the pids and, on rank ``victim``, dying by SIGKILL after
    :data:`KILL_AFTER` steps."""
    import lightning.pytorch as pl

    class KillAt(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_rank == 0:
                children = psutil.Process().children(recursive=True)
                (out / "children").write_text(" ".join(str(child.pid) for child in children))
            (out / f"pid-{trainer.global_rank}").write_text(str(os.getpid()))

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_rank == victim and trainer.global_step == KILL_AFTER:
                _mark_killed(out)
                os.kill(os.getpid(), signal.SIGKILL)

    return KillAt()


def main() -> None:
    """Train TinyLlama under the DDP plan on two CPU ranks until the victim dies."""
    import lightning.pytorch as pl
    from test_lightning import BATCH, DDP, TinyLlama, dataset
    from torch.utils.data import DataLoader

    from stratagem.integrations.lightning import AutoParallelStrategy

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--victim", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=AutoParallelStrategy(plan=DDP, verbose=False),
                         max_steps=1000, max_epochs=-1, callbacks=[_kill_at(args.out, args.victim)], logger=False,
                         default_root_dir=args.out, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(TinyLlama(), DataLoader(dataset(DDP.dp), batch_size=BATCH))


if __name__ == "__main__":
    main()
