"""Gradient clipping on every plan the plugins apply: by the global norm, and by value.

``torch.nn.utils.clip_grad_norm_`` fails on a TP rank (its DTensor and plain gradients cannot meet in
one operator, nor can DTensor norms of different placements be stacked), and under a pipeline it
clips each stage by that stage's own norm. Here each gradient's share of the norm is taken from the
elements the rank holds: summed over the mesh dimensions it is sharded on (FSDP's, TP's, a vocabulary
split), counted once on those it is replicated on (DDP's and TP's copies), over the pipeline's
stages, a tied weight's copy once. Every gradient is then scaled in place by the same factor, as
single-process clipping scales it (docs/design.md, "Gradient clipping"). Clipping by value clamps
each element the rank holds; on a GPU torch's own meets the mixed lists a multi-tensor operator
refuses (:mod:`~stratagem.plugins.parameter_groups`). The norm and its scaling take the plain
local parts with torch's multi-tensor kernels (``torch._foreach_norm``, ``_foreach_mul_``: a launch
per device and dtype, not several per gradient), as torch's own clipping does with its default
``foreach``; clamping stays one kernel a gradient, one pass over it where torch's multi-tensor
clamps make two (``bench/clip_speed.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from stratagem.errors import UsageError
from stratagem.plugins.mesh import local_part
from stratagem.plugins.tensor_parallel import reduce_partial_grads

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False, pp_group: dist.ProcessGroup | None = None,
                    counted_elsewhere: Iterable[nn.Parameter] = ()) -> Tensor:
    """Scale the gradients of ``parameters`` (this rank's) in place so that the whole model's
    gradient norm is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does in one
    process; the whole model's norm before clipping, the same on every rank. ``pp_group``: the
    pipeline's ranks of this rank's stage line, whose stages hold the rest of the model;
    ``counted_elsewhere``: parameters whose gradient another stage counts (a tied weight's copy),
    scaled here but not counted. A sequence-parallel norm's unreduced gradient is summed first."""
    params = [param for param in parameters if param.grad is not None]
    reduce_partial_grads(params)
    skip = {id(param) for param in counted_elsewhere}
    total = _global_norm([param.grad for param in params if id(param) not in skip], float(norm_type), pp_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
                           "clipped (error_if_nonfinite=True)")
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for group in _by_device_and_dtype(local_part(param.grad) for param in params):
        torch._foreach_mul_(group, scale.to(group[0].device))
    return total


@torch.no_grad()
def clip_grad_value_(parameters: Iterable[nn.Parameter], clip_value: float) -> None:
    """Clamp every gradient element of ``parameters`` (this rank's) into ``[-clip_value,
    clip_value]`` in place, as ``torch.nn.utils.clip_grad_value_`` does in one process: on the
    local parts, a sequence-parallel norm's unreduced gradient summed first."""
    params = [param for param in parameters if param.grad is not None]
    reduce_partial_grads(params)
    for param in params:  # one pass each, where torch's multi-tensor clamps make two
        local_part(param.grad).clamp_(-clip_value, clip_value)


def _global_norm(grads: list[Tensor], norm_type: float, pp_group: dist.ProcessGroup | None) -> Tensor:
    """The norm of ``grads`` over every rank that holds a part of them: per mesh and the mesh
    dimensions a gradient is sharded on, one all-reduce of its local shares on each such dimension;
    then over ``pp_group``."""
    largest = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if largest else dist.ReduceOp.SUM
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    parts: dict[tuple, list[Tensor]] = {}  # (mesh, sharded dims) or () for what this rank alone counts
    for grad in grads:
        key = ()
        if isinstance(grad, DTensor):
            if any(placement.is_partial() for placement in grad.placements):
                raise UsageError(f"a gradient is unreduced ({grad.placements}) on a {grad.device_mesh.ndim}-D mesh, "
                                 "whose norm its parts cannot give\nHINT: reduce it first (the plugins' plans leave "
                                 "only sequence-parallel norms' gradients so, on a 1-D mesh, which clipping sums)")
            # sharded on every dimension it is not replicated on (Shard, and FSDP's _StridedShard under TP)
            dims = tuple(dim for dim, placement in enumerate(grad.placements) if not placement.is_replicate())
            key = (grad.device_mesh, dims) if dims else ()
        parts.setdefault(key, []).append(local_part(grad))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, tensors in parts.items():
        share = _share(tensors, norm_type, device)
        if key:
            mesh, dims = key
            for dim in dims:
                dist.all_reduce(share, op=op, group=mesh.get_group(dim))
        total = _combine(total, share, largest)
    if pp_group is not None:
        dist.all_reduce(total, op=op, group=pp_group)
    return total if largest else total ** (1.0 / norm_type)


def _share(tensors: list[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """What ``tensors`` (local parts) add to the norm, in fp32 on ``device``: their largest
    magnitude for the infinity norm, else the sum of their elements' magnitudes to the
    ``norm_type``: each tensor's norm in one multi-tensor kernel per device and dtype. An empty
    part (a rank an uneven split leaves without elements) adds nothing."""
    groups = _by_device_and_dtype(tensor for tensor in tensors if tensor.numel())
    if not groups:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.cat([torch.stack(torch._foreach_norm(group, norm_type, dtype=torch.float32)).to(device)
                       for group in groups])
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def _by_device_and_dtype(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """``tensors`` grouped as a multi-tensor kernel takes them: one device and dtype a list."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def _combine(a: Tensor, b: Tensor, largest: bool) -> Tensor:
    return torch.maximum(a, b) if largest else a + b
