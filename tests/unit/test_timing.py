"""The step-time model: each term against hand-worked numbers on a made-up profile, and the
whole against plausible bands on real presets."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from stratagem.advisor.cost import communication, compute, rates
from stratagem.advisor.cost import host as host_terms
from stratagem.advisor.cost import optimizer as optimizer_terms
from stratagem.advisor.cost.collectives import (
    estimate_all_gather_seconds,
    estimate_all_reduce_seconds,
    estimate_p2p_seconds,
)
from stratagem.advisor.cost.estimate import TimeBreakdown
from stratagem.advisor.hardware import Cluster, HostSpec, parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Plan, Workload
from stratagem.advisor.profile.profiler import ModelProfile, SegmentProfile
from stratagem.advisor.profile.structure import LinearLayer
from stratagem.advisor.cost.pace import pace
from stratagem.advisor.cost.pipeline import bubble_lost_share
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.cost.timing import estimate_time, mfu, tokens_per_second
from stratagem.errors import UsageError

# The catalog's H100 without its SM count: its GEMMs run at the flat achievable fraction whatever
# their shape, so that these tests check the other terms (test_gemm_shapes.py checks the shapes').
H100 = parse_cluster("1x8xH100")
H100 = dataclasses.replace(H100, node=dataclasses.replace(H100.node, device=dataclasses.replace(
    H100.device, num_sms=None, matmul_fraction=None)))
H100_ACHIEVED = 989e12 * rates.ACHIEVABLE_FLOPS_FRACTION["gpu"]
SEQ = 1024
WIDTH = 512


def _segment(name: str, *, params: int = 0, fwd: int = 0, attention: int = 0,
             output_bytes: int = 0, width: int | None = None) -> SegmentProfile:
    linear = LinearLayer(name="proj", in_features=width or 0, out_features=width or 0, bias=False)
    linears = (linear,) if width else ()
    return SegmentProfile(name=name, kind=name, num_params=params, param_bytes=4 * params,
                          buffer_bytes=0, fwd_flops=fwd, bwd_flops=2 * fwd, saved_bytes=0,
                          saved_param_copy_bytes=0, attention_fwd_flops=attention,
                          attention_saved_bytes=0, input_bytes=output_bytes,
                          output_bytes=output_bytes, linears=linears)


def _toy(num_blocks: int = 8) -> ModelProfile:
    """Blocks of 1e6 params, 1e12 forward FLOPs (a quarter of it attention), fp32 outputs;
    an embedding without FLOPs and a head with 2e12 forward FLOPs; profiled at batch 1."""
    block = _segment("block", params=10**6, fwd=10**12, attention=25 * 10**10,
                     output_bytes=SEQ * WIDTH * 4, width=WIDTH)
    return ModelProfile(name="toy", precision="bf16-mixed", batch_size=1, seq_len=SEQ,
                        embed=_segment("embed", params=10**6, output_bytes=SEQ * WIDTH * 4),
                        blocks=(block,) * num_blocks,
                        head=_segment("head", params=10**6, fwd=2 * 10**12),
                        block_container="layers")


TOY = _toy()

# The bubble's share is the other pipeline ranks' busy time over the paced rank's
# (stratagem.advisor.cost.pace). Where the embedding's and head's parameters make the ranks'
# parameter-sized work differ (the gradients' accumulation, FSDP's copies), it departs from the
# ratio of their FLOPs by under this much.
PARAMETER_WORK = 1e-3


def _cpu(cores: int) -> Cluster:
    """Four CPU ranks on a host of ``cores`` cores (not this machine's: what the test names)."""
    cpu, host = parse_cluster("4xcpu"), HostSpec(num_cores=cores, num_physical_cores=cores, memory_bytes=2**34)
    return dataclasses.replace(cpu, node=dataclasses.replace(cpu.node, host=host))


def _time(plan: Plan, *, profile: ModelProfile = TOY, cluster: Cluster = H100,
          optimizer: str = "adamw") -> TimeBreakdown:
    workload = Workload(global_batch_size=plan.global_batch_size, seq_len=profile.seq_len,
                        precision=plan.precision, optimizer=optimizer)
    return estimate_time(profile, cluster=cluster, workload=workload, plan=plan)


@pytest.fixture(scope="module")
def llama7b() -> ModelProfile:
    return profile_spec("llama-2-7b", seq_len=2048)


# -- terms against hand-worked numbers ----------------------------------------------------------


def test_single_device_is_compute_plus_optimizer_only():
    time = _time(Plan(micro_batch_size=2))
    flops = 2 * 3 * (8 * 10**12 + 2 * 10**12)  # 2 samples × (fwd + 2·fwd) × (blocks + head)
    params = 10 * 10**6
    assert time.compute == pytest.approx(flops / H100_ACHIEVED)
    adamw_bytes = params * 20 * 4  # torch.optim's AdamW operators' reads and writes; fp32
    bandwidth = 3350e9 * rates.MEMORY_BANDWIDTH_EFFICIENCY
    assert time.optimizer == pytest.approx(adamw_bytes / bandwidth)
    assert time.step_seconds == pytest.approx(time.compute + time.optimizer)
    assert time.to_dict()["step_seconds"] == time.step_seconds


def test_sgd_streams_fewer_bytes_than_adamw():
    adamw = _time(Plan()).optimizer
    assert _time(Plan(), optimizer="sgd").optimizer == pytest.approx(adamw * 8 / 20)  # momentum SGD's passes


def test_a_calibrated_optimizer_step_replaces_streaming_and_launching_estimates():
    """Measured seconds per fp32 parameter and per tensor: the optimizer term is the rank's
    parameters at the first (halved for bf16 parameters), its dispatch the tensors at the second."""
    cpu = parse_cluster("2xcpu")
    measured = dataclasses.replace(cpu, node=dataclasses.replace(
        cpu.node, optimizer_seconds=(("adamw", 1e-8, 3e-5), ("sgd", 1e-9, 5e-6))))
    profile = dataclasses.replace(TOY, blocks=tuple(dataclasses.replace(b, num_tensors=3) for b in TOY.blocks))
    for optimizer, per_param, per_tensor in measured.node.optimizer_seconds:
        for plan, shard in ((Plan(dp_replicate=2), 1), (Plan(dp_shard=2, zero=1), 2)):
            time = _time(plan, profile=profile, cluster=measured, optimizer=optimizer)
            before = _time(plan, profile=profile, cluster=cpu, optimizer=optimizer)
            assert time.optimizer == pytest.approx(10**7 / shard * per_param)
            launches = per_tensor - host_terms.OP_DISPATCH_SECONDS * optimizer_terms.OPTIMIZER_OPS_PER_TENSOR[optimizer]
            assert time.dispatch - before.dispatch == pytest.approx(8 * 3 / shard * launches)
    bf16 = Plan(dp_replicate=2, precision="bf16-true")
    assert _time(bf16, profile=profile, cluster=measured).optimizer == pytest.approx(10**7 * 1e-8 / 2)


def test_dtensor_parameters_step_per_call_on_gpus_and_per_tensor_on_cpu_ranks():
    """AdamW over FSDP's DTensor parameters: on GPUs torch.optim's foreach path makes each operator
    one DTensor call for all the tensors; CPU ranks step one tensor at a time, every tensor making
    its own calls. A calibration measures the path its device takes."""
    calls = optimizer_terms.OPTIMIZER_OPS_PER_TENSOR["adamw"]
    gpu = dataclasses.replace(H100, node=dataclasses.replace(H100.node, num_devices=4))
    measured = dataclasses.replace(gpu, node=dataclasses.replace(gpu.node, dtensor_optimizer_seconds=(5e-4, 2e-5)))

    def seconds(cluster: Cluster) -> tuple[float, float]:
        plan = Plan(dp_shard=4, zero=3)
        workload = Workload(global_batch_size=plan.global_batch_size, seq_len=SEQ)
        return optimizer_terms.dtensor_optimizer_seconds(rank_step(TOY, cluster=cluster, workload=workload, plan=plan))

    per_call, per_tensor = optimizer_terms.DTENSOR_OP_SECONDS, optimizer_terms.DTENSOR_FOREACH_TENSOR_SECONDS
    assert seconds(gpu) == pytest.approx((calls * per_call, calls * per_tensor))
    assert seconds(measured) == (5e-4, 2e-5)
    assert seconds(_cpu(4)) == pytest.approx((0.0, calls * per_call))


def test_fsdp_on_gpus_leaves_a_small_models_step_to_the_device():
    """GPT-2 (196 parameter tensors) under FSDP on eight H100s: its optimizer's DTensor calls, ten
    for the rank's tensors, take the host a few milliseconds, under the device's work."""
    profile = profile_spec("gpt2", seq_len=SEQ)
    plan = Plan(dp_shard=8, zero=3, micro_batch_size=8, block_container=profile.block_container)
    assert _time(plan, profile=profile, cluster=parse_cluster("8xH100-SXM-80GB")).dispatch == 0.0


def test_an_offloaded_optimizer_on_the_host_hides_none_of_the_hosts_launches():
    """FSDP2's CPU offload steps the optimizer on the host after backward, launching its own
    operators as it goes (its term holds them) while the device waits. The micro-batches' launches
    hide under the device's compute alone: what they take beyond it adds, however long the host's
    optimizer step is."""
    blocks = tuple(dataclasses.replace(b, fwd_ops=400, bwd_ops=800) for b in TOY.blocks)
    profile = dataclasses.replace(TOY, blocks=blocks)
    plan = Plan(dp_shard=1, zero=3, offload="params", micro_batch_size=1, block_container=profile.block_container)
    workload = Workload(global_batch_size=1, seq_len=SEQ)
    launches = host_terms.microbatch_dispatch_seconds(rank_step(profile, cluster=H100, workload=workload, plan=plan))
    time = _time(plan, profile=profile)
    assert launches > time.compute and time.optimizer > launches - time.compute  # it would have hidden them
    assert time.dispatch == pytest.approx(launches - time.compute)


def test_doubling_tp_halves_the_blocks_compute_and_leaves_the_head_whole():
    """TOY: blocks 8e12 forward FLOPs, head 2e12; TP splits the blocks only (the plugins keep the
    embedding and head replicated): 8/2 + 2 against 8/4 + 2."""
    assert _time(Plan(tp=4)).compute == pytest.approx(_time(Plan(tp=2)).compute * (8 / 4 + 2) / (8 / 2 + 2))


def test_tp_without_sequence_parallelism_moves_the_residual_stream_whole_on_every_rank():
    """Blocks moving 1 GB forward without FLOPs, 40 % of it on the residual stream (norms, residual
    adds: tp_replicated_op_bytes), 2 GB backward: under tp4 a rank moves 60 %/4 + 40 % of them;
    under tp4+sp, a quarter; on a CPU rank at its cost per byte (no kernel gaps, no attention)."""
    blocks = tuple(dataclasses.replace(b, fwd_op_bytes=10**9, bwd_op_bytes=2 * 10**9,
                                       tp_replicated_op_bytes=4 * 10**8) for b in TOY.blocks)
    profile, cpu = dataclasses.replace(TOY, blocks=blocks), _cpu(4)
    moved = {sp: _time(Plan(tp=4, sequence_parallel=sp), profile=profile, cluster=cpu).compute
             - _time(Plan(tp=4, sequence_parallel=sp), cluster=cpu).compute for sp in (False, True)}
    assert moved[False] == pytest.approx(moved[True] * (1 + 0.4 * 3))


def test_sequence_parallel_norms_pay_dtensor_s_dispatch_per_operator():
    """Each operator the blocks' sequence norms dispatch (sp_norm_ops) runs on DTensors under SP:
    a TP Linear's DTensor overhead over its DTENSOR_OPS_PER_TP_LINEAR operators, each."""
    profile = dataclasses.replace(TOY, blocks=tuple(dataclasses.replace(b, sp_norm_ops=24) for b in TOY.blocks))
    workload = Workload(global_batch_size=1, seq_len=SEQ)
    host = {sp: host_terms.microbatch_dispatch_seconds(rank_step(
        profile, cluster=H100, workload=workload, plan=Plan(tp=4, sequence_parallel=sp, micro_batch_size=1)))
        for sp in (False, True)}
    per_op = optimizer_terms.DTENSOR_OP_SECONDS - host_terms.OP_DISPATCH_SECONDS  # uncalibrated
    assert host[True] - host[False] == pytest.approx(8 * 24 * per_op)


def test_full_checkpointing_recomputes_the_block_forwards():
    time = _time(Plan(activation_checkpointing="full"))
    assert time.recompute == pytest.approx(8 * 10**12 / H100_ACHIEVED)


def test_each_kernel_a_gpu_launches_adds_the_devices_gap_after_it():
    """TOY's blocks launching 30 kernels forward and 50 backward each, fused to 10 and 20 where the
    plan compiles them: on a GPU every micro-batch adds the gap after each; a CPU rank has none."""
    blocks = tuple(dataclasses.replace(b, fwd_ops=30, bwd_ops=50, fwd_fused_ops=10, bwd_fused_ops=20)
                   for b in TOY.blocks)
    profile = dataclasses.replace(TOY, blocks=blocks)
    gap = rates.kernel_gap_seconds(H100)
    for compiled, kernels in ((False, 80), (True, 30)):
        plan = Plan(micro_batch_size=1, grad_accum=2, compile=compiled)
        launched = _time(plan, profile=profile).compute - _time(plan).compute
        assert launched == pytest.approx(2 * 8 * kernels * gap)
    cpu = _cpu(4)
    assert rates.kernel_gap_seconds(cpu) == 0
    assert _time(Plan(), profile=profile, cluster=cpu).compute == _time(Plan(), cluster=cpu).compute


@pytest.mark.parametrize("policy", ["selective", "selective-op"])
def test_selective_checkpointing_recomputes_what_the_profile_measured(policy):
    """Each of TOY's 8 blocks recomputing 2.5e11 FLOPs (its attention) and moving 1e9 bytes
    without FLOPs (4e5 of them parameter-sized, at any micro-batch) under ``policy``: both at the
    H100's rates, the batch-sized ones twice at a micro-batch of 2, with the device's gap after
    each of its 50 kernels; their launches add host time."""
    key = policy.replace("-", "_")
    blocks = tuple(dataclasses.replace(b, **{f"{key}_recompute_flops": 25 * 10**10, f"{key}_recompute_ops": 50,
                                             f"{key}_recompute_op_bytes": 10**9,
                                             f"{key}_recompute_param_op_bytes": 4 * 10**5}) for b in TOY.blocks)
    profile = dataclasses.replace(TOY, blocks=blocks)
    per_byte = rates.seconds_per_op_byte(H100)
    for mbs in (1, 2):
        time = _time(Plan(activation_checkpointing=policy, micro_batch_size=mbs), profile=profile)
        expected = 8 * (mbs * 25 * 10**10 / H100_ACHIEVED + (mbs * 10**9 + 4 * 10**5) * per_byte
                        + 50 * rates.kernel_gap_seconds(H100))
        assert time.recompute == pytest.approx(expected)
    cpu = _cpu(4)
    host = {p: host_terms.microbatch_dispatch_seconds(rank_step(
        profile, cluster=cpu, workload=Workload(global_batch_size=1, seq_len=SEQ), plan=Plan(activation_checkpointing=p)))
        for p in ("none", policy)}
    assert host[policy] - host["none"] == pytest.approx(8 * 50 * host_terms.OP_DISPATCH_SECONDS)
    # the other policy's measurement (zero here) is not read
    other = "selective-op" if policy == "selective" else "selective"
    assert _time(Plan(activation_checkpointing=other), profile=profile).recompute == 0


def test_the_bubble_is_a_microbatch_of_every_other_rank_over_the_virtual_stages():
    even = dataclasses.replace(TOY, embed=_segment("embed", output_bytes=TOY.embed.output_bytes),
                               head=_segment("head"))  # four equal stages
    plan = Plan(pp=4, microbatches=8, dp_shard=2, zero=3)  # FSDP: no reduction in the drain
    time = _time(plan, profile=even)
    # equal stages: Narayanan et al. 2021 eq. 1, (p−1)/m of the ideal time of m micro-batches
    assert time.bubble == pytest.approx(3 / 8 * (time.compute + time.recompute + time.tp_comm))
    # TOY's head (2e12 FLOPs) doubles the last rank's load: the three others fill and drain in
    # 3 × 2e12 / 4e12 = 1.5 of its micro-batches
    heavy = _time(plan)
    assert heavy.bubble == pytest.approx(1.5 / 8 * (heavy.compute + heavy.recompute + heavy.tp_comm),
                                         rel=PARAMETER_WORK)
    interleaved = _time(dataclasses.replace(plan, pp_schedule="interleaved-1f1b", pp_virtual=2), profile=even)
    assert interleaved.bubble == pytest.approx(time.bubble / 2)
    gpipe = _time(dataclasses.replace(plan, pp_schedule="gpipe"), profile=even)
    assert gpipe.bubble == time.bubble


def test_ranks_sharing_cores_run_the_busiest_stage_at_the_ranks_mean_load():
    plan = Plan(pp=2, dp_shard=2, zero=3, microbatches=4)  # 2 ranks a core: no bubble lost
    time = _time(plan, cluster=_cpu(cores=2))
    # TOY's stages: 4 blocks (12e12 FLOPs a micro-batch) against 4 blocks and the head (18e12):
    # the cores run both at their mean, 15/18 of the busiest's time
    assert time.bubble == pytest.approx((15 / 18 - 1) * (time.compute + time.recompute + time.tp_comm),
                                        rel=PARAMETER_WORK)


def test_a_pipeline_drain_waits_for_every_stage_ddp_reduction_and_fsdp_reduces_after_it():
    even = dataclasses.replace(TOY, head=_segment("head", params=10**6))
    plan = Plan(pp=4, microbatches=8, dp_replicate=2)
    ddp = _time(plan, profile=even)
    # ranks hold 3, 2, 2 and 3 M parameters (embedding and head at the ends); the first is
    # costed, and the drain waits for the other ranks' 7 M reducing as its own 3 M do
    assert ddp.bubble == pytest.approx(3 / 8 * (ddp.compute + ddp.recompute + ddp.tp_comm) + 7 / 3 * ddp.dp_comm,
                                       rel=PARAMETER_WORK)
    fsdp = dataclasses.replace(plan, dp_replicate=1, dp_shard=2, zero=2)
    step = rank_step(even, cluster=H100, plan=fsdp,
                     workload=Workload(global_batch_size=fsdp.global_batch_size, seq_len=SEQ))
    grads = communication.estimate_grad_sync_seconds(step)
    assert grads > 0
    assert _time(fsdp, profile=even).dp_comm >= grads  # after the last micro-batch: nothing hides them
    alone = dataclasses.replace(fsdp, pp=1, microbatches=1, grad_accum=8)
    assert _time(alone, profile=even).dp_comm < communication.estimate_grad_sync_seconds(
        rank_step(even, cluster=H100, plan=alone, workload=Workload(global_batch_size=alone.global_batch_size,
                                                                    seq_len=SEQ)))


def test_a_cpu_rank_bubble_holds_the_host_time_of_the_other_ranks_microbatches():
    block = dataclasses.replace(TOY.blocks[0], fwd_ops=100, bwd_ops=200)
    even = dataclasses.replace(TOY, blocks=(block,) * 8, head=_segment("head", params=10**6))
    plan = Plan(pp=4, microbatches=8)
    cpu = _cpu(cores=4)  # a core each: the whole bubble is lost
    time = _time(plan, profile=even, cluster=cpu)
    step = rank_step(even, cluster=cpu, plan=plan, workload=Workload(global_batch_size=8, seq_len=SEQ))
    host = 8 * host_terms.microbatch_dispatch_seconds(step)
    assert host > 0
    assert time.bubble == pytest.approx(3 / 8 * (time.compute + host), rel=PARAMETER_WORK)


def test_cpu_ranks_sharing_cores_lose_only_the_bubble_no_busy_rank_can_take():
    assert bubble_lost_share(4, 1.0) == 1.0  # a device each: every idle moment is lost
    assert bubble_lost_share(2, 2.0) == 0.0  # one stage's ranks fill the cores
    # pp 4, 2 ranks a core: fill steps with 1/4, 2/4, 3/4 of the ranks busy idle 3/4, 2/4, 1/4 of
    # them; sharing, only the first loses throughput (1 − 2/4)
    assert bubble_lost_share(4, 2.0) == pytest.approx(0.5 / 1.5)
    assert (_cpu(cores=2).ranks_per_core, H100.ranks_per_core) == (2.0, 1.0)


def test_the_most_loaded_stage_holds_the_head():
    step = pace(TOY, cluster=H100, workload=Workload(global_batch_size=4, seq_len=SEQ),
                plan=Plan(pp=4, microbatches=4)).step
    assert [s.name for s in step.stage.segments] == ["block", "block", "head"]
    stage_flops = 4 * 3 * 4 * 10**12  # 4 micro-batches × (fwd + bwd) × (2 blocks + head)
    # 3 more micro-batches each add 3e6 fp32 gradients: two read, one written
    accumulation = 3 * 3 * 3 * 10**6 * 4 * step.seconds_per_op_byte
    assert _time(Plan(pp=4, microbatches=4)).compute == pytest.approx(stage_flops / H100_ACHIEVED + accumulation)


def test_tp_comm_is_four_all_reduces_per_block_and_microbatch():
    plan = Plan(tp=4, dp_replicate=2, micro_batch_size=2, grad_accum=3)
    message = 2 * SEQ * WIDTH * 2  # b·s·h in bf16
    one = estimate_all_reduce_seconds(message, group_size=4, bandwidth=450e9 * 0.75, latency=3e-6)
    time = _time(plan)
    assert time.tp_comm == pytest.approx(3 * 8 * 4 * one)
    assert time.tp_comm_total == time.tp_comm


def test_tp_reduces_per_linear_as_torch_s_colwise_and_rowwise_styles_do():
    """Forward all-reduces each rowwise output, backward each colwise input gradient (q, k and v
    each their own); with SP the norms gather and the rowwise outputs scatter."""
    names = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
             "mlp.up": "colwise", "mlp.gate": "colwise", "mlp.down": "rowwise"}
    linears = tuple(LinearLayer(name=n, in_features=4 * WIDTH if n == "mlp.down" else WIDTH,
                                out_features=4 * WIDTH if n in ("mlp.up", "mlp.gate") else WIDTH, bias=False)
                    for n in names)
    profile = _toy(num_blocks=1)
    profile = dataclasses.replace(profile, blocks=(dataclasses.replace(profile.blocks[0], linears=linears),))
    layout = tuple((f"layers.*.{n}", style) for n, style in names.items()) + (("layers.*.norm", "sequence_parallel"),)
    workload = Workload(global_batch_size=1, seq_len=SEQ)
    fields = {"tp": 2, "tp_layout": layout, "block_container": "layers"}
    step = rank_step(profile, cluster=H100, workload=workload, plan=Plan(**fields))
    forward, backward = communication.tp_collectives(step, profile.blocks[0])
    token = SEQ * 2  # bf16
    assert forward == (("all_reduce", token * WIDTH),) * 2
    assert backward == (("all_reduce", token * WIDTH),) * 5  # the down projection reads 4 × WIDTH: rowwise
    sp = rank_step(profile, cluster=H100, workload=workload, plan=Plan(**fields, sequence_parallel=True))
    forward, backward = communication.tp_collectives(sp, profile.blocks[0])
    assert [op for op, _ in forward] == ["all_gather", "reduce_scatter", "reduce_scatter"]
    assert [op for op, _ in backward] == ["reduce_scatter", "all_gather", "all_gather"]


