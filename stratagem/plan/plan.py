"""The Plan: the one vocabulary every part of stratagem speaks.

A Plan is plain data. The advisor produces it, the cost models score it, the plugins apply it
and the exporters translate it; none of them re-derives a decision it holds. Construction
checks everything the Plan can check alone; :meth:`Plan.check` adds what needs the cluster and
the model (world size, heads, blocks).

Mesh order is ``pp`` (outermost) × ``dp_replicate`` × ``dp_shard`` × ``tp`` (innermost, inside a
node). The global batch is ``micro_batch_size × microbatches × grad_accum × dp_replicate ×
dp_shard`` samples.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from stratagem.errors import UsageError
from stratagem.plan.checkpointing import SELECTIVE_POLICIES
from stratagem.plan.checks import (
    MAX_SAMPLES,
    MAX_WORLD_SIZE,
    check_bool,
    check_choice,
    check_optional_str,
    check_positive,
    shown,
)
from stratagem.plan.precision import PRECISIONS
from stratagem.plan.tp_styles import block_styles, check_tp_layout, vocab_styles

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb")
# Schedules that run pp_virtual >= 2 stages per rank, looping over the ranks.
INTERLEAVED_SCHEDULES = ("interleaved-1f1b", "interleaved-zb")
CHECKPOINTING = ("none", "selective", "selective-op", "full")  # selective ones: plan/checkpointing.py
OFFLOAD = ("none", "optimizer", "params")


_PRECISION_NAMES = tuple(PRECISIONS)

_COUNT_FIELDS = ("pp", "dp_replicate", "dp_shard", "tp", "pp_virtual", "microbatches",
                 "micro_batch_size", "grad_accum")


class MeshAxis(StrEnum):
    """Names of the DeviceMesh axes, outermost first."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    TP = "tp"


def admitted_offloads(zero: int) -> tuple[str, ...]:
    """The ``offload`` values ZeRO stage ``zero`` admits: FSDP2's CPU offload moves sharded
    optimizer states and gradients from ZeRO-2, and the parameters' shards too at ZeRO-3."""
    return OFFLOAD[:1 + (zero >= 2) + (zero == 3)]


