"""What gloo's collectives allocate beyond the tensors they are handed, on CPU ranks.

Each of four gloo ranks (``--ranks``) runs one all-reduce, one ``reduce_scatter_tensor`` and one
``all_gather_into_tensor`` at several message sizes, its input and output made and written
beforehand, and reads how far its resident set peaks above where it stood
(:class:`~stratagem.peak_memory.PeakMemory`, as ``verify`` measures a rank). The growth is the
collective's own scratch: memory a CPU rank's peak holds for as long as the collective runs, which
no tensor of the plan accounts for. Rank 0's figures are printed as a share of the message (the
all-reduce's tensor, the reduce-scatter's input, the all-gather's output).

    .venv/bin/python bench/collective_scratch.py            # about 5 s on 2 cores
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stratagem.distributed import host_store, join_group, leave_process_group, leave_spawned_process
from stratagem.peak_memory import PeakMemory

MIB = 2**20
SIZES_MIB = (1, 4, 16, 64)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def _scratch(what: str, mib: int, world: int) -> float:
    """Bytes one ``what`` of ``mib`` MiB raises this rank's peak beyond its own tensors."""
    numel = mib * MIB // 4
    whole, part = torch.ones(numel), torch.ones(numel // world)
    output = torch.zeros(numel // world if what == "reduce_scatter" else numel)  # written: its pages count
    dist.barrier()
    memory = PeakMemory(torch.device("cpu"))
    if what == "all_reduce":
        dist.all_reduce(whole)
    elif what == "reduce_scatter":
        dist.reduce_scatter_tensor(output, whole)
    else:
        dist.all_gather_into_tensor(output, part)
    grown = memory.stop()
    dist.barrier()
    return grown


def _rank(rank: int, port: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    join_group("gloo", ("127.0.0.1", port), rank=rank, world_size=world)
    if rank == 0:
        print(f"{world} gloo ranks, torch {torch.__version__}: "
              "peak growth beyond the tensors, MiB (share of the message)")
        print(f"{'message':>8}  " + "  ".join(f"{what:>18}" for what in COLLECTIVES), flush=True)
    for mib in SIZES_MIB:
        grown = [_scratch(what, mib, world) for what in COLLECTIVES]
        if rank == 0:
            cells = "  ".join(f"{g / MIB:9.2f} ({g / (mib * MIB):5.2f})" for g in grown)
            print(f"{mib:>5} MiB  {cells}", flush=True)
    leave_process_group()
    leave_spawned_process()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    ranks = parser.parse_args().ranks
    store = host_store()
    mp.start_processes(_rank, args=(store.port, ranks), nprocs=ranks, start_method="spawn", join=True)
