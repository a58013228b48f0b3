"""Step time of one Plan: a visible sum of named terms, each with its source.

:func:`estimate_time` scores the most loaded rank: the pipeline rank whose stages have the most
FLOPs, under the partition the plan carries (``Plan.stage_blocks``; the embedding on the first
stage, the head on the last).
It first describes that rank's work once (:class:`RankStep`), then adds the terms of
:class:`~stratagem.advisor.cost.estimate.TimeBreakdown`: compute, recompute, data-, tensor- and
pipeline-parallel communication (exposed part and total), pipeline bubble, optimizer step,
offload transfers and operator dispatch. Collectives cost what :mod:`~stratagem.advisor.cost.collectives` says on the link
:func:`~stratagem.advisor.cost.collectives.group_link` picks.

The constants below are first guesses with a stated source; calibration replaces them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from stratagem.advisor.cost.collectives import (
    estimate_all_gather_seconds,
    estimate_all_reduce_seconds,
    estimate_p2p_seconds,
    estimate_reduce_scatter_seconds,
    mesh_links,
)
from stratagem.advisor.cost.estimate import TimeBreakdown
from stratagem.advisor.hardware.spec import Cluster
from stratagem.plan import MeshAxis, Plan, Workload
from stratagem.plan.precision import Precision, get_precision
from stratagem.advisor.profile.model_profile import LinearLayer, ModelProfile, SegmentProfile
from stratagem.advisor.cost.stages import Stage, busiest_stage, others_share, rank_stages, whole_model
from stratagem.errors import UsageError

# Fraction of the dense peak that profiled FLOPs (matmuls, attention) run at, by device kind.
# GPU: dense bf16 GEMMs at transformer shapes reach 60-75 % of peak, attention kernels less;
# norms, softmax and elementwise ops are costed apart, by the bytes they move (seconds_per_op_byte).
# The whole step: Megatron-LM reaches 52 % MFU on A100 (Narayanan et al. 2021, Table 1), Llama 3
# 405B 38-43 % on H100 (HARDWARE_FACTS.md). Estimate. CPU: the catalog's per-core figure is
# already an achieved rate ("about half reached"), so 1.0. A calibrated rate is achieved already
# (the matmul benchmark's), so the fraction applies to catalog peaks only.
ACHIEVABLE_FLOPS_FRACTION = {"gpu": 0.6, "cpu": 1.0}

# Share of the aligned rate a GEMM reaches when a matrix's leading dimension is not a multiple of
# 16 bytes (measure.unaligned_gemm: cuBLAS's unaligned kernels). GPU: measured on an H200
# (torch 2.11, CUDA 13; bench/gpu_phases.py), [16384×768]·[768×50257] in bf16 at 120-151 TFLOP/s
# against 686-790 for a width of 50304: 0.18. CPU: fp32 loses little (`stratagem calibrate` here:
# 93-96 % of the rate at n = 1024, --nproc 2 and 4), so 1.0. Calibration measures it
# (NodeSpec.unaligned_matmul).
UNALIGNED_MATMUL_FRACTION = {"gpu": 0.18, "cpu": 1.0}

# fp32 training runs matmuls in full fp32: PyTorch >= 1.12 defaults
# torch.backends.cuda.matmul.allow_tf32 to False (float32_matmul_precision "highest").
FP32_MATMUL_USES_TF32 = False

# Fraction of the overlappable compute that really hides DP communication: NCCL kernels take
# SMs and HBM bandwidth from the compute they run beside. Estimate; a calibration's measured
# overlap (NodeSpec.comm_overlap, `stratagem calibrate`) replaces it.
DP_OVERLAP_EFFICIENCY = 0.8

# DDP's gradient bucket (torch DistributedDataParallel bucket_cap_mb=25): the last bucket's
# all-reduce starts only when backward ends, so it cannot hide.
DDP_BUCKET_BYTES = 25 * 2**20

# Fraction of peak memory bandwidth a streaming kernel reaches (foreach/fused multi-tensor
# optimizer kernels over many tensors, elementwise operators). Estimate.
MEMORY_BANDWIDTH_EFFICIENCY = 0.7

# Tensor reads + writes per parameter in one optimizer step as torch.optim runs it by default
# (one operator at a time, or ``foreach`` over many tensors: the same operators), each in the
# parameter dtype. AdamW (torch 2.13, adam.py): weight decay param.mul_ (2), exp_avg.lerp_(grad)
# (3), exp_avg_sq.mul_ (2) and addcmul_(grad, grad) (3), the denominator's sqrt, div and add_
# (2 each), param.addcdiv_(exp_avg, denom) (4): 20. A fused kernel would read param, grad and both
# states and write three (7), but torch.optim does not default to it. SGD (momentum 0):
# param.add_(grad) (3). Calibration measures the step instead (NodeSpec.optimizer_seconds).
OPTIMIZER_TENSOR_PASSES = {"adamw": 20, "sgd": 3}

# Host memory bandwidth torch's CPU optimizer reaches per node when the step is offloaded,
# bytes/s (shared by the node's ranks): a two-socket DDR5 host streams a few hundred GB/s,
# torch's CPU foreach kernels reach a fraction. Estimate; calibrate to replace.
HOST_OPTIMIZER_BANDWIDTH_PER_NODE = 50e9

# Host seconds to dispatch one operator in eager PyTorch (Python, dispatcher, autograd graph, kernel
# launch), whatever its size. He 2022 ("Making Deep Learning Go Brrrr") measures ≈ 3 µs per op
# without autograd; autograd and module hooks add several µs. Estimate; a calibration's measured
# figure (NodeSpec.op_seconds, `stratagem calibrate`) replaces it.
OP_DISPATCH_SECONDS = 10e-6

# Host seconds per operator on DTensors (FSDP2 and TP parameters): DTensor's Python
# __torch_dispatch__ and sharding propagation, several times a plain operator (torch 2.13's
# profiler: ≈ 0.2 ms per AdamW operator on FSDP2 parameters, one busy CPU core). Estimate;
# calibration measures it (NodeSpec.dtensor_op_seconds).
DTENSOR_OP_SECONDS = 100e-6

# Operators a tensor-parallel Linear runs on DTensors per micro-batch: the forward's matmul and
# the layout changes around it, the backward's two matmuls and theirs. Counted with
# torch.profiler (DTensor dispatches, forward and backward, torch 2.13, TP 2 without FSDP):
# bench/dtensor_ops.py prints 13.6 per TP Linear of llama-small, 10.4 of mixtral-small, 16.7 of
# vit-small. Uncalibrated, a TP Linear's host time is these at DTENSOR_OP_SECONDS; calibration
# measures a TP Linear's directly (NodeSpec.tp_linear_seconds: `stratagem calibrate --nproc 4` on 2
# cores printed 1.04 ms, where 12 of the optimizer's DTensor operators it printed, 26 µs each,
# make 0.31 ms: elementwise operators on DTensors propagate no sharding a matmul's layout needs).
DTENSOR_OPS_PER_TP_LINEAR = 12

# Operators one optimizer step dispatches per parameter tensor (torch.optim's single-tensor
# update, its CPU default; counted with a dispatch-mode counter on torch 2.13, zero_grad
# included). On GPUs torch.optim defaults to the foreach update: about as many per dtype group,
# not per tensor.
OPTIMIZER_OPS_PER_TENSOR = {"adamw": 10, "sgd": 3}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStep:
    """What one rank of the most loaded pipeline stage does in one optimizer step.

    ``stage`` holds the stage's segments (its blocks, plus the embedding or head where they
    sit) and their sums; ``flops_per_second`` is the rank's achievable FLOP/s,
    ``block_matmul_efficiency`` the share of it the blocks' matmuls reach at their sizes
    (:func:`block_matmul_efficiency`), ``unaligned_matmul_fraction`` the share of it GEMMs
    with unaligned matrices reach, ``seconds_per_op_byte`` what each byte operators without
    FLOPs read or write costs."""

    profile: ModelProfile
    cluster: Cluster
    plan: Plan
    optimizer: str
    precision: Precision
    stage: Stage
    links: dict[MeshAxis, tuple[float, float]]  # (bytes/s, seconds) per mesh axis: group_link
    flops_per_second: float
    block_matmul_efficiency: float
    unaligned_matmul_fraction: float
    seconds_per_op_byte: float

    def link(self, axis: MeshAxis, op: str) -> dict[str, float]:
        """``bandwidth`` and ``latency`` of ``op`` on the ``axis`` group (the collective's own
        calibrated fit inside a node, when measured), as keyword arguments."""
        bandwidth, latency = mesh_links(self.cluster, self.plan, op)[axis]
        return {"bandwidth": bandwidth, "latency": latency}

    @property
    def num_microbatches(self) -> int:
        """Micro-batches the rank runs per step: pipeline micro-batches × accumulation steps."""
        return self.plan.microbatches * self.plan.grad_accum

    @property
    def num_reductions(self) -> int:
        """Gradient reductions per step: once per step, except zero 3 (per accumulation step:
        sharded gradients cannot accumulate unreduced)."""
        return self.plan.grad_accum if self.plan.zero == 3 else 1

    @property
    def batch_scale(self) -> float:
        """Micro-batch size over the profiled batch size: what profiled FLOPs and bytes scale by."""
        return self.plan.micro_batch_size / self.profile.batch_size

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens (samples, for non-sequence models) in one micro-batch."""
        return self.plan.micro_batch_size * (self.profile.seq_len or 1)

    @property
    def params_per_rank(self) -> float:
        """Parameters of the stage on one TP rank (before any data-parallel sharding)."""
        return self.stage.per_tp_rank("num_params", self.plan.tp)

    @property
    def optimizer_params(self) -> float:
        """Parameters whose optimizer state this rank updates: zero >= 1 shards over dp_shard."""
        return self.params_per_rank / (self.plan.dp_shard if self.plan.zero else 1)

    def per_tp_rank(self, field: str, *, blocks_only: bool = False) -> float:
        """A profiled quantity summed over the stage (or its blocks only) as one TP rank runs it
        (the blocks split over the TP group, the embedding and head whole), at the profiled batch."""
        if blocks_only:
            return self.stage.block_sums[field] / self.plan.tp
        return self.stage.per_tp_rank(field, self.plan.tp)

    def per_microbatch(self, field: str, *, blocks_only: bool = False) -> float:
        """A profiled quantity that grows with the batch (``fwd_flops``, ``bwd_op_bytes``, …) for
        one micro-batch: :meth:`per_tp_rank` scaled by :attr:`batch_scale`."""
        return self.per_tp_rank(field, blocks_only=blocks_only) * self.batch_scale

    def pass_seconds(self, direction: str, *, blocks_only: bool = False) -> float:
        """Seconds of one micro-batch's forward (``"fwd"``) or backward (``"bwd"``) over the stage
        (or its blocks only) on one TP rank: its FLOPs at the achievable rate and the bytes its
        operators without FLOPs move, at :attr:`seconds_per_op_byte` (those of parameter-sized
        outputs, autocast's weight casts, as many at any micro-batch size). The blocks' FLOPs run at
        :attr:`block_matmul_efficiency` of the rate, the embedding's and head's at all of it, and
        the GEMMs with unaligned matrices at :attr:`unaligned_matmul_fraction` of either."""
        flops = f"{direction}_flops"
        blocks = self.per_microbatch(flops, blocks_only=True)
        outside = 0.0 if blocks_only else self.per_microbatch(flops) - blocks
        unaligned = self.per_microbatch(f"{direction}_unaligned_flops", blocks_only=blocks_only)
        return ((blocks / self.block_matmul_efficiency + outside
                 + unaligned * (1 / self.unaligned_matmul_fraction - 1)) / self.flops_per_second
                + (self.per_microbatch(f"{direction}_op_bytes", blocks_only=blocks_only)
                   + self.per_tp_rank(f"{direction}_param_op_bytes", blocks_only=blocks_only)) * self.seconds_per_op_byte)


