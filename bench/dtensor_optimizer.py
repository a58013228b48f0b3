"""What an optimizer step over DTensor parameters costs the host, by torch.optim's path (the time
model's ``DTENSOR_OP_SECONDS`` and ``DTENSOR_FOREACH_TENSOR_SECONDS``).

    .venv/bin/python bench/dtensor_optimizer.py [--repeats 15]

One gloo rank on this host times AdamW steps over 8 and 64 parameters of 64 elements, plain
tensors and DTensors, one tensor at a time (torch.optim's default on CPU, and for an offloaded
plan's parameters) and ``foreach`` (its default on GPUs, DTensors included), with ``stratagem
calibrate``'s own benchmarks (``advisor/calibrate/optimizers.py``), and prints each path's
seconds per step and per tensor. On the ``foreach`` path an AdamW step makes about ``OPTIMIZER_OPS_PER_TENSOR``
DTensor calls whatever the number of tensors; one tensor at a time it makes that many per tensor.
The lines below the table divide accordingly: the seconds of a DTensor call one tensor at a time,
and on the ``foreach`` path what a step costs per call and what each tensor adds to a call.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from stratagem.advisor.calibrate.optimizers import SMALL_STEP_TENSORS, dtensor_optimizer_seconds, small_step_seconds
from stratagem.advisor.cost.optimizer import OPTIMIZER_OPS_PER_TENSOR
from stratagem.distributed import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cpu, ops = torch.device("cpu"), OPTIMIZER_OPS_PER_TENSOR["adamw"]
        print(f"torch {torch.__version__}, one gloo rank, AdamW over {' and '.join(map(str, SMALL_STEP_TENSORS))}"
              " parameters of 64 elements")
        print(f"{'parameters, path':<30} {'per step':>11} {'per tensor':>11}")
        rows = {}
        for foreach in (False, True):
            path = "foreach" if foreach else "one tensor at a time"
            rows[foreach] = (small_step_seconds(cpu, repeats=args.repeats, foreach=foreach),
                             dtensor_optimizer_seconds(cpu, repeats=args.repeats, foreach=foreach))
            for kind, (per_step, per_tensor) in zip(("plain", "DTensor"), rows[foreach]):
                print(f"{kind + ', ' + path:<30} {per_step * 1e6:>8.0f} µs {per_tensor * 1e6:>8.1f} µs")
        (_, (_, single)), (_, (per_step, per_tensor)) = rows[False], rows[True]
        print(f"DTensor, one tensor at a time: {single / ops * 1e6:.1f} µs per call ({ops} calls per tensor)")
        print(f"DTensor, foreach: {per_step / ops * 1e6:.1f} µs per call ({ops} calls per step), "
              f"{per_tensor / ops * 1e6:.2f} µs per tensor in each")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