def test_tp_messages_carry_the_rows_each_linear_multiplies():
    """A ViT's all-reduces carry every patch of the micro-batch's images, a routed expert's its
    share of the tokens (the rows the profile saw), not one row per sample or every token."""
    vit = profile_spec("vit-small", precision="fp32")
    plan = Plan(tp=2, tp_layout=vit.tp_layout, block_container=vit.block_container, micro_batch_size=2,
                precision="fp32")
    step = rank_step(vit, cluster=H100, workload=Workload(global_batch_size=2, precision="fp32"), plan=plan)
    forward, _ = communication.tp_collectives(step, vit.blocks[0])
    assert forward == (("all_reduce", 2 * 65 * 256 * 4),) * 2  # 64 patches and the class token, width 256
    moe = profile_spec("mixtral-small", seq_len=128, precision="fp32")
    plan = Plan(tp=2, tp_layout=moe.tp_layout, block_container=moe.block_container, precision="fp32")
    step = rank_step(moe, cluster=H100, workload=Workload(global_batch_size=1, seq_len=128, precision="fp32"),
                     plan=plan)
    forward, _ = communication.tp_collectives(step, moe.blocks[0])
    assert forward == (("all_reduce", 128 * 256 * 4),) + (("all_reduce", 64 * 256 * 4),) * 4  # wo, 4 experts' w2