def estimate_time(profile: ModelProfile, *, cluster: Cluster, workload: Workload,
                  plan: Plan) -> TimeBreakdown:
    """Seconds per optimizer step of ``plan``, term by term, on the most loaded rank."""
    step = rank_step(profile, cluster=cluster, workload=workload, plan=plan)
    compute, recompute = estimate_compute_seconds(step), estimate_recompute_seconds(step)
    tp_comm = estimate_tp_comm_seconds(step)
    grads, gathers = estimate_grad_sync_seconds(step), estimate_param_gather_seconds(step)
    pp_comm = estimate_pp_comm_seconds(step)
    optimizer = estimate_optimizer_seconds(step)
    dp_comm = estimate_dp_comm_exposed_seconds(step, grads=grads, gathers=gathers, compute=compute,
                                               recompute=recompute)
    return TimeBreakdown(
        compute=compute,
        recompute=recompute,
        dp_comm=dp_comm.exposed,
        tp_comm=tp_comm,  # on the critical path: nothing overlaps it
        pp_comm=estimate_pp_comm_exposed_seconds(step, total=pp_comm, compute=compute + recompute),
        bubble=estimate_bubble_seconds(step, ideal=compute + recompute + tp_comm + _host_seconds(step),
                                       reductions=dp_comm.in_backward),
        optimizer=optimizer,
        offload=estimate_offload_seconds(step),
        dispatch=estimate_dispatch_seconds(step, device_busy=compute + recompute + tp_comm + optimizer),
        dp_comm_total=grads + gathers,
        tp_comm_total=tp_comm,
        pp_comm_total=pp_comm,
    )


