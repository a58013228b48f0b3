"""What an operator moves, as the profile counts it: which operators it counts at all, which it
prices by the bytes they read and write rather than by FLOPs, and those bytes. The step's counter
(:mod:`~stratagem.advisor.profile.measure`) and the TP split runs
(:mod:`~stratagem.advisor.profile.tp_layout`) share these rules."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from stratagem.advisor.profile.block_reuse import tensor_bytes
from stratagem.advisor.profile.flop_formulas import FLOP_FORMULAS

__all__ = ["UNCOUNTED_OPS", "WHOLE_KERNELS", "moved_bytes", "priced_by_bytes", "reads", "written_by"]

aten = torch.ops.aten

# Ops not counted as operators: fake tensors dispatch ``prim.device`` where eager mode answers
# without dispatching, and saved-tensor hooks add a ``detach`` per saved tensor unpacked (eager
# mode's own detaches are views that launch nothing either).
UNCOUNTED_OPS = {torch.ops.prim.device, aten.detach}

# Ops that read only the elements they gather from an input (a table, log-probabilities).
_GATHER_OPS = {aten.embedding, aten.index_select, aten.gather, aten.index, aten.nll_loss_forward}
# Ops that read none of their input of the output's shape (the log-probabilities): they zero their
# output and write one element a row (ATen's nll_loss_backward, CPU and CUDA alike).
_SCATTER_OPS = {aten.nll_loss_backward}

# Pointwise backward operators the device runs as one kernel that FlopCounterMode would count as
# their decomposition: ATen gives them a CompositeImplicitAutograd kernel beside the CPU and CUDA
# ones (for double backward), and FlopCounterMode decomposes every operator its registry lacks.
# SiLU's gradient so became eight operators (sigmoid, ``1 − s`` in three, four products and sums)
# moving several times the bytes of the one kernel a backward without a graph of its own runs.
# Registered by overload without FLOPs to keep them whole (FlopCounterMode looks an operator up by
# its overload before it decomposes it, by its packet after), and counted as the operators
# without FLOPs they are. (ATen's other operators of both kinds, ``native_batch_norm`` and the
# nearest-neighbour upsamplings, are not pointwise: left to FlopCounterMode.)
WHOLE_KERNELS = (aten.silu_backward, aten.mish_backward)
# Operators with a FLOP formula: torch's counter's and the profile's own.
_WITH_FORMULAS = frozenset((*flop_registry, *FLOP_FORMULAS))


def written_by(func_packet: Any, out: Any, args: Any) -> list[torch.Tensor]:
    """The tensors an operator writes: its outputs, but views (an output sharing an input's
    storage, the in-place ops, whose names end in ``_``, excepted: they write it)."""
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not func_packet.__name__.endswith("_"):
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
        outputs = [t for t in outputs if StorageWeakRef(t.untyped_storage()) not in inputs]
    return outputs


def priced_by_bytes(func_packet: Any) -> bool:
    """Whether the profile prices an operator by the bytes it moves: one it counts (not
    :data:`UNCOUNTED_OPS`) without a FLOP formula (torch's counter's or :data:`FLOP_FORMULAS`;
    :data:`WHOLE_KERNELS` have one only to stay whole)."""
    return func_packet not in UNCOUNTED_OPS and (func_packet in WHOLE_KERNELS or func_packet not in _WITH_FORMULAS)


def moved_bytes(func_packet: Any, args: Any, out: Any) -> int:
    """Bytes an operator :func:`priced_by_bytes` reads and writes, as the step counts them (none
    for a view; a gather's and a scatter's as :func:`reads` says)."""
    written = written_by(func_packet, out, args)
    return tensor_bytes(reads(func_packet, args, written)) + tensor_bytes(written) if written else 0


def reads(func_packet: Any, args: Any, written: list[torch.Tensor]) -> list[torch.Tensor]:
    """What an operator without FLOPs that writes ``written`` reads: its tensor arguments, but a
    gather reads what it writes, not its whole input, and a scatter none of its input of the
    output's shape."""
    if func_packet in _GATHER_OPS:
        return written
    return [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)
            and not (func_packet in _SCATTER_OPS and t.shape == written[0].shape)]
