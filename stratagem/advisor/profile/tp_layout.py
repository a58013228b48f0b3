"""Find how tensor parallelism can split a model, from what its blocks do, and prove it on fake tensors.

During the profiling step we record, per block, the order in which its Linear layers run and
which tensor each reads. Linears that read the same tensor form a column group (attention's
q/k/v, SwiGLU's gate and up projections); the first later Linear that reads one of the group's
widths and writes the block's width back is its row partner (attention's output projection,
the MLP's down projection). That is Megatron's pairing (Shoeybi et al. 2019, §3): split the
group's outputs, the partner's inputs, one all-reduce per pair.

Names alone prove nothing, so the layout is then tried: each block runs once more on fake
tensors with the column weights' outputs and the row weights' inputs halved (two-way tensor
parallelism). A block that hard-codes its head count, or mixes features between the pair,
fails that run or changes its output's shape — and the model gets no TP layout, with the reason.
The same two runs, whole and halved, measure what every TP rank keeps whole: of the bytes a block
saves for backward, the split leaves ``R`` on each rank and halves the rest ``S``, so the whole
block saves ``W = R + S``, the halved one ``H = R + S/2``, and ``R = 2H − W`` (Korthikanti et al.
2022, eq. 2, has ``R`` at 10·sbh for their GPT block: its norms' and the pair's inputs, its
dropout masks; a block's own code decides which tensors they are here). The whole run also counts
what the column Linears save of their inputs: sequence parallelism all-gathers those inputs, and
torch's autograd keeps them gathered for the weights' gradients (Megatron-LM keeps the shard and
gathers it again in backward; docs/cost-model.md, "What TP leaves whole, measured"). A block
checkpointed under a selective policy keeps its input and the outputs of the operators the policy
keeps (:mod:`stratagem.plan.checkpointing`); the same two runs measure what of those outputs each
rank keeps whole (a row Linear's full-width output), as ``2H − W`` of them.

A model that declares its own plan — Hugging Face's ``config.base_model_tp_plan`` — gets that
plan instead of the structural pairing, when every entry splits a block's Linear by column or row
(entries such as ``packed_colwise`` or ``moe_tp_experts`` have no equivalent here; the structure
then decides; the embedding's and head's entries are :mod:`~.vocab_layout`'s). The declared plan is
proven by the same two-way split.

The input embedding and the output head, outside the blocks, are :mod:`~.vocab_layout`'s.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from stratagem.advisor.profile.attention import CudaAttention
from stratagem.advisor.profile.autocast import CudaAutocast
from stratagem.advisor.profile.block_inputs import fresh
from stratagem.advisor.profile.fused import FusedKernels
from stratagem.advisor.profile.fake_tensor_log import quiet_fake_tensor_log
from stratagem.advisor.profile.measure import CAST_OPS, MASK_OPS, stored_bytes
from stratagem.advisor.profile.model_profile import policy_field
from stratagem.advisor.profile.op_bytes import moved_bytes, priced_by_bytes
from stratagem.advisor.profile.vocab_layout import HF_VOCAB_STYLES
from stratagem.advisor.profile.recompute import CheckpointPolicies
from stratagem.plan.checkpointing import SELECTIVE_POLICIES
from stratagem.plan.tp_styles import is_sequence_norm

if TYPE_CHECKING:
    from stratagem.advisor.profile.counts import SegmentCounts

Layout = tuple[tuple[str, str], ...]
_BLOCK = "block"  # the one block a split run counts


class SplitKept(NamedTuple):
    """Of the bytes a block saves for backward at the profiled batch, what a TP split keeps whole on
    every rank: without sequence parallelism (``replicated``, R = 2H − W), and with it, the column
    Linears' all-gathered inputs (``gathered``); of the bytes its forward's operators without
    FLOPs move, the share no split divides without sequence parallelism (``op_share``, the same
    2H − W over W: the norms and residual adds on the whole residual stream); and, per selective
    checkpointing policy, of the outputs the policy keeps, what no split divides
    (``policy_replicated``; the block's input, kept whole too, aside)."""

    replicated: int = 0
    gathered: int = 0
    op_share: float = 0.0
    policy_replicated: Mapping[str, int] = MappingProxyType({})


def split_fields(kept: SplitKept, counts: SegmentCounts) -> dict[str, int]:
    """A block's :class:`~.model_profile.SegmentProfile` fields of what a TP split keeps whole,
    from ``kept`` and the block's ``counts``: of what it saves, without SP and with it; of what its
    operators without FLOPs move; and of what each selective policy keeps, its input and the kept
    outputs no split divides. Each at most the whole it is part of."""
    fields = {"tp_replicated_bytes": min(kept.replicated, counts.saved_bytes),
              "tp_gathered_bytes": min(kept.gathered, counts.saved_bytes),
              "tp_replicated_op_bytes": round(kept.op_share * counts.fwd_op_bytes)}
    for policy, measured in counts.policies.items():
        whole = counts.input_bytes + kept.policy_replicated.get(policy, 0)
        fields[policy_field(policy, "tp_replicated_bytes")] = min(whole, counts.input_bytes + measured.kept_bytes)
    return fields


class TPLayout(NamedTuple):
    """What :func:`find_tp_layout` found: the ``layout`` (empty where there is none, and
    ``unavailable`` says why), by block FQN what a split keeps whole (``kept``), and why sequence
    parallelism cannot run the blocks where it cannot (``sp_unavailable``)."""

    layout: Layout
    unavailable: str | None
    kept: dict[str, SplitKept]
    sp_unavailable: str | None = None


@dataclass(frozen=True, slots=True)
class _LinearCall:
    name: str  # FQN relative to the block
    reads: tuple  # the data its input reads (_reads): Linears reading one view of one storage read the same
    in_features: int
    out_features: int
    rows: int  # rows the call multiplied: its input's elements over in_features


class LinearCallRecorder:
    """While active, records the calls of each block's Linears."""

    def __init__(self, model: nn.Module, blocks: tuple[str, ...]) -> None:
        self._model = model
        self._blocks = blocks
        self.calls: dict[str, list[_LinearCall]] = {b: [] for b in blocks}
        self._handles: list = []

    def __enter__(self) -> LinearCallRecorder:
        for fqn in self._blocks:
            block = self._model.get_submodule(fqn)
            for name, sub in block.named_modules():
                if isinstance(sub, nn.Linear):
                    self._handles.append(sub.register_forward_hook(self._linear_hook(fqn, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _linear_hook(self, block: str, name: str):
        def hook(module, args, output):
            calls = self.calls[block]
            if not any(c.name == name for c in calls):
                calls.append(_LinearCall(name, _reads(args[0]), module.in_features, module.out_features,
                                         args[0].numel() // max(module.in_features, 1)))
        return hook

    def rows(self, block: str) -> dict[str, int]:
        """Rows each of ``block``'s Linears multiplied in its first call."""
        return {call.name: call.rows for call in self.calls.get(block, [])}


def _reads(tensor: torch.Tensor) -> tuple:
    """What ``tensor`` reads: its storage, by a weak reference (which keeps the storage's id unique
    without keeping its data: the step frees what its backward no longer needs), and its view of it."""
    return StorageWeakRef(tensor.untyped_storage()), tensor.storage_offset(), tuple(tensor.shape), tensor.stride()


def pair_linears(calls: list[_LinearCall]) -> dict[str, str]:
    """``{linear: "colwise" | "rowwise"}`` for every column group with a row partner."""
    styles: dict[str, str] = {}
    seen_reads: list[tuple] = []
    for call in calls:
        if call.reads not in seen_reads:
            seen_reads.append(call.reads)
    for reads in seen_reads:
        group = [c for c in calls if c.reads == reads and c.name not in styles]
        if not group:
            continue
        last = max(calls.index(c) for c in group)
        widths = {c.out_features for c in group}
        partner = next((c for c in calls[last + 1:] if c.name not in styles and c.reads != reads
                        and c.in_features in widths and c.out_features == group[0].in_features), None)
        if partner is not None:
            styles.update({c.name: "colwise" for c in group})
            styles[partner.name] = "rowwise"
    return styles


def find_tp_layout(model: nn.Module, container: str | None, recorder: LinearCallRecorder,
                   state: dict[str, torch.Tensor], inputs: dict[str, tuple[tuple, dict]], *,
                   kv_heads: int | None = None, autocast_dtype: torch.dtype | None = None,
                   gpu_kernels: bool = False) -> TPLayout:
    """The model's TP layout (patterns with ``*`` for the block index) and, when there is none,
    why: each block that ran is split on its first call's ``inputs`` (:mod:`.block_inputs`), under
    the step's autocast (``autocast_dtype``; with CUDA's float32 list where ``gpu_kernels``); where
    a split fails and the model's ``kv_heads`` key/value heads do not halve, that is the reason
    (the failure itself is a reshape's). Must run inside the fake mode that made ``state`` and the
    recorded inputs."""
    if container is None:
        return TPLayout((), "the model has no repeated blocks to split", {})
    kinds: dict[str, dict[str, str]] = {}
    for fqn, calls in recorder.calls.items():
        if fqn in inputs and calls:
            kinds[fqn] = pair_linears(calls)
    layouts = {tuple(sorted(styles.items())) for styles in kinds.values()}
    declared = declared_styles(model, container)
    if declared is not None:
        kinds = {fqn: declared for fqn in kinds}
    if not kinds or not any(kinds.values()):
        return TPLayout((), "its blocks pair no column-split Linear with a row-split one", {})
    if len(layouts) > 1:
        return TPLayout((), "its blocks split differently from one another", {})
    kept, sp_unavailable = {}, None
    for fqn, styles in kinds.items():
        run = _try_split(model.get_submodule(fqn), fqn, styles, inputs[fqn], state,
                         autocast_dtype=autocast_dtype, gpu_kernels=gpu_kernels)
        if run.failure:
            if kv_heads and kv_heads % 2:
                return TPLayout((), (f"its {kv_heads} key/value head{'s' * (kv_heads > 1)} cannot be split two "
                                     "ways (tensor parallelism splits the attention heads across its ranks)"), {})
            return TPLayout((), f"splitting {fqn} two ways fails ({run.failure})", {})
        kept[fqn] = run.kept
        sp_unavailable = sp_unavailable or run.sp_unavailable
    styles = next(iter(kinds.values()))
    block = model.get_submodule(next(iter(kinds)))
    norms = [name for name, sub in block.named_modules() if name and is_sequence_norm(sub)]
    layout = [(f"{container}.*.{name}", style) for name, style in styles.items()]
    layout += [(f"{container}.*.{name}", "sequence_parallel") for name in norms]
    return TPLayout(tuple(layout), None, kept, sp_unavailable)


def declared_styles(model: nn.Module, container: str) -> dict[str, str] | None:
    """``{linear: style}`` (relative to a block) from the model's own ``config.base_model_tp_plan``,
    or None when it declares none or one with entries other than colwise/rowwise Linears of the
    blocks in ``container`` and the vocabulary's (:data:`~.vocab_layout.HF_VOCAB_STYLES`)."""
    declared = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not declared:
        return None
    blocks_name = container.rpartition(".")[2]  # the plan's keys are relative to the base model
    linears = {name for name, sub in model.get_submodule(container)[0].named_modules() if isinstance(sub, nn.Linear)}
    styles = {}
    for pattern, style in declared.items():
        if style in HF_VOCAB_STYLES and ".*." not in pattern:
            continue  # the embedding's and head's: vocab_layout.py reads them
        head, star, name = pattern.partition(".*.")
        if head != blocks_name or not star or name not in linears or style not in ("colwise", "rowwise"):
            return None
        styles[name] = style
    return styles


class _SplitRun(NamedTuple):
    failure: str | None  # why the halved block fails, or None
    kept: SplitKept = SplitKept()
    sp_unavailable: str | None = None  # why SP cannot run the block (_NormReaders)


def _try_split(block: nn.Module, fqn: str, styles: dict[str, str], inputs: tuple[tuple, dict],
               state: dict[str, torch.Tensor], *, autocast_dtype: torch.dtype | None,
               gpu_kernels: bool) -> _SplitRun:
    """Run ``block``'s forward on its fake weights and on them split two ways as ``styles`` says,
    each run on its own copy of the call's objects (:func:`~.block_inputs.fresh`) and counted as the
    step counts it (:func:`_saving_run`): why the split fails, or what it keeps whole of the bytes
    the block saves for backward."""
    own = {name[len(fqn) + 1:]: t for name, t in state.items() if name.startswith(f"{fqn}.")}
    run = functools.partial(_saving_run, block, inputs=inputs, autocast_dtype=autocast_dtype, gpu_kernels=gpu_kernels)
    columns = [block.get_submodule(name) for name, style in styles.items() if style == "colwise"]
    try:  # a failing split is an answer here, not an error to log
        split = {name: _halved(name, t, styles) for name, t in own.items()}
        with torch.enable_grad(), quiet_fake_tensor_log():
            with _NormReaders(block) as readers:
                whole, whole_saved = run(own, columns=columns)
            halves, halves_saved = run(split)
    except Exception as err:  # noqa: BLE001 — any failure means the split is unsafe
        return _SplitRun(f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
    shapes = [tuple(t.shape) for t in tree_flatten(whole)[0] if isinstance(t, torch.Tensor)]
    if shapes != [tuple(t.shape) for t in tree_flatten(halves)[0] if isinstance(t, torch.Tensor)]:
        return _SplitRun("the output changes shape")
    whole_readers = [name for name in readers.names if styles.get(name) != "colwise"]
    sp_unavailable = (f"{fqn}.{whole_readers[0]} reads a norm's output and is not split by column (a router, or a "
                      "Linear the layout leaves whole), where sequence parallelism hands that output to the "
                      "column-split Linears alone") if whole_readers else None
    moved = whole_saved.op_bytes
    op_share = min(1.0, max(0, 2 * halves_saved.op_bytes - moved) / moved) if moved else 0.0
    policies = {p: max(0, 2 * halves_saved.kept[p] - whole_saved.kept[p]) for p in SELECTIVE_POLICIES}
    return _SplitRun(None, SplitKept(max(0, 2 * halves_saved.bytes - whole_saved.bytes), whole_saved.gathered,
                                     op_share, MappingProxyType(policies)), sp_unavailable)


class _NormReaders:
    """While active, the ``names`` of ``block``'s Linears that read the output of one of its
    sequence norms (:func:`~stratagem.plan.tp_styles.is_sequence_norm`), a view of it included.
    Under sequence parallelism that output is all-gathered into a DTensor, which only the column
    Linears the layout splits take (:mod:`stratagem.plugins.tensor_parallel`)."""

    def __init__(self, block: nn.Module) -> None:
        self._block = block
        self._outputs: set[StorageWeakRef] = set()
        self._kept: list[torch.Tensor] = []  # strong references keep the storages distinct
        self.names: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> _NormReaders:
        for name, sub in self._block.named_modules():
            if name and is_sequence_norm(sub):
                self._handles.append(sub.register_forward_hook(self._norm_done))
            elif isinstance(sub, nn.Linear):
                self._handles.append(sub.register_forward_pre_hook(functools.partial(self._linear_starts, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _norm_done(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self._kept.append(output)
            self._outputs.add(StorageWeakRef(output.untyped_storage()))

    def _linear_starts(self, name: str, module: nn.Module, args: Any) -> None:
        if (args and isinstance(args[0], torch.Tensor) and name not in self.names
                and StorageWeakRef(args[0].untyped_storage()) in self._outputs):
            self.names.append(name)


def _saving_run(block: nn.Module, weights: dict[str, torch.Tensor], *, inputs: tuple[tuple, dict],
                autocast_dtype: torch.dtype | None, gpu_kernels: bool,
                columns: Sequence[nn.Module] = ()) -> tuple[Any, _SavedBytes]:
    """``block``'s output on ``weights`` and what its forward saves for backward (weights and their
    casts aside; of it, what the ``columns`` Linears save: :class:`_SavedBytes`), under the
    step's autocast (CPU autocast in ``autocast_dtype``, none where None) and, where
    ``gpu_kernels``, as a GPU runs it: fused kernels, CUDA's attention kernels, its autocast float32
    list, one-byte dropout masks (the order :func:`~.step.run_fake_step` enters them in)."""
    saved = _SavedBytes(weights, gpu_kernels=gpu_kernels)
    on_gpu = (FusedKernels(saved), CudaAttention(), CudaAutocast()) if gpu_kernels else ()
    with contextlib.ExitStack() as modes:
        for mode in (torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor), saved, *on_gpu,
                     torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None)):
            modes.enter_context(mode)
        for column in columns:
            modes.callback(column.register_forward_pre_hook(lambda *_: saved.enter_column()).remove)
            modes.callback(column.register_forward_hook(lambda *_: saved.leave_column()).remove)
        output = torch.func.functional_call(block, weights, *fresh(*inputs))
    return output, saved


class _SavedBytes(TorchDispatchMode):
    """While active, with :meth:`pack` the saved-tensor hook, the ``bytes`` a forward saves for
    backward as the step counts them (:class:`~.measure.SavedTensorCounter`): each storage once,
    the ``weights`` and their dtype copies (autocast's casts, :data:`~.measure.CAST_OPS`) never,
    the masks dropout draws (:data:`~.measure.MASK_OPS`) at one byte per element where
    ``gpu_kernels``; and ``gathered``: what column Linears save (between :meth:`enter_column` and
    :meth:`leave_column`), their inputs, each storage once, counted there even where an operator
    before them saved it too (SP gathers a copy of its own). And ``op_bytes``: what the operators
    the profile prices by bytes read and write, as the step counts them
    (:func:`~.op_bytes.moved_bytes`; autocast's weight copies, parameter-sized, aside). And
    ``kept``: per selective checkpointing policy, the bytes of the outputs it keeps, each storage
    once (:class:`~.recompute.CheckpointPolicies` counts them op by op, as the profile's step
    does). It is the counter :class:`~.fused.FusedKernels` reports a fused kernel's saved
    tensors and bytes to."""

    def __init__(self, weights: dict[str, torch.Tensor], *, gpu_kernels: bool) -> None:
        super().__init__()
        self.bytes = 0
        self.gathered = 0
        self.op_bytes = 0
        self._columns = 0  # column Linears running
        self.suppressed = 0  # FusedKernels: the decomposition it runs instead of its kernel saves nothing
        self._gpu_kernels = gpu_kernels
        self._weights = {StorageWeakRef(t.untyped_storage()) for t in weights.values()}  # and their casts
        self._counted: set[StorageWeakRef] = set()
        self._masks: set[StorageWeakRef] = set()
        self._gathered: set[StorageWeakRef] = set()
        self._seen: list[torch.Tensor] = []  # strong references keep the storages distinct
        self._policies = CheckpointPolicies(self._weights)  # the weights' casts join the set as they are made
        self._policies.start(_BLOCK)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.suppressed:  # a fused kernel's decomposition runs no operator a policy keeps
            self._policies.op(_BLOCK, str(func.overloadpacket), out, flops=0, ops=0, op_bytes=0, param_op_bytes=0)
        if not isinstance(out, torch.Tensor):
            return out
        packet = func.overloadpacket
        if (packet in CAST_OPS and isinstance(args[0], torch.Tensor)
                and StorageWeakRef(args[0].untyped_storage()) in self._weights):
            self._weights.add(StorageWeakRef(out.untyped_storage()))  # parameter-sized: no activation bytes
            return out
        if self._gpu_kernels and packet in MASK_OPS:
            self._masks.add(StorageWeakRef(out.untyped_storage()))
        if not self.suppressed and priced_by_bytes(packet):
            self.op_bytes += moved_bytes(packet, args, out)
        return out

    @property
    def kept(self) -> dict[str, int]:
        """Per selective policy, the bytes of the operators' outputs it keeps (the block's input aside)."""
        return {policy: counts.kept_bytes for policy, counts in self._policies.counts[_BLOCK].items()}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The saved-tensor hook: count ``tensor`` unless a fused kernel counts what it saves."""
        if not self.suppressed:
            self.count_saved(tensor)
        return tensor

    def count_saved(self, tensor: torch.Tensor | None = None, *, num_bytes: int = 0) -> None:
        """Count ``tensor`` (its storage once) and ``num_bytes`` as saved."""
        self.bytes += num_bytes
        if tensor is None or (ref := StorageWeakRef(tensor.untyped_storage())) in self._weights:
            return
        size = stored_bytes(tensor, ref, self._masks)
        if self._columns and ref not in self._gathered:
            self._gathered.add(ref)
            self.gathered += size
        if ref not in self._counted:
            self._counted.add(ref)
            self._seen.append(tensor)
            self.bytes += size

    def enter_column(self) -> None:
        """A column Linear's forward starts: what it saves (its input) is all-gathered under SP."""
        self._columns += 1

    def leave_column(self) -> None:
        self._columns -= 1

    def count_kernels(self, *, ops: int, op_bytes: int, param_op_bytes: int = 0) -> None:
        """A fused kernel's bytes (its launches are not counted here)."""
        self.op_bytes += op_bytes


def _halved(name: str, tensor: torch.Tensor, styles: dict[str, str]) -> torch.Tensor:
    module, _, kind = name.rpartition(".")
    style = styles.get(module)
    if style == "colwise" or (style == "rowwise" and kind == "weight"):
        dim = 0 if style == "colwise" else 1
        shape = list(tensor.shape)
        if shape[dim] % 2:
            raise ValueError(f"{name} has an odd width ({shape[dim]})")
        shape[dim] //= 2
        return torch.empty(shape, dtype=tensor.dtype, device=tensor.device, requires_grad=tensor.requires_grad)
    return tensor