def rank_step(profile: ModelProfile, *, cluster: Cluster, workload: Workload,
              plan: Plan) -> RankStep:
    """Describe the most loaded rank's work; :class:`UsageError` when the profile, workload and
    plan disagree on what a step is."""
    if workload.seq_len and profile.seq_len and workload.seq_len != profile.seq_len:
        raise UsageError(f"the profile was taken at seq_len={profile.seq_len}, the workload has "
                         f"{workload.seq_len}: attention FLOPs do not scale linearly\n"
                         f"HINT: profile the model at seq_len={workload.seq_len}")
    if plan.global_batch_size != workload.global_batch_size:
        raise UsageError(f"{plan.name} processes {plan.global_batch_size} samples per step, the "
                         f"workload {workload.global_batch_size}\nHINT: micro_batch_size × "
                         "microbatches × grad_accum × dp must equal the global batch")
    curve = matmul_curve(cluster, plan.precision)
    fraction = 1.0 if curve else ACHIEVABLE_FLOPS_FRACTION["gpu" if cluster.is_gpu else "cpu"]
    peak = estimate_peak_flops(cluster, precision=plan.precision)
    stage = busiest_stage(profile, plan)
    efficiency = block_matmul_efficiency(profile, plan, stage, curve)
    return RankStep(profile=profile, cluster=cluster, plan=plan, optimizer=workload.optimizer,
                    precision=get_precision(plan.precision), stage=stage, links=mesh_links(cluster, plan),
                    flops_per_second=fraction * peak,
                    block_matmul_efficiency=efficiency,
                    unaligned_matmul_fraction=unaligned_matmul_fraction(cluster, plan.precision),
                    seconds_per_op_byte=seconds_per_op_byte(cluster))


def estimate_peak_flops(cluster: Cluster, *, precision: str) -> float:
    """Dense peak FLOP/s of one device in ``precision``'s compute dtype (fp32 as
    :data:`FP32_MATMUL_USES_TF32` says)."""
    return cluster.device.peak_flops(_matmul_dtype(cluster, precision))


def _matmul_dtype(cluster: Cluster, precision: str) -> str:
    """The device dtype ``precision``'s matmuls run in: ``fp32`` (``tf32`` as
    :data:`FP32_MATMUL_USES_TF32` says), ``bf16`` or ``fp16``."""
    dtype = get_precision(precision).compute_dtype
    if dtype == "float32":
        return "tf32" if FP32_MATMUL_USES_TF32 and cluster.device.peak_tf32 is not None else "fp32"
    return {"bfloat16": "bf16", "float16": "fp16"}[dtype]


def matmul_curve(cluster: Cluster, precision: str) -> list[tuple[int, float]]:
    """The calibrated (side, FLOP/s) of square matmuls in ``precision``'s matmul dtype, by side
    (``NodeSpec.matmul_curve``; empty uncalibrated)."""
    dtype = _matmul_dtype(cluster, precision)
    return sorted((n, rate) for measured, n, rate in cluster.node.matmul_curve if measured == dtype)


def unaligned_matmul_fraction(cluster: Cluster, precision: str) -> float:
    """The share of the aligned rate GEMMs with unaligned matrices reach in ``precision``'s matmul
    dtype: as calibrated (``NodeSpec.unaligned_matmul``), else :data:`UNALIGNED_MATMUL_FRACTION`."""
    measured = dict(cluster.node.unaligned_matmul).get(_matmul_dtype(cluster, precision))
    return measured if measured is not None else UNALIGNED_MATMUL_FRACTION["gpu" if cluster.is_gpu else "cpu"]


def block_matmul_efficiency(profile: ModelProfile, plan: Plan, stage: Stage, curve: list[tuple[int, float]]) -> float:
    """The share of the peak rate the stage's blocks' Linears reach at their sizes, from a
    matmul curve (:func:`matmul_curve`; 1 without one): each Linear's GEMM on
    one TP rank (the micro-batch's tokens × its input × its output width, the split side
    divided by TP) runs at the curve's rate for a square matmul of the same FLOPs (``n³ = m·k·n``,
    interpolated in ``log n``, clamped at the measured ends), over the rate at the largest size;
    weighted by FLOPs, as their times add. The rows a Linear multiplies are those the profile saw
    (:func:`linear_rows`: a routed expert's share of the tokens), else the block's tokens, from
    its FLOPs (the attention core's set aside)."""
    if not curve:
        return 1.0
    styles = _block_styles(plan.tp_layout, plan.block_container) if plan.tp > 1 else {}
    scale = plan.micro_batch_size / profile.batch_size
    flops = seconds = 0.0
    for block, count in stage.kinds:
        widths = sum(linear.in_features * linear.out_features for linear in block.linears)
        if not widths:
            continue
        per_sample = (block.fwd_flops - block.attention_fwd_flops) / (2 * widths) / profile.batch_size
        for linear in block.linears:
            style = styles.get(linear.name)
            inner = linear.in_features / (plan.tp if style == "rowwise" else 1)
            outer = linear.out_features / (plan.tp if style == "colwise" else 1)
            size = linear_rows(linear, scale, per_sample * plan.micro_batch_size) * inner * outer
            flops += count * size
            seconds += count * size / _interpolated_rate(curve, size ** (1 / 3))
    return flops / seconds / curve[-1][1] if seconds else 1.0


