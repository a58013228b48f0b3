"""The pipeline partition: balanced stages by hand-worked costs, carried by the Plan, costed as carried."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

import pytest

from stratagem.advisor.cost.rates import flops_per_moved_byte
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.model_profile import ModelProfile, SegmentProfile
from stratagem.advisor.search.partition import balanced_stage_blocks, stage_costs
from stratagem.plan import Plan, Workload, even_stage_blocks
from stratagem.advisor.search.advice import advise
from stratagem.advisor.search.enumeration import search_plans
from stratagem.advisor.cost.pace import pace
from stratagem.advisor.cost.stages import rank_stages
from stratagem.advisor.search.targets import pp_degrees
from stratagem.errors import UsageError


def _segment(name: str, flops: int, params: int = 0) -> SegmentProfile:
    return SegmentProfile(name=name, kind="Block" if name.startswith("layers") else name, num_params=params,
                          param_bytes=4 * params, buffer_bytes=0, fwd_flops=flops, bwd_flops=2 * flops,
                          saved_bytes=0, saved_param_copy_bytes=0, attention_fwd_flops=0,
                          attention_saved_bytes=0, input_bytes=8, output_bytes=8)


def _profile(blocks: int, *, embed: int = 0, head: int = 0, pp_unavailable: str | None = None) -> ModelProfile:
    """``blocks`` blocks of 1 forward FLOP and 10 parameters each; ``embed``/``head`` in block units."""
    return ModelProfile(
        name="toy", precision="fp32", batch_size=1, seq_len=None,
        embed=_segment("embed", embed, params=100), blocks=tuple(_segment(f"layers.{i}", 1, 10) for i in range(blocks)),
        head=_segment("head", head, params=100), block_container="layers", pp_unavailable=pp_unavailable)


def test_equal_blocks_split_evenly():
    assert balanced_stage_blocks(_profile(8), 4) == (2, 2, 2, 2)
    assert balanced_stage_blocks(_profile(8), 1) == (8,)


def test_heavy_head_gets_fewer_blocks():
    """Head = 3 blocks of work: [4, 1] gives stages of 4 and 1 + 3 = 4 block-times; [3, 2] 3 and 5."""
    assert balanced_stage_blocks(_profile(5, head=3), 2) == (4, 1)
    costs = stage_costs(_profile(5, head=3), (4, 1))
    assert [flops for flops, _ in costs] == [12, 12]  # forward + backward = 3 × forward


def test_embedding_and_head_both_counted():
    """14 forward units (2 + 10 blocks + 2) over 3 stages: the slowest stage takes at least 5."""
    profile = _profile(10, embed=2, head=2)
    partition = balanced_stage_blocks(profile, 3)
    assert sum(partition) == 10
    assert max(flops for flops, _ in stage_costs(profile, partition)) == 3 * 5


def test_memory_breaks_ties_between_equally_fast_partitions():
    """4 equal blocks in 3 stages: [1, 1, 2], [1, 2, 1] and [2, 1, 1] are equally slow; the
    embedding and head (100 parameters each) make the middle stage the one to take two blocks."""
    assert balanced_stage_blocks(_profile(4), 3) == (1, 2, 1)


def test_the_slowest_stage_is_as_fast_as_any_split_allows():
    """Against every split of toy models with uneven blocks (and ties among them)."""
    rng = random.Random(0)
    for _ in range(40):
        flops = [rng.choice((1, 2, 3, 7)) for _ in range(rng.randint(1, 9))]
        profile = dataclasses.replace(_profile(len(flops), embed=rng.randint(0, 3), head=rng.randint(0, 3)),
                                      blocks=tuple(_segment(f"layers.{i}", f, 10) for i, f in enumerate(flops)))
        for num_stages in range(1, len(flops) + 1):
            splits = (tuple(b - a for a, b in zip((0, *cuts), (*cuts, len(flops))))
                      for cuts in itertools.combinations(range(1, len(flops)), num_stages - 1))
            slowest = min(max(f for f, _ in stage_costs(profile, split)) for split in splits)
            partition = balanced_stage_blocks(profile, num_stages)
            assert max(f for f, _ in stage_costs(profile, partition)) == slowest


def test_too_many_stages_is_a_usage_error():
    with pytest.raises(UsageError, match="(?s)5 pipeline stages.*4 blocks.*HINT"):
        balanced_stage_blocks(_profile(4), 5)


def test_even_split_puts_the_remainder_first():
    assert even_stage_blocks(10, 4) == (3, 3, 2, 2)


def test_plan_carries_and_checks_the_partition():
    plan = Plan(pp=2, microbatches=2, stage_blocks=(3, 1))
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.blocks_per_stage(4) == (3, 1)
    assert Plan(pp=2, microbatches=2).blocks_per_stage(5) == (3, 2)
    with pytest.raises(UsageError, match="(?s)2 positive block counts.*HINT"):
        Plan(pp=2, microbatches=2, stage_blocks=(4,))
    with pytest.raises(UsageError, match="pp=1"):
        Plan(stage_blocks=(4,))
    with pytest.raises(UsageError, match="(?s)covers 4 blocks, but the model has 6.*HINT"):
        plan.check(world_size=2, num_blocks=6)


def test_stages_are_costed_as_the_plan_partitions():
    profile = _profile(6, head=4)
    uneven = Plan(pp=2, microbatches=2, stage_blocks=(5, 1), precision="fp32")
    first, last = rank_stages(profile, uneven)
    assert (len(first.blocks), len(last.blocks)) == (5, 1)
    assert first.segments[0] is profile.embed and last.segments[-1] is profile.head
    paced = pace(profile, cluster=parse_cluster("2xA100"), workload=Workload(global_batch_size=2, precision="fp32"),
                 plan=uneven)
    assert paced.step.stage is first  # 5 blocks against 1 + a 4-block head
    even = Plan(pp=2, microbatches=2)
    assert len(rank_stages(profile, even)[0].blocks) == 3


def test_an_even_split_follows_the_virtual_stages():
    profile = _profile(8)
    plain, interleaved = Plan(pp=2, microbatches=2), Plan(pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2,
                                                          microbatches=2)
    assert [b.name for b in rank_stages(profile, plain)[1].blocks] == [f"layers.{i}" for i in (4, 5, 6, 7)]
    assert [b.name for b in rank_stages(profile, interleaved)[1].blocks] == [f"layers.{i}" for i in (2, 3, 6, 7)]


def test_interleaved_rank_holds_every_pp_th_stage():
    profile = _profile(8)
    plan = Plan(pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2, microbatches=2, stage_blocks=(1, 2, 3, 2))
    first, second = rank_stages(profile, plan)
    assert [b.name for b in first.blocks] == ["layers.0", "layers.3", "layers.4", "layers.5"]
    assert [b.name for b in second.blocks] == ["layers.1", "layers.2", "layers.6", "layers.7"]
    assert second.segments[-1] is profile.head


def test_pp_degrees_need_no_divisibility_but_a_splittable_model():
    assert pp_degrees(_profile(6), 8) == (1, 2, 4)
    assert pp_degrees(_profile(6, pp_unavailable="tied"), 8) == (1,)


def test_search_fills_the_balanced_partition_and_honours_a_pinned_one():
    profile, cluster = _profile(6, head=3), parse_cluster("2xA100")
    workload = Workload(global_batch_size=4, precision="fp32")
    plans = [p for group in search_plans(profile, cluster, workload) for p in group if p.pp == 2 and p.pp_virtual == 1]
    assert plans and {p.stage_blocks for p in plans} == {balanced_stage_blocks(profile, 2)}
    advice = advise(profile, cluster, workload, constraints={"pp": 2, "pp_virtual": 1, "stage_blocks": [3, 3]})
    assert advice.plans and all(e.plan.stage_blocks == (3, 3) for e in advice.plans)
    with pytest.raises(UsageError, match="(?s)cover 5 blocks, but toy has 6.*HINT"):
        advise(profile, cluster, workload, constraints={"stage_blocks": (3, 2)})


def test_unsplittable_model_gets_no_pipeline_plans_and_a_note():
    profile, cluster = _profile(4, pp_unavailable="tied weights"), parse_cluster("2xA100")
    excluded: Counter = Counter()
    plans = [p for group in search_plans(profile, cluster, Workload(global_batch_size=4), excluded=excluded) for p in group]
    assert all(p.pp == 1 for p in plans)
    assert any("No pipeline plans: tied weights" in note
               for note in advise(profile, cluster, Workload(global_batch_size=4)).notes)


def test_a_tied_embedding_and_head_pipeline_with_a_copy_on_the_last_stage():
    """GPT-2 ties its head to its embedding: the first stage holds the table, the last a copy
    (params, and so gradients and optimizer states), summed after each step by an all-reduce
    between the two that nothing hides; offloaded parameters cannot take part, so the search
    leaves pipeline × offload plans out for it."""
    from stratagem.advisor.cost.pipeline import estimate_tied_gradient_seconds
    from stratagem.advisor.cost.rank_step import rank_step
    from stratagem.advisor.profile.cache import profile_spec

    gpt2 = profile_spec("gpt2", seq_len=1024, precision="bf16-mixed", kernels="gpu")
    assert gpt2.pp_unavailable is None and gpt2.pp_tied_params == 50257 * 768
    untied = dataclasses.replace(gpt2, pp_tied_params=0)
    plan = Plan(pp=2, microbatches=4, micro_batch_size=2, precision="bf16-mixed", block_container=gpt2.block_container)
    (first, last), (first_untied, last_untied) = rank_stages(gpt2, plan), rank_stages(untied, plan)
    assert first.num_params == first_untied.num_params
    assert last.num_params - last_untied.num_params == gpt2.pp_tied_params
    assert rank_stages(gpt2, dataclasses.replace(plan, pp=1, microbatches=1, grad_accum=4))[0].num_params == gpt2.num_params

    cluster, workload = parse_cluster("2xH100-SXM-80GB"), Workload(global_batch_size=8, seq_len=1024)
    seconds = [estimate_tied_gradient_seconds(rank_step(profile, cluster=cluster, workload=workload, plan=p))
               for profile, p in ((gpt2, plan), (untied, plan), (gpt2, dataclasses.replace(plan, pp=1, microbatches=1, grad_accum=4)))]
    assert seconds[0] > 0 and seconds[1] == seconds[2] == 0

    plans = [e.plan for e in advise(gpt2, cluster, workload, top=10_000).plans]
    assert any(p.pp > 1 for p in plans) and not any(p.pp > 1 and p.offloads_parameters for p in plans)


def test_a_head_that_moves_bytes_paces_the_pipeline_and_weighs_in_the_partition():
    """A large vocabulary's head has few FLOPs beside the gigabytes its logits and their fp32
    softmax move. By FLOPs the stages below look equal; by time the head's rank is the slowest,
    and the partition weighs its bytes at the FLOPs the device runs in their time."""
    cluster, workload = parse_cluster("2xA100"), Workload(global_batch_size=2, precision="fp32")
    byte_flops = flops_per_moved_byte(cluster, "fp32")
    blocks = tuple(dataclasses.replace(b, fwd_flops=10**12, bwd_flops=2 * 10**12) for b in _profile(8).blocks)
    # the head moves what two blocks' FLOPs take, in bytes: forward a third, backward the rest
    head = dataclasses.replace(_segment("head", 0), fwd_op_bytes=round(2 * 10**12 / byte_flops),
                               bwd_op_bytes=round(4 * 10**12 / byte_flops))
    profile = dataclasses.replace(_profile(8), blocks=blocks, head=head)
    assert balanced_stage_blocks(profile, 2) == (4, 4)  # FLOPs alone: the head weighs nothing
    assert balanced_stage_blocks(profile, 2, byte_flops=byte_flops) == (5, 3)  # 5 blocks against 3 and the head
    plan = Plan(pp=2, microbatches=2, stage_blocks=(4, 4), precision="fp32")
    paced = pace(profile, cluster=cluster, workload=workload, plan=plan)
    assert paced.step.stage is rank_stages(profile, plan)[1]
    assert paced.others_share == pytest.approx(4 / 6, rel=0.05)  # four blocks' time against six's