def test_sequence_parallel_moves_the_same_volume_and_full_checkpointing_adds_the_forward_again():
    """SP trades each block's all-reduces for all-gathers and reduce-scatters of the same volume,
    and gathers at its region's edges: the last block's output forward, the first block's input
    gradient backward (the toy layout names no norm, so no norm gradients are summed)."""
    plain = _time(Plan(tp=4)).tp_comm
    edge = estimate_all_gather_seconds(SEQ * WIDTH * 2, group_size=4, bandwidth=450e9 * 0.75, latency=3e-6)
    assert _time(Plan(tp=4, sequence_parallel=True)).tp_comm == pytest.approx(plain + 2 * edge)
    assert _time(Plan(tp=4, activation_checkpointing="full")).tp_comm == pytest.approx(1.5 * plain)


def test_pp_comm_sends_every_microbatch_both_ways_and_exposes_fill_and_drain():
    plan = Plan(pp=2, microbatches=4, dp_replicate=4)
    one = estimate_p2p_seconds(SEQ * WIDTH * 4, bandwidth=450e9 * 0.75, latency=3e-6)
    time = _time(plan)
    assert time.pp_comm_total == pytest.approx(2 * 4 * one)
    assert time.pp_comm == pytest.approx(2 * 1 * one)
    # ranks that reach a message apart (calibrated on CPU ranks sharing cores) wait on each one
    waiting = dataclasses.replace(H100, node=dataclasses.replace(H100.node, sync_seconds=((8, 1e-3),)))
    assert _time(plan, cluster=waiting).pp_comm_total == pytest.approx(2 * 4 * (one + 1e-3))


