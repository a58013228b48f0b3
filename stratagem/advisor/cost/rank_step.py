"""What one pipeline rank does in one optimizer step: :class:`RankStep`, built once per plan
(for the rank that paces it: :mod:`~stratagem.advisor.cost.pace`) and handed to every time term."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stratagem.advisor.cost.attention import AttentionTime, fused_attention_time
from stratagem.advisor.cost.batch_norm import stage_norm_seconds
from stratagem.advisor.cost.collectives import mesh_links
from stratagem.advisor.cost.convolutions import stage_layout_bytes
from stratagem.advisor.cost.rates import (
    block_matmul_efficiency,
    kernel_gap_seconds,
    large_gemm_rate,
    matmul_curve,
    matmul_dtype,
    seconds_per_op_byte,
    unaligned_matmul_fraction,
)
from stratagem.advisor.cost.stages import Stage, rank_stages
from stratagem.advisor.hardware.spec import Cluster
from stratagem.advisor.memo import by_identity_and_plan
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.errors import UsageError
from stratagem.plan import MeshAxis, Plan, Workload
from stratagem.plan.precision import Precision, get_precision


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStep:
    """What one rank of a pipeline stage does in one optimizer step.

    ``stage`` holds the stage's segments (its blocks, plus the embedding or head where they
    sit) and their sums; ``flops_per_second`` is the rank's achievable FLOP/s,
    ``block_matmul_efficiency`` the share of it the blocks' matmuls reach at their sizes,
    ``unaligned_matmul_fraction`` the share GEMMs with unaligned matrices reach,
    ``seconds_per_op_byte`` what each byte operators without FLOPs move costs
    (:mod:`~stratagem.advisor.cost.rates`), ``kernel_gap_seconds`` the device's gap after each
    kernel launched; ``layout_bytes`` what the layout transforms around
    NCHW convolutions move per ``(direction, blocks only)`` at the profiled batch
    (:mod:`~stratagem.advisor.cost.convolutions`); ``norm_seconds`` what BatchNorm's ATen kernels
    add likewise (:mod:`~stratagem.advisor.cost.batch_norm`); ``attention`` the fused attention
    kernels' FLOPs and seconds per micro-batch by ``blocks only``, where priced apart from the
    GEMMs (:mod:`~stratagem.advisor.cost.attention`)."""

    profile: ModelProfile
    cluster: Cluster
    plan: Plan
    optimizer: str
    grad_clip: str | None  # Workload.grad_clip: how the step clips its gradients first, if at all
    precision: Precision
    stage: Stage
    links: dict[MeshAxis, tuple[float, float]]  # (bytes/s, seconds) per mesh axis: group_link
    flops_per_second: float
    block_matmul_efficiency: float
    unaligned_matmul_fraction: float
    seconds_per_op_byte: float
    kernel_gap_seconds: float
    layout_bytes: dict[tuple[str, bool], float]
    norm_seconds: dict[tuple[str, bool], float]
    attention: dict[bool, AttentionTime] | None = None

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
        """Gradient reductions per step: once per accumulation step under FSDP (ZeRO-2 and 3: FSDP2
        reduces each backward's gradients into their shards, as the verify runner and Lightning run
        it) and under a pipeline (each schedule step reduces after its micro-batches); once per
        step under DDP (``no_sync`` until the last accumulation step)."""
        return self.plan.grad_accum if self.plan.uses_fsdp or self.plan.pp > 1 else 1

    @property
    def num_gathers(self) -> int:
        """All-gathers of each FSDP unit per step: ZeRO-2 once; ZeRO-3 before every micro-batch's
        forward and again before its backward, but under a pipeline ``m + 1`` per schedule step
        (torch's schedule leaves units gathered after their backward, so a forward that follows
        one gathers nothing: bench/fsdp_pipeline_gathers.py counts 3, 5, 9 at m = 2, 4, 8)."""
        plan = self.plan
        if not plan.shards_parameters:
            return 1
        return (plan.microbatches + 1) * plan.grad_accum if plan.pp > 1 else 2 * self.num_microbatches

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
        return self.per_tp_rank("num_params")

    @property
    def optimizer_params(self) -> float:
        """Parameters whose optimizer state this rank updates: ZeRO shards them over dp_shard."""
        return self.params_per_rank / (self.plan.dp_shard if self.plan.shards_optimizer else 1)

    @property
    def gradient_params(self) -> float:
        """Parameters whose gradients this rank keeps after a reduction: ZeRO-2/3 shards them."""
        return self.params_per_rank / (self.plan.dp_shard if self.plan.shards_gradients else 1)

    def per_tp_rank(self, field: str, *, blocks_only: bool = False) -> float:
        """A profiled quantity summed over the stage (or its blocks only) as one TP rank runs it
        (the blocks split over the TP group, the embedding and head as the layout splits the
        vocabulary: :meth:`~stratagem.advisor.cost.stages.Stage.per_tp_rank`), at the profiled batch."""
        if blocks_only:
            return self.stage.block_sums[field] / self.plan.tp
        return self.stage.per_tp_rank(field, self.plan.tp, self.plan.vocab_tp_styles)

    def per_microbatch(self, field: str, *, blocks_only: bool = False) -> float:
        """A profiled quantity that grows with the batch (``fwd_flops``, ``bwd_op_bytes``, …) for
        one micro-batch: :meth:`per_tp_rank` scaled by :attr:`batch_scale`."""
        return self.per_tp_rank(field, blocks_only=blocks_only) * self.batch_scale

    def pass_seconds(self, direction: str, *, blocks_only: bool = False) -> float:
        """Seconds of one micro-batch's forward (``"fwd"``) or backward (``"bwd"``) over the stage
        (or its blocks only) on one TP rank: the blocks' FLOPs at :attr:`block_matmul_efficiency`
        of the rate, the embedding's and head's (the vocabulary projection's split as the layout
        says) at all of it, unaligned GEMMs at
        :attr:`unaligned_matmul_fraction` of either; plus the bytes operators without FLOPs move
        (those of parameter-sized outputs, autocast's weight casts, at any micro-batch size), the
        blocks' fused where the plan compiles them (:meth:`run_bytes`), and those of the layout transforms
        around NCHW convolutions (:attr:`layout_bytes`); what BatchNorm's ATen kernels add
        (:attr:`norm_seconds`); fused attention at its own seconds
        (:attr:`attention`), where priced apart; and the device's gap after each kernel the pass
        launches (:attr:`kernel_gap_seconds`; every TP rank launches them all: :meth:`launched`)."""
        flops = f"{direction}_flops"
        blocks = self.per_microbatch(flops, blocks_only=True)
        outside = 0.0 if blocks_only else self.per_microbatch(flops) - blocks
        attention = 0.0
        if self.attention is not None:
            in_blocks, stage = self.attention[True], self.attention[blocks_only]
            blocks -= in_blocks.flops[direction]
            outside -= stage.flops[direction] - in_blocks.flops[direction]
            attention = stage.seconds[direction]
        unaligned = self.per_microbatch(f"{direction}_unaligned_flops", blocks_only=blocks_only)
        matmuls = (blocks / self.block_matmul_efficiency + outside
                   + unaligned * (1 / self.unaligned_matmul_fraction - 1)) / self.flops_per_second
        moved = (self.run_bytes(direction, blocks_only=blocks_only)
                 + self.per_tp_rank(f"{direction}_param_op_bytes", blocks_only=blocks_only)
                 + self.layout_bytes[direction, blocks_only] * self.batch_scale)
        launched = self.launched(direction, blocks_only=blocks_only)
        norms = self.norm_seconds[direction, blocks_only] * self.batch_scale
        return attention + matmuls + norms + moved * self.seconds_per_op_byte + launched * self.kernel_gap_seconds

    def run_bytes(self, direction: str, *, blocks_only: bool = False) -> float:
        """Bytes ``direction``'s operators without FLOPs move in one micro-batch on one TP rank, as
        the plan runs them (:meth:`_as_run`), the blocks' share TP does not divide whole
        (:attr:`tp_whole_op_factor`)."""
        def moved(blocks: bool) -> float:
            return self._as_run(direction, "op_bytes", lambda field, only: self.per_microbatch(field, blocks_only=only),
                                blocks_only=blocks)
        blocks = moved(True)
        return blocks * self.tp_whole_op_factor + (0.0 if blocks_only else moved(False) - blocks)

    @property
    def tp_whole_op_factor(self) -> float:
        """What a TP rank moves of its blocks' bytes without FLOPs, over an even ``1/tp`` share of
        them: ``1 + s·(tp − 1)``, ``s`` the share the split leaves whole on every rank
        (``SegmentProfile.tp_replicated_op_bytes``: the norms and residual adds on the whole
        residual stream); 1 with sequence parallelism, which runs them on sequence shards."""
        plan = self.plan
        moved = self.stage.block_sums["fwd_op_bytes"]
        if plan.tp == 1 or plan.sequence_parallel or not moved:
            return 1.0
        return 1 + self.stage.block_sums["tp_replicated_op_bytes"] / moved * (plan.tp - 1)

    def launched(self, direction: str, *, blocks_only: bool = False) -> float:
        """Operators (kernels) ``direction`` launches per micro-batch on each rank, as the plan runs
        them (:meth:`_as_run`; every TP rank launches them all)."""
        return self._as_run(direction, "ops", lambda field, blocks: (self.stage.block_sums if blocks
                                                                     else self.stage.sums)[field],
                            blocks_only=blocks_only)

    def _as_run(self, direction: str, kind: str, total: Callable[[str, bool], float], *, blocks_only: bool) -> float:
        """A stage's sum of ``direction``'s operators' ``kind`` (``ops`` or ``op_bytes``; ``total``
        reads a field over the blocks or the whole stage) as the plan runs them: the blocks' fused
        where it compiles them (``fwd_fused_ops``), the embedding's and head's eager (the compile
        plugin compiles blocks only: :mod:`stratagem.plugins.compile`)."""
        eager = f"{direction}_{kind}"
        if not self.plan.compile:
            return total(eager, blocks_only)
        blocks = total(f"{direction}_fused_{kind}", True)
        return blocks if blocks_only else blocks + total(eager, False) - total(eager, True)

    @property
    def fused_ops_share(self) -> float:
        """The share of the blocks' forward operators a compiled block launches as kernels (1 for
        plans that do not compile)."""
        return self._fused_share("ops")

    @property
    def fused_share(self) -> float:
        """The share of the blocks' forward bytes moved without FLOPs that fusing leaves (1 for
        plans that do not compile): what a compiled recomputation moves of an eager one's."""
        return self._fused_share("op_bytes")

    def _fused_share(self, kind: str) -> float:
        eager = self.stage.block_sums[f"fwd_{kind}"]
        return self.stage.block_sums[f"fwd_fused_{kind}"] / eager if self.plan.compile and eager else 1.0


