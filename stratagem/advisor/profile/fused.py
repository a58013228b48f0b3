"""Functions a GPU runs as one fused kernel that a CPU profile sees decomposed, counted as the
GPU runs them.

``torch.rms_norm`` (``nn.RMSNorm``) dispatches on CUDA to ``aten._fused_rms_norm`` when its input
and weight share a dtype (PyTorch PR #153666, torch 2.9; under autocast its fp32 policy makes them
share one, PR #174824): one kernel forward that saves the input and each row's reciprocal RMS in
fp32, one backward and a reduction for the weight's gradient, which reads the output's gradient
and the input again (``RMSNormBackwardKernelImpl``: LayerNorm's two backward kernels). On the
CPU, fake tensors included, it decomposes into pow, mean, add, rsqrt and two products that save
fp32 intermediates and launch six operators each way. Hugging Face's own RMSNorm modules are
written as those operators and run them on a GPU too: they are counted as they run.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
def _bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


RSTD_BYTES = 4
"""Bytes per row of the reciprocal RMS the fused kernel saves (fp32 whatever the input's dtype)."""


class FusedCounts(Protocol):
    """What the profile's counters let a fused kernel do: stop counting what its decomposition
    runs (``suppressed``), and count the kernel instead."""

    suppressed: int

    def count_kernels(self, *, ops: int, op_bytes: int, param_op_bytes: int = 0) -> None: ...

    def count_saved(self, tensor: torch.Tensor | None = None, *, num_bytes: int = 0) -> None: ...


class FusedKernels(TorchFunctionMode):
    """While active, each :data:`FUSED` function call is counted as its GPU kernel (``counts``)."""

    def __init__(self, counts: FusedCounts) -> None:
        super().__init__()
        self._counts = counts

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in FUSED:
            return func(*args, **kwargs)
        self._counts.suppressed += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self._counts.suppressed -= 1
        _count_rms_norm(self._counts, *args, out=out, **kwargs)
        return out


def _count_rms_norm(counts: FusedCounts, input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                    eps: float | None = None, *, out: torch.Tensor) -> None:
    """The fused forward's operator, bytes moved and saved tensors, and hooks that count its
    backward the same way in place of the decomposition's."""
    rows = input.numel() // max(1, math.prod(normalized_shape if isinstance(normalized_shape, (list, tuple))
                                             else (normalized_shape,)))
    weight_bytes = _bytes(weight)
    counts.count_kernels(ops=1, op_bytes=_bytes(input) + _bytes(out) + rows * RSTD_BYTES,
                         param_op_bytes=weight_bytes)
    if out.grad_fn is None:
        return
    counts.count_saved(input)
    counts.count_saved(num_bytes=rows * RSTD_BYTES)
    backward_bytes = 2 * _bytes(input) + _bytes(out) + rows * RSTD_BYTES  # grad in/out, input, rstd
    if weight is not None and weight.requires_grad:  # the weight's gradient reads grad out and input again
        backward_bytes += 2 * _bytes(input)
    _replace_backward(counts, out.grad_fn, stop=input.grad_fn,
                      count=lambda: counts.count_kernels(ops=1 + (weight is not None), op_bytes=backward_bytes,
                                                         param_op_bytes=2 * weight_bytes))


def _replace_backward(counts: FusedCounts, entry: Any, *, stop: Any, count: Callable[[], None]) -> None:
    """Suppress counting while the autograd nodes of a decomposition run (from ``entry`` to the
    input's node ``stop``, parameters' accumulators excluded), and ``count`` once as ``entry`` starts."""
    nodes, queue = [], deque([entry])
    while queue:
        node = queue.popleft()
        if node is None or node is stop or node in nodes or type(node).__name__ == "AccumulateGrad":
            continue
        nodes.append(node)
        queue.extend(next_node for next_node, _ in node.next_functions)

    def start(*_: Any) -> None:
        counts.suppressed += 1

    def end(*_: Any) -> None:
        counts.suppressed -= 1

    entry.register_prehook(lambda *_: count())
    for node in nodes:
        node.register_prehook(start)
        node.register_hook(end)


FUSED = frozenset({torch.rms_norm, F.rms_norm})
"""The torch functions :class:`FusedKernels` counts as their fused GPU kernels."""