def test_pipeline_stages_send_whole_activations_under_sequence_parallelism():
    """The TP plugin gathers each stage's output at its last block, so SP sends what TP alone does
    (Megatron-LM would send the shard); each stage the rank holds gathers at its edges."""
    plans = {sp: Plan(pp=2, tp=2, dp_replicate=2, microbatches=4, sequence_parallel=sp) for sp in (False, True)}
    assert _time(plans[True]).pp_comm_total == pytest.approx(_time(plans[False]).pp_comm_total)
    edges = {v: _time(Plan(pp=2, tp=2, dp_replicate=2, microbatches=4, sequence_parallel=True,
                           pp_schedule="interleaved-1f1b", pp_virtual=v)).tp_comm
             - _time(Plan(pp=2, tp=2, dp_replicate=2, microbatches=4, pp_schedule="interleaved-1f1b",
                          pp_virtual=v)).tp_comm for v in (2, 4)}
    assert edges[4] == pytest.approx(2 * edges[2])


def test_ddp_all_reduces_fp32_gradients_once_per_step_bucket_by_bucket():
    plan = Plan(dp_replicate=8, grad_accum=4)
    buckets = 2  # 40 MB of fp32 gradients in 25 MiB buckets
    expected = buckets * estimate_all_reduce_seconds(10 * 10**6 * 4 / buckets, group_size=8,
                                                     bandwidth=450e9 * 0.75, latency=3e-6)
    assert _time(plan).dp_comm_total == pytest.approx(expected)