def linear_rows(linear: LinearLayer, batch_scale: float, tokens: float) -> float:
    """Rows ``linear`` multiplies per micro-batch: the profiled rows scaled by ``batch_scale``
    (micro-batch over profiled batch), or ``tokens`` where the profile recorded none."""
    return linear.rows * batch_scale if linear.rows else tokens


def _interpolated_rate(curve: list[tuple[int, float]], n: float) -> float:
    """The rate of a square matmul of side ``n`` on ``curve`` (sorted (side, FLOP/s)): linear in
    ``log n`` between measured sides, the end's rate beyond them."""
    if n <= curve[0][0]:
        return curve[0][1]
    for (n0, r0), (n1, r1) in zip(curve, curve[1:]):
        if n <= n1:
            return r0 + (r1 - r0) * math.log(n / n0) / math.log(n1 / n0)
    return curve[-1][1]


def seconds_per_op_byte(cluster: Cluster) -> float:
    """Seconds each byte an operator without FLOPs reads or writes costs: as calibrated
    (``NodeSpec.op_byte_seconds``), else at the device's memory bandwidth ×
    :data:`MEMORY_BANDWIDTH_EFFICIENCY` (roofline, Williams et al. 2009)."""
    measured = cluster.node.op_byte_seconds
    if measured is not None:
        return measured
    return 1 / (cluster.device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)


# -- compute ----------------------------------------------------------------------------------


def estimate_compute_seconds(step: RankStep) -> float:
    """Forward and backward of every micro-batch on the rank, seconds: profiled FLOPs (measured:
    the profile) scaled to the micro-batch, the blocks' divided over TP, over achievable FLOP/s,
    and the bytes the operators without FLOPs move (:meth:`RankStep.pass_seconds`), with the
    data-parallel runtime's copies around its collectives (:func:`estimate_dp_copy_seconds`) and
    the gradients' accumulation over micro-batches (:func:`estimate_grad_accumulation_seconds`).
    Megatron splits the vocabulary projection too (Shoeybi et al. 2019, §3); the TP plugin keeps
    the embedding and head whole on every TP rank, and this costs what it applies."""
    passes = step.num_microbatches * (step.pass_seconds("fwd") + step.pass_seconds("bwd"))
    return passes + estimate_dp_copy_seconds(step) + estimate_grad_accumulation_seconds(step)


def estimate_grad_accumulation_seconds(step: RankStep) -> float:
    """Adding each micro-batch's gradients to those of the ones before, seconds: autograd adds
    into ``.grad`` in place after the first (the profile ran one micro-batch, which only stores
    them), in the parameter dtype: two read and one written per gradient, at the rank's cost per
    byte moved. FSDP2 (zero 2/3) adds its reduced shards."""
    plan = step.plan
    grads = step.params_per_rank / (plan.dp_shard if plan.zero >= 2 else 1)
    return (step.num_microbatches - 1) * 3 * grads * step.precision.param_bytes * step.seconds_per_op_byte


def estimate_dp_copy_seconds(step: RankStep) -> float:
    """The data-parallel runtime's copies around its collectives, seconds: compute's (they run on
    its stream or core), each byte copied read and written at the rank's cost per byte moved
    (:attr:`RankStep.seconds_per_op_byte`). DDP copies every gradient into its buckets and back
    after the all-reduce (``gradient_as_bucket_view=False``, the plugins' default); FSDP2 copies a
    unit's shard into the all-gather's input and the gathered unit out into the parameters, in
    the compute dtype, at every gather (:func:`estimate_param_gather_seconds`), and the unit's
    gradients into the reduce-scatter's input, in the parameter dtype, at every reduction."""
    plan = step.plan
    if plan.dp == 1:
        return 0.0
    params, prec = step.params_per_rank, step.precision
    if plan.zero <= 1:
        copied = 2 * params * prec.param_bytes
    else:
        gathers = 2 * step.num_microbatches if plan.zero == 3 else 1
        copied = (gathers * params * prec.compute_bytes * (1 + 1 / plan.dp_shard)
                  + step.num_reductions * params * prec.param_bytes)
    return 2 * copied * step.seconds_per_op_byte


def estimate_recompute_seconds(step: RankStep) -> float:
    """Forward run again in backward, seconds: every block's forward for ``full``, the FLOPs of
    its attention core for ``selective`` (Korthikanti et al. 2022, §5, Table 2)."""
    policy = step.plan.activation_checkpointing
    if policy == "none":
        return 0.0
    if policy == "full":
        per_microbatch = step.pass_seconds("fwd", blocks_only=True)
    else:
        per_microbatch = step.per_microbatch("attention_fwd_flops", blocks_only=True) / step.flops_per_second
    return step.num_microbatches * per_microbatch


def estimate_bubble_seconds(step: RankStep, *, ideal: float, reductions: float) -> float:
    """Pipeline fill and drain, seconds: the busiest rank waits one micro-batch of every other
    rank before its first and after its last (:func:`_others_share` of its own), so
    ``share/(m·v)`` of the ideal time of its micro-batches (``ideal``: compute, recompute, TP
    communication, and on CPU ranks the host's launching of their operators) — Narayanan et al.
    2021, §2.2.1 eq. 1 (GPipe and 1F1B alike; ``share = p − 1`` for equal stages) and §2.2.2
    (interleaved: divided by ``v`` virtual stages). Zero-bubble
    (``interleaved-zb``) fills it with weight-gradient passes: Qi et al. 2024 (ZB-H1, §3) leave
    ``(p−1)(T_F + T_B − T_W)`` of 1F1B's ``(p−1)(T_F + T_B + T_W)``, with the backward split into
    equal input (``T_B``) and weight (``T_W``) halves: the forward's share of the pass.

    CPU ranks that share cores lose only part of it (:func:`bubble_lost_share`); for the rest,
    the node's cores run every rank's micro-batches as they come, so the busiest rank's take the
    ranks' mean time rather than its own (the lighter stages leave it their cores): where stages
    differ, that part is negative.

    The drain also waits for the other ranks' reductions that run inside their last backward
    (DDP's, before the input gradient goes upstream): the rank's own exposed ones
    (``reductions``: :attr:`DpExposure.in_backward`), scaled by the other ranks' parameters over
    its own; waiting on communication, no busy rank takes those cores."""
    plan = step.plan
    if plan.pp == 1:
        return 0.0
    share = _others_share(step)
    fill = share / (plan.microbatches * plan.pp_virtual) * ideal
    if plan.pp_schedule == "interleaved-zb":
        forward, backward = step.stage.sums["fwd_flops"], step.stage.sums["bwd_flops"]
        fill *= forward / (forward + backward) if forward + backward else 1.0
    lost = bubble_lost_share(plan.pp, step.cluster.ranks_per_core)
    spread = (1 - lost) * ((1 + share) / plan.pp - 1) * ideal
    drain = others_share(step.profile, plan, "num_params") * reductions
    return lost * fill + spread + drain


