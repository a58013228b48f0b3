"""What a compiler that fuses operators without FLOPs would move: ``torch.compile``'s inductor,
or Megatron-LM's hand-fused kernels (softmax with its scale and mask, bias with GELU, bias with
dropout and the residual add, LayerNorm).

Between two GEMMs, a chain of element-wise operators, reductions and copies becomes one kernel
that reads what the chain takes from outside it once and writes only what leaves it; the
intermediates stay in registers. What leaves a fused group: a tensor a GEMM (or another FLOP
operator) reads, one saved for backward, one the other direction or another segment reads, and
one nothing reads (a gradient, an output). Each group is one kernel launch. The compiler's
choices that this leaves out: a reduction that cannot take its consumers into its kernel (two
kernels where one is counted), and the partitioner recomputing in backward what the eager step
saved (the same bytes saved are counted).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torch.multiprocessing.reductions import StorageWeakRef

Group = tuple[str, bool]
"""Where an operator runs: its segment and whether in backward."""


@dataclass
class _Op:
    group: Group
    reads: list[tuple[StorageWeakRef, int]]
    writes: list[tuple[StorageWeakRef, int]]


@dataclass
class FusionTracker:
    """Collects every operator's storages read and written, then counts the bytes and kernels of
    the fused operators per segment and direction (:meth:`fused`)."""

    _ops: list[_Op] = field(default_factory=list)
    _producer: dict[StorageWeakRef, tuple[Group, bool]] = field(default_factory=dict)  # (group, fusible)
    _readers: dict[StorageWeakRef, set[tuple[Group, bool]]] = field(default_factory=lambda: defaultdict(set))
    _saved: set[StorageWeakRef] = field(default_factory=set)
    _unfused: dict[Group, int] = field(default_factory=lambda: defaultdict(int))  # operators that stay kernels

    def op(self, group: Group, *, fusible: bool, reads: list[tuple[StorageWeakRef, int]],
           writes: list[tuple[StorageWeakRef, int]]) -> None:
        """One operator of ``group``: the storages it reads and writes, with their bytes."""
        for ref, _ in reads:
            self._readers[ref].add((group, fusible))
        for ref, _ in writes:
            self._producer[ref] = (group, fusible)
        if fusible:
            self._ops.append(_Op(group, reads, writes))
        else:
            self._unfused[group] += 1

    def saved(self, ref: StorageWeakRef) -> None:
        """A storage saved for backward: its producer's group must write it out."""
        self._saved.add(ref)

    def fused(self) -> dict[Group, tuple[int, int]]:
        """Per group: the bytes its fused operators move, and the kernels it launches fused (the
        fused groups, and each operator that does not fuse: GEMMs, attention, weight casts)."""
        moved: dict[Group, int] = defaultdict(int)
        counted: dict[Group, set[StorageWeakRef]] = defaultdict(set)
        parent: dict[int, int] = {}
        writer: dict[StorageWeakRef, int] = {}
        for index, op in enumerate(self._ops):
            parent[index] = index
            for ref, size in op.reads:
                inside = self._producer.get(ref) == (op.group, True)
                if inside and ref in writer:
                    _union(parent, index, writer[ref])
                elif ref not in counted[op.group]:
                    counted[op.group].add(ref)
                    moved[op.group] += size
            for ref, size in op.writes:
                writer[ref] = index
                if self._leaves(ref, op.group):
                    moved[op.group] += size
        kernels: dict[Group, int] = defaultdict(int, self._unfused)
        for index, op in enumerate(self._ops):
            if _root(parent, index) == index:
                kernels[op.group] += 1
        return {group: (moved[group], kernels[group]) for group in {*kernels, *moved}}

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