def test_every_blocking_collective_waits_the_calibrated_sync_time():
    """Ranks that reach a collective apart (measured: ``NodeSpec.sync_seconds``) add that wait to
    each TP all-reduce, DDP bucket, FSDP gather and reduce-scatter, and to nothing else."""
    wait = 1e-3
    waiting = dataclasses.replace(H100, node=dataclasses.replace(H100.node, sync_seconds=((8, wait),)))
    tp = Plan(tp=4, dp_replicate=2, micro_batch_size=2, grad_accum=3)
    assert _time(tp, cluster=waiting).tp_comm - _time(tp).tp_comm == pytest.approx(3 * 8 * 4 * wait)
    ddp = Plan(dp_replicate=8, grad_accum=4)
    assert _time(ddp, cluster=waiting).dp_comm_total - _time(ddp).dp_comm_total == pytest.approx(2 * wait)
    fsdp = Plan(dp_shard=8, zero=3, grad_accum=2, block_container="layers")
    units = 8 + 1  # the blocks and the root: gathered twice and reduced once per micro-batch
    assert _time(fsdp, cluster=waiting).dp_comm_total - _time(fsdp).dp_comm_total == \
        pytest.approx(2 * 3 * units * wait)
    assert _time(Plan(), cluster=waiting) == _time(Plan())