def _others_share(step: RankStep) -> float:
    """The other pipeline ranks' micro-batches over the busiest rank's: by FLOPs on GPUs
    (:func:`~stratagem.advisor.cost.stages.others_share`); on CPU ranks, where the host's launching and
    the bytes moved weigh as much as FLOPs (an embedding's gather has none), each rank's passes
    and launching, costed at this rank's rates."""
    if step.cluster.is_gpu:
        return others_share(step.profile, step.plan, "fwd_flops", "bwd_flops")

    def load(rank: RankStep) -> float:
        return rank.pass_seconds("fwd") + rank.pass_seconds("bwd") + microbatch_dispatch_seconds(rank)

    own = load(step)
    total = sum(load(replace(step, stage=stage)) for stage in rank_stages(step.profile, step.plan))
    return (total - own) / own if own else step.plan.pp - 1.0


def bubble_lost_share(pp: int, ranks_per_core: float) -> float:
    """The share of a pipeline's bubble a node loses when ``ranks_per_core`` ranks share each
    core. The bubble fills and drains in ``pp − 1`` steps, ``j/pp`` of the ranks busy at step
    ``j``: with a core each, the idle ``1 − j/pp`` is lost; sharing cores, the busy ranks take the
    idle ones' cores (the scheduler gives every runnable thread a core), so a node keeps its whole
    throughput while ``ranks_per_core · j/pp ≥ 1`` and loses ``1 − ranks_per_core · j/pp`` below.
    1 for ranks with a device each; 0 where the busy stage's ranks fill the cores."""
    steps = range(1, pp)
    idle = sum(1 - j / pp for j in steps)
    if not idle or ranks_per_core <= 1:
        return 1.0
    return sum(max(0.0, 1 - ranks_per_core * j / pp) for j in steps) / idle


# -- tensor and pipeline parallel communication ----------------------------------------------


def estimate_tp_comm_seconds(step: RankStep) -> float:
    """TP collectives of every block and micro-batch, seconds, none overlapped: those of
    :func:`tp_collectives` in forward and backward, the forward's again under full recomputation,
    each with its wait for the ranks (:func:`collective_wait_seconds`)."""
    plan = step.plan
    if plan.tp == 1:
        return 0.0
    forwards = 2 if plan.activation_checkpointing == "full" else 1
    per_microbatch = 0.0
    for block, count in step.stage.kinds:
        forward, backward = tp_collectives(step, block)
        seconds = [sum(_COLLECTIVE_SECONDS[op](num_bytes, group_size=plan.tp, **step.link(MeshAxis.TP, op))
                       + collective_wait_seconds(step, plan.tp) for op, num_bytes in messages)
                   for messages in (forward, backward)]
        per_microbatch += count * (forwards * seconds[0] + seconds[1])
    return step.num_microbatches * per_microbatch


_COLLECTIVE_SECONDS = {"all_reduce": estimate_all_reduce_seconds, "all_gather": estimate_all_gather_seconds,
                       "reduce_scatter": estimate_reduce_scatter_seconds}

_Messages = tuple[tuple[str, float], ...]


def tp_collectives(step: RankStep, block: SegmentProfile) -> tuple[_Messages, _Messages]:
    """The TP collectives ``(op, bytes)`` of one micro-batch through ``block``, in forward and in
    backward, as the TP plugin applies the plan's layout (torch's ``ColwiseParallel`` and
    ``RowwiseParallel``, one Linear at a time): forward all-reduces each rowwise Linear's output,
    backward each colwise Linear's input gradient (the Linears reading one input each reduce
    their own, unlike Megatron's one per column group). With sequence parallelism each norm on
    sequence shards all-gathers its output in forward and reduce-scatters its gradient in
    backward, each rowwise Linear reduce-scatters its output and all-gathers its gradient
    (Korthikanti et al. 2022, §4.2.2). Messages are ``rows × width`` in the compute dtype, each
    Linear at the rows the profile saw it multiply (:func:`linear_rows`; a routed expert's share),
    the micro-batch's tokens where not recorded. A block the layout does not name: Megatron's
    pairing (Shoeybi et al. 2019, §3), two ``b·s·h`` all-reduces each way, or with SP an
    all-gather and a reduce-scatter in their place."""
    styles = _block_styles(step.plan.tp_layout, step.plan.block_container)
    rows = [linear for linear in block.linears if styles.get(linear.name) == "rowwise"]
    cols = [linear for linear in block.linears if styles.get(linear.name) == "colwise"]
    element = step.precision.compute_bytes

    def per_row(linear: LinearLayer) -> float:
        return linear_rows(linear, step.batch_scale, step.tokens_per_microbatch) * element

    width = tp_message_bytes(step, block)
    if step.plan.sequence_parallel:
        norms = sum(style == "sequence_parallel" for style in styles.values())
        if not rows:
            norms, row_bytes = 2, [width, width]
        else:
            row_bytes = [per_row(linear) * linear.out_features for linear in rows]
        return ((("all_gather", width),) * norms + tuple(("reduce_scatter", b) for b in row_bytes),
                (("reduce_scatter", width),) * norms + tuple(("all_gather", b) for b in row_bytes))
    if not rows:
        return (("all_reduce", width),) * 2, (("all_reduce", width),) * 2
    return (tuple(("all_reduce", per_row(linear) * linear.out_features) for linear in rows),
            tuple(("all_reduce", per_row(linear) * linear.in_features) for linear in cols))