def zero_bubble_refuses(*, dp: int, activation_checkpointing: str) -> str | None:
    """Why the ``interleaved-zb`` schedule (torch's ``ScheduleInterleavedZeroBubble``, which
    runs each weight-gradient pass apart from its input-gradient pass) cannot train with these
    settings, or None. Checked on torch 2.13 against one process: equal alone and with TP; with
    data parallelism (DDP, ZeRO, FSDP) the gradients reduce before the deferred weight passes
    add theirs (the weights part after the first step); with activation checkpointing the
    schedule fails."""
    if dp > 1:
        return ("defers weight gradients past the data-parallel gradient reduction (DDP, ZeRO, FSDP), "
                "which would miss them")
    if activation_checkpointing != "none":
        return "cannot split the backward of checkpointed blocks into input and weight passes"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """How to parallelize one training step (docs/design.md, "The Plan").

    ``zero``: 0 DDP · 1 optimizer states sharded · 2 + gradients sharded · 3 + parameters
    sharded (FSDP full shard), over ``dp_shard``; ``dp_replicate > 1`` with ``zero >= 2`` is HSDP.
    ``offload`` moves FSDP's shards to host memory (``zero >= 2``; also with ``dp_shard = 1``,
    where FSDP serves only to offload).
    ``microbatches`` are pipeline micro-batches per step (1 without pipelining);
    ``grad_accum`` steps accumulate gradients before the optimizer steps.
    ``block_container`` is the FQN of the module list whose children are the model's blocks
    (FSDP units, checkpoint units, compile units, pipeline split points), as the profile found it.
    ``compile`` runs each block through ``torch.compile`` (after TP and checkpointing, before FSDP).
    ``tp_layout`` says how tensor parallelism splits the model: ``(pattern, style)`` pairs, the
    pattern a module FQN with ``*`` for a block index (``"layers.*.attention.wq"``), the style one
    of :data:`~stratagem.plan.tp_styles.TP_STYLES` (most in Hugging Face's words).
    ``stage_blocks`` is the pipeline partition: blocks per stage, ``pp × pp_virtual`` entries in
    stage order (rank ``r`` runs stages ``r, r + pp, …``), the embedding before stage 0's blocks and
    the head after the last stage's; None splits the blocks as evenly as possible
    (:func:`even_stage_blocks`). The advisor fills it with a balanced partition.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    microbatches: int = 1
    micro_batch_size: int = 1
    grad_accum: int = 1
    activation_checkpointing: str = "none"
    compile: bool = False
    offload: str = "none"
    precision: str = "bf16-mixed"
    block_container: str | None = None
    tp_layout: tuple[tuple[str, str], ...] = ()
    stage_blocks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def unchecked(cls, *parts: dict[str, Any]) -> Plan:
        """A plan of the fields in ``parts`` (every field, in one or more dicts) built without
        the checks of construction, for a caller that builds valid plans and checks them itself:
        the search validates the first plan of each layout it keeps, and the others differ from
        it only in a micro-batching that the search builds valid."""
        plan = object.__new__(cls)
        for part in parts:
            for name, value in part.items():
                _SET_FIELD[name](plan, value)
        return plan

    def validate(self) -> None:
        """Raise :class:`UsageError` unless the fields make a plan: what construction checks."""
        counts = (self.pp, self.dp_replicate, self.dp_shard, self.tp, self.pp_virtual,
                  self.microbatches, self.micro_batch_size, self.grad_accum)
        if set(map(type, counts)) != {int} or min(counts) < 1:  # not all(...): the search builds many plans
            for name in _COUNT_FIELDS:
                check_positive(f"Plan.{name}", getattr(self, name))
        check_positive("Plan.world_size", self.world_size, maximum=MAX_WORLD_SIZE,
                       why="pp × dp_replicate × dp_shard × tp ranks, more than any cluster holds")
        check_positive("Plan.global_batch_size", self.global_batch_size, maximum=MAX_SAMPLES,
                       why="micro_batch_size × microbatches × grad_accum × dp samples per step")
        check_positive("Plan.pp_virtual", self.pp_virtual, maximum=MAX_WORLD_SIZE,
                       why="more stages per rank than any model has blocks")
        check_bool("Plan.sequence_parallel", self.sequence_parallel)
        check_bool("Plan.compile", self.compile)
        check_optional_str("Plan.block_container", self.block_container)
        check_choice("Plan.zero", self.zero, (0, 1, 2, 3))
        check_choice("Plan.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        check_choice("Plan.activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)
        check_choice("Plan.offload", self.offload, OFFLOAD)
        check_choice("Plan.precision", self.precision, _PRECISION_NAMES)
        self._check_data_parallel()
        self._check_pipeline()
        self._check_stage_blocks()
        if self.sequence_parallel and self.tp == 1:
            raise UsageError("Plan.sequence_parallel needs tp > 1: it splits activations over the TP group")
        try:
            check_tp_layout(self.tp_layout)
        except TypeError:  # not hashable (lists): checked without the cache
            check_tp_layout.__wrapped__(self.tp_layout)

    def _check_data_parallel(self) -> None:
        if not self.shards_optimizer and self.dp_shard > 1:
            raise UsageError(f"Plan.dp_shard={self.dp_shard} with zero=0: without ZeRO nothing is sharded\n"
                             "HINT: use dp_replicate for plain data parallelism, or zero>=1")
        if self.shards_optimizer and self.dp_shard == 1 and not self.offloads:
            # FSDP over one rank only makes sense for its CPU offload.
            raise UsageError(f"Plan.zero={self.zero} shards over dp_shard, which is 1\n"
                             "HINT: set zero=0, or dp_shard to the data-parallel degree")
        if self.shards_optimizer_only and self.dp_replicate > 1:
            raise UsageError("Plan.zero=1 shards optimizer states over every data-parallel rank; "
                             f"dp_replicate={self.dp_replicate} must be 1\nHINT: put the degree in dp_shard")
        if self.offload not in admitted_offloads(self.zero):
            if self.offloads_parameters and self.uses_fsdp:
                raise UsageError("Plan.offload='params' needs zero=3: parameters live sharded on the CPU")
            raise UsageError(f"Plan.offload={self.offload!r} needs zero>=2 (FSDP's CPU offload)")

    def _check_pipeline(self) -> None:
        if self.pp == 1:
            if self.pp_virtual != 1 or self.microbatches != 1:
                raise UsageError("Plan.pp_virtual and Plan.microbatches apply to pipeline plans; "
                                 f"with pp=1 both must be 1 (got {self.pp_virtual}, {self.microbatches})\n"
                                 "HINT: use grad_accum to split a batch without pipelining")
            return
        if self.is_interleaved and self.pp_virtual < 2:
            raise UsageError(f"Plan.pp_schedule={self.pp_schedule!r} needs pp_virtual >= 2 stages per rank")
        if not self.is_interleaved and self.pp_virtual != 1:
            raise UsageError(f"Plan.pp_virtual={self.pp_virtual} needs an interleaved pp_schedule "
                             f"({', '.join(INTERLEAVED_SCHEDULES)})")
        if self.is_zero_bubble and (reason := zero_bubble_refuses(
                dp=self.dp, activation_checkpointing=self.activation_checkpointing)):
            raise UsageError(f"Plan.pp_schedule='interleaved-zb' {reason}\nHINT: use interleaved-1f1b")
        if self.microbatches < self.pp and self.pp_schedule != "gpipe":
            raise UsageError(f"Plan.microbatches={self.microbatches} < pp={self.pp}: {self.pp_schedule} "
                             "needs at least one micro-batch per stage")
        if self.is_interleaved and self.microbatches % self.pp:
            raise UsageError(f"{self.pp_schedule} needs microbatches ({self.microbatches}) "
                             f"divisible by pp ({self.pp})")

    def _check_stage_blocks(self) -> None:
        if self.stage_blocks is None:
            return
        if not isinstance(self.stage_blocks, tuple):
            raise UsageError(f"Plan.stage_blocks must be a list of block counts or null, got {shown(self.stage_blocks)}")
        if self.pp == 1:
            raise UsageError("Plan.stage_blocks partitions pipeline stages; with pp=1 it must be None")
        if (len(self.stage_blocks) != self.num_stages or set(map(type, self.stage_blocks)) != {int}
                or min(self.stage_blocks) < 1):  # not all(...): the search builds many plans
            raise UsageError(f"Plan.stage_blocks={shown(list(self.stage_blocks))} must hold {self.num_stages} positive "
                             f"block counts (pp {self.pp} × virtual {self.pp_virtual} stages)\n"
                             "HINT: one count per stage in stage order, e.g. [3, 5] for pp=2; or leave it "
                             "unset for an even split")

    # -- derived -------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Ranks the plan uses: pp × dp_replicate × dp_shard × tp."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: dp_replicate × dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: pp × pp_virtual."""
        return self.pp * self.pp_virtual

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.micro_batch_size * self.microbatches * self.grad_accum * self.dp

    @property
    def mesh_degrees(self) -> tuple[int, int, int, int]:
        """The degrees of :class:`MeshAxis`' axes in their order: pp, dp_replicate, dp_shard, tp."""
        return self.pp, self.dp_replicate, self.dp_shard, self.tp

    @property
    def mesh_shape(self) -> dict[MeshAxis, int]:
        """Degree per mesh axis, outermost first."""
        return dict(zip(MeshAxis, self.mesh_degrees))

    @property
    def mesh_strides(self) -> Mapping[MeshAxis, int]:
        """Rank distance between neighbours of each axis's groups (:func:`mesh_strides`)."""
        return mesh_strides(self.mesh_degrees)

    # ZeRO stages as the runtimes apply them: 1 is torch's ZeroRedundancyOptimizer under DDP,
    # 2 and 3 are FSDP2 over dp_shard (HSDP with dp_replicate > 1).

    @property
    def shards_optimizer(self) -> bool:
        """Optimizer states are sharded over ``dp_shard`` (ZeRO-1 and up)."""
        return self.zero >= 1

    @property
    def shards_optimizer_only(self) -> bool:
        """ZeRO-1: DDP replicates weights and gradients, ZeroRedundancyOptimizer shards its states."""
        return self.zero == 1

    @property
    def shards_gradients(self) -> bool:
        """Gradients are reduce-scattered to shards over ``dp_shard`` (ZeRO-2 and up)."""
        return self.zero >= 2

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-3: weights stay sharded between uses, gathered before each forward and backward."""
        return self.zero == 3

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 (``fully_shard``) applies the data parallelism (ZeRO-2/3); else DDP does."""
        return self.zero >= 2

    @property
    def uses_ddp(self) -> bool:
        """DDP applies the data parallelism: ``zero`` 0/1 over more than one data-parallel rank."""
        return self.dp > 1 and not self.uses_fsdp

    @property
    def is_hsdp(self) -> bool:
        """FSDP inside each ``dp_shard`` group, replicated over ``dp_replicate``."""
        return self.uses_fsdp and self.dp_replicate > 1

    @property
    def sums_norm_grads_at_step(self) -> bool:
        """Sequence parallelism's norms leave their weights' gradients ``Partial`` over the TP ranks,
        and they are summed once before each optimizer step: with SP and no FSDP (which reduces
        them with its units)."""
        return self.sequence_parallel and not self.uses_fsdp

    @property
    def block_tp_styles(self) -> dict[str, str]:
        """``tp_layout``'s styles by module name inside a block (``layers.*.attention.wq`` →
        ``attention.wq``): how TP splits each block's modules."""
        return block_styles(self.tp_layout, self.block_container)

    @property
    def vocab_tp_styles(self) -> frozenset[str]:
        """The vocabulary styles ``tp_layout`` applies (``vocab_embedding``, ``vocab_head``): whether
        TP splits the input embedding and the output head by vocabulary."""
        return vocab_styles(self.tp_layout)

    @property
    def runs_autocast(self) -> bool:
        """The plugins run forward under ``torch.autocast``: ``*-mixed`` plans that DDP applies.
        FSDP2 casts the gathered parameters to the compute dtype itself (its mixed-precision
        policy), so its step computes as the compute dtype's ``-true`` precision does."""
        return PRECISIONS[self.precision].autocast and not self.uses_fsdp

    @property
    def checkpoints(self) -> bool:
        """Some activations are recomputed in backward (``selective``, ``selective-op`` or ``full``)."""
        return self.activation_checkpointing != "none"

    @property
    def checkpoints_selectively(self) -> bool:
        """A selective policy (:data:`~stratagem.plan.checkpointing.SELECTIVE_POLICIES`): each
        block keeps some operators' outputs and recomputes the others in backward."""
        return self.activation_checkpointing in SELECTIVE_POLICIES

    @property
    def recomputes_blocks(self) -> bool:
        """Full checkpointing: each block keeps only its input and runs its forward again."""
        return self.activation_checkpointing == "full"

    @property
    def offloads(self) -> bool:
        """Model states live in host memory (``optimizer`` or ``params``)."""
        return self.offload != "none"

    @property
    def offloads_parameters(self) -> bool:
        """The weights' shards live in host memory too, uploaded before each gather."""
        return self.offload == "params"

    @property
    def is_interleaved(self) -> bool:
        """The schedule loops over ``pp_virtual`` stages per rank."""
        return self.pp_schedule in INTERLEAVED_SCHEDULES

    @property
    def is_zero_bubble(self) -> bool:
        """The schedule runs weight gradients apart from input gradients (``interleaved-zb``)."""
        return self.pp_schedule == "interleaved-zb"

    @property
    def complexity(self) -> int:
        """How many moving parts the plan has; near-ties in speed go to the simpler plan."""
        return (
            (self.tp > 1) + (self.pp > 1) + self.sequence_parallel + (self.pp_virtual > 1)
            + self.shards_optimizer + (self.dp_replicate > 1 and self.dp_shard > 1)
            + self.checkpoints + self.compile + 2 * self.offloads + (self.grad_accum > 1)
        )

    @property
    def name(self) -> str:
        """Short human name, e.g. ``tp4+sp·pp2·fsdp8 zero3 ckpt=full mb=2``."""
        degrees = []
        if self.tp > 1:
            degrees.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.pp > 1:
            virtual = f"x{self.pp_virtual}" if self.pp_virtual > 1 else ""
            degrees.append(f"pp{self.pp}{virtual}({self.pp_schedule})")
        if self.dp_replicate > 1:
            degrees.append(f"dp{self.dp_replicate}")
        if self.dp_shard > 1:
            degrees.append(f"fsdp{self.dp_shard}" if self.uses_fsdp else f"dp{self.dp_shard}")
        words = ["·".join(degrees) or "single"]
        if self.zero:
            words.append(f"zero{self.zero}")
        if self.checkpoints:
            words.append(f"ckpt={self.activation_checkpointing}")
        if self.compile:
            words.append("compiled")
        if self.offloads:
            words.append(f"offload={self.offload}")
        words.append(f"mb={self.micro_batch_size}")
        if self.microbatches > 1:
            words.append(f"m={self.microbatches}")
        if self.grad_accum > 1:
            words.append(f"ga={self.grad_accum}")
        return " ".join(words)

    def __str__(self) -> str:
        return self.name

    # -- checks that need the world ------------------------------------------------------

    def check(self, *, world_size: int, devices_per_node: int | None = None,
              num_heads: int | None = None, num_kv_heads: int | None = None,
              num_blocks: int | None = None) -> None:
        """Raise :class:`UsageError` unless the plan fits this world and this model."""
        if self.world_size != world_size:
            raise UsageError(f"pp({self.pp}) × dp_replicate({self.dp_replicate}) × dp_shard({self.dp_shard}) "
                             f"× tp({self.tp}) = {self.world_size}, but the world size is {world_size}")
        if devices_per_node and devices_per_node % self.tp and self.tp % devices_per_node:
            raise UsageError(f"tp={self.tp} does not tile nodes of {devices_per_node} devices")
        for what, count in (("attention heads", num_heads), ("key/value heads", num_kv_heads)):
            if count and count % self.tp:
                raise UsageError(f"tp={self.tp} does not divide the model's {count} {what}")
        if num_blocks is not None and self.pp > 1 and num_blocks < self.num_stages:
            raise UsageError(f"{self.num_stages} pipeline stages (pp {self.pp} × virtual {self.pp_virtual}) "
                             f"but the model has only {num_blocks} blocks")
        if num_blocks is not None and self.stage_blocks is not None and sum(self.stage_blocks) != num_blocks:
            raise UsageError(f"Plan.stage_blocks={list(self.stage_blocks)} covers {sum(self.stage_blocks)} "
                             f"blocks, but the model has {num_blocks}\nHINT: the counts must add up to "
                             "the model's blocks; or leave stage_blocks unset for an even split")

    def blocks_per_stage(self, num_blocks: int) -> tuple[int, ...]:
        """Blocks of each pipeline stage in stage order: ``stage_blocks``, or the even split of
        ``num_blocks`` (``(num_blocks,)`` without pipelining)."""
        if self.pp == 1:
            return (num_blocks,)
        if self.stage_blocks is not None:
            return self.stage_blocks
        return even_stage_blocks(num_blocks, self.num_stages)

    # -- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, JSON-ready (``tp_layout`` as a list of ``[pattern, style]`` pairs,
        ``stage_blocks`` as a list or None)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The inverse of :meth:`to_dict`; missing fields take their defaults."""
        if not isinstance(data, dict):
            raise UsageError(f"a plan must be a mapping of Plan fields, got {shown(data)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"unknown Plan field(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        layout, stages = data.get("tp_layout", ()), data.get("stage_blocks")
        check_tp_layout.__wrapped__(layout)
        if stages is not None and not isinstance(stages, (list, tuple)):
            raise UsageError(f"Plan.stage_blocks must be a list of block counts or null, got {shown(stages)}")
        return cls(**{**data, "tp_layout": tuple(tuple(pair) for pair in layout),
                      "stage_blocks": None if stages is None else tuple(stages)})

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan from JSON: its fields, an entry of ``advise --format json`` (``{"plan": ...}``)
        or that whole document (its best plan)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UsageError(f"a plan must be a JSON object: {err}") from None
        except RecursionError:
            raise UsageError("a plan must be a JSON object of Plan fields: this one nests too deeply") from None
        if not isinstance(data, dict):
            raise UsageError(f"a plan must be a JSON object, got {type(data).__name__}")
        if isinstance(data.get("plans"), list):  # a whole `advise --format json` document: its best
            if not data["plans"]:
                raise UsageError("the advice holds no plan that fits\nHINT: see its suggestions")
            data = data["plans"][0]
        if isinstance(data, dict) and isinstance(data.get("plan"), dict):  # one entry of `advise --format json`
            data = data["plan"]
        if not isinstance(data, dict):
            raise UsageError(f"a plan must be a JSON object of Plan fields, got {shown(data)}")
        return cls.from_dict(data)


# Each field's slot setter: what object.__setattr__ calls for a frozen Plan, without its lookups.
_SET_FIELD = {f.name: Plan.__dict__[f.name].__set__ for f in fields(Plan)}


@functools.lru_cache(maxsize=256)
def mesh_strides(degrees: tuple[int, ...]) -> Mapping[MeshAxis, int]:
    """Rank distance between neighbours of each axis's groups on a mesh of ``degrees`` (in
    :class:`MeshAxis` order): the product of the degrees inside the axis (``tp``: 1)."""
    strides, inner = {}, 1
    for axis, degree in reversed(tuple(zip(MeshAxis, degrees))):
        strides[axis] = inner
        inner *= degree
    return MappingProxyType(strides)


@functools.lru_cache(maxsize=1024)
def even_stage_blocks(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """``num_blocks`` split into ``num_stages`` contiguous stages as evenly as possible (the
    earlier stages take the remainder)."""
    per, extra = divmod(num_blocks, num_stages)
    return tuple(per + (i < extra) for i in range(num_stages))
