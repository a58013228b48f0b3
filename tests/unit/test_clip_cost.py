"""The gradients' clipping in the step (``Workload.grad_clip``): its passes over the gradients the
rank keeps, where they live, the norm's all-reduces, and the host's launches."""

from __future__ import annotations

import pytest

from stratagem.advisor.cost.collectives import estimate_all_reduce_seconds
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.cost.host import CLIP_NORM_OPS, OP_DISPATCH_SECONDS, TO_LOCAL_OPS
from stratagem.advisor.cost.optimizer import (
    CLIP_GRADIENT_PASSES,
    HOST_OPTIMIZER_BANDWIDTH_PER_NODE,
    estimate_clip_seconds,
)
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.errors import UsageError
from stratagem.plan import MeshAxis, Plan, Workload


@pytest.fixture(scope="module")
def gpt2():
    return profile_spec("gpt2-tiny")


def _steps(profile, cluster, plan: Plan, batch: int):
    return {clip: rank_step(profile, cluster=cluster, plan=plan, workload=Workload(
        global_batch_size=batch, seq_len=profile.seq_len, grad_clip=clip)) for clip in (None, "norm", "value")}


def test_clipping_streams_the_rank_s_gradients_by_norm_three_times_by_value_twice(gpt2):
    cluster = parse_cluster("1xH100-SXM-80GB")
    steps = _steps(gpt2, cluster, Plan(micro_batch_size=2, block_container="layers"), 2)
    gradient_bytes = gpt2.num_params * 4  # bf16-mixed: fp32 parameters and gradients
    assert estimate_clip_seconds(steps[None]) == 0
    for clip, passes in CLIP_GRADIENT_PASSES.items():
        assert estimate_clip_seconds(steps[clip]) == pytest.approx(
            passes * gradient_bytes * steps[clip].seconds_per_op_byte)  # one rank: no all-reduce


def test_sharded_gradients_clip_their_shard_and_all_reduce_the_norm_once_per_splitting_dimension(gpt2):
    cluster = parse_cluster("8xH100-SXM-80GB")
    plan = Plan(dp_shard=4, tp=2, zero=3, micro_batch_size=2, block_container="layers", tp_layout=gpt2.tp_layout)
    steps = _steps(gpt2, cluster, plan, 8)
    step = steps["norm"]
    streamed = 3 * step.gradient_params * 4 * step.seconds_per_op_byte
    reduces = sum(estimate_all_reduce_seconds(4, group_size=size, **step.link(axis, "all_reduce"))
                  for axis, size in ((MeshAxis.DP_SHARD, 4), (MeshAxis.TP, 2)))
    assert step.gradient_params == pytest.approx(step.params_per_rank / 4)
    assert estimate_clip_seconds(step) == pytest.approx(streamed + reduces)
    assert estimate_clip_seconds(steps["value"]) == pytest.approx(
        2 * step.gradient_params * 4 * step.seconds_per_op_byte)
    # ZeRO-1 reduces every gradient whole: each rank clips all of them, and plain tensors need no all-reduce
    zero1 = _steps(gpt2, cluster, Plan(dp_shard=8, zero=1, micro_batch_size=1, block_container="layers"), 8)["norm"]
    assert estimate_clip_seconds(zero1) == pytest.approx(3 * zero1.params_per_rank * 4 * zero1.seconds_per_op_byte)


def test_an_offloaded_plan_clips_on_the_host(gpt2):
    cluster = parse_cluster("8xH100-SXM-80GB")
    plan = Plan(dp_shard=8, zero=3, offload="params", micro_batch_size=1, block_container="layers")
    step = _steps(gpt2, cluster, plan, 8)["value"]
    assert estimate_clip_seconds(step) == pytest.approx(
        2 * step.gradient_params * 4 * 8 / HOST_OPTIMIZER_BANDWIDTH_PER_NODE)


def test_clipping_adds_its_launches_and_its_passes_to_the_step(gpt2):
    """On a CPU rank every launch adds: by norm a fixed count, by value one a gradient tensor; FSDP's
    DTensor gradients add their local parts' taking."""
    cluster = parse_cluster("2xcpu")
    tensors = sum(segment.num_tensors for segment in gpt2.segments)
    for plan in (Plan(dp_replicate=2, micro_batch_size=1, precision="fp32", block_container="layers"),
                 Plan(dp_shard=2, zero=3, micro_batch_size=1, precision="fp32", block_container="layers")):
        times = {clip: evaluate(gpt2, cluster, Workload(global_batch_size=2, seq_len=gpt2.seq_len, precision="fp32",
                                                         grad_clip=clip), plan).time
                 for clip in (None, "norm", "value")}
        steps = _steps(gpt2, cluster, plan, 2)
        local = TO_LOCAL_OPS * tensors if plan.uses_fsdp else 0
        for clip, ops in (("norm", CLIP_NORM_OPS + 2 * local), ("value", tensors + local)):
            assert times[clip].dispatch - times[None].dispatch == pytest.approx(ops * OP_DISPATCH_SECONDS)
            assert times[clip].optimizer - times[None].optimizer == pytest.approx(estimate_clip_seconds(steps[clip]))


def test_a_workload_clips_by_norm_or_by_value():
    with pytest.raises(UsageError, match="Workload.grad_clip='l2' is not one of 'norm', 'value'"):
        Workload(global_batch_size=1, grad_clip="l2")