def _num_tp_linears(plan: Plan, block: SegmentProfile) -> int:
    """``block``'s Linears the plan's layout splits (all of them when it names none)."""
    styles = _block_styles(plan.tp_layout, plan.block_container)
    split = sum(styles.get(linear.name) in ("colwise", "rowwise") for linear in block.linears)
    return split or len(block.linears)


def splits_routed_experts(profile: ModelProfile, plan: Plan) -> bool:
    """Whether ``plan``'s tensor parallelism splits a Linear that multiplies fewer rows than its
    block's others: a routed expert, whose rows follow the routing from step to step."""
    if plan.tp == 1:
        return False
    styles = _block_styles(plan.tp_layout, plan.block_container)
    split = {name for name, style in styles.items() if style in ("colwise", "rowwise")}
    for block in profile.blocks:  # as _num_tp_linears: a layout that names none splits them all
        most = max((linear.rows for linear in block.linears), default=0)
        if any(0 < linear.rows < most and (not split or linear.name in split) for linear in block.linears):
            return True
    return False


@functools.lru_cache(maxsize=256)
def _block_styles(layout: tuple[tuple[str, str], ...], container: str | None) -> dict[str, str]:
    """``layout``'s styles by module name relative to a block (``layers.*.attention.wq`` →
    ``attention.wq``)."""
    prefix = f"{container}.*."
    return {pattern[len(prefix):]: style for pattern, style in layout if pattern.startswith(prefix)}


def tp_message_bytes(step: RankStep, block: SegmentProfile) -> float:
    """Bytes of one TP collective of ``block``: ``b·s·h`` in the compute dtype, ``h`` the input
    width of the block's first linear (the model width), ``b·s`` the rows it multiplies
    (:func:`linear_rows`: a ViT's patches too); a block without linears: its output as profiled,
    scaled to the micro-batch."""
    if not block.linears:
        return block.output_bytes * step.batch_scale
    first = block.linears[0]
    rows = linear_rows(first, step.batch_scale, step.tokens_per_microbatch)
    return rows * first.in_features * step.precision.compute_bytes


def collective_wait_seconds(step: RankStep, group_size: int) -> float:
    """What a blocking collective over ``group_size`` ranks waits beyond its own time, seconds: the
    ranks reach it apart after the compute before it, and it ends when the last arrives. As
    calibrated (``NodeSpec.sync_seconds``: ranks that share cores arrive a scheduler slice
    apart); uncalibrated none, as for ranks with a device each, which arrive within microseconds
    of each other."""
    return (step.cluster.node.sync_seconds or 0.0) if group_size > 1 else 0.0


def estimate_pp_comm_seconds(step: RankStep) -> float:
    """Pipeline p2p, seconds per step on one rank: every micro-batch sends its activation
    forward and its gradient backward across each of the rank's ``pp_virtual`` stage boundaries
    (Narayanan et al. 2021, §2.2), each message received by a rank that waits on it
    (:func:`_pp_message_seconds`)."""
    plan = step.plan
    if plan.pp == 1:
        return 0.0
    return 2 * step.num_microbatches * plan.pp_virtual * _pp_message_seconds(step)


def estimate_pp_comm_exposed_seconds(step: RankStep, *, total: float, compute: float) -> float:
    """The part of pipeline p2p no compute hides, seconds: the first micro-batch's activation
    crosses all ``pp·v − 1`` boundaries before the last stage starts, and its gradient crosses
    back (fill and drain, on the critical path); steady-state sends run asynchronously beside
    compute (isend/irecv), exposed only beyond the compute they run next to (``compute``,
    recompute included). ``total``: all of the rank's p2p seconds."""
    if total == 0.0:
        return 0.0
    fill_drain = 2 * (step.plan.num_stages - 1) * _pp_message_seconds(step)
    return min(total, fill_drain + max(0.0, total - compute))


def _pp_message_seconds(step: RankStep) -> float:
    """One boundary activation (as profiled, scaled to the micro-batch; split over TP with SP),
    and the receiver's wait for a sender that reaches it apart, as a blocking collective's
    (:func:`collective_wait_seconds`: on CPU ranks that share cores, the sender's transfer
    waits for a scheduler slice while the others compute)."""
    plan = step.plan
    num_bytes = step.stage.max_block_output_bytes * step.batch_scale
    num_bytes /= plan.tp if plan.sequence_parallel else 1
    return estimate_p2p_seconds(num_bytes, **step.link(MeshAxis.PP, "p2p")) + collective_wait_seconds(step, 2)


# -- data-parallel communication -------------------------------------------------------------


def estimate_grad_sync_seconds(step: RankStep) -> float:
    """Gradient reductions per step, seconds, one collective per communication unit (DDP
    bucket, FSDP unit: :func:`_num_comm_units`), each paying its latency and its wait for the
    ranks (:func:`collective_wait_seconds`). Gradients reduce in the parameter dtype (DDP
    reduces ``param.grad``: fp32 for ``*-mixed``, bf16 for ``bf16-true``; FSDP2 as applied here
    keeps ``reduce_dtype`` fp32 like torchtitan). zero 0/1: all-reduce (DDP); zero 2/3:
    reduce-scatter over ``dp_shard``, then HSDP all-reduces the shard over ``dp_replicate``
    (ZeRO, Rajbhandari et al. 2020, §7.2)."""
    plan = step.plan
    units = _num_comm_units(step)
    unit_bytes = step.params_per_rank * step.precision.param_bytes / units
    if plan.zero <= 1:
        axis = MeshAxis.DP_REPLICATE if plan.zero == 0 else MeshAxis.DP_SHARD
        return units * (estimate_all_reduce_seconds(unit_bytes, group_size=plan.dp, **step.link(axis, "all_reduce"))
                        + collective_wait_seconds(step, plan.dp))
    shard = estimate_reduce_scatter_seconds(unit_bytes, group_size=plan.dp_shard,
                                            **step.link(MeshAxis.DP_SHARD, "reduce_scatter"))
    shard += estimate_all_reduce_seconds(unit_bytes / plan.dp_shard, group_size=plan.dp_replicate,
                                         **step.link(MeshAxis.DP_REPLICATE, "all_reduce"))
    shard += collective_wait_seconds(step, plan.dp_shard) + collective_wait_seconds(step, plan.dp_replicate)
    return step.num_reductions * units * shard