def test_a_collective_waits_what_calibration_measured_for_its_group_size():
    """A collective ends when the last of its ranks arrives: the fewer it waits for, the shorter
    (bench/collective_wait.py). Calibration measures the wait per group size; a group of a size not
    measured takes the nearest measured, the larger on a tie."""
    measured = ((2, 1e-3), (4, 2e-3), (8, 5e-3))
    calibrated = dataclasses.replace(H100, node=dataclasses.replace(H100.node, sync_seconds=measured))
    step = rank_step(TOY, cluster=calibrated, plan=Plan(), workload=Workload(global_batch_size=1, seq_len=SEQ))
    waits = {n: communication.collective_wait_seconds(step, n) for n in (1, 2, 3, 4, 6, 8, 16)}
    assert waits == {1: 0.0, 2: 1e-3, 3: 2e-3, 4: 2e-3, 6: 5e-3, 8: 5e-3, 16: 5e-3}
    tp2, tp8 = (Plan(tp=tp, dp_replicate=8 // tp, grad_accum=3) for tp in (2, 8))
    collectives = 3 * 8 * 4  # micro-batches × blocks × TP collectives each (two per direction)
    assert _time(tp2, cluster=calibrated).tp_comm - _time(tp2).tp_comm == pytest.approx(collectives * 1e-3)
    assert _time(tp8, cluster=calibrated).tp_comm - _time(tp8).tp_comm == pytest.approx(collectives * 5e-3)


@pytest.mark.parametrize("precision", ["bf16-true", "fp32"])
def test_zero2_moves_ddp_volume_and_zero3_half_again(precision):
    """ZeRO (Rajbhandari et al. 2020) §7.2: in one dtype, zero 2 = DDP, zero 3 = 1.5 × DDP, in
    volume; each collective (a DDP bucket's all-reduce: 14 ring steps on 8 ranks; an FSDP unit's
    gather or reduce-scatter: 7) adds its latency."""
    buckets = 2 if precision == "fp32" else 1
    ddp = _dp_volume_seconds(Plan(dp_replicate=8, precision=precision), buckets * 14)
    zero2 = _dp_volume_seconds(Plan(dp_shard=8, zero=2, precision=precision), 2 * UNITS * 7)
    zero3 = _dp_volume_seconds(Plan(dp_shard=8, zero=3, precision=precision), 3 * UNITS * 7)
    assert zero2 == pytest.approx(ddp)
    assert zero3 == pytest.approx(1.5 * ddp)


UNITS = len(TOY.blocks) + 1  # FSDP units: the blocks and the root


def _dp_volume_seconds(plan: Plan, latency_steps: int) -> float:
    """Data-parallel communication less its latency (3 µs per ring step on H100s): the volume."""
    return _time(plan).dp_comm_total - latency_steps * 3e-6


def test_fsdp_reduces_every_accumulation_step_and_zero3_gathers_every_microbatch():
    """DDP reduces once (``no_sync`` before the last accumulation step); FSDP2 reduce-scatters
    each backward's gradients (fp32), ZeRO-2 gathers once and ZeRO-3 twice a micro-batch (bf16)."""
    ddp = _dp_volume_seconds(Plan(dp_replicate=8, grad_accum=4), 2 * 14)
    zero2 = _dp_volume_seconds(Plan(dp_shard=8, zero=2, grad_accum=4), (4 + 1) * UNITS * 7)
    zero3 = _dp_volume_seconds(Plan(dp_shard=8, zero=3, grad_accum=4), (4 + 2 * 4) * UNITS * 7)
    assert zero3 > zero2 > ddp
    # four fp32 reduce-scatters (half an all-reduce's volume each) and one bf16 gather (a quarter)
    assert zero2 == pytest.approx((4 / 2 + 1 / 4) * ddp, rel=0.02)


def test_exposed_dp_comm_never_exceeds_the_total_and_overlap_hides_most_of_fsdp():
    for plan in (Plan(dp_replicate=8), Plan(dp_shard=8, zero=1), Plan(dp_shard=8, zero=2),
                 Plan(dp_shard=8, zero=3, grad_accum=2)):
        time = _time(plan)
        assert 0 < time.dp_comm <= time.dp_comm_total
    zero3 = _time(Plan(dp_shard=8, zero=3, micro_batch_size=4))
    assert zero3.dp_comm < 0.2 * zero3.dp_comm_total


def test_hsdp_adds_an_all_reduce_across_nodes():
    cluster = parse_cluster("4x8xH100:ib-ndr")
    fsdp = _time(Plan(dp_shard=8, zero=3), cluster=cluster).dp_comm_total
    hsdp = _time(Plan(dp_replicate=4, dp_shard=8, zero=3), cluster=cluster).dp_comm_total
    assert hsdp > fsdp


def test_offload_copies_over_pcie_and_steps_on_the_host():
    base = _time(Plan(dp_shard=8, zero=2))
    offloaded = _time(Plan(dp_shard=8, zero=2, offload="optimizer"))
    host_link = H100.node.host_link
    shard_bytes = 10 * 10**6 / 8 * 4
    copy = estimate_p2p_seconds(shard_bytes, bandwidth=host_link.effective_bandwidth,
                                latency=host_link.latency)
    assert base.offload == 0.0
    assert offloaded.offload == pytest.approx(2 * copy)  # gradients down, parameters up
    assert offloaded.optimizer > base.optimizer
    params = _time(Plan(dp_shard=8, zero=3, offload="params", grad_accum=2))
    assert params.offload == pytest.approx((2 + 2 * 2) * copy)


def test_fp32_runs_at_the_fp32_peak_not_tf32():
    assert rates.estimate_peak_flops(H100, precision="fp32") == 67e12
    assert rates.estimate_peak_flops(H100, precision="bf16-mixed") == 989e12


def test_profile_and_workload_must_agree_with_the_plan():
    with pytest.raises(UsageError, match="seq_len"):
        estimate_time(TOY, cluster=H100, workload=Workload(global_batch_size=1, seq_len=2 * SEQ),
                      plan=Plan())
    with pytest.raises(UsageError, match="global batch"):
        estimate_time(TOY, cluster=H100, workload=Workload(global_batch_size=2, seq_len=SEQ),
                      plan=Plan())


def test_tokens_per_second_and_mfu_by_hand():
    time = _time(Plan())
    workload = Workload(global_batch_size=1, seq_len=SEQ)
    tokens = tokens_per_second(TOY, workload=workload, time=time)
    assert tokens == pytest.approx(SEQ / time.step_seconds)
    model_flops = 3 * 10 * 10**12
    expected = model_flops / time.step_seconds / 989e12
    utilisation = mfu(TOY, cluster=H100, workload=workload, plan=Plan(), time=time)
    assert utilisation == pytest.approx(expected)


# -- real presets ------------------------------------------------------------------------------


def test_full_checkpointing_adds_about_a_third_on_llama7b(llama7b):
    """Backward costs about twice forward, so one more forward is about +1/3 (the head aside)."""
    time = _time(Plan(activation_checkpointing="full"), profile=llama7b)
    block_forward = sum(b.fwd_flops for b in llama7b.blocks)
    # FLOPs dominate; the bytes moved by operators without FLOPs and the device's gap after each
    # kernel shift the ratio a little: the forward moves half the bytes the backward does (eager
    # Llama 2 7B's, SiLU's gradient one kernel) and launches more kernels per FLOP, more than a third
    assert time.recompute / time.compute == pytest.approx(block_forward / llama7b.flops_per_step, rel=0.1)
    assert 0.3 < time.recompute / time.compute < 0.36


def test_llama7b_ddp_on_eight_h100_is_plausible(llama7b):
    """Published 7B runs on H100 reach roughly 40-55 % MFU (docs/hardware.md: 38-56 %) with fused
    kernels; eager PyTorch, as profiled, also streams every norm's and elementwise op's output,
    autocast's weight casts and DDP's bucket copies through HBM: less. Measured eager on one
    H200 (verify, llama-2-7b mb=1 ga=4 at 2048 tokens): 1.02 s a step, 33 % of its dense peak."""
    plan = Plan(dp_replicate=8, micro_batch_size=1, grad_accum=4)
    workload = Workload(global_batch_size=32, seq_len=2048)
    time = estimate_time(llama7b, cluster=H100, workload=workload, plan=plan)
    utilisation = mfu(llama7b, cluster=H100, workload=workload, plan=plan, time=time)
    assert 0.2 < utilisation < 0.65
    assert 0.4 < time.step_seconds < 2.0  # the H100's HBM is 30 % slower than the H200's
    assert 5_000 < tokens_per_second(llama7b, workload=workload, time=time) / 8 < 15_000


def test_zero_bubble_leaves_the_forwards_share_of_the_interleaved_bubble():
    """Qi et al. 2024, ZB-H1: (T_F + T_B − T_W) of 1F1B's (T_F + T_B + T_W), the backward split
    into equal input and weight passes: with backward = 2 × forward, a third."""
    fields = dict(pp=2, pp_virtual=2, microbatches=4, block_container="layers")
    interleaved = _time(Plan(pp_schedule="interleaved-1f1b", **fields)).bubble
    zero_bubble = _time(Plan(pp_schedule="interleaved-zb", **fields)).bubble
    assert zero_bubble == pytest.approx(interleaved / 3)


def test_block_matmuls_run_at_the_calibrated_rate_for_their_size():
    """A 128-token × 256 × 256 GEMM is a square matmul of side 203, log-interpolated on the curve;
    split over TP 2 (colwise), of side 161."""
    from stratagem.advisor.cost.stages import whole_model

    block = _segment("block", fwd=2 * 128 * 256 * 256, width=256)
    profile = ModelProfile(name="gemm", precision="fp32", batch_size=1, seq_len=128, embed=_segment("embed"),
                           blocks=(block,), head=_segment("head"), block_container="layers")
    curve = [(128, 10e12), (1024, 40e12)]
    side = (128 * 256 * 256) ** (1 / 3)
    expected = (10e12 + 30e12 * math.log(side / 128) / math.log(8)) / 40e12
    alone = rates.block_matmul_efficiency(profile, Plan(precision="fp32"), whole_model(profile), curve)
    assert alone == pytest.approx(expected)
    split = Plan(precision="fp32", tp=2, tp_layout=(("layers.*.proj", "colwise"),), block_container="layers")
    side = (128 * 256 * 128) ** (1 / 3)
    assert rates.block_matmul_efficiency(profile, split, whole_model(profile), curve) == \
        pytest.approx((10e12 + 30e12 * math.log(side / 128) / math.log(8)) / 40e12)
    assert rates.block_matmul_efficiency(profile, Plan(precision="fp32"), whole_model(profile), []) == 1.0


def test_written_out_attention_is_bounded_by_memory_on_a_calibrated_rank_as_on_the_catalogs():
    """A block whose attention is written out (BLOOM's eager ALiBi attention): 1,024 tokens, 16
    heads 64 wide, 8 samples. Its score GEMMs move more bytes than their FLOPs take, and a
    calibrated rank bounds them by its bandwidth as the catalog's does; its Linears' three GEMMs
    each weigh in, as the convolutions' and the attention's do (a calibrated H200's block
    efficiency had weighed the Linears' forward alone, and the scores at the largest GEMMs' rate)."""
    from stratagem.advisor.calibrate.calibration import Calibration
    from stratagem.advisor.cost.stages import whole_model

    width, heads, tokens = 1024, 16, 8 * 1024
    linear_flops = 2 * tokens * width * width * 12  # Q/K/V, output and a 4× MLP
    attention = 2 * 2 * 8 * heads * 1024 * 1024 * (width // heads)
    block = dataclasses.replace(_segment("block", fwd=linear_flops + attention, attention=attention, width=width),
                                linears=tuple(LinearLayer(name=f"p{i}", in_features=width, out_features=width, bias=False)
                                              for i in range(12)))
    profile = ModelProfile(name="explicit", precision="bf16-mixed", batch_size=8, seq_len=1024, num_heads=heads,
                           embed=_segment("embed"), blocks=(block,), head=_segment("head"), block_container="layers")
    plan = Plan(micro_batch_size=8)
    catalog = parse_cluster("1xH200")
    measured = Calibration.load(Path(__file__).parents[2] / "bench" / "calibrations" / "h200-sxm-141gb-2026-11-28.json")
    calibrated = measured.apply(catalog)
    curve = rates.matmul_curve(calibrated, plan.precision)
    efficiencies = [rates.block_matmul_efficiency(profile, plan, whole_model(profile), points, cluster=cluster)
                    for cluster, points in ((catalog, []), (calibrated, curve))]
    assert efficiencies[0] < 0.8 and efficiencies[1] == pytest.approx(efficiencies[0], rel=0.1)
    # Fused, the same attention never writes its scores out: a calibration taken before attention was
    # measured keeps it at the Linears' rate, unbounded by memory.
    from stratagem.advisor.profile.model_profile import AttentionCall

    fused = dataclasses.replace(block, fused_attention=(AttentionCall(
        seq_q=1024, seq_kv=1024, head_dim=width // heads, causal=True, fwd_flops=attention, bwd_flops=2 * attention),))
    older = dataclasses.replace(calibrated, node=dataclasses.replace(calibrated.node, attention_curve=()))
    linears_alone = dataclasses.replace(block, fwd_flops=linear_flops, attention_fwd_flops=0)
    fused_eff, alone_eff = (rates.block_matmul_efficiency(one, plan, whole_model(one), curve, cluster=older)
                            for one in (dataclasses.replace(profile, blocks=(b,)) for b in (fused, linears_alone)))
    assert fused_eff == pytest.approx(alone_eff) and fused_eff > efficiencies[1]


def test_gemms_with_unaligned_rows_run_at_their_share_of_the_rate():
    """The head's 2e12 forward and 4e12 backward FLOPs all unaligned: 6e12 FLOPs take 1/0.18
    times as long on a GPU (the catalog's share), or the calibrated share; on CPU ranks no longer."""
    head = dataclasses.replace(TOY.head, fwd_unaligned_flops=2 * 10**12, bwd_unaligned_flops=4 * 10**12)
    odd = dataclasses.replace(TOY, head=head)
    extra = 6e12 * (1 / rates.UNALIGNED_MATMUL_FRACTION["gpu"] - 1) / H100_ACHIEVED
    assert _time(Plan(), profile=odd).compute - _time(Plan()).compute == pytest.approx(extra)
    measured = dataclasses.replace(H100, node=dataclasses.replace(H100.node, unaligned_matmul=(("bf16", 0.5),)))
    assert _time(Plan(), profile=odd, cluster=measured).compute - _time(Plan(), cluster=measured).compute == \
        pytest.approx(6e12 / H100_ACHIEVED)
    cpu = parse_cluster("2xcpu")
    assert _time(Plan(), profile=odd, cluster=cpu).compute == pytest.approx(_time(Plan(), cluster=cpu).compute)


def test_a_pipeline_casts_each_weight_once_a_step_under_its_one_autocast_context():
    """The pipeline plugin runs the whole schedule under one autocast context, whose cache keeps
    each weight's cast: a gigabyte more of a stage's forward casts costs its step one gigabyte's
    time, where a step without a pipeline, each micro-batch's forward in a context of its own, pays
    it for every micro-batch. FSDP2 runs no autocast."""
    profile = profile_spec("llama-tiny", seq_len=SEQ)
    heavier = dataclasses.replace(profile, blocks=tuple(
        dataclasses.replace(block, fwd_param_op_bytes=block.fwd_param_op_bytes + 10**9) for block in profile.blocks))
    workload = Workload(global_batch_size=8, seq_len=SEQ)

    def extra(cluster: Cluster, plan: Plan) -> float:
        steps = [rank_step(p, cluster=cluster, workload=workload, plan=plan) for p in (profile, heavier)]
        return compute.estimate_compute_seconds(steps[1]) - compute.estimate_compute_seconds(steps[0])

    blocks = profile.block_container
    per_gigabyte = rank_step(profile, cluster=H100, workload=workload, plan=Plan(grad_accum=8)).seconds_per_op_byte * 1e9
    stage_blocks = len(profile.blocks) // 2
    assert extra(parse_cluster("2xH100"), Plan(pp=2, microbatches=8, block_container=blocks)) == pytest.approx(
        stage_blocks * per_gigabyte)  # once a step
    assert extra(H100, Plan(grad_accum=8)) == pytest.approx(8 * len(profile.blocks) * per_gigabyte)  # every micro-batch
    sharded = rank_step(profile, cluster=parse_cluster("4xH100"), workload=workload,
                        plan=Plan(pp=2, microbatches=4, dp_shard=2, zero=3, block_container=blocks))
    assert compute.estimate_cached_cast_seconds(sharded) == 0.0  # FSDP2 casts the gathered parameters itself


def test_parameter_sized_bytes_do_not_grow_with_the_micro_batch_and_gradients_accumulate():
    """Autocast's weight casts write as much for a micro-batch of 4 as of 1; each micro-batch
    after the first adds its fp32 gradients to the ones before, reading both and writing the sum
    (FSDP2: its shard of them)."""
    head = dataclasses.replace(TOY.head, fwd_param_op_bytes=10**9, bwd_param_op_bytes=2 * 10**9)
    casts = dataclasses.replace(TOY, head=head)
    step = rank_step(TOY, cluster=H100, workload=Workload(global_batch_size=1, seq_len=SEQ), plan=Plan())
    for micro_batch in (1, 4):
        plan = Plan(micro_batch_size=micro_batch, grad_accum=4 // micro_batch)
        extra = _time(plan, profile=casts).compute - _time(plan).compute
        assert extra == pytest.approx(plan.grad_accum * 3e9 * step.seconds_per_op_byte)
    params = TOY.num_params
    assert compute.estimate_grad_accumulation_seconds(step) == 0.0
    accumulating = rank_step(TOY, cluster=H100, workload=Workload(global_batch_size=4, seq_len=SEQ),
                             plan=Plan(grad_accum=4))
    assert compute.estimate_grad_accumulation_seconds(accumulating) == pytest.approx(
        3 * 3 * params * 4 * step.seconds_per_op_byte)
    sharded = rank_step(TOY, cluster=H100, workload=Workload(global_batch_size=32, seq_len=SEQ),
                        plan=Plan(grad_accum=4, dp_shard=8, zero=3, block_container="layers"))
    assert compute.estimate_grad_accumulation_seconds(sharded) == pytest.approx(
        3 * 3 * params / 8 * 4 * step.seconds_per_op_byte)


def test_zero3_under_a_pipeline_gathers_each_unit_once_per_micro_batch_and_once_more():
    """torch's pipeline schedule leaves FSDP units gathered after their backward: m + 1 gathers
    per unit for m micro-batches (ZeRO-3 without a pipeline gathers twice per micro-batch)."""
    def gathers(microbatches: int) -> float:
        plan = Plan(pp=2, dp_shard=2, zero=3, micro_batch_size=1, microbatches=microbatches, block_container="layers")
        step = rank_step(TOY, cluster=H100, workload=Workload(global_batch_size=2 * microbatches, seq_len=SEQ),
                         plan=plan)
        return communication.estimate_param_gather_seconds(step)

    assert gathers(8) / gathers(2) == pytest.approx((8 + 1) / (2 + 1))
