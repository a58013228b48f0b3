"""How long a CPU rank's blocking collective waits for the others after compute, by group size.

Ranks that share cores (four gloo ranks on two here) reach a collective a scheduler slice apart;
the collective ends when the last arrives. Calibration measures that wait per group size, a group
smaller than the job alternating with the group across it (``sync_seconds``; docs/cost-model.md,
"Collectives"). This prints, for ``--runs`` runs on ``--ranks`` ranks, the wait of each size the
calibration measures as it measures it, and of the smaller groups left alone (no collective across
them), which fall into step with each other and wait less than a plan's groups do.

    .venv/bin/python bench/collective_wait.py            # about 40 s on 2 cores
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.multiprocessing as mp

from stratagem.advisor.calibrate.benchmarks import sync_seconds
from stratagem.advisor.calibrate.run import Settings, measured_groups
from stratagem.distributed import host_store, join_group, leave_process_group, leave_spawned_process
from stratagem.units import format_seconds

def _rank(rank: int, port: int, world: int, runs: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    join_group("gloo", ("127.0.0.1", port), rank=rank, world_size=world)
    groups, cpu = measured_groups(1, world), torch.device("cpu")
    repeats = Settings.for_device(cpu, quick=False).collective_repeats  # as calibration runs it
    if rank == 0:
        print(f"{world} gloo ranks, torch {torch.__version__}: wait after 10 ms of matmuls")
    for run in range(runs):
        cells = []
        for _, size, group, across in groups:
            wait = sync_seconds(cpu, repeats=repeats, group=group, across=across)
            cells.append(f"×{size} {format_seconds(wait)}")
            if across is not None:
                cells.append(f"×{size} alone {format_seconds(sync_seconds(cpu, repeats=repeats, group=group))}")
        if rank == 0:
            print(f"run {run + 1}: " + ", ".join(cells), flush=True)
    leave_process_group()
    leave_spawned_process()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    store = host_store()
    mp.start_processes(_rank, args=(store.port, args.ranks, args.runs), nprocs=args.ranks, start_method="spawn",
                       join=True)