def estimate_param_gather_seconds(step: RankStep) -> float:
    """Parameter all-gathers over ``dp_shard`` per step, seconds, one per FSDP unit, each paying
    its latency and its wait for the ranks (:func:`collective_wait_seconds`). zero 1: the
    optimizer re-syncs updated parameters (param dtype) after its step, costed as one gather:
    ZeroRedundancyOptimizer, as the plugin builds it, broadcasts each rank's bucket of
    parameters, all at once and asynchronously — the gather's bytes, in as many pieces as
    ranks. zero 2: each FSDP unit gathered
    once per step, in the compute dtype; zero 3: before forward and again before backward of
    every micro-batch (FSDP reshard-after-forward; ZeRO, Rajbhandari et al. 2020, §7.2.2: 1.5×
    DDP's volume)."""
    plan = step.plan
    if plan.zero == 0:
        return 0.0
    dtype_bytes = step.precision.param_bytes if plan.zero == 1 else step.precision.compute_bytes
    pieces = 1 if plan.zero == 1 else _num_comm_units(step)
    count = 2 * step.num_microbatches if plan.zero == 3 else 1
    gather = estimate_all_gather_seconds(step.params_per_rank * dtype_bytes / pieces, group_size=plan.dp_shard,
                                         **step.link(MeshAxis.DP_SHARD, "all_gather"))
    return count * pieces * (gather + collective_wait_seconds(step, plan.dp_shard))


class DpExposure(NamedTuple):
    """DP communication no compute hides (``exposed``), and of it what reduces inside the last
    backward (``in_backward``: DDP's buckets), which a pipeline's drain waits for on every stage
    (:func:`estimate_bubble_seconds`)."""

    exposed: float
    in_backward: float


def estimate_dp_comm_exposed_seconds(step: RankStep, *, grads: float, gathers: float,
                                     compute: float, recompute: float) -> DpExposure:
    """The part of DP communication no compute hides, seconds.

    DDP and FSDP overlap reductions with backward, FSDP its gathers with forward too: exposed
    = ``max(0, comm − window × efficiency)`` (:data:`DP_OVERLAP_EFFICIENCY`, or the calibrated
    overlap) plus the last bucket or unit, which
    starts when compute ends. zero 1's post-step parameter sync has nothing to hide behind.
    Under a pipeline schedule (torch.distributed.pipelining), DDP reduces inside each stage's
    last backward, before its input gradient goes upstream; FSDP reduces once after the last
    micro-batch (``perform_reduce_grad``), beside no compute. ``grads`` and ``gathers``: the
    reductions' and gathers' full seconds; ``compute`` and ``recompute``: the step's."""
    plan = step.plan
    fixed, hideable = (gathers, grads) if plan.zero == 1 else (0.0, grads + gathers)
    if plan.pp > 1 and plan.zero >= 2:
        fixed, hideable = grads, gathers
    if hideable == 0.0:
        return DpExposure(fixed, 0.0)
    overlap = step.cluster.node.comm_overlap
    efficiency = DP_OVERLAP_EFFICIENCY if overlap is None else overlap
    window = _dp_overlap_window_seconds(step, compute=compute, recompute=recompute) * efficiency
    tail = hideable / _num_comm_units(step)
    overlapped = min(hideable, max(0.0, hideable - window) + tail)
    return DpExposure(fixed + overlapped, overlapped if plan.zero <= 1 else 0.0)


def _dp_overlap_window_seconds(step: RankStep, *, compute: float, recompute: float) -> float:
    """Compute that DP communication can run beside: the backward of the micro-batches that
    reduce (zero 0/1), plus the first forward (zero 2's one gather), or everything (zero 3)."""
    if step.plan.zero == 3:
        return compute + recompute
    backward = step.pass_seconds("bwd") + recompute / step.num_microbatches
    forward = step.pass_seconds("fwd") if step.plan.zero == 2 else 0.0
    return forward + step.num_reductions * backward


def _num_comm_units(step: RankStep) -> int:
    """Pieces DP communication runs in: DDP buckets (zero 0/1), FSDP units (zero 2/3: one per
    block plus the root)."""
    if step.plan.zero >= 2:
        return len(step.stage.blocks) + 1
    grad_bytes = step.params_per_rank * step.precision.param_bytes
    return max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))


# -- optimizer and offload --------------------------------------------------------------------


def estimate_optimizer_seconds(step: RankStep) -> float:
    """One optimizer step on the rank's shard, seconds, beyond launching its operators
    (:func:`estimate_dispatch_seconds`): as calibrated, the step's measured seconds per parameter
    (``NodeSpec.optimizer_seconds``, fp32; scaled by the parameter dtype's bytes), else
    memory-bound streaming of :data:`OPTIMIZER_TENSOR_PASSES` tensors in the parameter dtype on
    the device (peak bandwidth × :data:`MEMORY_BANDWIDTH_EFFICIENCY`: roofline, Williams et al.
    2009). Offloaded, on the host: :data:`HOST_OPTIMIZER_BANDWIDTH_PER_NODE` shared by the node's
    ranks."""
    num_bytes = (step.optimizer_params * OPTIMIZER_TENSOR_PASSES[step.optimizer]
                 * step.precision.param_bytes)
    if step.plan.offload != "none":
        return num_bytes / (HOST_OPTIMIZER_BANDWIDTH_PER_NODE / step.cluster.devices_per_node)
    if (measured := _calibrated_optimizer(step)) is not None:
        return step.optimizer_params * measured[0] * step.precision.param_bytes / 4
    return num_bytes / (step.cluster.device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)


def _calibrated_optimizer(step: RankStep) -> tuple[float, float] | None:
    """(seconds per fp32 parameter, seconds per parameter tensor) of the step's optimizer as
    calibrated on the node, or None."""
    return next(((per_param, per_tensor) for name, per_param, per_tensor in step.cluster.node.optimizer_seconds
                 if name == step.optimizer), None)


