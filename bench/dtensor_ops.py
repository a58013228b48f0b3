"""How many operators a tensor-parallel Linear runs on DTensors per micro-batch (the time model's
``DTENSOR_OPS_PER_TP_LINEAR``).

    .venv/bin/python bench/dtensor_ops.py [--models llama-small mixtral-small vit-small] [--seq-len 128]
                                          [--sequence-parallel]

For each preset, 2 gloo ranks apply TP 2 with the preset's own layout (no data parallelism), run
one forward and backward to warm up, then one under ``torch.profiler`` on identical data, and
count DTensor's dispatches (the profiler's ``PythonSubclass`` events: one per operator a
DTensor argument sends through ``__torch_dispatch__``). Prints the count, the TP collectives
waited on (``wait_tensor``), the modules the layout splits (the blocks' Linears, and the input
embedding and output head it splits by vocabulary, and a loss on the logits' vocabulary shards,
which the time model counts as TP Linears too) and the dispatches per split module. With
``--sequence-parallel`` the plans run SP too (its norms' operators are DTensor dispatches as well:
``SegmentProfile.sp_norm_ops``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stratagem.distributed import free_port
from stratagem.plan import Plan
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.search.targets import sp_excludes
from stratagem.models import PRESETS
from stratagem.plugins import apply_plan, build_mesh, vocab_parallel_loss
from stratagem.verify.runner import real_model

MICRO_BATCH = 2


def _worker(rank: int, port: int, model: str, seq_len: int | None, plan_json: str, split_modules: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        plan, preset = Plan.from_json(plan_json), real_model(model, seq_len=seq_len)
        torch.manual_seed(0)  # the same weights and data on both ranks: the same routing
        built = preset.build(MICRO_BATCH, preset.make_batch(MICRO_BATCH))
        inputs, targets = built.batch.args, built.batch.targets
        module = apply_plan(built.module, plan, build_mesh(plan, device_type="cpu"))
        with vocab_parallel_loss(plan):  # a preset's loss runs on the logits' vocabulary shards, as verify runs it
            built.loss(module(*inputs), targets).backward()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                built.loss(module(*inputs), targets).backward()
        if rank == 0:
            counts = {event.key: event.count for event in prof.key_averages()}
            dispatches = counts.get("PythonSubclass", 0)
            print(f"{model:<16} {dispatches:>10} {counts.get('_c10d_functional::wait_tensor', 0):>12} "
                  f"{split_modules:>14} {dispatches / split_modules:>12.1f}", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama-small", "mixtral-small", "vit-small"])
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample of the sequence models")
    parser.add_argument("--sequence-parallel", action="store_true", help="TP with sequence parallelism")
    args = parser.parse_args()
    print(f"{'model':<16} {'dispatches':>10} {'collectives':>12} {'split modules':>14} {'per module':>12}")
    for model in args.models:
        seq_len = args.seq_len if PRESETS[model].input_kind == "tokens" else None
        profile = profile_spec(model, seq_len=seq_len, precision="fp32", kernels="cpu")
        if args.sequence_parallel and (why := sp_excludes(profile, 2)):
            print(f"{model:<16} no sequence parallelism: {why}")
            continue
        plan = Plan(tp=2, tp_layout=profile.tp_layout, block_container=profile.block_container,
                    micro_batch_size=MICRO_BATCH, precision="fp32", sequence_parallel=args.sequence_parallel)
        per_block = sum(style in ("colwise", "rowwise") for _, style in profile.tp_layout)
        split = per_block * len(profile.blocks) + len(plan.vocab_tp_styles)
        mp.spawn(_worker, args=(free_port(), model, seq_len, plan.to_json(), split), nprocs=2)


if __name__ == "__main__":
    main()
