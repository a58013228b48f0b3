"""The memory model against published tables: ZeRO Table 1 and Korthikanti et al.'s formulas."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.cost.activations import estimate_activations, estimate_block_activations, rank_activations
from stratagem.advisor.cost.buffers import Transient, estimate_buffers
from stratagem.advisor.cost.memory import (StateLayout, estimate_memory, estimate_params_per_rank, estimate_rank_memory,
                                          estimate_root_reduce, estimate_step_bytes, estimate_unsharded_gradients,
                                          largest_stepped_tensor, state_layout)
from stratagem.advisor.cost.rank_view import in_flight_microbatches, rank_view
from stratagem.plan import Plan, Workload
from stratagem.advisor.profile.profiler import ModelProfile, SegmentProfile, profile_model
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.search.enumeration import search_plans
from stratagem.advisor.cost.stages import candidate_ranks
from stratagem.models import Transformer, get_preset


def _segment(name: str, num_params: int = 0, **kw) -> SegmentProfile:
    fields = dict(num_params=num_params, param_bytes=4 * num_params, buffer_bytes=0, fwd_flops=0, bwd_flops=0,
                  saved_bytes=0, saved_param_copy_bytes=0, attention_fwd_flops=0, attention_saved_bytes=0,
                  input_bytes=0, output_bytes=0)
    return SegmentProfile(name=name, kind=name, **(fields | kw))


def _states_only(num_params: int, num_blocks: int = 1) -> ModelProfile:
    blocks = tuple(_segment(f"layers.{i}", num_params // num_blocks) for i in range(num_blocks))
    return ModelProfile(name="psi", precision="bf16-mixed", batch_size=1, seq_len=None, embed=_segment("embed"),
                        blocks=blocks, head=_segment("head"), block_container="layers")


@pytest.mark.parametrize("zero, expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_table_1(zero, expected_gb):
    """Rajbhandari et al. 2020, Table 1: Ψ = 7.5B, Nd = 64, mixed-precision Adam (K = 12)."""
    profile = _states_only(7_500_000_000)
    plan = Plan(dp_shard=64, zero=zero) if zero else Plan(dp_replicate=64)
    memory = estimate_memory(profile, Workload(global_batch_size=64), plan, runtime="deepspeed")
    states = memory.parameters + memory.gradients + memory.optimizer
    assert states / 1e9 == pytest.approx(expected_gb, rel=0.01)


def test_torch_layout_keeps_fp32_weights_and_grads_under_autocast():
    assert state_layout("bf16-mixed", "adamw") == StateLayout(weights=4, grads=4, optimizer=8, step_temporaries=4)
    assert state_layout("bf16-true", "adamw") == StateLayout(weights=2, grads=2, optimizer=4, step_temporaries=2)
    assert state_layout("fp32", "sgd") == StateLayout(weights=4, grads=4, optimizer=4)
    assert state_layout("bf16-mixed", "adamw", runtime="deepspeed") == StateLayout(
        weights=2, grads=2, optimizer=12, zero2_shards_weights=False, frees_gradients=False)


@pytest.fixture(scope="module")
def gpt_block():
    """A GPT block (h=768, a=12) with attention written out and dropout, in 16-bit, s=256, b=2."""
    config = dataclasses.replace(get_preset("gpt2").config, attention="explicit", dropout=0.1, n_layers=2)
    with torch.device("meta"):
        model = Transformer(config)
    tokens = torch.zeros(2, 256, dtype=torch.long)
    profile = profile_model(model, (tokens,), loss_fn=lambda out: out.float().mean(), precision="bf16-true")
    return profile.blocks[0]


S, B, H, A = 256, 2, 768, 12


@pytest.mark.parametrize("plan, formula", [
    # Korthikanti et al. 2022: eq. 1 (no parallelism), eq. 2 (TP), eq. 4 (TP + SP), eq. 5 (full recompute);
    # eq. 4 as torch runs SP: the attention's and the MLP's all-gathered inputs (2·sbh each) kept whole
    (Plan(), S * B * H * (34 + 5 * A * S / H)),
    (Plan(tp=4, dp_replicate=1), S * B * H * (10 + 24 / 4 + 5 * A * S / (H * 4))),
    (Plan(tp=4, sequence_parallel=True), S * B * H * (4 + (34 - 4 + 5 * A * S / H) / 4)),
    (Plan(activation_checkpointing="full"), 2 * S * B * H),
    # The plugin's policies, as the profile measures them (not eq. 4's attention-core recompute):
    # the block's input and its Linears' outputs (q, k, v, wo, w1, w2: 1+1+1+1+4+1 widths, 16-bit);
    # selective-op every second of them (q, v, w1) and no attention kernel (explicit attention).
    (Plan(activation_checkpointing="selective", tp=4, sequence_parallel=True), S * B * H / 4 * 2 * (1 + 9)),
    (Plan(activation_checkpointing="selective-op", tp=4, sequence_parallel=True), S * B * H / 4 * 2 * (1 + 6)),
], ids=["none", "tp", "tp+sp", "full", "selective+tp+sp", "selective-op+tp+sp"])
def test_korthikanti_activation_memory_per_layer(gpt_block, plan, formula):
    assert estimate_block_activations(gpt_block, plan, scale=1.0) == pytest.approx(formula, rel=0.05)


def test_what_tp_leaves_whole_is_measured_at_eq_2s_share(gpt_block):
    """Korthikanti et al.'s eq. 2 keeps 10·sbh of their GPT block whole on every TP rank (the norms'
    inputs, the attention's and the MLP's, two one-byte dropout masks): the profile measures it by
    splitting the block, not by taking the share from the paper. Of it, sequence parallelism
    gathers the attention's and the MLP's inputs, 4·sbh, which torch keeps gathered for backward
    (Megatron-LM keeps the shards and gathers them again)."""
    assert gpt_block.tp_replicated_bytes == pytest.approx(10 * S * B * H, rel=0.03)
    assert gpt_block.tp_gathered_bytes == 4 * S * B * H


def test_in_flight_microbatches_per_schedule():
    assert in_flight_microbatches(Plan(pp=4, microbatches=8, pp_schedule="gpipe")) == 8
    assert in_flight_microbatches(Plan(pp=4, microbatches=8)) == 4
    interleaved = Plan(pp=4, microbatches=8, pp_schedule="interleaved-1f1b", pp_virtual=2)
    assert in_flight_microbatches(interleaved) == pytest.approx(4 * (1 + 3 / 8))


def test_activations_scale_with_micro_batch_and_split_over_pipeline_stages():
    profile = _states_only(1000, num_blocks=8)
    profile = dataclasses.replace(profile, batch_size=2, blocks=tuple(
        dataclasses.replace(b, saved_bytes=1000, input_bytes=100) for b in profile.blocks))
    base = estimate_activations(rank_view(profile, Plan(micro_batch_size=2)))
    assert base == 8 * 1000
    assert estimate_activations(rank_view(profile, Plan(micro_batch_size=4))) == 2 * base
    # 1F1B on 4 stages: the first holds 2 blocks × 4 micro-batches in flight = the whole model's.
    assert estimate_activations(rank_view(profile, Plan(pp=4, microbatches=8, micro_batch_size=2))) == base
    assert estimate_activations(rank_view(profile, Plan(pp=4, microbatches=8, micro_batch_size=2, pp_schedule="gpipe"))) == 2 * base


def test_blocks_the_model_checkpoints_itself_are_rebuilt_one_at_a_time_in_backward():
    """A model that checkpoints its own blocks keeps their inputs through the forward, and its
    backward rebuilds one block at a time (``rebuilt_bytes``, measured by
    stratagem/advisor/profile/own_checkpoints.py): the largest counts beside every kept input.
    Under the plan's full checkpointing as well, its recompute rebuilds the block's input (all the
    model's own checkpoint keeps of it) and then the model's own checkpoint the rest."""
    profile = _states_only(1000, num_blocks=8)
    profile = dataclasses.replace(profile, batch_size=2, blocks=tuple(
        dataclasses.replace(b, saved_bytes=100, input_bytes=100, rebuilt_bytes=900 + i)
        for i, b in enumerate(profile.blocks)))
    assert estimate_activations(rank_view(profile, Plan(micro_batch_size=2))) == 8 * 100 + 907
    assert estimate_activations(rank_view(profile, Plan(micro_batch_size=4))) == 2 * (8 * 100 + 907)
    full = Plan(micro_batch_size=2, activation_checkpointing="full")
    assert estimate_activations(rank_view(profile, full)) == 8 * 100 + 100 + 907


def test_autocast_holds_the_forward_s_weight_copies_to_its_end_though_a_checkpoint_drops_them():
    """Measured with MemTracker (bench/own_checkpoint_peak.py): a model that checkpoints its own
    blocks under autocast holds every weight copy its forward made in autocast's cache through the
    loss's forward, though no block saves one; the loss's backward meets those the head saved."""
    profile = _states_only(1000, num_blocks=2)
    blocks = tuple(dataclasses.replace(b, saved_bytes=100, input_bytes=100, rebuilt_bytes=900,
                                       forward_param_copy_bytes=5000) for b in profile.blocks)
    head = dataclasses.replace(profile.head, saved_bytes=2000, output_bytes=5000, bwd_largest_output_bytes=10_000,
                               saved_param_copy_bytes=300, forward_param_copy_bytes=300)
    memory = estimate_memory(dataclasses.replace(profile, blocks=blocks, head=head), Workload(global_batch_size=1),
                             Plan())
    assert (memory.activations, memory.buffers) == (2 * 100 + 2000 + 10_000 + 5000, 2 * 5000 + 300)


def test_the_backward_rebuilds_the_last_block_first_and_holds_the_first_to_its_end():
    """Under full checkpointing the backward rebuilds the rank's last block first, beside every
    kept input, and its first block last, beside every gradient: a convolutional network's blocks
    shrink with its images (bench/fake_parallel_peak.py's ResNet-50 ``single ckpt=full`` at 64
    images: +14.0 % over abc8e0c, which priced its first block rebuilt beside every kept input)."""
    profile = _states_only(0, num_blocks=3)
    blocks = tuple(dataclasses.replace(b, saved_bytes=saved, input_bytes=100)
                   for b, saved in zip(profile.blocks, (4000, 1000, 1000)))
    view = rank_view(dataclasses.replace(profile, blocks=blocks), Plan(activation_checkpointing="full"))
    activations = rank_activations(view)
    assert (activations.first.rebuilt, activations.last.rebuilt, activations.rebuilt) == (1000, 4000, 4000)
    memory = estimate_memory(dataclasses.replace(profile, blocks=blocks), Workload(global_batch_size=1),
                             Plan(activation_checkpointing="full"))
    assert memory.activations == 100 + 4000  # the first block, rebuilt last: its input and its own (not 3 * 100 + …)


def test_a_block_s_backward_holds_its_activations_gradients_beside_what_it_kept_and_rebuilt():
    """Measured with MemTracker (bench/fake_parallel_peak.py's ViT-S/16 ``single ckpt=full`` at 64
    images: -9.9 % over abc8e0c, +3.2 % with it): as a block's backward runs it holds the gradients of its
    activations (``bwd_held_bytes``) beside all it kept and rebuilt, the first block it reaches
    beside every kept input, the last beside every gradient and what the embedding keeps (a
    stem's widest images), which its own backward frees after the blocks'."""
    profile = _states_only(0, num_blocks=3)
    blocks = tuple(dataclasses.replace(b, saved_bytes=saved, input_bytes=100, bwd_held_bytes=held)
                   for b, saved, held in zip(profile.blocks, (4000, 1000, 1000), (2000, 10, 10)))
    profile = dataclasses.replace(profile, blocks=blocks, embed=dataclasses.replace(profile.embed, saved_bytes=5000))
    workload = Workload(global_batch_size=1)
    assert estimate_memory(profile, workload, Plan()).activations == 5000 + 6000 + 10  # the first block reached
    full = estimate_memory(profile, workload, Plan(activation_checkpointing="full"))
    assert full.activations == 5000 + 100 + 4000 + 2000  # the last: the embedding's, its input, rebuilt, held


def test_a_full_checkpoint_s_rerun_holds_what_the_forward_held_beside_the_output_s_gradient():
    """Measured with MemTracker (bench/fake_parallel_peak.py's ResNet-50 ``single ckpt=full`` at 64
    images: -9.5 % without it): a rerun at its fullest holds what the block's forward holds beyond
    what it saves (``fwd_held_bytes``: a bottleneck's branches and their sum at its last ReLU) with
    the gradient of the block's output waiting, where more than its backward holds; not where the
    block is compiled, whose kernels keep those intermediates, nor without full checkpointing. The
    rerun saves the input the block saves itself (``input_saved_bytes``) from what the checkpoint
    kept: counted once (ViT-S/16 ``ckpt=full`` there +3.2 % at 442a1e3, counted twice; -0.5 % at 060aa73)."""
    profile = _states_only(0, num_blocks=3)
    blocks = tuple(dataclasses.replace(b, saved_bytes=saved, input_bytes=100, input_saved_bytes=100, output_bytes=400,
                                       bwd_held_bytes=500, fwd_held_bytes=held, compiled_saved_bytes=saved)
                   for b, saved, held in zip(profile.blocks, (4000, 1000, 1000), (3000, 10, 10)))
    profile = dataclasses.replace(profile, blocks=blocks, embed=dataclasses.replace(profile.embed, saved_bytes=5000))
    workload = Workload(global_batch_size=1)
    full = estimate_memory(profile, workload, Plan(activation_checkpointing="full"))
    assert full.activations == 5000 + 4000 + 3000 + 400  # the first block's rerun (its input in it), its gradient
    compiled = estimate_memory(profile, workload, Plan(activation_checkpointing="full", compile=True))
    assert compiled.activations == 5000 + 4000 + 500  # its backward's gradients
    assert estimate_memory(profile, workload, Plan()).activations == 5000 + 6000 + 500


def test_a_checkpointed_backward_holds_the_weight_copies_of_the_block_it_recomputes_and_the_embedding_s():
    """Measured with MemTracker (bench/fake_parallel_peak.py's ResNet-50 ``single ckpt=full`` at 64
    images: +1.0 % while every block moment held the largest block's copies and the head's): under
    checkpointing each block's backward holds, of autocast's weight copies, those its recompute
    makes and the embedding's; the head's are freed once its backward has run."""
    profile = _states_only(0, num_blocks=3)
    blocks = tuple(dataclasses.replace(b, saved_param_copy_bytes=copies)
                   for b, copies in zip(profile.blocks, (10, 40, 5000)))
    embed, head = (dataclasses.replace(segment, saved_param_copy_bytes=copies)
                   for segment, copies in ((profile.embed, 7), (profile.head, 300)))
    profile = dataclasses.replace(profile, blocks=blocks, embed=embed, head=head)
    transient = estimate_buffers(rank_view(profile, Plan(activation_checkpointing="full")), 0.0)
    assert (transient.head, transient.first_block, transient.last_block, transient.embedding) == (307, 5007, 17, 7)


def test_where_blocks_differ_the_backward_can_peak_between_the_rank_s_first_and_last_block():
    """Measured with MemTracker (bench/fake_parallel_peak.py's ResNet-101 ``single ckpt=full`` at 32
    images, -0.0 %; -1.9 % with only the first and last blocks' moments, the case run through the
    bench's functions at d0f6aea, before it joined the bench): the backward frees one block's
    activations and makes its gradients as it goes, and where the last blocks have the weights and
    the first the activations, as a convolutional network's stages, the fullest moment lies
    between: here at the third block, beside the last one's gradients and what the three keep."""
    profile = _states_only(0, num_blocks=4)
    blocks = tuple(dataclasses.replace(b, num_params=params, saved_bytes=saved, input_bytes=10)
                   for b, params, saved in zip(profile.blocks, (0, 0, 0, 10_000), (1000, 1000, 100, 10)))
    workload = Workload(global_batch_size=1, optimizer="sgd")
    memory = estimate_memory(dataclasses.replace(profile, blocks=blocks), workload, Plan())
    assert (memory.gradients, memory.activations) == (4 * 10_000, 1000 + 1000 + 100)


def test_interleaving_keeps_korthikanti_s_share_of_layers():
    profile = _states_only(1000, num_blocks=8)
    profile = dataclasses.replace(profile, batch_size=1, blocks=tuple(
        dataclasses.replace(b, saved_bytes=1000, input_bytes=100) for b in profile.blocks))
    plan = Plan(pp=4, microbatches=8, pp_schedule="interleaved-1f1b", pp_virtual=2)
    # §4.2.3: the first stage holds L·(1 + (p−1)/(p·v)) layers' activations, L = 8 layers.
    assert estimate_activations(rank_view(profile, plan)) == pytest.approx(8 * 1000 * (1 + 3 / 8))


@pytest.mark.parametrize("runtime, optimizer", [("torch", "adamw"), ("deepspeed", "sgd")])
def test_memory_costed_once_per_layout_equals_each_plan_costed_afresh(runtime, optimizer):
    """estimate_memory reuses model states across the plans of a layout and activations across
    plans that agree on what activations depend on; every searched plan's breakdown equals its
    candidate ranks costed afresh (estimate_rank_memory caches nothing)."""
    profile = profile_spec("llama-2-7b", seq_len=2048)
    workload = Workload(global_batch_size=64, seq_len=2048, optimizer=optimizer)
    plans = [p for group in search_plans(profile, parse_cluster("2x4xA100-SXM4-80GB:ib-hdr"), workload) for p in group]
    layout = state_layout(workload.precision, optimizer, runtime=runtime)
    assert len(plans) > 1000 and any(len(candidate_ranks(profile, p)) > 1 for p in plans)
    for plan in plans:
        afresh = (estimate_rank_memory(profile, plan, layout, rank=r) for r in candidate_ranks(profile, plan))
        assert estimate_memory(profile, workload, plan, runtime=runtime) == max(afresh, key=lambda m: (m.total, m.host))


def _with_root(profile: ModelProfile, *, embed: int, head: int) -> ModelProfile:
    return dataclasses.replace(profile, embed=_segment("embed", embed), head=_segment("head", head))


def test_gradients_and_activations_meet_only_when_forwards_run_into_gradients():
    """Gradients are None through the forward and come as backward frees activations: the peak
    holds the larger; with accumulation it holds both, and on a pipeline rank that runs a forward
    after its first backward."""
    profile = _states_only(1000, num_blocks=2)
    profile = dataclasses.replace(profile, batch_size=1, precision="fp32", blocks=tuple(
        dataclasses.replace(b, saved_bytes=6000) for b in profile.blocks))
    workload = Workload(global_batch_size=2, precision="fp32")
    alone = estimate_memory(profile, workload, Plan(precision="fp32"))
    assert (alone.activations, alone.gradients) == (12000, 0)
    accumulating = estimate_memory(profile, workload, Plan(precision="fp32", grad_accum=2))
    assert (accumulating.activations, accumulating.gradients) == (12000, 4000)
    # Per stage: one block, 500 parameters (2000 bytes of gradients), 6000 bytes a micro-batch.
    layout = state_layout("fp32", "adamw")

    def rank(schedule: str, microbatches: int, index: int) -> tuple[float, float]:
        plan = Plan(precision="fp32", pp=2, microbatches=microbatches, pp_schedule=schedule)
        memory = estimate_rank_memory(profile, plan, layout, rank=index)
        return memory.activations, memory.gradients

    assert rank("1f1b", 4, 0) == (12000, 2000)  # two in flight when its third forward runs into gradients
    assert rank("1f1b", 2, 1) == (6000, 2000)  # the last stage: f0 b0 f1 b1
    # Every forward before the first backward: the gradients come as that micro-batch's activations go,
    # the others' held through it (3 × 6000 + 2000 < 4 × 6000: the peak is the loss's moment)
    assert rank("1f1b", 2, 0) == (12000, 0) and rank("gpipe", 4, 0) == (24000, 0)
    kept = estimate_memory(profile, workload, Plan(precision="fp32"), runtime="deepspeed")  # its own buffers
    assert kept.gradients > 0 and kept.activations == 12000


def test_the_optimizer_step_peaks_with_foreach_adamw_s_temporaries():
    """torch.optim's foreach AdamW (its GPU default) holds one state's bytes per parameter beside
    the states at its step: 20 bytes per fp32 parameter (bench/fake_peak.py's MemTracker count),
    none on CPU ranks (one tensor at a time) or for SGD. Where activations are few, that is the
    peak; DDP's buckets outlive the backward, FSDP's gathered units do not."""
    profile = dataclasses.replace(_states_only(1000, num_blocks=2), precision="fp32", batch_size=1)
    workload = Workload(global_batch_size=1, precision="fp32")
    adamw = estimate_memory(profile, workload, Plan(precision="fp32"))
    assert (adamw.optimizer, adamw.total) == (8000 + 4000, 20 * 1000)
    cpu = estimate_memory(dataclasses.replace(profile, kernels="cpu"), workload, Plan(precision="fp32"))
    assert cpu.total == 16 * 1000
    sgd = Workload(global_batch_size=1, precision="fp32", optimizer="sgd")
    assert estimate_memory(profile, sgd, Plan(precision="fp32")).total == 12 * 1000
    workload = Workload(global_batch_size=4, precision="fp32")
    ddp = estimate_memory(profile, workload, Plan(dp_replicate=4, precision="fp32"))
    assert (ddp.optimizer, ddp.buffers) == (8000 + 4000, 4000)  # the buckets stay
    blocks = dataclasses.replace(_states_only(1000, num_blocks=100), precision="fp32", batch_size=1)
    fsdp = estimate_memory(blocks, workload, Plan(dp_shard=4, zero=3, precision="fp32", block_container="layers"))
    assert (fsdp.optimizer, fsdp.buffers) == ((8000 + 4000) / 4, 0)  # the shard's temporaries; nothing gathered


def test_adamw_one_tensor_at_a_time_holds_two_states_of_the_largest_tensor_it_steps():
    """On CPU ranks torch.optim steps one tensor at a time; AdamW's denominator holds the square root
    of ``exp_avg_sq`` and its quotient at once: two states' bytes of the tensor it steps, the
    largest deciding (MemTracker on fake tensors, bench/fake_parallel_peak.py: GPT-2 large
    ``single ckpt=full``, stepped so, 12.01 GiB predicted and counted; 11.79 predicted without
    them). FSDP shards each tensor, ZeRO-1 steps whole ones, TP splits the blocks'; SGD's momentum
    step is in place."""
    blocks = tuple(_segment(f"layers.{i}", 2000, largest_tensor_params=600) for i in range(2))
    profile = ModelProfile(name="psi", precision="fp32", batch_size=1, seq_len=None, kernels="cpu",
                           embed=_segment("embed", 1000, largest_tensor_params=1000), blocks=blocks,
                           head=_segment("head"), block_container="layers")

    def step_bytes(plan: Plan, optimizer: str = "adamw") -> float:
        view = rank_view(profile, plan)
        return estimate_step_bytes(view, estimate_params_per_rank(view), state_layout("fp32", optimizer),
                                   on_gpu=False)[0]

    assert step_bytes(Plan(precision="fp32")) == 2 * 4 * 1000
    assert estimate_memory(profile, Workload(global_batch_size=1, precision="fp32"),
                           Plan(precision="fp32")).total == 16 * 5000 + 2 * 4 * 1000
    assert step_bytes(Plan(dp_shard=4, zero=3, precision="fp32", block_container="layers")) == 2 * 4 * 1000 / 4
    assert step_bytes(Plan(dp_shard=4, zero=1, precision="fp32")) == 2 * 4 * 1000
    assert step_bytes(Plan(tp=4, precision="fp32")) == 2 * 4 * 1000  # the embedding's table stays whole
    assert step_bytes(Plan(tp=2, dp_replicate=2, precision="fp32"), "sgd") == 0
    small_table = dataclasses.replace(profile, embed=_segment("embed", 1000, largest_tensor_params=100))
    view = rank_view(small_table, Plan(tp=4, precision="fp32"))
    assert largest_stepped_tensor(view) == 600 / 4  # a block's Linear, split


def test_tp_splits_the_blocks_and_keeps_the_embedding_and_head_whole():
    profile = _with_root(_states_only(8000, num_blocks=2), embed=1000, head=1000)
    memory = estimate_memory(profile, Workload(global_batch_size=1), Plan(tp=4))
    assert memory.parameters == 4 * (8000 / 4 + 2000)


def test_fsdp_gathers_units_moment_by_moment_and_ddp_keeps_a_copy_of_every_gradient():
    """Measured with MemTracker on rank 0 of a fake 8-rank group (bench/fake_parallel_peak.py,
    Llama 3 8B fsdp8): the loss ran with nothing gathered and the last block's backward held the
    root and that block gathered beside the sharded weights, as ``reshard_after_forward=True`` on
    the root too has it. Moments: forward's end, loss, head, first block, last block, embedding."""
    profile = _with_root(_states_only(8000, num_blocks=4), embed=1000, head=3000)  # blocks of 2000
    root, block = 4 * 4000, 4 * 2000

    def transient(plan: Plan, model: ModelProfile = profile) -> Transient:
        view = rank_view(model, plan)
        return estimate_buffers(view, estimate_params_per_rank(view))

    zero3 = Plan(dp_shard=4, zero=3, precision="fp32", block_container="layers")
    assert transient(zero3) == (root, 0, root + block, root + 2 * block, root + block, root)
    in_forward = dataclasses.replace(profile, loss_in_forward=True)  # the root's backward gathers before the loss
    assert transient(zero3, in_forward) == (root, root + block, root + block, root + 2 * block, root + block, root)
    every = 4 * 12000
    zero2 = Plan(dp_shard=4, zero=2, precision="fp32", block_container="layers")
    assert transient(zero2) == (every, every, every, every, root + block, root)  # freed after their backward
    assert transient(Plan(dp_replicate=4, precision="fp32")) == Transient.constant(every)
    assert transient(Plan(dp_shard=4, zero=3, precision="fp32")) == Transient.constant(every)  # one unit
    zero2_memory = estimate_memory(profile, Workload(global_batch_size=4, precision="fp32"), zero2)
    assert zero2_memory.parameters == 4 * 12000 / 4  # shards kept
    assert estimate_memory(profile, Workload(global_batch_size=1), Plan(precision="fp32")).buffers == 0


def _zero3_with_logits(*, embed: int, head: int, logits: int) -> tuple[ModelProfile, Workload, Plan]:
    """Four blocks of 2000 parameters keeping 1000 bytes each, the root's ``embed`` and ``head``
    parameters, a head keeping 500 bytes and writing ``logits`` bytes; fp32 ZeRO-3 over 4 ranks."""
    profile = _with_root(_states_only(8000, num_blocks=4), embed=embed, head=head)
    blocks = tuple(dataclasses.replace(b, saved_bytes=1000) for b in profile.blocks)
    head_kept = dataclasses.replace(profile.head, saved_bytes=500, output_bytes=logits, bwd_largest_output_bytes=logits)
    profile = dataclasses.replace(profile, batch_size=1, precision="fp32", head=head_kept, blocks=blocks)
    return (profile, Workload(global_batch_size=4, precision="fp32"),
            Plan(dp_shard=4, zero=3, precision="fp32", block_container="layers"))


def test_the_loss_under_fsdp_meets_no_gathered_unit_unless_the_forward_computes_it():
    """A head whose loss gradients are the largest tensors peaks at the loss: under ZeRO-3 nothing
    is gathered then, unless the model's forward computes the loss (the root gathered again, with
    the last block prefetched, before the loss's backward)."""
    profile, workload, plan = _zero3_with_logits(embed=1000, head=3000, logits=200_000)
    outside = estimate_memory(profile, workload, plan)
    assert (outside.activations, outside.buffers, outside.gradients) == (4500 + 2 * 200_000, 0, 0)
    inside = estimate_memory(dataclasses.replace(profile, loss_in_forward=True), workload, plan)
    assert (inside.activations, inside.buffers) == (outside.activations, 4 * (4000 + 2000))
    # accumulating, the earlier micro-batch's reduced (sharded) gradients are there too, and only they
    accumulating = estimate_memory(profile, Workload(global_batch_size=8, precision="fp32"),
                                   dataclasses.replace(plan, grad_accum=2))
    assert (accumulating.activations, accumulating.buffers, accumulating.gradients) == (4500 + 2 * 200_000, 0,
                                                                                        4 * 12000 / 4)


def test_the_head_s_backward_starts_with_the_root_gathered_again_and_gloo_gathers_and_reduces_through_copies():
    """Under ZeRO-3 the root is gathered again, the last block prefetched, when the head's output
    gradient arrives, the loss's backward done: with a large root and logits a little smaller,
    that moment is the peak. Gloo's all-gather holds its output twice while it runs, its
    reduce-scatter its input (bench/gloo_collective_memory.py): on CPU ranks the moment holds the
    root twice (its own gather) and every unit's reduce-scatter copies its gradients twice."""
    profile, workload, plan = _zero3_with_logits(embed=5000, head=100, logits=26_000)
    root, block = 4 * 5100, 4 * 2000
    gpus = estimate_memory(profile, workload, plan, cluster=parse_cluster("4xH100-SXM-80GB"))
    assert (gpus.activations, gpus.buffers, gpus.gradients) == (4500 + 26_000, root + block, 0)
    cpus = estimate_memory(profile, workload, plan, cluster=parse_cluster("4xcpu"))
    assert (cpus.activations, cpus.buffers, cpus.gradients) == (4500 + 26_000, 2 * root, 0)
    view = rank_view(profile.computed_by(plan), plan, 0)
    layout = state_layout("fp32", "adamw")
    assert estimate_unsharded_gradients(view, layout, collectives_copy=True) == (4 * 100, block, 2 * block)


def test_the_backward_ends_reducing_the_root_unit_through_a_copy_before_its_shard_exists():
    """FSDP2 reduces the root unit (embedding and head) last, its parameters resharded first: its
    gradients unsharded and their copy in the reduce dtype beside every other unit's shard, its own
    not made yet (bench/fake_parallel_peak.py, Llama 3 8B fsdp8 ckpt=full: exactly this, 20.34 GiB).
    Gloo copies the reduce-scatter's input again; an earlier micro-batch's reduction made the shard."""
    profile, workload, plan = _zero3_with_logits(embed=11_900, head=100, logits=0)
    root, every, shard = 12_000, 4 * 20_000 / 4, 4 * 12_000 / 4
    view = rank_view(profile.computed_by(plan), plan, 0)
    assert estimate_root_reduce(view, state_layout("fp32", "adamw")) == (root * (4 + 4), shard)
    gpus = estimate_memory(profile, workload, plan, cluster=parse_cluster("4xH100-SXM-80GB"))
    assert (gpus.gradients, gpus.activations, gpus.buffers) == (every - shard + root * (4 + 4), 0, 0)
    cpus = estimate_memory(profile, workload, plan, cluster=parse_cluster("4xcpu"))
    assert cpus.gradients == every - shard + root * (4 + 2 * 4)
    accumulating = estimate_memory(profile, Workload(global_batch_size=8, precision="fp32"),
                                   dataclasses.replace(plan, grad_accum=2))
    assert accumulating.gradients == every + root * (4 + 4)
    offloaded = dataclasses.replace(plan, offload="params")  # the shards go to the host: none to subtract
    assert estimate_root_reduce(rank_view(profile.computed_by(offloaded), offloaded, 0),
                                state_layout("fp32", "adamw")) == (root * (4 + 4), 0.0)
    assert estimate_memory(profile, workload, offloaded).gradients == root * (4 + 4)


def test_fsdp_backward_holds_the_head_s_and_a_unit_s_unsharded_gradients():
    """FSDP2 reduces the root (the head's gradients) last and a block unit's gradients through a
    copy: the first block's backward holds both beside the activations but the head's."""
    profile = _with_root(_states_only(8000, num_blocks=4), embed=1000, head=3000)  # blocks of 2000
    blocks = tuple(dataclasses.replace(b, saved_bytes=10_000) for b in profile.blocks)
    profile = dataclasses.replace(profile, batch_size=1, precision="fp32",
                                  head=dataclasses.replace(profile.head, saved_bytes=500), blocks=blocks)
    workload = Workload(global_batch_size=4, precision="fp32")
    zero3 = estimate_memory(profile, workload, Plan(dp_shard=4, zero=3, precision="fp32", block_container="layers"))
    # head 3000 + 2 units of 2000 params, fp32; the head's 500 activation bytes freed and one block's
    # activations going as its unit's gradients come (the smaller of 10 000 and 8000 bytes)
    assert (zero3.gradients, zero3.activations) == (4 * (3000 + 2 * 2000), 40_500 - 500 - 8000)
    ddp = estimate_memory(profile, workload, Plan(dp_replicate=4, precision="fp32"))
    assert (ddp.gradients, ddp.activations) == (4 * 12000, 0)  # the backward's end: every gradient, no activation


def test_fsdp_s_unsharded_gradients_come_in_the_gathered_dtype_and_reduce_through_an_fp32_copy():
    """Under bf16-mixed FSDP2 gathers bf16 parameters, so autograd makes their gradients in bf16;
    ``foreach_reduce`` copies a unit's into one fp32 buffer before freeing them: the head's held
    2 bytes a parameter, the unit's 2 + 4 (both were 4 bytes a parameter until 2026-11-28)."""
    profile = _with_root(_states_only(8000, num_blocks=4), embed=1000, head=3000)  # blocks of 2000
    plan = Plan(dp_shard=4, zero=3, precision="bf16-mixed", block_container="layers")
    view = rank_view(profile.computed_by(plan), plan, 0)
    held, unit, copy = estimate_unsharded_gradients(view, state_layout("bf16-mixed", "adamw"))
    assert (held, unit, copy) == (2 * 3000, 2 * 2000, 4 * 2000)


def test_fsdp_under_a_pipeline_holds_the_stage_gathered_and_its_gradients_unsharded():
    """torch's pipeline schedule keeps every FSDP unit gathered after its backward and reduces the
    gradients only after the last micro-batch: the whole stage's weights and gradients, beside the
    sharded states. A model FSDP wraps as one unit reduces all its gradients through one copy."""
    profile = _with_root(_states_only(8000, num_blocks=4), embed=1000, head=3000)  # blocks of 2000
    plan = Plan(pp=2, dp_shard=2, zero=3, microbatches=2, precision="fp32", block_container="layers")
    last = estimate_rank_memory(profile, plan, state_layout("fp32", "adamw"), rank=1)  # 2 blocks and the head
    assert (last.buffers, last.gradients) == (4 * 7000, 4 * 7000 / 2 + 4 * 7000)
    one_unit = estimate_memory(profile, Workload(global_batch_size=4, precision="fp32"),
                               Plan(dp_shard=4, zero=3, precision="fp32"))
    assert (one_unit.buffers, one_unit.gradients) == (4 * 12000, 4 * 12000 / 4 + 2 * 4 * 12000)


def test_the_loss_gradients_are_as_wide_as_the_loss_computes_them():
    """Under autocast the logits leave the head in bf16 and the loss upcasts them: its two
    gradients are the fp32 one the head's backward wrote (measured on an H200: GPT-2 at 16 × 1024
    tokens peaked at 2 × 3.07 GiB beyond its saved activations, not 2 × 1.53)."""
    profile = _states_only(1000, num_blocks=2)
    blocks = tuple(dataclasses.replace(b, saved_bytes=3000, output_bytes=100) for b in profile.blocks)
    head = dataclasses.replace(profile.head, output_bytes=5000, bwd_largest_output_bytes=10000)
    profile = dataclasses.replace(profile, blocks=blocks, head=head)
    memory = estimate_memory(profile, Workload(global_batch_size=2), Plan(micro_batch_size=2))
    assert memory.activations == 2 * (6000 + 2 * 10000)


def test_the_loss_backward_holds_two_logit_gradients_and_pipeline_stages_keep_their_outputs():
    """Cross-entropy's backward makes the gradients of the log-softmax's output and input, each
    the logits' size, beside every activation; a pipeline stage keeps each in-flight
    micro-batch's output until its backward."""
    profile = _states_only(1000, num_blocks=2)
    blocks = tuple(dataclasses.replace(b, saved_bytes=3000, output_bytes=100) for b in profile.blocks)
    profile = dataclasses.replace(profile, batch_size=1, precision="fp32", blocks=blocks,
                                  head=dataclasses.replace(profile.head, output_bytes=5000))
    workload = Workload(global_batch_size=2, precision="fp32")
    alone = estimate_memory(profile, workload, Plan(precision="fp32", micro_batch_size=2))
    assert (alone.gradients, alone.activations) == (0, 2 * (6000 + 2 * 5000))
    piped = Plan(precision="fp32", pp=2, microbatches=2, pp_schedule="gpipe", block_container="layers")
    last = estimate_rank_memory(profile, piped, state_layout("fp32", "adamw"), rank=1)
    assert last.activations == 2 * 3000 + 2 * 5000 + 2 * 5000  # two micro-batches' saved and logits, the loss's two


def test_checkpointed_blocks_keep_neither_a_rebuilt_block_nor_weight_copies_to_the_loss():
    """Measured with MemTracker (bench/fake_parallel_peak.py, one H100-shaped rank): under
    checkpointing the loss's backward meets no rebuilt block (none is rebuilt before the backward
    reaches it) and, of autocast's weight copies, only those outside the blocks (a checkpointed
    block saves none; autocast's cache empties as the forward's region ends); the forward's end
    holds every copy and the logits the loss computes from, as the head made them and widened."""
    profile = _states_only(1000, num_blocks=2)
    blocks = tuple(dataclasses.replace(b, saved_bytes=3000, input_bytes=100, saved_param_copy_bytes=500)
                   for b in profile.blocks)
    head = dataclasses.replace(profile.head, saved_bytes=2000, output_bytes=5000, bwd_largest_output_bytes=10_000,
                               saved_param_copy_bytes=300)
    profile = dataclasses.replace(profile, blocks=blocks, head=head)
    workload = Workload(global_batch_size=1)
    memory = estimate_memory(profile, workload, Plan(activation_checkpointing="full"))
    assert (memory.activations, memory.buffers) == (2 * 100 + 2000 + 2 * 10_000, 300)  # the loss's backward
    plain = estimate_memory(profile, workload, Plan())
    assert plain.buffers == 2 * 500 + 300  # without checkpointing the backward keeps every copy
    copied = tuple(dataclasses.replace(b, saved_param_copy_bytes=5000) for b in blocks)
    forward = estimate_memory(dataclasses.replace(profile, blocks=copied), workload,
                              Plan(activation_checkpointing="full"))
    assert (forward.activations, forward.buffers) == (2 * 100 + 2000 + 10_000 + 5000, 2 * 5000 + 300)
