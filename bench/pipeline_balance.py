"""Stage balance of a pipeline: the advisor's partition against a naive equal-block split.

    .venv/bin/python bench/pipeline_balance.py

The model has uneven segments: a Llama-shaped decoder (16 blocks × 128) with an 8192-token
vocabulary, whose output layer and loss cost about five blocks. For each partition of it into
``PP`` stages, every stage module is built as the engine builds it
(:func:`stratagem.plugins.pipeline.split_stages`) and its forward + backward on one micro-batch
is timed in this process (the fastest of ``REPEATS`` runs, round-robin over all stages; the stages run one after another, so the
times do not disturb each other). A 1F1B or GPipe step of ``M`` micro-batches lasts about
``(M + PP − 1) × t_max`` (the slowest stage paces every other, Narayanan et al. 2021, §2.2);
the bubble is the share of that time the stages sit idle: ``1 − Σ t / (PP × (M + PP − 1) × t_max)``.

Its last lines are predictions, not measurements (:func:`predicted_ranks`): each rank's busy time
by the cost model for a large-vocabulary model in two stages on H100s, split by FLOPs alone and
with the bytes its operators without FLOPs move weighed in.
"""

from __future__ import annotations

import time
from dataclasses import replace
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from stratagem.advisor.cost.pace import busy
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.cost.rates import flops_per_moved_byte
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.search.partition import balanced_stage_blocks
from stratagem.plan import Plan, Workload, even_stage_blocks
from stratagem.advisor.profile.profiler import profile_model
from stratagem.models import get_preset
from stratagem.models.transformer import Transformer
from stratagem.plugins.pipeline import split_stages

from plans import given_plan  # bench/plans.py

PP, M, MICRO_BATCH, SEQ_LEN, REPEATS = 4, 8, 4, 64, 15


def _preset():
    base = get_preset("llama-tiny")
    config = replace(base.config, vocab_size=8192, dim=128, n_layers=16, ffn_dim=352)
    return replace(base, name="llama-16x128-v8192", config=config, vocab_size=8192,
                   build=partial(Transformer, config))


def stage_steps(model: nn.Module, plan: Plan, batch: tuple[tuple[Tensor, ...], Tensor],
                loss_fn) -> list[Callable[[], None]]:
    """One closure per stage running its forward + backward on one micro-batch (the stage's
    input is the previous stage's output)."""
    (tokens,), targets = batch
    stages = [split_stages(model, plan, pp_rank=r, example_inputs=(tokens,))[0] for r in range(PP)]
    steps, x = [], tokens
    for i, stage in enumerate(stages):
        last = i == PP - 1
        inputs = x if i == 0 else x.detach().requires_grad_()

        def step(stage=stage, inputs=inputs, last=last) -> None:
            out = stage(inputs)
            (loss_fn(out, targets) if last else out.float().sum()).backward()

        steps.append(step)
        with torch.no_grad():
            x = stage(inputs)
    return steps


def fastest_seconds(steps: list[Callable[[], None]]) -> list[float]:
    """Each closure's fastest of ``REPEATS`` runs, taken round-robin so that load from other
    processes on this shared machine spreads over all of them."""
    best = [float("inf")] * len(steps)
    for _ in range(REPEATS + 1):  # the first round warms up, and counts only if it is fastest
        for i, step in enumerate(steps):
            started = time.perf_counter()
            step()
            best[i] = min(best[i], time.perf_counter() - started)
    return best


def report(label: str, partition: tuple[int, ...], seconds: list[float]) -> float:
    slowest = max(seconds)
    step = (M + PP - 1) * slowest
    bubble = 1 - sum(seconds) * M / (PP * step)
    times = "  ".join(f"{1e3 * t:6.2f}" for t in seconds)
    print(f"{label:<22} blocks {str(list(partition)):<16} ms/stage {times}   "
          f"step ≈ {1e3 * step:6.1f} ms, bubble {100 * bubble:4.1f} %")
    return step


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    preset = _preset()
    model = preset.build()
    batch = preset.make_batch(MICRO_BATCH, SEQ_LEN)
    profile = profile_model(model, batch[0], loss_fn=lambda out: preset.loss(out, batch[1]), precision="fp32",
                            kernels="cpu")
    print(f"{preset.name}: {len(profile.blocks)} blocks; head {profile.head.flops / profile.blocks[0].flops:.1f} "
          f"blocks of FLOPs, embedding {profile.embed.param_bytes / 2**20:.0f} MiB; pp={PP}, {M} micro-batches "
          f"of {MICRO_BATCH}×{SEQ_LEN}, fp32, 1 thread")
    partitions = {"naive (equal blocks)": even_stage_blocks(len(profile.blocks), PP),
                  "advisor (balanced)": balanced_stage_blocks(
                      profile, PP, byte_flops=flops_per_moved_byte(parse_cluster(f"{PP}xcpu"), "fp32"))}
    closures = []
    for partition in partitions.values():
        plan = Plan(pp=PP, microbatches=M, micro_batch_size=MICRO_BATCH, precision="fp32",
                    block_container=profile.block_container, stage_blocks=partition)
        closures += stage_steps(model, plan, batch, preset.loss)
    seconds = fastest_seconds(closures)
    steps = {label: report(label, partition, seconds[i * PP:(i + 1) * PP])
             for i, (label, partition) in enumerate(partitions.items())}
    naive, advisor = steps.values()
    print(f"advisor's partition: step {naive / advisor:.2f}× faster than the equal split")
    predicted_ranks()


def predicted_ranks(model: str = "hf:bench/configs/qwen2.5-1.5b", cluster_spec: str = "8xH100",
                    seq_len: int = 4096) -> None:
    """The cost model's busy time of each pipeline rank (:func:`~stratagem.advisor.cost.pace.busy`)
    for a large-vocabulary model on GPUs, two stages of its blocks split by FLOPs alone and with
    the bytes moved weighed in: a head whose logits move gigabytes with few FLOPs beside them."""
    cluster = parse_cluster(cluster_spec)
    profile = profile_spec(model, seq_len=seq_len, precision="bf16-mixed")
    workload = Workload(global_batch_size=64, seq_len=seq_len, precision="bf16-mixed")
    for label, byte_flops in (("FLOPs alone", 0.0), ("bytes weighed", flops_per_moved_byte(cluster, "bf16-mixed"))):
        split = balanced_stage_blocks(profile, 2, byte_flops=byte_flops, compiled=True)
        plan = given_plan({"pp": 2, "dp_shard": 4, "zero": 2, "compile": True, "micro_batch_size": 2,
                           "microbatches": 8, "stage_blocks": list(split)}, profile, cluster, workload)
        ranks = "  ".join(f"{1e3 * busy(rank_step(profile, cluster=cluster, workload=workload, plan=plan, rank=r)).seconds:6.0f}"
                          for r in range(2))
        print(f"{model} on {cluster_spec}, {plan.name}, {label:<13}: blocks {list(split)}, "
              f"ms busy per rank {ranks}")


if __name__ == "__main__":
    main()
