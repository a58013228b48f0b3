"""A CNN with BatchNorm (``resnet-tiny``) under every kind of plan the search offers it on two
CPU ranks, trained on real gloo processes against one process (``training.py``), in fp32, and
under FSDP's mixed precision, where BatchNorm stays float32.

What is compared, and why: per-step losses, every final weight, and the final buffers
(BatchNorm's running mean, variance and batch count) of data-parallel rank 0. No plan reduces
buffers: under DDP (``broadcast_buffers``) every rank starts each forward from rank 0's and
updates them with its own micro-batch, so rank 0's are those it computed from its own
micro-batches alone; FSDP keeps each rank's own. DDP treats rank 0's as the model's (it
broadcasts them to the others before every forward), and the single process reproduces them by
keeping one set per data-parallel rank (``training.py``). A pipeline stage updates its
statistics with every micro-batch, in order, as the single process does; checkpointed blocks
update them once per micro-batch, not again while recomputing.

Tolerance: fp32's ``rtol=1e-5, atol=1e-6`` for every case, bf16 ones included: their single
process computes through the same dtypes (``training.py``'s ``bf16-params`` reference, or the
model cast as ``bf16-true`` casts it), and two ranks sum two gradients as one process
accumulates them. Observed bit-equal: losses, weights and statistics.
"""

from __future__ import annotations

import pytest
import torch
from test_data_parallel import assert_matches_single_process
from test_pipeline import TWO_RANKS as PIPELINE_TWO_RANKS
from training import Case

from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.search.enumeration import search_plans
from stratagem.models import get_preset
from stratagem.plan import Plan, Workload
from stratagem.plugins import apply_plan, build_mesh, build_optimizer

PRESET = "resnet-tiny"
_DP = {"micro_batch_size": 2, "precision": "fp32", "block_container": "layers"}
_PP2 = {"pp": 2, "microbatches": 4, **_DP}
_BF16 = {**_DP, "dp_shard": 2, "precision": "bf16-mixed"}

TWO_RANKS = {case.name: case for case in [
    Case("cnn_ddp", Plan(dp_replicate=2, **_DP), preset=PRESET),
    Case("cnn_zero1", Plan(dp_shard=2, zero=1, **_DP), preset=PRESET),
    Case("cnn_zero2_selective_ckpt", Plan(dp_shard=2, zero=2, activation_checkpointing="selective", **_DP),
         preset=PRESET),
    Case("cnn_zero1_selective_op_ckpt", Plan(dp_shard=2, zero=1, activation_checkpointing="selective-op", **_DP),
         preset=PRESET),
    Case("cnn_zero3_full_ckpt", Plan(dp_shard=2, zero=3, activation_checkpointing="full", **_DP), preset=PRESET),
    Case("cnn_pp2_1f1b", Plan(pp_schedule="1f1b", **_PP2), preset=PRESET),
    Case("cnn_pp2_interleaved", Plan(pp_schedule="interleaved-1f1b", pp_virtual=2, **_PP2), preset=PRESET),
    Case("cnn_pp2_zero_bubble", Plan(pp_schedule="interleaved-zb", pp_virtual=2, **_PP2), preset=PRESET),
    # bf16 under FSDP: the plan the advisor ranked second for resnet-50 on one H100, on two ranks
    Case("cnn_zero3_offload_bf16", Plan(zero=3, offload="params", **_BF16), preset=PRESET, reference="bf16-params"),
    Case("cnn_zero3_selective_bf16", Plan(zero=3, activation_checkpointing="selective", **_BF16), preset=PRESET,
         reference="bf16-params"),
    # bf16-true: the model cast whole but BatchNorm, fed bf16 images
    Case("cnn_ddp_bf16_true", Plan(dp_replicate=2, **{**_DP, "precision": "bf16-true"}), preset=PRESET),
    Case("cnn_zero2_bf16_true", Plan(zero=2, **{**_BF16, "precision": "bf16-true"}), preset=PRESET),
    # a traced pipeline's stages, each FSDP on one rank for its offload (offered on GPUs)
    Case("cnn_pp2_zero3_offload_bf16", Plan(zero=3, offload="params", **{**_PP2, "precision": "bf16-mixed"}),
         preset=PRESET, reference="bf16-params"),
]}
FOUR_RANKS: dict[str, Case] = {}


def _kinds(plan: Plan) -> tuple[str, ...]:
    """What kind of plan ``plan`` is, along each dimension the plugins apply."""
    data = f"zero{plan.zero}" if plan.zero else "ddp" if plan.dp > 1 else "none"
    return (f"dp:{data}", f"checkpointing:{plan.activation_checkpointing}", f"offload:{plan.offload}",
            f"pipeline:{plan.pp_schedule if plan.pp > 1 else 'none'}")


def test_every_kind_of_plan_the_search_offers_is_trained():
    """The search's plans for the preset on two CPU ranks (fp32) are of the kinds these cases
    (and the traced ResNet pipeline of ``test_pipeline.py``) train, along every dimension."""
    profile = profile_spec(PRESET, precision="fp32")
    cluster = parse_cluster("2xcpu")
    offered = {kind for group in search_plans(profile, cluster, Workload(global_batch_size=8, precision="fp32"))
               for plan in group for kind in _kinds(plan)}
    cases = [*TWO_RANKS.values(), *(c for c in PIPELINE_TWO_RANKS.values() if c.preset == PRESET)]
    trained = {kind for case in cases if case.plan.precision == "fp32" for kind in _kinds(case.plan)}
    assert offered == trained


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_cnn_matches_single_process(two_ranks, name):
    """Losses, weights and rank 0's BatchNorm statistics (float32 under every precision here)."""
    run = two_ranks[name]
    assert_matches_single_process(TWO_RANKS[name], run)
    assert {b.dtype for key, b in run.buffers.items() if "running" in key} == {torch.float32}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_one_rank_fsdp_offload_keeps_batchnorm_float32(one_rank, precision):
    """``single zero3 offload=params`` (FSDP on one rank for its CPU offload), the plan that
    failed on ResNet-50 with "Expected running_mean to have type BFloat16 but got Float": it
    trains, BatchNorm's weights and statistics stay float32 and the convolutions compute in
    bfloat16."""
    plan = Plan(zero=3, offload="params", precision=precision, block_container="layers")
    preset = get_preset(PRESET)
    torch.manual_seed(0)
    model = apply_plan(preset.build(), plan, build_mesh(plan, device_type="cpu"))
    optimizer = build_optimizer(model, plan, torch.optim.AdamW, lr=1e-3)
    (images,), targets = preset.make_batch(2, generator=torch.Generator().manual_seed(0))
    output = model(images.to(torch.bfloat16) if precision == "bf16-true" else images)
    preset.loss(output, targets).backward()
    optimizer.step()
    norm, conv = model.layers[0].bn1, model.layers[0].conv1
    assert output.dtype == torch.bfloat16 and torch.isfinite(output).all()
    assert {norm.weight.dtype, norm.running_mean.dtype, norm.running_var.dtype} == {torch.float32}
    assert conv.weight.dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)  # sharded masters
    assert norm.num_batches_tracked.item() == 1