def rank_step(profile: ModelProfile, *, cluster: Cluster, workload: Workload,
              plan: Plan, rank: int = 0) -> RankStep:
    """Describe pipeline rank ``rank``'s work (every rank's without a pipeline; with one,
    :func:`~stratagem.advisor.cost.pace.pace` finds the rank that paces the step), from the
    profile of what the plan computes (``ModelProfile.computed_by``); :class:`UsageError` when
    the profile, workload and plan disagree on what a step is."""
    if workload.seq_len and profile.seq_len and workload.seq_len != profile.seq_len:
        raise UsageError(f"the profile was taken at seq_len={profile.seq_len}, the workload has "
                         f"{workload.seq_len}: attention FLOPs do not scale linearly\n"
                         f"HINT: profile the model at seq_len={workload.seq_len}")
    if plan.global_batch_size != workload.global_batch_size:
        raise UsageError(f"{plan.name} processes {plan.global_batch_size} samples per step, the "
                         f"workload {workload.global_batch_size}\nHINT: micro_batch_size × "
                         "microbatches × grad_accum × dp must equal the global batch")
    profile = profile.computed_by(plan)
    stage = rank_stages(profile, plan)[rank]
    per_byte = seconds_per_op_byte(cluster)
    return RankStep(profile=profile, cluster=cluster, plan=plan, optimizer=workload.optimizer,
                    grad_clip=workload.grad_clip,
                    precision=get_precision(plan.precision), stage=stage, links=mesh_links(cluster, plan),
                    flops_per_second=large_gemm_rate(cluster, plan.precision),
                    attention=_rank_attention(profile, plan, cluster, rank),
                    block_matmul_efficiency=_rank_matmul_efficiency(profile, plan, cluster, rank),
                    unaligned_matmul_fraction=unaligned_matmul_fraction(cluster, plan.precision),
                    seconds_per_op_byte=per_byte, kernel_gap_seconds=kernel_gap_seconds(cluster),
                    layout_bytes=stage_layout_bytes(stage, plan, cluster),
                    norm_seconds=stage_norm_seconds(stage, plan, cluster, per_byte))


