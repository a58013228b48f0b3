"""What splitting the vocabulary over the TP group costs: the embedding's table and the head's
weight and projection FLOPs divided by ``tp`` where the layout splits them (and only on the
pipeline ranks holding them), the collectives the split adds, the whole embedding gradient the
backward holds for a moment, and a TP Linear's host time for each."""

from __future__ import annotations

import dataclasses

import pytest

from stratagem.advisor.cost import buffers, communication, host, memory
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.cost.rank_view import rank_view
from stratagem.advisor.cost.stages import rank_stages
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Plan, Workload

H100 = parse_cluster("1x8xH100")
LLAMA = profile_spec("llama-2-7b")  # vocabulary 32,000 × width 4,096, untied, at 4,096 tokens
TP = 8


def _plans(**fields) -> tuple[Plan, Plan]:
    """The plan with the profile's layout (the vocabulary split) and the same with the blocks' alone."""
    split = Plan(tp=TP, tp_layout=LLAMA.tp_layout, block_container=LLAMA.block_container, **fields)
    blocks = tuple(pair for pair in LLAMA.tp_layout if not pair[1].startswith("vocab_"))
    return split, dataclasses.replace(split, tp_layout=blocks)


def _steps(micro_batch_size: int = 1):
    """:func:`_plans`' steps on one node of eight H100s."""
    workload = Workload(global_batch_size=micro_batch_size, seq_len=LLAMA.seq_len)
    return tuple(rank_step(LLAMA, cluster=H100, workload=workload, plan=plan)
                 for plan in _plans(micro_batch_size=micro_batch_size))


def test_the_layout_splits_the_embedding_and_the_head():
    assert dict(LLAMA.tp_layout)["tok_embeddings"] == "vocab_embedding"
    assert dict(LLAMA.tp_layout)["output"] == "vocab_head"
    assert _plans()[0].vocab_tp_styles == {"vocab_embedding", "vocab_head"} and not _plans()[1].vocab_tp_styles


def test_a_tp_rank_holds_the_vocabulary_s_share_of_the_parameters_and_runs_its_share_of_the_head():
    split, whole = _steps()
    table = 32_000 * 4096
    assert LLAMA.embed.vocab_params == LLAMA.head.vocab_params == table
    assert whole.params_per_rank - split.params_per_rank == pytest.approx(2 * table * (1 - 1 / TP))
    projection = 2 * LLAMA.batch_size * 4096 * table  # forward FLOPs of the profiled batch
    assert whole.per_tp_rank("fwd_flops") - split.per_tp_rank("fwd_flops") == pytest.approx(projection * (1 - 1 / TP))
    assert whole.per_tp_rank("bwd_flops") - split.per_tp_rank("bwd_flops") == pytest.approx(2 * projection * (1 - 1 / TP))
    # the final norm stays whole; the blocks divide as before
    assert split.per_tp_rank("num_params") - split.per_tp_rank("num_params", blocks_only=True) == pytest.approx(
        2 * table / TP + 4096)


def test_only_the_pipeline_ranks_holding_them_divide_them():
    split, _ = _plans(pp=4, microbatches=4)
    shares = [set(stage.vocab_shares) for stage in rank_stages(LLAMA, split)]
    assert shares == [{"vocab_embedding"}, set(), set(), {"vocab_head"}]


def test_the_split_adds_the_embedding_s_all_reduce_and_the_head_s_gather_and_reduction():
    split, whole = _steps(micro_batch_size=2)
    tokens = 2 * 4096
    forward, backward = communication.vocab_collectives(split)
    # under autocast the residual stream (the embedding's output, the head's input) is fp32, the logits bf16
    assert forward == (("all_reduce", tokens * 4096 * 4), ("all_gather", tokens * 32_000 * 2))
    assert backward == (("all_reduce", tokens * 4096 * 4),)
    assert communication.vocab_collectives(whole) == ((), ())
    assert communication.estimate_tp_comm_seconds(split) > communication.estimate_tp_comm_seconds(whole)
    assert host.num_vocab_splits(split) == 2 and host.num_vocab_splits(whole) == 0


def test_states_divide_and_the_whole_embedding_gradient_meets_every_gradient_once():
    split, whole = _plans(dp_shard=2, zero=3, precision="bf16-mixed")
    layout = memory.state_layout("bf16-mixed", "adamw")
    profile = LLAMA.computed_by(split)
    views = [rank_view(profile, plan) for plan in (split, whole)]
    table = 32_000 * 4096
    params = [memory.estimate_params_per_rank(view) for view in views]
    assert params[1] - params[0] == pytest.approx(2 * table * (1 - 1 / TP))
    # FSDP's root unit, gathered in the compute dtype, holds the rank's share of the vocabulary
    gathered = [buffers.estimate_buffers(view, p).first_block for view, p in zip(views, params)]
    assert gathered[1] - gathered[0] == pytest.approx(2 * table * (1 - 1 / TP) * 2)
    assert memory.estimate_embedding_gradient(views[0], layout) == pytest.approx(layout.grads * table * (1 - 1 / TP))
    assert memory.estimate_embedding_gradient(views[1], layout) == 0
    workload = Workload(global_batch_size=2, seq_len=LLAMA.seq_len)
    totals = [memory.estimate_memory(LLAMA, workload, plan).total for plan in (split, whole)]
    assert totals[0] < totals[1]


def test_autocast_s_copy_of_the_head_s_weight_divides_as_made_and_as_saved():
    """Autocast's copy of the head's weight is of the rank's share of it: in its cache through the
    forward (``forward_param_copy_bytes``) and saved for the backward (``saved_param_copy_bytes``)."""
    split, whole = _plans(precision="bf16-mixed")
    moments = [buffers.estimate_buffers(rank_view(LLAMA.computed_by(plan), plan), 0.0) for plan in (split, whole)]
    copy = 2 * 32_000 * 4096 * (1 - 1 / TP)  # bf16
    assert moments[1].forward - moments[0].forward == pytest.approx(copy, rel=1e-3)
    assert moments[1].loss - moments[0].loss == pytest.approx(copy, rel=1e-3)
