"""What gloo's collectives hold beyond their tensors on a CPU rank: the peak of the process's
resident memory (``stratagem.peak_memory.PeakMemory``, as ``verify`` measures CPU ranks) while
one collective runs on a 64 MiB fp32 input over two gloo ranks, less the output's own pages.

FSDP gathers its units with ``all_gather_into_tensor`` and reduces their gradients with
``reduce_scatter_tensor``; TP all-reduces its row Linears' outputs and gathers a vocabulary-split
head's logits. On NCCL none of them holds more than a fixed buffer. On gloo clusters the memory
model prices the copies the first two hold (``stratagem.advisor.cost.memory.collectives_copy``);
all-reduce's own buffer it leaves out.

    .venv/bin/python bench/gloo_collective_memory.py        # about 20 seconds on 2 cores
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stratagem.distributed import host_store, join_group
from stratagem.peak_memory import PeakMemory

MIB = 2**20
ELEMENTS = 16 * MIB  # fp32: 64 MiB
WORLD = 2


def _rank(rank: int, port: int) -> None:
    join_group("gloo", ("127.0.0.1", port), rank=rank, world_size=WORLD)
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        source = torch.ones(ELEMENTS)
        size = {"all_reduce": 0, "all_gather_into_tensor": ELEMENTS * WORLD}.get(name, ELEMENTS // WORLD)
        output = torch.zeros(size)  # written now, so the collective pages in nothing of its own output
        dist.barrier()
        memory = PeakMemory(torch.device("cpu"))
        if name == "all_reduce":
            dist.all_reduce(source)
        else:
            getattr(dist, name)(output, source)
        beyond = memory.stop()
        if rank == 0:
            print(f"{name:<24} {beyond / MIB:>7.1f} MiB beyond its tensors "
                  f"({beyond / (ELEMENTS * 4):.2f} × the input)", flush=True)
    dist.destroy_process_group()


def main() -> None:
    store = host_store()
    print(f"gloo, {WORLD} ranks, a {ELEMENTS * 4 // MIB} MiB fp32 input each")
    mp.start_processes(_rank, args=(store.port,), nprocs=WORLD, start_method="spawn", join=True)


if __name__ == "__main__":
    main()
