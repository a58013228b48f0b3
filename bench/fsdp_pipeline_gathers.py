"""How often torch's pipeline schedules all-gather each FSDP unit in one step.

Four gloo ranks train llama-tiny under ``pp2 × fsdp2`` (ZeRO-3, then ZeRO-2) with 1F1B and GPipe
at several micro-batch counts ``m``, counting FSDP2's ``foreach_all_gather`` calls in the second
step and dividing by the stage's FSDP units. torch's schedule leaves each unit gathered after
its backward (``set_reshard_after_backward(False)``), so a forward that follows a backward
gathers nothing: ZeRO-3 gathers ``m + 1`` times, not ``2m``, what the cost model's
``RankStep.num_gathers`` counts.

    .venv/bin/python bench/fsdp_pipeline_gathers.py        # about a minute on 2 cores
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from stratagem.distributed import host_store, join_group, leave_process_group, leave_spawned_process
from stratagem.models import get_preset
from stratagem.plan import Plan
from stratagem.plugins import apply_plan, build_mesh
from stratagem.plugins.materialize import materialize

RANKS = 4
CASES = [(zero, schedule, m) for zero, schedule in itertools.product((3, 2), ("1f1b", "gpipe")) for m in (2, 4, 8)]


def _rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    join_group("gloo", ("127.0.0.1", port), rank=rank, world_size=RANKS)
    calls = 0
    gather = _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return gather(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    preset = get_preset("llama-tiny")
    for zero, schedule, m in CASES:
        plan = Plan(pp=2, dp_shard=2, zero=zero, microbatches=m, pp_schedule=schedule, micro_batch_size=2,
                    precision="fp32", block_container="layers")
        torch.manual_seed(0)
        (tokens,), targets = preset.make_batch(2 * m, seq_len=16)
        with torch.device("meta"):
            module = preset.build()
        pipeline = apply_plan(module, plan, build_mesh(plan, device_type="cpu"), loss_fn=preset.loss,
                              example_inputs=(tokens[:2],))
        for stage in pipeline.modules:
            materialize(stage, torch.device("cpu"))
        units = sum(isinstance(sub, FSDPModule) for sub in pipeline.modules.modules())
        for _ in range(2):  # the first step's shape inference gathers too: count the second
            calls = 0
            pipeline.step(tokens, target=targets)
        if rank == 0:
            print(f"zero {zero}  {schedule:<5}  m = {m}:  {calls / units:g} gathers per unit "
                  f"({calls} over {units} units)", flush=True)
        del pipeline
    leave_process_group()
    leave_spawned_process()


if __name__ == "__main__":
    store = host_store()
    mp.start_processes(_rank, args=(store.port,), nprocs=RANKS, start_method="spawn", join=True)
