"""What an optimizer step over DTensor parameters costs the host, by torch.optim's path (the time
model's ``DTENSOR_OP_SECONDS``, ``DTENSOR_FOREACH_TENSOR_SECONDS`` and ``DTENSOR_FUSED_TENSOR_SECONDS``).

    .venv/bin/python bench/dtensor_optimizer.py [--repeats 15]

One gloo rank on this host times AdamW steps over 8 and 64 parameters of 64 elements, plain
tensors and DTensors, one tensor at a time (torch.optim's default on CPU, and for an offloaded
plan's parameters before the plugins stepped them fused), ``foreach`` (its default on GPUs,
DTensors included) and fused (an offloaded plan's host step now), with ``stratagem
calibrate``'s own benchmarks (``advisor/calibrate/optimizers.py``), and prints each path's
seconds per step and per tensor. On the ``foreach`` path an AdamW step makes about ``OPTIMIZER_OPS_PER_TENSOR``
DTensor calls whatever the number of tensors; one tensor at a time it makes that many per tensor.
The lines below the table divide accordingly: the seconds of a DTensor call one tensor at a time,
and on the ``foreach`` path what a step costs per call and what each tensor adds to a call. Last,
the cost model's GPT-2 on eight H100s under DDP and FSDP, with the host launches the device's work
does not hide (docs/cost-model.md, "Host time: operator dispatch", says what FSDP's step was before the model knew
the foreach path, from a scratch evaluation).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from stratagem.advisor.calibrate.optimizers import SMALL_STEP_TENSORS, small_step_seconds
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.cost.optimizer import OPTIMIZER_OPS_PER_TENSOR
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.distributed import free_port
from stratagem.plan import Workload
from stratagem.units import format_seconds

from plans import given_plan  # bench/plans.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cpu, ops, mesh = torch.device("cpu"), OPTIMIZER_OPS_PER_TENSOR["adamw"], init_device_mesh("cpu", (1,))
        print(f"torch {torch.__version__}, one gloo rank, AdamW over {' and '.join(map(str, SMALL_STEP_TENSORS))}"
              " parameters of 64 elements")
        print(f"{'parameters, path':<30} {'per step':>11} {'per tensor':>11}")
        rows = {}
        for path, options in (("one tensor at a time", {"foreach": False}), ("foreach", {"foreach": True}),
                              ("fused", {"fused": True})):
            rows[path] = (small_step_seconds(cpu, repeats=args.repeats, **options),
                          small_step_seconds(cpu, repeats=args.repeats, mesh=mesh, **options))
            for kind, (per_step, per_tensor) in zip(("plain", "DTensor"), rows[path]):
                print(f"{kind + ', ' + path:<30} {per_step * 1e6:>8.0f} µs {per_tensor * 1e6:>8.1f} µs")
        (_, (_, single)), (_, (per_step, per_tensor)) = rows["one tensor at a time"], rows["foreach"]
        print(f"DTensor, one tensor at a time: {single / ops * 1e6:.1f} µs per call ({ops} calls per tensor)")
        print(f"DTensor, foreach: {per_step / ops * 1e6:.1f} µs per call ({ops} calls per step), "
              f"{per_tensor / ops * 1e6:.2f} µs per tensor in each")
        per_step, per_tensor = rows["fused"][1]
        print(f"DTensor, fused (an offloaded plan's host step): {per_step * 1e6:.0f} µs a step (one call), "
              f"{per_tensor * 1e6:.1f} µs per tensor in it")
    finally:
        dist.destroy_process_group()
    gpt2_on_eight_h100s()


def gpt2_on_eight_h100s() -> None:
    """What the foreach path means to a user: the cost model's GPT-2 (196 parameter tensors) on
    eight H100s, 64 sequences of 1,024 tokens, under DDP and under FSDP, with the host time of its
    launches beyond the device's work (``dispatch``)."""
    cluster, workload = parse_cluster("8xH100-SXM-80GB"), Workload(global_batch_size=64, seq_len=1024)
    profile = profile_spec("gpt2", seq_len=1024)
    for fields in ({"dp_replicate": 8}, {"dp_shard": 8, "zero": 3}):
        plan = given_plan({**fields, "micro_batch_size": 8}, profile, cluster, workload)
        time = evaluate(profile, cluster, workload, plan).time
        print(f"gpt2 on 8xH100-SXM-80GB, {plan.name}: step {format_seconds(time.step_seconds)}, of it host "
              f"launches beyond the device's work {format_seconds(time.dispatch)}")


if __name__ == "__main__":
    main()
