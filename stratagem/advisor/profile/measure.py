"""Run a model once, forward and backward, on fake tensors and attribute every cost to a segment.

The segments are the model's blocks plus ``embed`` (whatever runs before the first block) and
``head`` (whatever runs after the last block, the loss included). For each segment we count

* forward and backward FLOPs, through ``torch.utils.flop_counter.FlopCounterMode`` (whose module
  tracker also follows the backward pass), with formulas added for the CPU flash-attention
  kernel that the stock registry lacks;
* bytes saved for backward, through ``saved_tensors_hooks``, each storage counted once, the
  parameters themselves excluded and the compute-dtype copies that autocast makes of them kept
  apart (they scale with parameters, not with the batch);
* which non-block parameters it is the first to use;
* the operators it dispatches in forward and in backward (each costs host time to launch,
  whatever its size: what a step of small kernels spends), and the bytes read and written by
  those without a FLOP formula (norms, activations, softmax, reductions, elementwise
  arithmetic, copies: their time grows with the bytes they move through memory, not with
  FLOPs); views move nothing. Those of parameter-sized outputs are counted apart, as they move
  as much at any batch size: autocast's casts of parameters, the backward's casts of their
  gradients, an embedding's dense gradient;
* the FLOPs of GEMMs whose matrices' rows do not start on 16-byte boundaries (a leading
  dimension, such as GPT-2's 50,257-token vocabulary, that is not a multiple of 8 half-precision
  or 4 single-precision elements): cuBLAS runs them with its slower unaligned kernels;
* the attention core (Korthikanti et al. 2022, §4.2): the forward FLOPs of ops that read or
  write an s×s tensor (QKᵀ, AV) or are fused attention kernels, and the saved tensors shaped s×s
  in their last two dimensions (softmax output, dropout mask and output);
* per block and selective checkpointing policy, what the block keeps and what its backward
  recomputes (:mod:`~stratagem.advisor.profile.recompute`), decided op by op as the plugin's
  policy decides.

Blocks identical to one already measured are not run again
(:mod:`~stratagem.advisor.profile.block_reuse`): an 80-layer model costs about one layer.

Kernels differ between CPU and CUDA. A profile for GPUs (``kernels="gpu"``) counts what the
CUDA kernels do: dropout masks at one byte per element (CPU dropout keeps its mask in the input
dtype, CUDA's ``native_dropout`` a bool mask), LayerNorm's backward reading its input and the
output's gradient a second time for the weight's gradient and a softmax its long rows three
times (:mod:`~stratagem.advisor.profile.reread`), the functions CUDA fuses as one kernel
(:mod:`~stratagem.advisor.profile.fused`), the attention kernel CUDA picks
(:mod:`~stratagem.advisor.profile.attention`) and what CUDA's autocast runs in float32
(:mod:`~stratagem.advisor.profile.autocast`); a profile for CPU ranks (``kernels="cpu"``) counts
what the CPU runs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from stratagem.advisor.profile.backward_blocks import BackwardBlocks
from stratagem.advisor.profile.backward_held import BackwardHeld
from stratagem.advisor.profile.block_reuse import tensor_bytes, tensor_leaves
from stratagem.advisor.profile.batch_norms import BATCH_NORM_OPS, batch_norm_call
from stratagem.advisor.profile.convolutions import conv_layer
from stratagem.advisor.profile.counts import RunRecord, SegmentCounts
from stratagem.advisor.profile.flop_formulas import FLOP_FORMULAS
from stratagem.advisor.profile.forward_held import ForwardHeld
from stratagem.advisor.profile.fusion import FusionTracker, Read, region_of, sums_across_rows
from stratagem.advisor.profile.op_bytes import UNCOUNTED_OPS, WHOLE_KERNELS, priced_by_bytes, reads, written_by
from stratagem.advisor.profile.own_checkpoints import RebuiltBytes
from stratagem.advisor.profile.recompute import CheckpointPolicies
from stratagem.advisor.profile.reread import REREAD_BYTES

aten = torch.ops.aten

EMBED = "embed"
HEAD = "head"

# Ops whose output becomes a dropout mask (CPU dropout: empty_like, bernoulli_, div_, mul).
MASK_OPS = {aten.bernoulli_, aten.bernoulli}
# Ops that make a dtype copy of a tensor (autocast's weight casts).
CAST_OPS = {aten._to_copy}
# Ops whose output is a parameter's gradient at any batch size (an embedding's is dense).
_PARAMETER_SIZED_OPS = {aten.embedding_dense_backward}
# Matrix products whose matrices' leading dimensions decide which GEMM kernels run.
_GEMM_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
# The row alignment cuBLAS's fastest (vectorised, tensor-core) kernels need: 16 bytes.
GEMM_ALIGNMENT_BYTES = 16


ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
}

ATTENTION_BACKWARD_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
}


def attention_shape(func_packet: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, bool, int]:
    """``(seq_q, seq_kv, head_dim, causal, kv_group)`` of a call of a fused attention kernel or its
    backward (:data:`ATTENTION_OPS`, :data:`ATTENTION_BACKWARD_OPS`), read by the names of the
    operator's schema: ``kv_group`` query heads share each key and value head (``[batch, heads,
    rows, width]``; more than 1 where grouped-query attention reaches the kernel unexpanded)."""
    named = dict(zip((a.name for a in func_packet.default._schema.arguments), args)) | kwargs
    query, key = named["query"], named["key"]
    return (int(query.shape[-2]), int(key.shape[-2]), int(query.shape[-1]), bool(named.get("is_causal", False)),
            max(1, int(query.shape[-3]) // int(key.shape[-3])) if query.dim() >= 3 else 1)


def _no_flops(*args: Any, **kwargs: Any) -> int:
    return 0


def unaligned_gemm(args: Any, out: Any) -> bool:
    """Whether a matrix of a GEMM (an operand or the output) has a leading dimension, the stride
    of whichever of its last two dimensions is not contiguous, of a byte length that is not a
    multiple of :data:`GEMM_ALIGNMENT_BYTES`. Matrices of one row or column have none."""
    for tensor in (*tree_flatten(args)[0], out):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or min(tensor.shape[-2:]) < 2:
            continue
        rows, columns = tensor.stride()[-2:]
        lead = rows if columns == 1 else columns if rows == 1 else 0
        if lead * tensor.element_size() % GEMM_ALIGNMENT_BYTES:
            return True
    return False


def writes_a_gradient(out: torch.Tensor, inputs: list[torch.Tensor],
                      gradient_shapes: set[tuple[tuple[int, ...], torch.dtype]]) -> bool:
    """Whether a backward operator writes a trainable parameter's gradient (its shape and dtype)
    from tensors of that shape alone: a gradient cast back to its parameter's dtype, tied
    parameters' gradients summed. It moves as many bytes at any batch size."""
    return (tuple(out.shape), out.dtype) in gradient_shapes and all(t.shape == out.shape for t in inputs)


