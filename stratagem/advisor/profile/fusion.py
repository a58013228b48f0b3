"""What a compiler that fuses operators without FLOPs would move: ``torch.compile``'s inductor,
or Megatron-LM's hand-fused kernels (softmax with its scale and mask, bias with GELU, bias with
dropout and the residual add, LayerNorm).

Between two GEMMs, a chain of element-wise operators, reductions and copies becomes one kernel
that reads what the chain takes from outside it once and writes only what leaves it; the
intermediates stay in registers. What leaves a fused group: a tensor a GEMM (or another FLOP
operator) reads, one saved for backward, one the other direction or another segment reads, and
one nothing reads (a gradient, an output). Each group is one kernel launch.

A sum over the leading dimensions (a bias's gradient, a norm's weight and bias gradients: ``[C]``
from ``[b, s, C]``) iterates over other elements than the chain's row-wise work, and inductor
gives it kernels of its own: partial sums over slices of the rows, then their sum. They read what
the sum needs from memory, computing again from the chain's inputs what stayed in registers
(``bench/inductor_kernels.py`` prints what inductor writes for a GPU). Left out: the
partitioner recomputing in backward what the eager step saved (the same bytes saved are counted).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field

from torch.multiprocessing.reductions import StorageWeakRef

COLUMN_KERNELS = 2
"""Kernels a sum over the leading dimensions launches: partial sums over slices of the rows, then
their sum (inductor's split reduction, ``ir.Reduction.num_splits``, as its generated code for GPT-2
and ViT blocks shows: ``bench/inductor_kernels.py``)."""

Group = tuple[str, bool]
"""Where an operator runs: its segment and whether in backward."""


@dataclass
class _Op:
    group: Group
    reads: list[tuple[StorageWeakRef, int]]
    writes: list[tuple[StorageWeakRef, int]]
    sums: list[tuple[StorageWeakRef, int]]  # those of ``writes`` that sum over the leading dimensions

    @property
    def only_sums(self) -> bool:
        """Whether all it writes are such sums: then it is no part of a fused chain's kernel."""
        return bool(self.sums) and len(self.sums) == len(self.writes)


