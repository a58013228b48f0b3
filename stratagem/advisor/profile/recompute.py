"""What a block checkpointed under each selective policy keeps and recomputes, counted operator
by operator in the profile's fake step (:mod:`~stratagem.advisor.profile.measure`).

The policies are those of :mod:`stratagem.plan.checkpointing`, which the checkpointing plugin
applies: the decision is a function of the operator's name and of how many matmuls the block ran
before it, so the step that measures the block without checkpointing can tell, op by op, what
``create_selective_checkpoint_contexts`` would keep. A checkpointed block keeps its input (added
when the profile is assembled) and the outputs of the kept operators, each storage once; its
backward runs the other operators of its forward again, as far as torch's non-reentrant
checkpoint recomputes: it stops after the last operator that saves a tensor for backward (its
"early stop"), so work after that (a final residual add) is not counted.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from stratagem.advisor.profile.counts import PolicyCounts
from stratagem.plan.checkpointing import SELECTIVE_POLICIES, PolicyState


class CheckpointPolicies:
    """Per block and policy of :data:`SELECTIVE_POLICIES`, a :class:`PolicyCounts`, filled as the
    block's forward runs: :meth:`start` at each call of a block, :meth:`op` for each operator,
    :meth:`saved` whenever autograd saves a tensor (recompute reaches at least that far)."""

    def __init__(self, params: set[StorageWeakRef]) -> None:
        self._params = params
        self.counts: dict[str, dict[str, PolicyCounts]] = {}  # block -> policy -> counts
        self._states: dict[str, dict[str, PolicyState]] = {}
        self._pending: dict[str, dict[str, PolicyCounts]] = {}  # work since the last saved tensor
        self._kept: dict[str, set[StorageWeakRef]] = {}  # block/policy -> kept storages (weak: autograd frees them)

    def start(self, block: str) -> None:
        """A call of ``block`` begins: each policy counts matmuls from 0 (as the plugin's does)."""
        self._states[block] = {p: PolicyState(p) for p in SELECTIVE_POLICIES}
        self._pending[block] = {p: PolicyCounts() for p in SELECTIVE_POLICIES}
        self.counts.setdefault(block, {p: PolicyCounts() for p in SELECTIVE_POLICIES})

    def op(self, block: str, name: str, out: object, *, flops: int, ops: int, op_bytes: int,
           param_op_bytes: int, attention_flops: int = 0) -> None:
        """Operator ``name`` (``"aten.mm"``) of ``block``'s forward wrote ``out`` at this cost
        (``attention_flops``: its FLOPs, where it is a fused attention kernel)."""
        states = self._states.get(block)
        if states is None:
            return
        for policy, state in states.items():
            if state.keeps(name):
                self.counts[block][policy].kept_bytes += self._new_bytes(f"{block}/{policy}", out)
            else:
                self._pending[block][policy].add_work(PolicyCounts(
                    recompute_flops=flops, recompute_ops=ops, recompute_op_bytes=op_bytes,
                    recompute_param_op_bytes=param_op_bytes, recompute_attention_flops=attention_flops))

    def saved(self, block: str) -> None:
        """Autograd saved a tensor in ``block``'s forward: the recompute runs this far."""
        pending = self._pending.get(block)
        if pending is None:
            return
        for policy, work in pending.items():
            self.counts[block][policy].add_work(work)
            pending[policy] = PolicyCounts()

    def _new_bytes(self, key: str, out: object) -> int:
        """Bytes of the storages of ``out``'s tensors not counted under ``key`` before, parameters
        excluded."""
        seen = self._kept.setdefault(key, set())
        total = 0
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref in self._params or ref in seen:
                continue
            seen.add(ref)
            total += tensor.untyped_storage().nbytes()
        return total