def _gradient_of(out: torch.Tensor) -> torch.Tensor | None:
    """The parameter of ``out``'s shape and dtype that the autograd node running now hands it to
    (an ``AccumulateGrad`` it feeds, or is), as its gradient; None if none. Shapes alone cannot
    tell: an activation flattened to ``[tokens, width]`` has a square weight's shape where the
    tokens the profile runs equal the width (OPT-1.3B's 2,048 at 2 × 1,024)."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    nodes = [node, *(following for following, _ in node.next_functions if following is not None)]
    return next((variable for found in nodes if (variable := getattr(found, "variable", None)) is not None
                 and variable.shape == out.shape and variable.dtype == out.dtype), None)


def _widest_last_dim(tree: Any) -> int:
    """The last dimension of the largest tensor in ``tree`` (1 for scalars, 0 for none): the width
    an operator of the head works at (the vocabulary's, or the hidden size)."""
    largest = max(tensor_leaves(tree), key=lambda t: t.numel(), default=None)
    return 0 if largest is None else largest.shape[-1] if largest.dim() else 1


def _largest(tensors: list[torch.Tensor], *, but: set[tuple[int, ...]]) -> int:
    """Bytes of the largest of ``tensors`` whose shape is not in ``but``."""
    return max((tensor_bytes(t) for t in tensors if tuple(t.shape) not in but), default=0)


class CostCounter(FlopCounterMode):
    """A FlopCounterMode that attributes FLOPs and tensor provenance to segments."""

    def __init__(self, *, block_of: dict[str, str], record: RunRecord,
                 state_names: dict[StorageWeakRef, str], gradient_shapes: set[tuple[tuple[int, ...], torch.dtype]],
                 has_blocks: bool, seq_len: int | None, batch_size: int | None, gpu_kernels: bool = True,
                 model_name: str = "", sequence_norms: frozenset[str] = frozenset()) -> None:
        whole = {op.default: _no_flops for op in WHOLE_KERNELS}
        super().__init__(display=False, custom_mapping={**FLOP_FORMULAS, **whole})
        self.seq_len = seq_len
        self.batch_size = batch_size
        self._block_of = block_of  # module-tracker name -> block FQN
        self._backward = BackwardBlocks(block_of)
        self._model_name = model_name  # the module tracker's name for the model
        self._sequence_norms = sequence_norms  # module-tracker names of the blocks' sequence norms
        self._record = record
        self._state_names = state_names
        self._gradient_shapes = gradient_shapes  # (shape, dtype) of the trainable parameters
        self._parameter_shapes = {shape for shape, _ in gradient_shapes}
        self._has_blocks = has_blocks
        self._fwd_after_blocks = False
        self._param_users: dict[str, set[str]] = defaultdict(set)  # state name -> the segments whose forward uses it
        self.param_copies: set[StorageWeakRef] = set()
        self.masks: set[StorageWeakRef] = set()
        self._gpu_kernels = gpu_kernels  # count what CUDA's kernels move (module docstring)
        self.suppressed = 0  # inside a decomposition counted as its fused kernel (fused.FusedKernels)
        self.saved: SavedTensorCounter | None = None
        self.policies = CheckpointPolicies(set(state_names))
        self.rebuilt = RebuiltBytes(record)
        self.held = BackwardHeld(record)
        self.fwd_held = ForwardHeld(record, outside=(EMBED, HEAD))
        self.fusion = FusionTracker()

    def segment(self) -> str:
        """The segment running now: the block a running module is or lies in (in backward as
        :class:`~stratagem.advisor.profile.backward_blocks.BackwardBlocks` follows them), else
        embed/head by execution order."""
        parents = self.mod_tracker.parents
        if not self._has_blocks:
            return EMBED
        if self.mod_tracker.is_bw:
            block = self.rebuilt.nested_segment() or self._backward.segment(parents)
            return block if block is not None else EMBED if self._backward.last is not None else HEAD
        block = next((b for name in parents if (b := self._backward.within(name)) is not None), None)
        if block is not None:
            self._fwd_after_blocks = True
            return block
        return HEAD if self._fwd_after_blocks else EMBED

    def _gradient_segment(self, out: Any, running: str) -> str:
        """The segment an operator counts in: ``running``, unless in backward it makes the
        gradient of a parameter that ``running`` did not use (its cast back to the parameter's
        dtype), which counts in the parameter's first user: the engine may run a weight's cast
        after the block's input gradient, when the module tracker has left the block (BLOOM's MLP
        and attention output weights, counted in the embedding's before). A tied weight's
        gradients count where each use made them."""
        if not (self.mod_tracker.is_bw and isinstance(out, torch.Tensor)
                and (tuple(out.shape), out.dtype) in self._gradient_shapes):
            return running
        parameter = _gradient_of(out)
        name = None if parameter is None else self._state_names.get(StorageWeakRef(parameter.untyped_storage()))
        if name is None or running in self._param_users[name]:
            return running
        return self._record.param_segment.get(name, running)

    def _module(self, seg: str) -> str:
        """The innermost module running now, named relative to segment ``seg``'s block (to the
        model outside the blocks)."""
        name = max(self.mod_tracker.parents, key=lambda n: n.count("."), default="")
        block = next((tracked for tracked, fqn in self._block_of.items() if fqn == seg), None)
        for prefix in (f"{block}.", f"{self._model_name}.") if block else (f"{self._model_name}.",):
            if name.startswith(prefix) and name != block:
                return name[len(prefix):]
        return ""  # the block itself, or the model

    def count_kernels(self, *, ops: int, op_bytes: int, param_op_bytes: int = 0) -> None:
        """Count ``ops`` operators moving ``op_bytes`` (and ``param_op_bytes`` of parameter-sized
        tensors) in the running segment and direction: an eager fused kernel's. Compiled, its
        decomposition's operators fuse with their neighbours (:meth:`_count_flops`)."""
        counts = self._record.segments[self.segment()]
        self._count_norm_ops(counts, ops)
        if self.mod_tracker.is_bw:
            counts.bwd_ops += ops
            counts.bwd_op_bytes += op_bytes
            counts.bwd_param_op_bytes += param_op_bytes
        else:
            counts.fwd_ops += ops
            counts.fwd_op_bytes += op_bytes
            counts.fwd_param_op_bytes += param_op_bytes
            self.policies.op(self.segment(), "fused kernel", None, flops=0, ops=ops, op_bytes=op_bytes,
                             param_op_bytes=param_op_bytes)

    def _count_norm_ops(self, counts: SegmentCounts, ops: int) -> None:
        """Count ``ops`` among the operators of a sequence norm (a LayerNorm or RMSNorm in a block)
        when one is running, in either direction: under SP each runs on DTensors."""
        if ops and not self._sequence_norms.isdisjoint(self.mod_tracker.parents):
            counts.sp_norm_ops += ops

    def count_saved(self, tensor: torch.Tensor | None = None, *, num_bytes: int = 0) -> None:
        """Count ``tensor`` (once per storage) or ``num_bytes`` as saved for backward."""
        assert self.saved is not None, "run_fake_step pairs the counters"
        self.saved.count(tensor, num_bytes=num_bytes)
        if not self.mod_tracker.is_bw:
            self.policies.saved(self.segment())

    def _count_flops(self, func_packet, out, args, kwargs):
        seg = self._gradient_segment(out, self.segment())
        if self.mod_tracker.is_bw:
            self.rebuilt.op(seg, args, out)
        held = self.held if self.mod_tracker.is_bw else self.fwd_held
        held.op(seg, args, out, parameter_sized=self._parameter_sized(func_packet, args, out))
        if not self.suppressed:
            self._count(seg, func_packet, out, args, kwargs)
        elif priced_by_bytes(func_packet):
            # inside an eager fused kernel (fused.FusedKernels): compiled, its operators fuse
            written = written_by(func_packet, out, args)
            batch, sized = self._bytes_moved(func_packet, args, out, written)
            if batch or sized:
                self._track_fusion(seg, func_packet, args, out, fusible=not sized)
        self._track_provenance(func_packet, out, args, seg)
        return out

    def _formula(self, func_packet: Any) -> Callable[..., int] | None:
        """The FLOP formula of an operator with FLOPs (GEMMs, convolutions, attention); None for
        one without (:data:`WHOLE_KERNELS` are registered only to stay whole)."""
        return None if func_packet in WHOLE_KERNELS else self.flop_registry.get(func_packet)

    def _count(self, seg: str, func_packet: Any, out: Any, args: Any, kwargs: Any) -> None:
        """Count one operator of segment ``seg`` in the running direction: its FLOPs (those of
        unaligned GEMMs and of the attention core apart), its launch, the bytes it moves without
        FLOPs; in a block's forward, also for what each checkpointing policy recomputes."""
        counts, is_bw = self._record.segments[seg], self.mod_tracker.is_bw
        formula = self._formula(func_packet)
        counted = func_packet not in UNCOUNTED_OPS
        ops = 1 if counted else 0
        batch = sized = flops = unaligned = 0
        if counted:
            written = written_by(func_packet, out, args)
            if formula is None:
                batch, sized = self._bytes_moved(func_packet, args, out, written)
                if self._gpu_kernels and func_packet in REREAD_BYTES:
                    batch += REREAD_BYTES[func_packet](args)
            if is_bw:  # the largest gradient written, no weight's
                counts.bwd_largest_output_bytes = max(counts.bwd_largest_output_bytes,
                                                      _largest(written, but=self._parameter_shapes))
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            unaligned = flops if func_packet in _GEMM_OPS and unaligned_gemm(args, out) else 0
        if formula is not None or batch or sized:  # views move nothing and launch no kernel
            self._track_fusion(seg, func_packet, args, out, fusible=formula is None and not sized)
        if formula is not None and func_packet in (ATTENTION_BACKWARD_OPS if is_bw else ATTENTION_OPS):
            calls = counts.fused_attention.setdefault(attention_shape(func_packet, args, kwargs), [0, 0])
            calls[is_bw] += flops
        self._count_norm_ops(counts, ops)
        if seg == HEAD and batch:
            counts.by_width[_widest_last_dim((args, out))][1 + is_bw] += batch
        if is_bw:
            counts.bwd_ops += ops
            counts.bwd_op_bytes += batch
            counts.bwd_param_op_bytes += sized
            counts.bwd_flops += flops
            counts.bwd_unaligned_flops += unaligned
            return
        counts.fwd_ops += ops
        counts.fwd_op_bytes += batch
        counts.fwd_param_op_bytes += sized
        counts.fwd_flops += flops
        counts.fwd_unaligned_flops += unaligned
        if formula is not None and (func_packet in ATTENTION_OPS or self._touches_scores(args, out)):
            counts.attention_fwd_flops += flops
        if func_packet is aten.convolution and (conv := conv_layer(args, kwargs, out, name=self._module(seg))):
            counts.convs.append(conv)
        if func_packet in BATCH_NORM_OPS and (norm := batch_norm_call(func_packet, args, kwargs)):
            counts.batch_norms.append(norm)
        if counted:  # torch's selective checkpointing asks its policy about these alone
            self.policies.op(seg, str(func_packet), out, flops=flops, ops=1, op_bytes=batch, param_op_bytes=sized,
                             attention_flops=flops if func_packet in ATTENTION_OPS else 0)

    def _track_fusion(self, seg: str, func_packet: Any, args: Any, out: Any, *, fusible: bool) -> None:
        """Tell the fusion tracker what an operator reads and writes (``fusible``: it moves
        batch-sized bytes without FLOPs, so a compiler may fuse it with its neighbours)."""
        def refs(tree: Any) -> list[tuple[StorageWeakRef, int]]:
            return [(StorageWeakRef(t.untyped_storage()), tensor_bytes(t)) for t in tensor_leaves(tree)]

        written = written_by(func_packet, out, args)
        sums = [t for t in written if sums_across_rows(tree_flatten(args)[0], t)] if fusible else []
        cast = (out.dtype, tuple(out.shape)) if func_packet in CAST_OPS and isinstance(out, torch.Tensor) else None
        reads = [Read(ref, size, region_of(t)) for (ref, size), t in zip(refs(args), tensor_leaves(args), strict=True)]
        self.fusion.op((seg, self.mod_tracker.is_bw), fusible=fusible, reads=reads, writes=refs(written),
                       sums=refs(sums), cast=cast)

    def _bytes_moved(self, func_packet: Any, args: Any, out: Any, written: list[torch.Tensor]) -> tuple[int, int]:
        """Bytes an operator without FLOPs reads and writes (``written``: :func:`written`; none
        for a view; a gather reads what it writes, not its whole input, a scatter none of its
        input of the output's shape), as (those that grow with the batch, the parameter-sized
        ones: the outputs of :meth:`_parameter_sized` operators and their inputs of that shape)."""
        if not written:
            return 0, 0
        read = reads(func_packet, args, written)
        if not self._parameter_sized(func_packet, args, out):
            return tensor_bytes(read) + tensor_bytes(written), 0
        alike = [t for t in read if t.shape == written[0].shape]
        return tensor_bytes(read) - tensor_bytes(alike), tensor_bytes(alike) + tensor_bytes(written)

    def _parameter_sized(self, func_packet: Any, args: Any, out: Any) -> bool:
        """Whether an operator writes as much at any batch size: an embedding's dense gradient;
        in forward, a cast of a parameter or buffer (autocast's weight copies); in backward, an
        operator on tensors of a trainable parameter's shape that outputs its shape and dtype
        (its gradient cast back to it, tied parameters' gradients summed)."""
        if func_packet in _PARAMETER_SIZED_OPS:
            return True
        if not isinstance(out, torch.Tensor):
            return False
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        if self.mod_tracker.is_bw:
            return writes_a_gradient(out, tensors, self._gradient_shapes) and _gradient_of(out) is not None
        return func_packet in CAST_OPS and any(StorageWeakRef(t.untyped_storage()) in self._state_names
                                                for t in tensors)

    def is_scores(self, tensor: torch.Tensor) -> bool:
        """Shaped like attention scores: s×s in the last two dimensions, with heads in front
        (``[b, heads, s, s]``, or ``[b·heads, s, s]``) — not a ``[b, s, h]`` activation whose
        width happens to equal s, nor a batch-independent ``[s, s]`` mask."""
        s = self.seq_len
        if s is None or s < 2 or tensor.dim() < 3 or tuple(tensor.shape[-2:]) != (s, s):
            return False
        return tensor.dim() >= 4 or tensor.shape[0] != self.batch_size

    def _touches_scores(self, args: Any, out: Any) -> bool:
        return any(isinstance(t, torch.Tensor) and self.is_scores(t) for t in tree_flatten((args, out))[0])

    def _track_provenance(self, func_packet, out, args, seg: str) -> None:
        for arg in tree_flatten(args)[0]:
            if isinstance(arg, torch.Tensor):
                name = self._state_names.get(StorageWeakRef(arg.untyped_storage()))
                if name is not None:
                    self._record.param_segment.setdefault(name, seg)
                    if not self.mod_tracker.is_bw:
                        self._param_users[name].add(seg)
                    if func_packet in CAST_OPS and isinstance(out, torch.Tensor):
                        self._param_copy(seg, out)
        if self._gpu_kernels and func_packet in MASK_OPS and isinstance(out, torch.Tensor):
            self.masks.add(StorageWeakRef(out.untyped_storage()))

    def _param_copy(self, seg: str, copy: torch.Tensor) -> None:
        """Follow a parameter's copy (autocast's cast); count it once in the forward's, saved or not."""
        ref = StorageWeakRef(copy.untyped_storage())
        if not self.mod_tracker.is_bw and ref not in self.param_copies:
            self._record.segments[seg].forward_param_copy_bytes += copy.untyped_storage().nbytes()
        self.param_copies.add(ref)


class SavedTensorCounter:
    """``saved_tensors_hooks`` pack hook: bytes saved for backward per segment, once per storage.
    What a block's rerun saves in backward (a reentrant checkpoint's) is not kept from the forward:
    :class:`~stratagem.advisor.profile.own_checkpoints.RebuiltBytes` counts it."""

    def __init__(self, counter: CostCounter, record: RunRecord, params: set[StorageWeakRef]) -> None:
        self._counter = counter
        self._record = record
        self._params = params
        self._seen: set[StorageWeakRef] = set()  # counted once (a weak reference keeps its storage's id unique)
        self.kept = counter.held.kept  # the activations counted, by storage: (segment, bytes)
        self._inputs: dict[StorageWeakRef, str] = {}  # the blocks' inputs: the block that took each last

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._counter.mod_tracker.is_bw:  # in backward, a rerun's save: what the block rebuilds (RebuiltBytes)
            if not self._counter.suppressed:
                self.count(tensor)
            self._counter.policies.saved(self._counter.segment())  # a checkpointed block's recompute reaches this far
        return tensor

    def count(self, tensor: torch.Tensor | None, *, num_bytes: int = 0) -> None:
        """Count ``tensor`` (its storage once; parameters never) and ``num_bytes`` as saved in the
        running segment."""
        if num_bytes:
            self._record.segments[self._counter.segment()].saved_bytes += num_bytes
        if tensor is None:
            return
        ref = StorageWeakRef(tensor.untyped_storage())
        self._counter.fusion.saved(ref)
        if ref in self._params or ref in self._seen:
            return
        self._seen.add(ref)
        segment = self._counter.segment()
        if segment in (EMBED, HEAD):  # a reentrant checkpoint saves its block's input once the block ran
            segment = self._inputs.get(ref, segment)
        counts = self._record.segments[segment]
        if ref in self._counter.param_copies:
            counts.saved_param_copy_bytes += tensor.untyped_storage().nbytes()
            return
        num_bytes = stored_bytes(tensor, ref, self._counter.masks)
        counts.saved_bytes += num_bytes
        if segment == HEAD:
            counts.by_width[_widest_last_dim(tensor)][0] += num_bytes
        self.kept[ref] = (segment, num_bytes)
        self._counter.fwd_held.saved(segment, ref, num_bytes)
        if self._counter.is_scores(tensor):
            counts.attention_saved_bytes += num_bytes

    def counted(self, tree: Any) -> bool:
        """Whether a tensor of ``tree`` was counted as saved (by any segment)."""
        return any(StorageWeakRef(t.untyped_storage()) in self._seen for t in tensor_leaves(tree))

    def kept_in(self, segment: str, tree: Any) -> bool:
        """Whether ``segment`` counted a tensor of ``tree`` as kept for backward."""
        return any(self.kept.get(StorageWeakRef(t.untyped_storage()), ("",))[0] == segment for t in tensor_leaves(tree))

    def mark_counted(self, tree: Any) -> None:
        """Count ``tree``'s tensors as counted already (a stand-in's output: block_reuse.BlockReuse)."""
        self._seen.update(StorageWeakRef(t.untyped_storage()) for t in tensor_leaves(tree))

    def claim(self, block: str, inputs: list[torch.Tensor]) -> None:
        """Count in ``block`` its ``inputs`` saved outside the blocks, before its forward starts or
        after (:meth:`count`): a checkpoint placed around the block saved them for it
        (:mod:`~stratagem.advisor.profile.own_checkpoints`)."""
        if self._counter.mod_tracker.is_bw:
            return
        for tensor in inputs:
            ref = StorageWeakRef(tensor.untyped_storage())
            self._inputs[ref] = block
            segment, num_bytes = self.kept.get(ref, (block, 0))
            if segment in (EMBED, HEAD):
                self._record.segments[segment].saved_bytes -= num_bytes
                self._record.segments[block].saved_bytes += num_bytes
                self.kept[ref] = (block, num_bytes)

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def stored_bytes(tensor: torch.Tensor, ref: StorageWeakRef, masks: set[StorageWeakRef]) -> int:
    """Bytes a tensor saved for backward holds (``ref``: its storage's): the storage's, or one per
    element where it is a dropout mask CUDA draws (``masks``, the storages :data:`MASK_OPS` drew
    into where the profile counts a GPU's kernels)."""
    return tensor.numel() if ref in masks else tensor.untyped_storage().nbytes()
