"""Build the DeviceMesh a Plan runs on, and find the sub-meshes each technique uses.

The mesh keeps the Plan's axis order, ``pp`` (outermost) × ``dp_replicate`` × ``dp_shard`` ×
``tp`` (innermost), named by :class:`~stratagem.plan.MeshAxis`. Axes of degree 1 are
dropped, so a collective never runs over a group of one, with two exceptions:

* ``dp_shard`` stays (even at degree 1) when ``zero >= 2``: FSDP needs an axis to shard over,
  and a one-rank FSDP still serves the Plan's CPU offload; with ``dp_replicate > 1`` the two
  make FSDP's 2-D (HSDP) mesh.
* a one-rank plan with nothing else to keep gets a single ``dp_replicate`` axis of size 1,
  because a DeviceMesh cannot have zero axes.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from stratagem.plan import MeshAxis, Plan
from stratagem.errors import UsageError

__all__ = ["build_mesh", "check_world_size", "data_parallel_axes", "local_part", "mesh_axes", "submesh"]


def mesh_axes(plan: Plan) -> dict[MeshAxis, int]:
    """The axes :func:`build_mesh` keeps for ``plan`` and their degrees, outermost first."""
    kept = {
        axis: degree for axis, degree in plan.mesh_shape.items()
        if degree > 1 or (axis is MeshAxis.DP_SHARD and plan.uses_fsdp)
    }
    return kept or {MeshAxis.DP_REPLICATE: 1}


def build_mesh(plan: Plan, *, device_type: str) -> DeviceMesh:
    """The DeviceMesh for ``plan`` over the default process group (``device_type``: ``"cpu"``,
    ``"cuda"``, …); the group must be up and its size must equal ``plan.world_size``."""
    if not dist.is_initialized():
        raise UsageError("build_mesh needs a process group\n"
                         "HINT: call torch.distributed.init_process_group() first (torchrun sets it up)")
    check_world_size(plan, world_size=dist.get_world_size())
    axes = mesh_axes(plan)
    return init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(map(str, axes)))


def check_world_size(plan: Plan, *, world_size: int) -> None:
    """Raise :class:`UsageError` unless the plan's degrees multiply to ``world_size``."""
    if plan.world_size != world_size:
        raise UsageError(
            f"pp({plan.pp}) × dp_replicate({plan.dp_replicate}) × dp_shard({plan.dp_shard}) "
            f"× tp({plan.tp}) = {plan.world_size}, but the world size is {world_size}\n"
            f"HINT: launch {plan.world_size} processes, or pick a plan for {world_size}"
        )


def data_parallel_axes(plan: Plan) -> tuple[MeshAxis, ...]:
    """The mesh axes data parallelism runs over, outermost first; () when it runs over one rank.

    ``zero = 0`` replicates over ``dp_replicate``; ``zero = 1`` shards optimizer states over
    ``dp_shard``; ``zero >= 2`` is FSDP over ``dp_shard``, HSDP over both when
    ``dp_replicate > 1``.
    """
    if not plan.shards_optimizer:
        return (MeshAxis.DP_REPLICATE,) if plan.dp_replicate > 1 else ()
    if plan.shards_optimizer_only:
        return (MeshAxis.DP_SHARD,)
    if plan.dp_replicate > 1:
        return (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD)
    return (MeshAxis.DP_SHARD,)


def submesh(mesh: DeviceMesh, axes: tuple[MeshAxis, ...]) -> DeviceMesh:
    """The sub-mesh of ``mesh`` over ``axes`` (names as :func:`build_mesh` gave them)."""
    names = tuple(str(axis) for axis in axes)
    missing = [name for name in names if name not in (mesh.mesh_dim_names or ())]
    if missing:
        raise UsageError(f"the mesh has axes {mesh.mesh_dim_names}, but the plan needs {', '.join(missing)}\n"
                         "HINT: build the mesh with stratagem.plugins.build_mesh(plan, device_type=...)")
    return mesh[names[0]] if len(names) == 1 else mesh[names]


def local_part(tensor: Tensor) -> Tensor:
    """A DTensor's local part on this rank (its shard under FSDP or TP, or its copy), a plain
    tensor itself: what a collective of the rank's own works on."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
