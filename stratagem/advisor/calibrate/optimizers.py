"""The optimizer benchmarks ``stratagem calibrate`` runs: torch.optim's step over large and small
parameter sets, on plain tensors and on DTensors, split into its cost per parameter (streaming
the states) and per tensor (launching its operators), or per step and per tensor where the
parameters are small."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stratagem.advisor.calibrate.benchmarks import interleaved
from stratagem.plan.workload import HOST_FUSED_OPTIMIZERS, OPTIMIZER_CLASSES, OPTIMIZER_OPTIONS

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SMALL_STEP_TENSORS", "benchmark_parameters", "host_optimizer_shape", "optimizer_class", "optimizer_seconds",
           "small_step_seconds"]


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The torch.optim class of an optimizer the cost model knows by ``name``
    (:data:`~stratagem.plan.OPTIMIZERS`)."""
    return getattr(torch.optim, OPTIMIZER_CLASSES[name][0])


OPTIMIZER_SMALL_TENSORS = (512, 64)
"""(tensors, elements each) of the parameter set whose step measures the cost per tensor."""


def optimizer_seconds(num_params: int, device: torch.device, *, repeats: int, mesh: DeviceMesh | None = None,
                      tensors: int = 8, pin_memory: bool = False,
                      fused: bool = False) -> dict[str, tuple[float, float]]:
    """Per optimizer of :data:`~stratagem.plan.OPTIMIZERS`, with its
    :data:`~stratagem.plan.workload.OPTIMIZER_OPTIONS`, as torch.optim runs it by
    default on ``device`` (one tensor at a time on CPU, ``foreach`` on GPUs): seconds of its step
    per fp32 parameter (streaming the parameters, gradients and states) and per parameter tensor
    (launching its operators), solved from two steps timed :func:`interleaved`: over
    ``num_params`` parameters in ``tensors`` tensors, and over :data:`OPTIMIZER_SMALL_TENSORS`.
    With a ``mesh`` the parameters are DTensors on it whose shards live on ``device``, as FSDP's
    offloaded parameters live on the host; with ``pin_memory``, the parameters and gradients in
    page-locked memory, as FSDP2 offloads them on GPU nodes (the states not: ``zeros_like``); with
    ``fused``, those of :data:`~stratagem.plan.workload.HOST_FUSED_OPTIMIZERS` on torch's fused
    kernel, as the plugins step offloaded parameters."""
    from stratagem.plan import OPTIMIZERS

    shapes = ((tensors, num_params // tensors), OPTIMIZER_SMALL_TENSORS)
    steps = [optimizer_class(name)(benchmark_parameters(count, numel, device, mesh, pin_memory=pin_memory), lr=1e-4,
                                   **OPTIMIZER_OPTIONS[name],
                                   **({"fused": True} if fused and name in HOST_FUSED_OPTIMIZERS else {})).step
             for name in OPTIMIZERS for count, numel in shapes]
    seconds = interleaved(steps, device, repeats=repeats)
    (n_large, p_large), (n_small, p_small) = ((tensors, tensors * numel) for tensors, numel in shapes)
    out = {}
    for name, large, small in zip(OPTIMIZERS, seconds[::2], seconds[1::2]):  # t = params·a + tensors·b
        per_param = max(0.0, (large * n_small - small * n_large) / (p_large * n_small - p_small * n_large))
        out[name] = (per_param, max(0.0, small - p_small * per_param) / n_small)
    return out


HOST_OPTIMIZER_BYTES = 2**28
"""The least fp32 parameters, gradients and AdamW states (16 bytes a parameter) the host
optimizer's step is timed over on GPU nodes (:func:`host_optimizer_shape`)."""

HOST_OPTIMIZER_TENSORS = 2
"""Tensors the host optimizer's large step is timed over."""


def host_optimizer_shape(cache_bytes: int | None, available_bytes: int, *, ranks: int) -> tuple[int, int]:
    """(tensors, parameters) of the large step ``calibrate`` times the host's optimizer over, one
    of ``ranks`` stepping at once: :data:`HOST_OPTIMIZER_TENSORS` tensors, each as large as the
    host's last-level caches (``cache_bytes``,
    :func:`~stratagem.advisor.hardware.host.last_level_cache_bytes`) in fp32, its gradient and
    AdamW states as large again (16 bytes a parameter), at least :data:`HOST_OPTIMIZER_BYTES` in
    all, within an eighth of the rank's share of the host's ``available_bytes``. torch.optim's CPU
    step runs its operators one tensor at a time: where a tensor's states fit the cache, the
    operators after the first read them there, at several times DRAM's rate, while an offloaded
    model's largest tensors stream from DRAM at every pass (docs/cost-model.md, "Optimizer step
    and offload")."""
    wanted = HOST_OPTIMIZER_TENSORS * 4 * (cache_bytes or 0)
    num_bytes = max(HOST_OPTIMIZER_BYTES, min(wanted, available_bytes // (8 * ranks)))
    return HOST_OPTIMIZER_TENSORS, num_bytes // 16


SMALL_STEP_TENSORS = (8, 64)
"""Parameter tensors (of 64 elements) of the two small AdamW steps whose times give the cost per
step and per tensor."""


def small_step_seconds(device: torch.device, *, repeats: int, mesh: DeviceMesh | None = None,
                       foreach: bool | None = None, fused: bool = False) -> tuple[float, float]:
    """Seconds of an AdamW step over small parameters on ``device`` (DTensors on ``mesh`` where
    given, as FSDP2's and TP's are), per step and per parameter tensor: solved from two steps
    over :data:`SMALL_STEP_TENSORS` tensors timed :func:`interleaved`, on the path ``foreach``
    names. None takes torch.optim's default there: ``foreach`` on GPUs, where each operator is one
    call for all the tensors (a DTensor call's cost mostly per step), one tensor at a time on CPU,
    where every tensor makes its own calls; ``fused``, the fused kernel (one call a step)."""
    implementation = {"fused": True} if fused else {"foreach": foreach}
    steps = [torch.optim.AdamW(benchmark_parameters(tensors, 64, device, mesh), **implementation).step
             for tensors in SMALL_STEP_TENSORS]
    (few, many), (few_seconds, many_seconds) = SMALL_STEP_TENSORS, interleaved(steps, device, repeats=repeats)
    per_tensor = max(0.0, (many_seconds - few_seconds) / (many - few))
    return max(0.0, few_seconds - few * per_tensor), per_tensor


def benchmark_parameters(tensors: int, numel: int, device: torch.device, mesh: DeviceMesh | None, *,
                         pin_memory: bool = False) -> list[torch.nn.Parameter]:
    """``tensors`` parameters of ``numel`` elements each on ``device`` (a rank's shards of DTensors
    on ``mesh`` where given), with gradients; both page-locked where ``pin_memory``."""

    def filled(value: float) -> torch.Tensor:
        return _sharded(torch.full((numel,), value, device=device, pin_memory=pin_memory), mesh)

    params = [torch.nn.Parameter(filled(0.0)) for _ in range(tensors)]
    for param in params:
        param.grad = filled(1.0)
    return params


def _sharded(local: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """``local`` as this rank's shard (along dim 0) of a DTensor on ``mesh`` (itself without one),
    left on its device as FSDP2 leaves an offloaded shard on the host: ``DTensor.from_local`` moves
    a local tensor onto the mesh's device type, which timed the "host" optimizer of a GPU mesh on
    the GPU (docs/cost-model.md, "Optimizer step and offload")."""
    if mesh is None:
        return local
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = torch.Size([local.shape[0] * mesh.size(), *local.shape[1:]])
    return _from_local_no_grad(local, DTensorSpec(mesh, (Shard(0),), TensorMeta(shape, local.stride(), local.dtype)))