@dataclass
class FusionTracker:
    """Collects every operator's storages read and written, then counts the bytes and kernels of
    the fused operators per segment and direction (:meth:`fused`)."""

    _ops: list[_Op] = field(default_factory=list)
    _producer: dict[StorageWeakRef, tuple[Group, bool]] = field(default_factory=dict)  # (group, fusible)
    _readers: dict[StorageWeakRef, set[tuple[Group, bool]]] = field(default_factory=lambda: defaultdict(set))
    _saved: set[StorageWeakRef] = field(default_factory=set)
    _unfused: dict[Group, int] = field(default_factory=lambda: defaultdict(int))  # operators that stay kernels
    _casts: dict[tuple, list[tuple[StorageWeakRef, int]]] = field(default_factory=dict)  # what each cast wrote
    _same: dict[StorageWeakRef, StorageWeakRef] = field(default_factory=dict)  # a repeated cast's result: the first's

    def op(self, group: Group, *, fusible: bool, reads: list[tuple[StorageWeakRef, int]],
           writes: list[tuple[StorageWeakRef, int]], sums: list[tuple[StorageWeakRef, int]] = (),
           cast: Hashable | None = None) -> None:
        """One operator of ``group``: the storages it reads and writes, with their bytes; ``sums``:
        those of ``writes`` that sum an input over its leading dimensions (a bias's or a norm's
        weight gradient); ``cast``: what a cast makes (dtype, shape), for a cast of what another
        cast of its group already made (autocast casts an activation for each operator that takes
        it; a compiler once), which is that cast's result and no operator."""
        reads = [(self._same.get(ref, ref), size) for ref, size in reads]
        if fusible and cast is not None:
            made = self._casts.setdefault((group, cast, tuple(ref for ref, _ in reads)), writes)
            if made is not writes:
                self._same.update((ref, earlier) for (ref, _), (earlier, _) in zip(writes, made))
                return
        for ref, _ in reads:
            self._readers[ref].add((group, fusible))
        for ref, _ in writes:
            self._producer[ref] = (group, fusible)
        if fusible:
            self._ops.append(_Op(group, reads, writes, list(sums)))
        else:
            self._unfused[group] += 1

    def saved(self, ref: StorageWeakRef) -> None:
        """A storage saved for backward: its producer's group must write it out."""
        self._saved.add(self._same.get(ref, ref))

    def fused(self) -> dict[Group, tuple[int, int]]:
        """Per group: the bytes its fused operators move, and the kernels it launches fused (the
        fused groups, each operator that does not fuse: GEMMs, attention, weight casts, and the
        kernels of each sum over the leading dimensions: :meth:`_reread`)."""
        parent: dict[int, int] = {}
        writer: dict[StorageWeakRef, int] = {}
        for index, op in enumerate(self._ops):
            parent[index] = index
            if not op.only_sums:
                for ref, _ in op.reads:
                    if self._inside(ref, op, writer):
                        _union(parent, index, writer[ref])
            for ref, _ in op.writes:
                writer[ref] = index
        moved: dict[int, int] = defaultdict(int)  # per fused kernel, by its root operator
        counted: dict[int, set[StorageWeakRef]] = defaultdict(set)
        writes_out: set[int] = set()
        writer.clear()
        for index, op in enumerate(self._ops):
            root = _root(parent, index)
            for ref, size in op.reads if not op.only_sums else ():
                if not self._inside(ref, op, writer) and ref not in counted[root]:
                    counted[root].add(ref)
                    moved[root] += size
            for ref, size in op.writes:
                writer[ref] = index
                if (ref, size) not in op.sums and self._leaves(ref, op.group):
                    moved[root] += size
                    writes_out.add(root)
        totals: dict[Group, list[int]] = defaultdict(lambda: [0, 0])
        for group, count in self._unfused.items():
            totals[group][1] += count
        for index, op in enumerate(self._ops):
            if index in writes_out:  # a chain whose results only sums recompute is no kernel
                totals[op.group][0] += moved[index]
                totals[op.group][1] += 1
            if op.sums:
                totals[op.group][0] += self._reread(op, writer)
                totals[op.group][1] += COLUMN_KERNELS
        return {group: (moved_bytes, kernels) for group, (moved_bytes, kernels) in totals.items()}

    def _inside(self, ref: StorageWeakRef, op: _Op, writer: dict[StorageWeakRef, int]) -> bool:
        """Whether ``op`` reads ``ref`` from its own fused kernel: a fused operator of its group
        wrote it last, and not a sum over the leading dimensions (those run apart)."""
        return (self._producer.get(ref) == (op.group, True) and ref in writer
                and not self._ops[writer[ref]].only_sums)

    def _reread(self, op: _Op, writer: dict[StorageWeakRef, int]) -> int:
        """Bytes the kernels of ``op``'s sums over the leading dimensions move: what they read from
        memory (through the intermediates of the group that stay in registers, what those were
        computed from: the compiler recomputes them) and what they write (the sums, a parameter's
        size)."""
        seen: set[StorageWeakRef] = set()
        total, stack = 0, list(op.reads)
        while stack:
            ref, size = stack.pop()
            if ref in seen:
                continue
            seen.add(ref)
            if self._producer.get(ref) == (op.group, True) and ref in writer and not self._leaves(ref, op.group):
                stack.extend(self._ops[writer[ref]].reads)
            else:
                total += size
        return total + sum(size for _, size in op.sums)

    def _leaves(self, ref: StorageWeakRef, group: Group) -> bool:
        """Whether a storage a fused operator of ``group`` writes must reach memory."""
        readers = self._readers.get(ref)
        return (ref in self._saved or not readers
                or any(reader != (group, True) for reader in readers))


def _root(parent: dict[int, int], index: int) -> int:
    while parent[index] != index:
        parent[index] = parent[parent[index]]
        index = parent[index]
    return index


def _union(parent: dict[int, int], a: int, b: int) -> None:
    parent[_root(parent, a)] = _root(parent, b)
