"""advise(): what the search keeps, leaves out, ranks first, and says when nothing fits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.profiler import profile_model
from stratagem.plan import PP_SCHEDULES, Plan, Workload
from stratagem.advisor.search.advice import advise, rank_estimates
from stratagem.advisor.search.enumeration import search_plans
from stratagem.advisor.search.targets import model_excludes
from stratagem.errors import UsageError


@pytest.fixture(scope="module")
def llama7b():
    return profile_spec("llama-2-7b", seq_len=2048)


@pytest.fixture(scope="module")
def gpt2():
    return profile_spec("gpt2", seq_len=1024)


def test_tp_plans_carry_the_profile_s_layout(llama7b):
    advice = advise(llama7b, parse_cluster("8xA100"), Workload(global_batch_size=8, seq_len=2048),
                    constraints={"tp": (2, 4)})
    assert advice.plans and all(e.plan.tp_layout == llama7b.tp_layout for e in advice.plans)
    assert ("layers.*.attention.wo", "rowwise") in llama7b.tp_layout


def test_every_plan_fits_the_world_the_batch_and_the_device(llama7b):
    cluster = parse_cluster("2x8xH100-SXM-80GB:ib-ndr")
    workload = Workload(global_batch_size=64, seq_len=2048)
    advice = advise(llama7b, cluster, workload, top=5)
    assert len(advice.plans) == 5 and advice.reasons
    for estimate in advice.plans:
        assert estimate.plan.world_size == 16 and estimate.plan.global_batch_size == 64
        assert estimate.fits and estimate.memory.total <= estimate.capacity_bytes
        assert 32 % estimate.plan.tp == 0 and 32 % estimate.plan.pp == 0
    throughputs = [e.throughput for e in advice.plans]
    assert throughputs[1:] == sorted(throughputs[1:], reverse=True)
    assert throughputs[0] >= 0.99 * max(throughputs)
    layouts = {(e.plan.tp, e.plan.pp, e.plan.dp_replicate, e.plan.dp_shard, e.plan.zero) for e in advice.plans}
    assert len(layouts) >= 4  # alternatives, not one layout with different micro-batches


def test_enumeration_covers_the_vocabulary(llama7b):
    cluster = parse_cluster("2x8xH100-SXM-80GB:ib-ndr")
    plans = [p for group in search_plans(llama7b, cluster, Workload(global_batch_size=64, seq_len=2048))
             for p in group]
    seen = lambda field: {getattr(p, field) for p in plans}  # noqa: E731
    assert seen("tp") == {1, 2, 4, 8} and seen("pp") == {1, 2, 4, 8, 16}
    assert seen("zero") == {0, 1, 2, 3} and seen("sequence_parallel") == {False, True}
    assert seen("pp_schedule") == set(PP_SCHEDULES) and seen("pp_virtual") == {1, 2, 4}
    assert seen("activation_checkpointing") == {"none", "selective", "selective-op", "full"}
    assert seen("offload") == {"none", "optimizer", "params"}
    assert any(p.dp_replicate > 1 and p.dp_shard > 1 for p in plans)  # HSDP
    assert all(p.microbatches >= p.pp for p in plans)
    zero_bubble = [p for p in plans if p.pp_schedule == "interleaved-zb"]
    assert zero_bubble and all(p.dp == 1 and p.activation_checkpointing == "none" for p in zero_bubble)


def test_nothing_fits_says_by_how_much_and_what_would(llama7b):
    big = profile_spec("llama-2-70b", seq_len=2048)
    advice = advise(big, parse_cluster("1xL4"), Workload(global_batch_size=4, seq_len=2048))
    assert advice.best is None and not advice.reasons
    text = " ".join(advice.suggestions)
    assert "The leanest plan found" in text and "GiB usable" in text and "would fit on" in text


def test_nothing_fits_names_the_logits_that_a_long_sequence_makes():
    """Llama 3 8B at 64K tokens on eight H100s, its loss in the user's code (the logits gathered
    whole on every TP rank, ``vocab_head``): under full checkpointing the logits over 128,256
    classes and their loss fill the leanest plan; the advice says so, that context parallelism is
    not planned, and that a loss stratagem runs splits them by vocabulary, which then fits."""
    gathered = profile_spec("llama-3-8b", seq_len=65536)
    gathered = dataclasses.replace(gathered, tp_layout=tuple(
        (pattern, "vocab_head" if style == "vocab_loss" else style) for pattern, style in gathered.tp_layout))
    cluster, workload = parse_cluster("8xH100-SXM-80GB"), Workload(global_batch_size=8, seq_len=65536)
    advice = advise(gathered, cluster, workload)
    assert advice.best is None
    (fix,) = [s for s in advice.suggestions if s.startswith("Activations of one micro-batch")]
    head = float(fix.split("checkpointing, ")[1].split(" GiB of them the output head's logits")[0])
    total = float(fix.split("take ")[1].split(" GiB")[0])
    assert 0.8 * total < head < total
    assert "whole on every tensor-parallel rank" in fix and "a shorter sequence" in fix
    assert "context parallelism" in fix and "(`vocab_loss`)" in fix
    on_shards = advise(profile_spec("llama-3-8b", seq_len=65536), cluster, workload)
    assert on_shards.best.plan.tp > 1 and "vocab_loss" in on_shards.best.plan.vocab_tp_styles


def test_the_strategies_target_plans_with_the_logits_gathered(llama7b):
    """A preset's layout runs the loss on the vocabulary shards (``vocab_loss``), which the
    strategies refuse (they run the user's loss): advice for ``--target lightning`` gathers the
    logits (``vocab_head``) in its tensor-parallel plans, and prices them so."""
    cluster, workload = parse_cluster("8xA100"), Workload(global_batch_size=8, seq_len=2048)
    constraints = {"tp": 8}
    own = advise(llama7b, cluster, workload, constraints=constraints)
    lightning = advise(llama7b, cluster, workload, constraints=constraints, target="lightning")
    assert all("vocab_loss" in e.plan.vocab_tp_styles for e in own.plans)
    assert lightning.plans
    assert all(e.plan.vocab_tp_styles == {"vocab_embedding", "vocab_head"} for e in lightning.plans)
    assert lightning.plans[0].memory.total > own.plans[0].memory.total


def test_one_gpu_may_offload_what_it_cannot_hold(llama7b):
    advice = advise(llama7b, parse_cluster("1xA100-SXM4-80GB"), Workload(global_batch_size=8, seq_len=2048))
    best = advice.best.plan
    assert best.offload != "none" and best.dp_shard == 1 and best.zero >= 2
    assert advice.best.memory.host > 0 and advice.best.memory.host <= advice.best.host_capacity_bytes


def test_targets_leave_out_what_their_runtime_cannot_run(gpt2):
    cluster = parse_cluster("2x8xA100-SXM4-80GB:ib-hdr")
    workload = Workload(global_batch_size=64, seq_len=1024)
    accelerate = advise(gpt2, cluster, workload, target="accelerate")
    assert all(e.plan.pp == 1 and e.plan.tp == 1 for e in accelerate.plans)
    assert any("pipeline" in reason for reason in accelerate.excluded)
    deepspeed = advise(gpt2, cluster, workload, target="deepspeed", top=50)
    assert not any(e.plan.pp > 1 and e.plan.zero >= 2 for e in deepspeed.plans)
    with pytest.raises(UsageError, match="unknown target"):
        advise(gpt2, cluster, workload, target="megatron")


def test_constraints_pin_plan_fields(gpt2):
    cluster = parse_cluster("8xA100")
    advice = advise(gpt2, cluster, Workload(global_batch_size=64, seq_len=1024), constraints={"tp": 2, "zero": (2, 3)})
    assert advice.plans and all(e.plan.tp == 2 and e.plan.zero in (2, 3) for e in advice.plans)
    with pytest.raises(UsageError, match="unknown constraint"):
        advise(gpt2, cluster, Workload(global_batch_size=64, seq_len=1024), constraints={"tensor": 2})


def test_models_without_a_tp_layout_get_no_tensor_parallel_plans():
    resnet = profile_spec("resnet-50")
    advice = advise(resnet, parse_cluster("8xA100"), Workload(global_batch_size=256), top=20)
    assert all(e.plan.tp == 1 for e in advice.plans)
    assert any("pair no column-split Linear" in note for note in advice.notes)
    assert advice.plans[0].throughput_unit == "samples/s"


def test_sequence_parallelism_only_where_tp_divides_the_blocks_sequence():
    """vit-small's blocks read 65 tokens (64 patches and the class token): the plugin splits the
    sequence evenly, so no TP degree offers SP, and the report says why."""
    vit = profile_spec("vit-small", precision="fp32", kernels="cpu")
    assert vit.block_sequence == 65 and profile_spec("llama-tiny").block_sequence == 64
    advice = advise(vit, parse_cluster("4xcpu"), Workload(global_batch_size=8, precision="fp32"), top=60)
    assert any(e.plan.tp > 1 for e in advice.plans) and not any(e.plan.sequence_parallel for e in advice.plans)
    assert any("sequence of 65 does not divide by tp=4" in reason for reason in advice.excluded)
    plan = Plan(tp=2, sequence_parallel=True, micro_batch_size=8, precision="fp32",
                block_container=vit.block_container, tp_layout=vit.tp_layout)
    assert model_excludes(vit, parse_cluster("2xcpu"), plan) == \
        "no sequence parallelism: the blocks' sequence of 65 does not divide by tp=2"


def test_compiled_plans_of_blocks_at_several_input_sizes_get_a_note(gpt2):
    """ResNet's bottlenecks share one forward at four stages' sizes: compiled one by one, dynamo
    recompiles it with dynamic shapes, which the compiled plans' prediction does not price."""
    resnet = profile_spec("resnet-50")
    cluster = parse_cluster("1xH100-SXM-80GB")
    advice = advise(resnet, cluster, Workload(global_batch_size=64), top=5)
    assert any(e.plan.compile for e in advice.plans)
    noted = [n for n in advice.notes if "dynamic shapes" in n]
    assert len(noted) == 1 and "16 Bottleneck blocks take inputs of" in noted[0]
    eager = advise(resnet, cluster, Workload(global_batch_size=64), top=5, constraints={"compile": False})
    uniform = advise(gpt2, cluster, Workload(global_batch_size=8, seq_len=1024), top=5)
    assert not [n for n in (*eager.notes, *uniform.notes) if "dynamic shapes" in n]


class _Halving(nn.Module):
    """A block that keeps every other token: the next one takes half the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))[:, ::2]


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_dynamic_shape_note_counts_sizes_not_dtypes():
    """An MLP's first block takes the fp32 input and the others autocast's bf16: the same size in
    other bytes, which dynamo recompiles as a static graph (no note); blocks that halve the sequence
    take inputs of several sizes, and the note names their kernels, not convolutions they lack."""
    cluster = parse_cluster("1xH100-SXM-80GB")

    def compiled_notes(blocks: list[nn.Module]) -> list[str]:
        profile = profile_model(_Stack(blocks), (torch.randn(4, 16, 64),), precision="bf16-mixed")
        advice = advise(profile, cluster, Workload(global_batch_size=4), top=5, constraints={"compile": True})
        assert advice.plans
        return [n for n in advice.notes if "dynamic shapes" in n]

    mlp = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)]
    assert compiled_notes(mlp) == []
    (noted,) = compiled_notes([_Halving() for _ in range(4)])
    assert "4 _Halving blocks take inputs of 4 sizes" in noted and "their kernels and the compile times" in noted
    assert "convolutions" not in noted


def test_near_ties_go_to_the_simpler_plan(gpt2):
    cluster = parse_cluster("8xA100")
    workload = Workload(global_batch_size=64, seq_len=1024)
    simple = advise(gpt2, cluster, workload, constraints={"zero": 0, "activation_checkpointing": "none",
                                                            "compile": False}).best
    fancy = dataclasses.replace(simple, plan=Plan(dp_shard=8, zero=3, micro_batch_size=8),
                                throughput=simple.throughput * 1.005)
    assert rank_estimates([fancy, simple]) == [simple, fancy]
    faster = dataclasses.replace(fancy, throughput=simple.throughput * 1.05)
    assert rank_estimates([simple, faster]) == [faster, simple]


def test_an_impossible_workload_is_a_usage_error(gpt2):
    with pytest.raises(UsageError, match="global batch of 3 on 16 devices.*not dividing the global batch"):
        advise(gpt2, parse_cluster("2x8xH100:ib-ndr"), Workload(global_batch_size=3, seq_len=1024))


def test_optimizer_only_offload_is_for_deepspeed(llama7b):
    cluster = parse_cluster("8xA100")
    workload = Workload(global_batch_size=8, seq_len=2048)
    torch_plans = advise(llama7b, cluster, workload, top=50)
    assert all(e.plan.offload != "optimizer" for e in torch_plans.plans)
    assert any("optimizer-only CPU offload" in reason for reason in torch_plans.excluded)


def test_tensor_parallel_plans_shard_data_parallelism_with_fsdp(llama7b):
    advice = advise(llama7b, parse_cluster("2x8xH100:ib-ndr"), Workload(global_batch_size=64, seq_len=2048), top=50)
    assert all(e.plan.zero >= 2 or e.plan.dp == 1 for e in advice.plans if e.plan.tp > 1)
    assert any("DDP over tensor-parallel" in reason for reason in advice.excluded)


@pytest.mark.parametrize("name, traced", [("vit-tiny", True), ("llama-tiny", False)])
def test_traced_pipeline_stages_get_neither_tp_nor_checkpointing(name, traced):
    """ViT's pipeline stages are traced graphs, which the engine refuses to give tensor
    parallelism or checkpointing; the reference Transformer's are built by removal and take both."""
    profile = profile_spec(name)
    assert profile.pp_traced is traced
    cluster, workload = parse_cluster("8xA100"), Workload(global_batch_size=64, seq_len=profile.seq_len)
    pipelines = [p for group in search_plans(profile, cluster, workload) for p in group if p.pp > 1]
    limited = [p for p in pipelines if p.tp > 1 or p.activation_checkpointing != "none"]
    assert pipelines and bool(limited) is not traced
    advice = advise(profile, cluster, workload, top=50, constraints={"pp": (2, 4)})
    ranked_limited = [e.plan for e in advice.plans if e.plan.tp > 1 or e.plan.activation_checkpointing != "none"]
    assert advice.plans and not (traced and ranked_limited)
    noted = [n for n in advice.notes if "stages are built by tracing" in n]
    assert noted == ([f"Pipeline plans only with tp=1, no activation checkpointing and no compilation: {name}'s "
                      "stages are built by tracing, and traced pipeline stages take neither tensor parallelism nor "
                      "per-block activation checkpointing or compilation."] if traced else [])


@pytest.mark.parametrize("name", ["mixtral-tiny", "llama-tiny"])
def test_tensor_parallel_routed_experts_get_a_warm_up_note(name):
    """A mixture of experts under TP meets new expert row counts for many steps, each costing
    DTensor a sharding decision: the report says the predicted step is the steady state."""
    profile = profile_spec(name)
    workload = Workload(global_batch_size=8, seq_len=profile.seq_len)
    advice = advise(profile, parse_cluster("4xcpu"), workload, top=5, constraints={"tp": (2,)})
    assert advice.plans and all(e.plan.tp == 2 for e in advice.plans)
    noted = [n for n in advice.notes if "routed experts" in n]
    assert noted == ([f"Tensor-parallel plans ({len(advice.plans)} of those ranked) split {name}'s routed experts, "
                      "whose row counts follow the routing, and DTensor decides how to shard each operator anew for "
                      "every row count it has not met yet (milliseconds each): their first tens to hundreds of steps "
                      "run slower than the step time predicted here, which is the steady state (`verify` reports "
                      "that warm-up beside the step)."] if name.startswith("mixtral") else [])
    untouched = advise(profile, parse_cluster("4xcpu"), workload, top=5, constraints={"tp": (1,)})
    assert not [n for n in untouched.notes if "routed experts" in n]


def test_lightning_target_leaves_out_what_the_strategy_refuses():
    from stratagem.advisor.search.targets import target_excludes

    common = {"micro_batch_size": 1, "microbatches": 4, "block_container": "layers"}
    interleaved = {"pp": 2, "pp_virtual": 2, "pp_schedule": "interleaved-1f1b", **common}
    assert target_excludes("lightning", Plan(**interleaved)) is None
    assert "under FSDP" in target_excludes("lightning", Plan(dp_shard=2, zero=3, **interleaved))
    assert "interleaved traced stages" in target_excludes("lightning", Plan(**interleaved), traced=True)
    assert target_excludes("any", Plan(**interleaved), traced=True) is None
    zero_bubble = Plan(**{**interleaved, "pp_schedule": "interleaved-zb"})
    assert "zero-bubble" in target_excludes("lightning", zero_bubble) and target_excludes("any", zero_bubble) is None
    assert target_excludes("lightning", Plan(pp=2, dp_replicate=2, **common)) is None
    assert target_excludes("lightning", Plan(pp=2, dp_shard=2, zero=3, **common)) is None
    assert target_excludes("lightning", Plan(pp=2, pp_schedule="gpipe", **common)) is None


def test_objective_memory_ranks_the_leanest_plan_first():
    profile = profile_spec("llama-2-7b", seq_len=4096)
    cluster, workload = parse_cluster("8xH100"), Workload(global_batch_size=64, seq_len=4096)
    lean = advise(profile, cluster, workload, objective="memory", top=50)
    assert lean.best.memory.total == min(e.memory.total for e in lean.plans)
    assert any("objective memory" in note for note in lean.notes)
    assert advise(profile, cluster, workload).best.throughput >= lean.best.throughput
    with pytest.raises(UsageError, match="unknown objective 'speed'; valid: throughput, memory"):
        advise(profile, cluster, workload, objective="speed")


@pytest.mark.parametrize("traced", [False, True])
def test_a_target_rules_a_group_alike_and_every_searched_plan_is_valid(llama7b, traced):
    """search_plans asks a target about a group's first plan only, and checks only each kept
    group's first plan (the others differ in micro-batching alone): every target's rules read no
    micro-batching, and every plan it yields passes Plan's own checks."""
    from stratagem.advisor.search.targets import TARGETS, target_excludes

    cluster = parse_cluster("2x4xA100-SXM4-80GB:ib-hdr")
    groups = [list(group) for group in search_plans(dataclasses.replace(llama7b, pp_traced=traced), cluster,
                                                     Workload(global_batch_size=64, seq_len=2048))]
    assert sum(len(group) > 1 for group in groups) > 100
    for group in groups:
        for target in TARGETS:
            assert len({target_excludes(target, plan, traced=traced) for plan in group}) == 1
        for plan in group:
            assert Plan(**dataclasses.asdict(plan)) == plan
