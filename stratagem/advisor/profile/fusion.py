"""What a compiler that fuses operators without FLOPs would move: ``torch.compile``'s inductor,
or Megatron-LM's hand-fused kernels (softmax with its scale and mask, bias with GELU, bias with
dropout and the residual add, LayerNorm).

Between two GEMMs, a chain of element-wise operators, reductions and copies becomes one kernel
that reads what the chain takes from outside it once and writes only what leaves it; the
intermediates stay in registers. What leaves a kernel: a tensor a GEMM (or another FLOP operator)
reads, one saved for backward, one the other direction, another segment or another kernel reads,
and one nothing reads (a gradient, an output). An operator joins the kernel of what it reads
unless that kernel would then run both before and after a GEMM: the residual stream after a
block's feed-forward GEMMs is a kernel of its own, which reads the stream written before them.
A cast of what another cast of the kernel already made is that cast's result (autocast casts an
activation once for each operator that takes it; a compiler once). Each kernel is one launch.

A sum across rows (over dimensions other than only the innermost: a bias's gradient and a norm's
weight and bias gradients, ``[C]`` from ``[b, s, C]``; BatchNorm's statistics and their gradients,
``[1, C, 1, 1]`` or ``[C]`` from ``[N, C, H, W]``) iterates over other elements than the chain's
row-wise work, and inductor gives it kernels of its own: partial sums over slices of the rows,
then their sum. They read what the sum needs from memory, computing again from the chain's inputs
what stayed in registers, and what uses the sum reads its input again; sums that read a tensor in
common share their first kernel (``bench/inductor_kernels.py`` prints what inductor writes for a
GPU). A reduction over the innermost dimensions (a LayerNorm's or a softmax's row) stays in the
chain's kernel.

The tracker takes operators from the eager step on fake tensors (profile/measure.py) or, for a
compiled block, from the graphs inductor lowers (profile/compiled_kernels.py), where the
partitioner's choices (what backward computes again) are made already.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

COLUMN_KERNELS = 2
"""Kernels a sum across rows launches: partial sums over slices of the rows, then their sum
(inductor's split reduction, ``ir.Reduction.num_splits``, as its generated code for GPT-2, ViT and
ResNet blocks shows: ``bench/inductor_kernels.py``); sums that share a first kernel add one each."""

def sums_across_rows(inputs: list, out: torch.Tensor) -> bool:
    """Whether ``out`` reduces one of ``inputs`` over dimensions that are not only its innermost:
    ``[C]`` or ``[1, 1, C]`` from ``[b, s, C]`` (a bias's gradient), ``[1, C, 1, 1]`` or ``[C]`` from
    ``[N, C, H, W]`` (BatchNorm's statistics), ``[b, C]`` from ``[b, s, C]`` (a mean over the
    tokens); not ``[b, s, 1]`` or ``[b, s]`` from it (a row's) nor a scalar (a loss)."""
    return any(isinstance(x, torch.Tensor) and x.dim() > 1 and x.numel() > out.numel()
               and _across_rows(tuple(x.shape), tuple(out.shape)) for x in inputs)


def _across_rows(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    """Whether a reduction of a ``shape`` tensor to ``out`` reduces a dimension before one it
    keeps: with the reduced dimensions kept as 1s, by position; without, ``out`` being the sizes
    ``shape`` keeps in order, other than its leading ones. Where sizes coincide (``[C]`` from
    ``[C, C]``: OPT's ``[tokens, width]`` with as many tokens as its width), the trailing ones win:
    a bias's gradient."""
    trailing = out
    while len(trailing) > 1 and trailing[0] == 1:
        trailing = trailing[1:]
    if 0 < len(trailing) < len(shape) and trailing == shape[-len(trailing):]:
        return True
    if len(out) == len(shape):
        if any(o not in (1, n) for n, o in zip(shape, out)):
            return False
        reduced = [o == 1 < n for n, o in zip(shape, out)]
        kept = [o == n > 1 for n, o in zip(shape, out)]
        return any(reduced[i] and any(kept[i + 1:]) for i in range(len(shape)))
    if len(out) > len(shape) or out == shape[:len(out)]:
        return False
    rest = iter(shape)
    return all(any(n == o for n in rest) for o in out)  # out's sizes in order among shape's


Group = tuple[str, bool]
"""Where an operator runs: its segment and whether in backward."""

Ref = Hashable
"""A storage an operator reads or writes (a ``StorageWeakRef``, or a graph's value)."""


class Region(NamedTuple):
    """Where a tensor lies in its storage, in elements: what a view of it reads."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    element_size: int
    storage_bytes: int


def region_of(t: torch.Tensor) -> Region:
    """The :class:`Region` of ``t`` (a real, fake or meta tensor)."""
    return Region(t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.element_size(), t.untyped_storage().nbytes())


class Read(NamedTuple):
    """A storage an operator reads, the bytes of the tensor it reads there, and where that tensor
    lies (None: unknown; the whole read counts)."""

    ref: Ref
    num_bytes: int
    region: Region | None = None


@dataclass
class _Op:
    group: Group
    reads: list[Read]
    writes: list[tuple[Ref, int]]
    sums: list[tuple[Ref, int]]  # those of ``writes`` that sum across rows (sums_across_rows)
    bit: int  # this operator's bit among every operator the tracker saw
    after: int  # the bits of every operator it depends on, its own included

    @property
    def only_sums(self) -> bool:
        """Whether all it writes are such sums: then it is no part of a fused chain's kernel."""
        return bool(self.sums) and len(self.sums) == len(self.writes)


@dataclass
class FusionTracker:
    """Collects every operator's storages read and written, then counts the bytes and kernels of
    the fused operators per segment and direction (:meth:`fused`)."""

    _ops: list[_Op] = field(default_factory=list)
    _writer: dict[Ref, int | None] = field(default_factory=dict)  # the fused operator that wrote it last (None: another)
    _group_of: dict[Ref, Group] = field(default_factory=dict)  # the group of the operator that wrote it last
    _after: dict[Ref, int] = field(default_factory=dict)  # what it depends on: its writer's ``after``
    _readers: dict[Ref, set[tuple[Group, int | None]]] = field(default_factory=lambda: defaultdict(set))
    _saved: set[Ref] = field(default_factory=set)
    _unfused: dict[Group, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))  # (bit, after)
    _casts: dict[tuple, list[tuple[Ref, int]]] = field(default_factory=dict)  # what each cast wrote
    _same: dict[Ref, Ref] = field(default_factory=dict)  # a repeated cast's result: the first's
    _seen: int = 0  # operators so far: the next one's bit

    def op(self, group: Group, *, fusible: bool, reads: list[tuple], writes: list[tuple[Ref, int]],
           sums: list[tuple[Ref, int]] = (), cast: Hashable | None = None) -> None:
        """One operator of ``group``: the storages it reads (each a :class:`Read`, or a storage and
        its bytes) and writes, with their bytes; ``sums``: those of ``writes`` that sum an input
        across rows (:func:`sums_across_rows`: a bias's gradient, BatchNorm's statistics); ``cast``:
        what a cast makes (dtype, shape), for a cast of what another cast of its group already made (autocast
        casts an activation for each operator that takes it; a compiler once), which is that
        cast's result and no operator."""
        reads = [Read(self._same.get(ref, ref), *rest) for ref, *rest in reads]
        if fusible and cast is not None:
            made = self._casts.setdefault((group, cast, tuple(read.ref for read in reads)), writes)
            if made is not writes:
                self._same.update((ref, earlier) for (ref, _), (earlier, _) in zip(writes, made))
                return
        bit = 1 << self._seen
        self._seen += 1
        after = bit
        for read in reads:
            after |= self._after.get(read.ref, 0)
        index = len(self._ops) if fusible else None
        for read in reads:
            self._readers[read.ref].add((group, index))
        for ref, _ in writes:
            self._writer[ref], self._group_of[ref], self._after[ref] = index, group, after
        if fusible:
            self._ops.append(_Op(group, reads, writes, list(sums), bit, after))
        else:
            self._unfused[group].append((bit, after))

    def saved(self, ref: Ref) -> None:
        """A storage saved for backward: its producer's group must write it out."""
        self._saved.add(self._same.get(ref, ref))

    def fused(self) -> dict[Group, tuple[int, int]]:
        """Per group: the bytes its fused operators move, and the kernels it launches fused (the
        fused groups, each operator that does not fuse: GEMMs, attention, weight casts, and the
        kernels of each sum across rows: :meth:`_sums`).

        An operator joins the kernel of an operator whose result it reads (of its group) unless
        that would make the kernel run both before and after an unfused one: where it depends on a
        GEMM that depends on that kernel (the residual stream after the feed-forward's GEMMs)."""
        parent: dict[int, int] = {}
        members: dict[int, int] = {}  # per kernel (by its root): its operators' bits
        needs: dict[int, int] = {}  # per kernel: what its operators depend on
        writer: dict[Ref, int] = {}
        for index, op in enumerate(self._ops):
            parent[index], members[index], needs[index] = index, op.bit, op.after
            for ref, *_ in op.reads if not op.only_sums else ():
                if ref in writer and self._ops[writer[ref]].group == op.group and not self._ops[writer[ref]].only_sums:
                    a, b = _root(parent, writer[ref]), _root(parent, index)
                    if a != b and not self._cycle(op.group, (members[a], needs[a]), (members[b], needs[b])):
                        parent[a] = b
                        members[b] |= members[a]
                        needs[b] |= needs[a]
            for ref, _ in op.writes:
                writer[ref] = index
        moved: dict[int, int] = defaultdict(int)  # per kernel, by its root
        read: dict[int, dict[Ref, list[Read]]] = defaultdict(lambda: defaultdict(list))  # from memory, per kernel
        stored: dict[int, set[Ref]] = defaultdict(set)  # written by the kernel
        writes_out: set[int] = set()
        writer.clear()
        for index, op in enumerate(self._ops):
            root = _root(parent, index)
            for one in op.reads if not op.only_sums else ():
                ref = one.ref
                inside = ref in writer and _root(parent, writer[ref]) == root and not self._ops[writer[ref]].only_sums
                if not inside:
                    read[root][ref].append(one)
            for ref, size in op.writes:
                writer[ref] = index
                if (ref, size) not in op.sums and self._leaves(ref, parent) and ref not in stored[root]:
                    stored[root].add(ref)  # written once: an in-place operator writes it again in registers
                    moved[root] += size
                    writes_out.add(root)
        for root, by_storage in read.items():
            moved[root] += sum(map(_covered, by_storage.values()))
        totals: dict[Group, list[int]] = defaultdict(lambda: [0, 0])
        for group, unfused in self._unfused.items():
            totals[group][1] += len(unfused)
        for index, op in enumerate(self._ops):
            if index in writes_out:  # a chain whose results only sums recompute is no kernel
                totals[op.group][0] += moved[index]
                totals[op.group][1] += 1
        for group, (moved_bytes, kernels) in self._sums(parent).items():
            totals[group][0] += moved_bytes
            totals[group][1] += kernels
        return {group: (moved_bytes, kernels) for group, (moved_bytes, kernels) in totals.items()}

    def _cycle(self, group: Group, one: tuple[int, int], other: tuple[int, int]) -> bool:
        """Whether two kernels (their operators' bits, what those depend on) would, as one, depend
        on an unfused operator of ``group`` that depends on them."""
        ops, needs = one[0] | other[0], one[1] | other[1]
        return any(after & ops and needs & bit for bit, after in self._unfused.get(group, ()))

    def _sums(self, parent: dict[int, int]) -> dict[Group, tuple[int, int]]:
        """Per group, the bytes and kernels of its sums across rows. Each reads what
        it needs from memory (through the group's intermediates that stay in registers, what those
        were computed from: the compiler computes them again) and writes its sum (a parameter's
        size, or a channel's for BatchNorm's statistics). Sums that read a tensor in common share
        their first kernel, which reads it once
        (inductor fuses them horizontally: a LayerNorm's weight and bias gradients, both
        LayerNorms' of a block), and each has a kernel of its own that adds its partial sums."""
        cluster: dict[int, int] = {}
        needs: dict[int, dict[Ref, int]] = {}
        first_reader: dict[tuple[Group, Ref], int] = {}
        for index, op in enumerate(self._ops):
            if not op.sums:
                continue
            cluster[index], needs[index] = index, self._summed(op, parent)
            for ref in needs[index]:
                other = first_reader.setdefault((op.group, ref), index)
                if _root(cluster, other) != _root(cluster, index):
                    cluster[_root(cluster, index)] = _root(cluster, other)
        read: dict[int, dict[Ref, int]] = defaultdict(dict)
        totals: dict[Group, list[int]] = defaultdict(lambda: [0, 0])
        for index in cluster:
            op = self._ops[index]
            read[_root(cluster, index)].update(needs[index])
            totals[op.group][0] += sum(size for _, size in op.sums)
            totals[op.group][1] += COLUMN_KERNELS - 1 + (_root(cluster, index) == index)
        for root, refs in read.items():
            totals[self._ops[root].group][0] += sum(refs.values())
        return {group: (moved, kernels) for group, (moved, kernels) in totals.items()}

    def _summed(self, op: _Op, parent: dict[int, int]) -> dict[Ref, int]:
        """What the kernel of ``op``'s sums reads from memory (:meth:`_sums`), with its bytes."""
        seen: set[Ref] = set()
        found, stack = {}, list(op.reads)
        while stack:
            ref, size, _ = stack.pop()
            if ref in seen:
                continue
            seen.add(ref)
            if (index := self._writer.get(ref)) is not None and self._ops[index].group == op.group \
                    and not self._leaves(ref, parent):
                stack.extend(self._ops[index].reads)
            else:
                found[ref] = size
        return found

    def _leaves(self, ref: Ref, parent: dict[int, int]) -> bool:
        """Whether a storage a fused operator writes must reach memory: saved, read by nothing, or
        read by what is not in its kernel (another group, an unfused operator, a fused operator of
        another kernel but a sum across rows: :meth:`_sums`)."""
        readers, index = self._readers.get(ref), self._writer.get(ref)
        if ref in self._saved or not readers or index is None:
            return True
        root, group = _root(parent, index), self._group_of[ref]
        return any(reader_group != group or reader is None
                   or _root(parent, reader) != root and not self._ops[reader].only_sums  # those compute it again
                   for reader_group, reader in readers)


def _covered(reads: list[Read]) -> int:
    """Bytes a kernel reads of one storage it reads as ``reads``: what their tensors cover together
    (slices of one storage each add their own part, a tensor read again adds nothing: a rotary
    embedding's quarter of each head and the rest, the halves it rotates); the largest read where
    one's region is unknown."""
    regions = {read.region for read in reads}
    if len(regions) == 1 or None in regions:
        return max(read.num_bytes for read in reads)
    views = (((*region.shape, region.element_size), (*(s * region.element_size for s in region.stride), 1),
              region.offset * region.element_size) for region in regions)  # in bytes: each element its own
    return covered_elements(views, next(iter(regions)).storage_bytes)


def covered_elements(views: Iterable[tuple[Sequence[int], Sequence[int], int]], length: int) -> int:
    """Elements of ``[0, length)`` that strided views of one buffer, each ``(sizes, strides, offset)``,
    cover together: an element two views read counts once, a view's part outside the range none."""
    views = list(views)
    low = min(0, *(offset for _, _, offset in views))
    high = max(length, *(offset + sum(s * (n - 1) for n, s in zip(sizes, strides)) + 1
                          for sizes, strides, offset in views))
    with _disable_current_modes():  # a real mask, whatever fake or counting mode the profile runs under
        mask = torch.zeros(high - low, dtype=torch.bool)
        for sizes, strides, offset in views:
            mask.as_strided(tuple(sizes), tuple(strides), offset - low).fill_(True)
        return int(mask[-low:length - low].sum())


def _root(parent: dict[int, int], index: int) -> int:
    while parent[index] != index:
        parent[index] = parent[parent[index]]
        index = parent[index]
    return index