def estimate_offload_seconds(step: RankStep) -> float:
    """Host-link (PCIe) copies per step, seconds, all exposed (conservative). Each gradient
    reduction copies the rank's gradient shard to the host; updated parameters return once
    (``optimizer``, ZeRO-Offload: Ren et al. 2021, §4.1) or before every parameter all-gather
    (``params``, FSDP2 CPUOffloadPolicy). CPU ranks have no host link: nothing moves."""
    plan, host_link = step.plan, step.cluster.node.host_link
    if plan.offload == "none" or host_link is None:
        return 0.0
    shard_bytes = step.optimizer_params * step.precision.param_bytes
    uploads = 2 * step.num_microbatches if plan.offload == "params" else 1
    copy = estimate_p2p_seconds(shard_bytes, bandwidth=host_link.effective_bandwidth,
                                latency=host_link.latency)
    return (step.num_reductions + uploads) * copy


# -- operator dispatch ------------------------------------------------------------------------


def estimate_dispatch_seconds(step: RankStep, *, device_busy: float) -> float:
    """Host time launching the step's operators that the device's own work does not hide,
    seconds: every micro-batch's (:func:`microbatch_dispatch_seconds`) and the optimizer's
    (:func:`_optimizer_dispatch_seconds`). A CPU rank runs each operator as it launches it, so
    all of it adds; a GPU runs behind the host, which binds only when it launches slower than
    the GPU computes (``device_busy``: the step's compute, recompute, TP collectives and
    optimizer)."""
    host = step.num_microbatches * microbatch_dispatch_seconds(step) + _optimizer_dispatch_seconds(step)
    return max(0.0, host - device_busy) if step.cluster.is_gpu else host


def microbatch_dispatch_seconds(step: RankStep) -> float:
    """Host seconds launching one micro-batch's operators: every operator the profile counted in
    forward and backward (the checkpointed blocks' forward again under full recomputation), at
    the node's seconds per operator (calibrated, else :data:`OP_DISPATCH_SECONDS`). TP does not
    divide them: every rank runs every operator. A TP block's Linears run on DTensors, which adds
    the node's host seconds per TP Linear (:func:`_tp_linear_seconds`)."""
    sums, plan = step.stage.sums, step.plan
    ops = sums["fwd_ops"] + sums["bwd_ops"]
    if plan.activation_checkpointing == "full":
        ops += step.stage.block_sums["fwd_ops"]
    tp_linears = sum(n * _num_tp_linears(plan, b) for b, n in step.stage.kinds) if plan.tp > 1 else 0
    return _op_seconds(step)[0] * ops + tp_linears * _tp_linear_seconds(step)


def _tp_linear_seconds(step: RankStep) -> float:
    """Host seconds a TP Linear's forward and backward on DTensors add beyond a plain Linear's:
    calibrated (``NodeSpec.tp_linear_seconds``), else :data:`DTENSOR_OPS_PER_TP_LINEAR` operators
    at DTensor's cost per operator beyond a plain one's."""
    measured = step.cluster.node.tp_linear_seconds
    if measured is not None:
        return measured
    plain, dtensor = _op_seconds(step)
    return DTENSOR_OPS_PER_TP_LINEAR * (dtensor - plain)


def _host_seconds(step: RankStep) -> float:
    """The micro-batches' host time that runs in line with their compute: all of it on CPU
    ranks, none on GPUs (which the host runs ahead of)."""
    return 0.0 if step.cluster.is_gpu else step.num_microbatches * microbatch_dispatch_seconds(step)


def _op_seconds(step: RankStep) -> tuple[float, float]:
    """Host seconds per operator on plain tensors and on DTensors: calibrated, else the estimates."""
    node = step.cluster.node
    return node.op_seconds or OP_DISPATCH_SECONDS, node.dtensor_op_seconds or DTENSOR_OP_SECONDS


def _optimizer_dispatch_seconds(step: RankStep) -> float:
    """Host seconds launching the optimizer step's operators: on DTensor parameters (FSDP2, TP)
    :data:`OPTIMIZER_OPS_PER_TENSOR` per tensor at DTensor's seconds per operator each; on plain
    tensors the calibrated seconds per tensor (``NodeSpec.optimizer_seconds``), else as many
    operators at a plain one's seconds, per tensor on CPU and per dtype group on GPUs
    (``foreach``); both per-operator costs from :func:`_op_seconds`."""
    plan, (plain, dtensor) = step.plan, _op_seconds(step)
    tensors = step.stage.sums["num_tensors"] / (plan.dp_shard if plan.zero == 1 else 1)
    ops_per_tensor = OPTIMIZER_OPS_PER_TENSOR[step.optimizer]
    if plan.zero >= 2 or plan.tp > 1:
        return dtensor * ops_per_tensor * tensors
    if (measured := _calibrated_optimizer(step)) is not None:
        return measured[1] * tensors
    return plain * ops_per_tensor * (1 if step.cluster.is_gpu else tensors)


# -- throughput ---------------------------------------------------------------------------------


def model_flops_per_step(profile: ModelProfile, *, workload: Workload) -> float:
    """Forward and backward FLOPs of one step of the whole global batch, recomputation excluded."""
    totals = whole_model(profile).sums
    return (totals["fwd_flops"] + totals["bwd_flops"]) * workload.global_batch_size / profile.batch_size


def tokens_per_second(profile: ModelProfile, *, workload: Workload, time: TimeBreakdown) -> float:
    """Tokens per second of the whole job (samples per second for non-sequence models)."""
    tokens_per_sample = workload.seq_len or profile.seq_len or 1
    return workload.global_batch_size * tokens_per_sample / time.step_seconds


def mfu(profile: ModelProfile, *, cluster: Cluster, workload: Workload, plan: Plan,
        time: TimeBreakdown) -> float:
    """Model FLOPs utilisation: model FLOPs (no recompute) per second over the plan's ranks'
    dense peak (PaLM, Chowdhery et al. 2022, App. B)."""
    peak = plan.world_size * estimate_peak_flops(cluster, precision=plan.precision)
    return model_flops_per_step(profile, workload=workload) / time.step_seconds / peak
