"""Plan: validation on construction, checks against a world and a model, names, JSON round-trip."""

from __future__ import annotations

import pytest

from stratagem.plan import MeshAxis, Plan, Workload
from stratagem.errors import UsageError


def test_defaults_are_a_single_device_plan():
    plan = Plan()
    assert plan.world_size == 1 and plan.global_batch_size == 1 and plan.name == "single mb=1"


def test_name_reads_like_the_plan():
    plan = Plan(tp=4, sequence_parallel=True, pp=2, microbatches=8, dp_shard=8, zero=3,
                activation_checkpointing="full", micro_batch_size=2)
    assert plan.name == "tp4+sp·pp2(1f1b)·fsdp8 zero3 ckpt=full mb=2 m=8"
    assert Plan(dp_replicate=2, dp_shard=4, zero=2).name == "dp2·fsdp4 zero2 mb=1"
    assert plan.world_size == 64 and plan.global_batch_size == 2 * 8 * 8
    assert list(plan.mesh_shape) == [MeshAxis.PP, MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.TP]


@pytest.mark.parametrize("plan", [
    Plan(),
    Plan(tp=8, sequence_parallel=True, dp_shard=4, zero=3, offload="params", precision="bf16-true"),
    Plan(pp=4, pp_schedule="interleaved-1f1b", pp_virtual=2, microbatches=8, dp_replicate=2, grad_accum=2),
    Plan(tp=2, tp_layout=(("layers.*.attention.wq", "colwise"), ("layers.*.attention.wo", "rowwise"))),
])
def test_json_round_trip(plan):
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan.from_json('{"plan": %s, "memory": {}}' % plan.to_json()) == plan  # an `advise --json` entry
    assert Plan.from_json('{"plans": [{"plan": %s}, {"plan": {}}]}' % plan.to_json()) == plan  # the document


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 0}, "Plan.tp must be a positive integer"),
    ({"zero": 4}, "Plan.zero=4 is not one of"),
    ({"dp_shard": 4}, "without ZeRO nothing is sharded"),
    ({"zero": 3}, "dp_shard, which is 1"),
    ({"zero": 1, "dp_shard": 2, "dp_replicate": 2}, "dp_replicate=2 must be 1"),
    ({"sequence_parallel": True}, "needs tp > 1"),
    ({"microbatches": 4}, "with pp=1 both must be 1"),
    ({"pp": 4, "microbatches": 2}, "needs at least one micro-batch per stage"),
    ({"pp": 2, "microbatches": 4, "pp_schedule": "interleaved-1f1b"}, "pp_virtual >= 2"),
    ({"pp": 2, "microbatches": 3, "pp_schedule": "interleaved-1f1b", "pp_virtual": 2}, "divisible by pp"),
    ({"pp": 2, "microbatches": 4, "pp_schedule": "interleaved-zb", "pp_virtual": 2, "dp_replicate": 2},
     "past the data-parallel gradient reduction"),
    ({"pp": 2, "microbatches": 4, "pp_schedule": "interleaved-zb", "pp_virtual": 2, "activation_checkpointing": "full"},
     "cannot split the backward of checkpointed blocks"),
    ({"offload": "optimizer", "dp_replicate": 2}, "needs zero>=2"),
    ({"offload": "params", "dp_shard": 2, "zero": 2}, "needs zero=3"),
    ({"activation_checkpointing": "some"}, "'none', 'selective', 'selective-op', 'full'"),
    ({"precision": "fp8"}, "Plan.precision='fp8'"),
    ({"tp_layout": (("layers.*.wq", "columnwise"),)}, "style of 'layers.*.wq'='columnwise'"),
])
def test_invalid_plans_say_why(kwargs, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Plan(**kwargs)


def test_check_against_world_and_model():
    plan = Plan(tp=4, dp_replicate=2, pp=2, microbatches=2)
    plan.check(world_size=16, devices_per_node=8, num_heads=32, num_kv_heads=8, num_blocks=32)
    with pytest.raises(UsageError, match=r"pp\(2\) × dp_replicate\(2\) × dp_shard\(1\) × tp\(4\) = 16, but the world size is 8"):
        plan.check(world_size=8)
    with pytest.raises(UsageError, match="does not divide the model's 12 attention heads"):
        Plan(tp=8).check(world_size=8, num_heads=12)
    with pytest.raises(UsageError, match="only 1 blocks"):
        plan.check(world_size=16, num_blocks=1)


def test_unknown_fields_and_bad_json():
    with pytest.raises(UsageError, match="unknown Plan field"):
        Plan.from_dict({"tp": 2, "tensor_parallel": 2})
    with pytest.raises(UsageError, match="JSON object"):
        Plan.from_json("[1, 2]")
    with pytest.raises(UsageError, match="no plan that fits"):
        Plan.from_json('{"plans": []}')


def test_workload_validation():
    assert Workload(global_batch_size=8, seq_len=1024).to_dict()["optimizer"] == "adamw"
    with pytest.raises(UsageError, match="Workload.optimizer"):
        Workload(global_batch_size=8, optimizer="lion")
    with pytest.raises(UsageError, match="Workload.global_batch_size"):
        Workload(global_batch_size=0)


def test_an_unchecked_plan_equals_the_checked_one_and_validates_on_demand():
    fields = {"pp": 2, "microbatches": 4, "dp_shard": 2, "zero": 3, "stage_blocks": (3, 1)}
    checked = Plan(**fields)
    shared = {name: getattr(checked, name) for name in Plan.__dataclass_fields__ if name != "micro_batch_size"}
    unchecked = Plan.unchecked(shared, {"micro_batch_size": 1})
    assert unchecked == checked and hash(unchecked) == hash(checked) and Plan.from_json(unchecked.to_json()) == checked
    unchecked.validate()
    with pytest.raises(UsageError, match="Plan.zero=4 is not one of"):
        Plan.unchecked(shared, {"micro_batch_size": 1, "zero": 4}).validate()


@pytest.mark.parametrize(("zero", "optimizer", "only", "gradients", "parameters", "fsdp"), [
    (0, False, False, False, False, False), (1, True, True, False, False, False),
    (2, True, False, True, False, True), (3, True, False, True, True, True)])
def test_zero_stages_say_what_they_shard(zero, optimizer, only, gradients, parameters, fsdp):
    plan = Plan(dp_shard=4 if zero else 1, dp_replicate=1 if zero else 4, zero=zero)
    assert (plan.shards_optimizer, plan.shards_optimizer_only, plan.shards_gradients, plan.shards_parameters,
            plan.uses_fsdp) == (optimizer, only, gradients, parameters, fsdp)
    assert not plan.is_hsdp


def test_derived_meanings_of_the_other_fields():
    plan = Plan(pp=2, dp_replicate=2, dp_shard=2, tp=2, zero=3, pp_schedule="interleaved-1f1b", pp_virtual=2,
                microbatches=4, activation_checkpointing="full", offload="params", block_container="layers",
                tp_layout=(("layers.*.attention.wq", "colwise"), ("output", "vocab_head")))
    assert plan.is_hsdp and plan.is_interleaved and not plan.is_zero_bubble
    assert plan.checkpoints and plan.recomputes_blocks and plan.offloads and plan.offloads_parameters
    assert plan.block_tp_styles == {"attention.wq": "colwise"}
    assert plan.vocab_tp_styles == {"vocab_head"}
    assert plan.mesh_degrees == (2, 2, 2, 2)
    assert dict(plan.mesh_strides) == {MeshAxis.TP: 1, MeshAxis.DP_SHARD: 2, MeshAxis.DP_REPLICATE: 4,
                                       MeshAxis.PP: 8}
    assert not plan.checkpoints_selectively
    for policy in ("selective", "selective-op"):
        selective = Plan(activation_checkpointing=policy)
        assert selective.checkpoints and selective.checkpoints_selectively
        assert not selective.recomputes_blocks and not selective.offloads
