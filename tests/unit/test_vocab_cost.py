"""What splitting the vocabulary over the TP group costs: the embedding's table and the head's
weight and projection FLOPs divided by ``tp`` where the layout splits them (and only on the
pipeline ranks holding them), the collectives the split adds, the whole embedding gradient the
backward holds for a moment, and a TP Linear's host time for each; and where the loss runs on the
logits' vocabulary shards (``vocab_loss``), the logits and the loss's tensors divided too."""

from __future__ import annotations

import dataclasses

import pytest

from stratagem.advisor.cost import activations, buffers, communication, host, memory
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.cost.rank_view import rank_view
from stratagem.advisor.cost.stages import rank_stages
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Plan, Workload

H100 = parse_cluster("1x8xH100")
LLAMA = profile_spec("llama-2-7b")  # vocabulary 32,000 × width 4,096, untied, at 4,096 tokens
TP = 8


def _plans(head: str = "vocab_head", **fields) -> tuple[Plan, Plan]:
    """The plan with the profile's layout (the vocabulary split; the head's ``head``: by default
    the logits gathered, as for a loss the user's code computes) and the same with the blocks' alone."""
    layout = tuple((pattern, head if style == "vocab_loss" else style) for pattern, style in LLAMA.tp_layout)
    split = Plan(tp=TP, tp_layout=layout, block_container=LLAMA.block_container, **fields)
    blocks = tuple(pair for pair in LLAMA.tp_layout if not pair[1].startswith("vocab_"))
    return split, dataclasses.replace(split, tp_layout=blocks)


def _steps(micro_batch_size: int = 1):
    """:func:`_plans`' steps on one node of eight H100s."""
    workload = Workload(global_batch_size=micro_batch_size, seq_len=LLAMA.seq_len)
    return tuple(rank_step(LLAMA, cluster=H100, workload=workload, plan=plan)
                 for plan in _plans(micro_batch_size=micro_batch_size))


def test_the_layout_splits_the_embedding_and_the_head():
    """A preset's loss is stratagem's, so its layout runs it on the logits' shards (``vocab_loss``,
    which splits the head as ``vocab_head`` does)."""
    assert dict(LLAMA.tp_layout)["tok_embeddings"] == "vocab_embedding"
    assert dict(LLAMA.tp_layout)["output"] == "vocab_loss"
    assert _plans()[0].vocab_tp_styles == {"vocab_embedding", "vocab_head"} and not _plans()[1].vocab_tp_styles
    assert _plans("vocab_loss")[0].vocab_tp_styles == {"vocab_embedding", "vocab_head", "vocab_loss"}


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
    assert shares == [{"vocab_embedding"}, set(), set(), {"vocab_head", "vocab_loss"}]


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
    # in the table's dtype as FSDP gathered it: bf16 under bf16-mixed
    assert memory.estimate_embedding_gradient(views[0], layout) == pytest.approx(2 * table * (1 - 1 / TP))
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


def test_a_loss_on_the_vocabulary_shards_divides_the_logits_and_gathers_none():
    """Under ``vocab_loss`` a TP rank holds its share of the logits, of their fp32 copy and
    log-probabilities, and of their gradients, at every moment the loss's tensors count (with what
    torch's decomposition of the loss on the shards holds beyond fused kernels); moves its
    share of the bytes the loss's operators move; and gathers no logits: torch's ``loss_parallel``
    all-reduces three fp32 values a row forward instead. The loss costs the host a TP Linear's time."""
    gathered, on_shards = _plans(micro_batch_size=2)[0], _plans("vocab_loss", micro_batch_size=2)[0]
    head = LLAMA.head
    assert head.vocab_saved_bytes > 0.8 * head.saved_bytes and head.vocab_fwd_op_bytes > 0.8 * head.fwd_op_bytes
    views = [rank_view(LLAMA.computed_by(plan), plan) for plan in (gathered, on_shards)]
    kept = [activations.rank_activations(view) for view in views]
    scale = 2 / LLAMA.batch_size
    assert kept[0].released - kept[1].released == pytest.approx(scale * head.vocab_saved_bytes * (1 - 1 / TP))
    assert kept[1].output_grad == pytest.approx(kept[0].output_grad / TP)
    # torch's decomposition on the shards holds three of the logits' gradients (a fused backward two)
    # and, forward, the shifted logits beside a fused log_softmax's input and output
    shard = kept[0].loss_grads / activations.LOSS_GRADIENT_COPIES / TP
    assert kept[1].loss_grads == pytest.approx(activations.LOSS_PARALLEL_GRADIENT_COPIES * shard)
    forward = kept[0].loss_inputs / TP + activations.LOSS_PARALLEL_TEMPORARIES * shard
    assert kept[1].loss_inputs == pytest.approx(forward)
    workload = Workload(global_batch_size=2, seq_len=LLAMA.seq_len)
    checkpointed = [dataclasses.replace(plan, activation_checkpointing="full") for plan in (gathered, on_shards)]
    peaks = [memory.estimate_memory(LLAMA, workload, plan).activations for plan in checkpointed]
    assert peaks[1] < 0.6 * peaks[0]  # where the loss's moments are the peak: under full checkpointing
    steps = [rank_step(LLAMA, cluster=H100, workload=workload, plan=plan) for plan in (gathered, on_shards)]
    moved = [step.per_tp_rank("fwd_op_bytes") for step in steps]
    assert moved[0] - moved[1] == pytest.approx(head.vocab_fwd_op_bytes * (1 - 1 / TP))
    tokens = 2 * 4096
    forward, backward = communication.vocab_collectives(steps[1])
    assert forward == (("all_reduce", tokens * 4096 * 4), *[("all_reduce", tokens * 4)] * 3)
    assert backward == communication.vocab_collectives(steps[0])[1]
    assert communication.estimate_tp_comm_seconds(steps[1]) < communication.estimate_tp_comm_seconds(steps[0])
    assert host.num_vocab_splits(steps[1]) == 3
