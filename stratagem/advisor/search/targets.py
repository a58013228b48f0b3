"""What each runtime can train, and what the model itself allows: the rules that exclude plans.

Each rule returns the reason a plan is left out, or None. The search counts exclusions by
reason so the report can say what it left out and why.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from stratagem.plan import Plan
from stratagem.plan.stages import TIED_OFFLOAD, TRACED_STAGE_LIMITS, tied_copies_allow, traced_stages_allow
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.errors import UsageError

if TYPE_CHECKING:
    from stratagem.advisor.hardware.spec import Cluster

TARGETS = ("any", "lightning", "accelerate", "deepspeed")
OPTIMIZER_OFFLOAD = "optimizer-only CPU offload (FSDP2 offloads parameters too; DeepSpeed's ZeRO-Offload can)"


def check_target(target: str) -> str:
    """``target`` if known, else a :class:`UsageError` listing the known ones."""
    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}; valid: {', '.join(TARGETS)}")
    return target


def target_profile(profile: ModelProfile, target: str) -> ModelProfile:
    """``profile`` as ``target`` trains it: the strategies (``lightning``) run the user's own loss,
    on gathered logits, so a layout that runs the loss on the vocabulary shards (``vocab_loss``)
    gathers them there (``vocab_head``), as ``integrations.planning.load_plan`` asks of a plan."""
    return profile.with_head_style("vocab_head") if target == "lightning" else profile


def runtime_for(target: str) -> str:
    """The runtime whose model-state layout the memory model uses for ``target``."""
    return "deepspeed" if target == "deepspeed" else "torch"


def target_excludes(target: str, plan: Plan, *, on_gpu: bool = True, traced: bool = False,
                    class_wrap_extra: str | None = None) -> str | None:
    """Why ``target`` cannot run ``plan`` (on GPUs, or on CPU ranks when not ``on_gpu``; for a
    model whose pipeline stages are ``traced``, see ``ModelProfile.pp_traced``; whose blocks' class
    names other modules have too, ``ModelProfile.class_wrap_extra``), or None when it can."""
    if plan.tp > 1 and plan.uses_ddp:
        return "DDP over tensor-parallel weights (DDP takes no DTensor parameters; FSDP/HSDP does)"
    if plan.offload == "optimizer" and target != "deepspeed":
        return OPTIMIZER_OFFLOAD
    if target == "accelerate":
        if plan.tp > 1:
            return "tensor parallelism (Accelerate needs a model carrying a TP plan)"
        if not on_gpu and plan.uses_fsdp:
            return "FSDP on CPU ranks (Accelerate runs only DDP there)"
        if plan.uses_fsdp and class_wrap_extra:
            return f"FSDP (Accelerate wraps units by class name, which other modules share with the blocks: {class_wrap_extra})"
        return accelerate_excludes(plan)
    if target == "lightning" and plan.pp_virtual > 1 and plan.uses_fsdp:
        return "interleaved stages under FSDP (the auto-parallel strategy holds a rank's stages in one module)"
    if target == "lightning" and plan.is_zero_bubble:
        return "the zero-bubble schedule (not yet run through the auto-parallel strategy; apply_plan runs it)"
    if target == "lightning" and plan.pp_virtual > 1 and traced:
        return "interleaved traced stages (the auto-parallel strategy holds one traced stage per rank)"
    if target == "deepspeed":
        return deepspeed_excludes(plan)
    return None


def accelerate_excludes(plan: Plan) -> str | None:
    """Why Accelerate's own config (DDP, FSDP2, ParallelismConfig; no DeepSpeed) cannot express
    ``plan``, or None. Shared with the Accelerate exporter; tensor parallelism is left to the
    caller, as only a model carrying a TP plan allows it."""
    if plan.offload == "optimizer":
        return OPTIMIZER_OFFLOAD
    if plan.compile:
        return "torch.compile per block (Accelerate's dynamo setting compiles the whole model)"
    if plan.pp > 1:
        return "pipeline parallelism (Accelerate trains none)"
    if plan.shards_optimizer_only:
        return "ZeRO-1 (Accelerate shards optimizer states alone only through DeepSpeed)"
    if plan.checkpoints_selectively:
        return (f"{plan.activation_checkpointing} activation checkpointing (Accelerate's FSDP checkpoints "
                "whole blocks)")
    if plan.checkpoints and not plan.uses_fsdp:
        return "activation checkpointing without FSDP (Accelerate's config sets it through FSDP only)"
    return None


def deepspeed_excludes(plan: Plan) -> str | None:
    """Why a DeepSpeed training config cannot express ``plan``, or None (shared with the
    DeepSpeed exporters)."""
    if plan.tp > 1:
        return "tensor parallelism (not in DeepSpeed training configs)"
    if plan.compile:
        return "torch.compile per block (not in DeepSpeed training configs)"
    if plan.pp > 1 and plan.uses_fsdp:
        return "ZeRO-2/3 with pipeline parallelism (DeepSpeed allows ZeRO-1 only)"
    if plan.pp > 1 and plan.pp_schedule != "1f1b":
        return f"{plan.pp_schedule} schedule (DeepSpeed pipelines run 1F1B)"
    return None


def model_excludes(profile: ModelProfile, cluster: Cluster, plan: Plan) -> str | None:
    """Why ``plan`` cannot train ``profile`` on ``cluster`` whatever the runtime, as the search
    leaves such plans out (a plan given by hand, not enumerated), or None when it can."""
    if plan.tp > 1:
        degrees, no_tp = tp_degrees(profile, cluster.devices_per_node)
        if no_tp or plan.tp not in degrees:
            return no_tp or (f"tp={plan.tp}: {profile.name}'s tensor-parallel degrees on nodes of "
                             f"{cluster.devices_per_node} are {', '.join(map(str, degrees))}")
    if plan.pp > 1 and profile.pp_unavailable:
        return f"no pipeline: {profile.pp_unavailable}"
    if plan.sequence_parallel and (why := sp_excludes(profile, plan.tp)):
        return f"no sequence parallelism: {why}"
    if plan.uses_ddp and profile.ddp_unavailable:
        return f"no DDP (zero 0 or 1): {profile.ddp_unavailable}"
    if profile.pp_tied_params and not tied_copies_allow(pp=plan.pp, offload=plan.offload):
        return TIED_OFFLOAD
    if plan.pp > 1 and profile.pp_traced and not traced_stages_allow(
            tp=plan.tp, activation_checkpointing=plan.activation_checkpointing, compile=plan.compile):
        return TRACED_STAGE_LIMITS
    if plan.offloads and not cluster.is_gpu:
        return "CPU offload on CPU ranks (their states are in host memory already)"
    return autocast_excludes(profile, plan) or target_excludes("any", plan, on_gpu=cluster.is_gpu,
                                                               traced=profile.pp_traced)


def autocast_excludes(profile: ModelProfile, plan: Plan) -> str | None:
    """Why ``plan`` cannot train ``profile``: it runs the step under autocast, which the model's
    step cannot run under (``ModelProfile.autocast_refused``); None otherwise."""
    if profile.autocast_refused and plan.runs_autocast:
        return f"under autocast: {profile.autocast_refused} (FSDP's mixed precision casts the weights: zero 2 or 3)"
    return None


def sp_excludes(profile: ModelProfile, tp: int) -> str | None:
    """Why sequence parallelism cannot split ``profile``'s blocks over ``tp`` ranks, or None: what
    the model rules out (``profile.sp_unavailable``), or a sequence ``tp`` does not divide (the
    plugin splits it evenly, as Megatron-LM does)."""
    if profile.sp_unavailable:
        return profile.sp_unavailable
    if profile.block_sequence and profile.block_sequence % tp:
        return f"the blocks' sequence of {profile.block_sequence} does not divide by tp={tp}"
    return None


def tp_degrees(profile: ModelProfile, devices_per_node: int) -> tuple[tuple[int, ...], str | None]:
    """TP degrees the model allows inside a node, and why there are none beyond 1: the profile
    must have found a TP layout (``profile.tp_layout``), and the degree must divide the heads
    and every split width."""
    if not profile.tp_layout:
        return (1,), f"{profile.tp_unavailable or 'no tensor-parallel layout found'}, so no safe split"
    widths = _split_widths(profile)
    heads = [h for h in (profile.num_heads, profile.num_kv_heads) if h]
    degrees = tuple(t for t in _powers_of_two(devices_per_node)
                    if all(n % t == 0 for n in (*heads, *widths)))
    return degrees, None


def _split_widths(profile: ModelProfile) -> set[int]:
    """The widths TP divides: colwise outputs and rowwise inputs of the first block."""
    styles = {pattern.rsplit(".*.", 1)[-1]: style for pattern, style in profile.tp_layout}
    block = profile.blocks[0]
    return {lin.out_features if styles[lin.name] == "colwise" else lin.in_features
            for lin in block.linears if styles.get(lin.name) in ("colwise", "rowwise")}


def pp_degrees(profile: ModelProfile, world: int) -> tuple[int, ...]:
    """Pipeline degrees dividing the world, with at least one block per stage (the partition
    balances uneven stages); only 1 when the profile found the model cannot be split
    (``profile.pp_unavailable``)."""
    blocks = len(profile.blocks)
    if profile.pp_unavailable:
        return (1,)
    return tuple(p for p in divisors(world) if p == 1 or blocks >= p)


@functools.lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of ``n``, ascending (in √n steps)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def _powers_of_two(limit: int) -> tuple[int, ...]:
    out, p = [], 1
    while p <= limit:
        if limit % p == 0:
            out.append(p)
        p *= 2
    return tuple(out)