# What a rank's GEMM shapes never depend on: data-parallel sharding, the schedule,
# checkpointing, compilation, offload, how many micro-batches run.
_NOT_IN_BLOCK_GEMMS = ("dp_replicate", "dp_shard", "zero", "sequence_parallel", "pp_schedule", "microbatches",
                       "grad_accum", "activation_checkpointing", "compile", "offload")


@by_identity_and_plan(ignoring=_NOT_IN_BLOCK_GEMMS)
def _rank_matmul_efficiency(profile: ModelProfile, plan: Plan, cluster: Cluster, rank: int) -> float:
    """:func:`block_matmul_efficiency` of pipeline rank ``rank``, once for the plans that share its GEMMs."""
    return block_matmul_efficiency(profile, plan, rank_stages(profile, plan)[rank], matmul_curve(cluster, plan.precision),
                                   cluster=cluster)


@by_identity_and_plan(ignoring=_NOT_IN_BLOCK_GEMMS)
def _rank_attention(profile: ModelProfile, plan: Plan, cluster: Cluster, rank: int) -> dict[bool, AttentionTime] | None:
    """:func:`~stratagem.advisor.cost.attention.fused_attention_time` of pipeline rank ``rank``,
    once for the plans that share its attention calls."""
    return fused_attention_time(profile, plan, rank_stages(profile, plan)[rank], cluster,
                                dtype=matmul_dtype(cluster, plan.precision),
                                seconds_per_byte=seconds_per_op_byte(cluster))
