"""Bytes that CUDA's eager kernels read beyond what an operator's tensors hold.

An operator without FLOPs is priced by the bytes of its inputs and outputs
(:mod:`~stratagem.advisor.profile.measure`); some of ATen's CUDA kernels read an input more than
once, or launch a kernel before their own. A GPU profile adds those bytes, by operator
(docs/cost-model.md, "Bytes moved by operators without FLOPs"):

* LayerNorm's backward (``LayerNormBackwardKernelImplInternal``, ``layer_norm_kernel.cu``) reads
  the output's gradient and the input once for the input's gradient and again, in a second
  kernel, for the weight's and bias's.
* Softmax and log-softmax over the innermost dimension (``host_softmax``, ``SoftMax.cu``) read a
  row once where it fits a warp's registers (at most 1,024 elements and 4 KiB) or a block's
  shared memory; a longer row (a language model's logits before its loss: 250,880 fp32 values
  for BLOOM) is read three times, for its maximum, its sum of exponentials and the output. On an
  H200, BLOOM-560M's fp32 log-softmax over 8 × 1,024 tokens took 7.95 ms, four passes of its 8.2
  GB at the copy's 4.14 TB/s (7.9 ms; ``bench/gpu_kernels.py``, 2026-11-28).
* Their backward (``host_softmax_backward``) reads the gradient a second time where the row does
  not fit a warp (7.9 ms for four passes against 8.09 measured, the same run); softmax's (not
  log-softmax's) multiplies the gradient by the output in a kernel of its own first, at any
  length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stratagem.advisor.profile.block_reuse import tensor_bytes

__all__ = ["REREAD_BYTES", "SHARED_MEMORY_PER_BLOCK"]

aten = torch.ops.aten

SHARED_MEMORY_PER_BLOCK = 48 * 1024
"""Bytes of shared memory a CUDA block gets without opting in (``sharedMemPerBlock``: 48 KiB on
every NVIDIA GPU since compute capability 3.0; CUDA C++ Programming Guide, "Technical
Specifications per Compute Capability"), the bound ``host_softmax`` tests a row against."""

_WARP_ROW = (1024, 4096)
"""The longest row (elements, bytes) of ``host_softmax``'s persistent kernels, one warp a row."""

_BLOCK_REDUCTION_BYTES = 32 * 4
"""Shared memory ``host_softmax``'s block keeps for its reduction: a float per warp, 32 warps of
its largest block."""


def _rows(tensor: torch.Tensor, dim: int) -> tuple[int, int] | None:
    """(row length, bytes per element) of ``tensor``'s softmax over ``dim``; None where ``dim``
    is not innermost (the spatial kernels, which read each element once)."""
    dim %= max(tensor.dim(), 1)
    if any(size != 1 for size in tensor.shape[dim + 1:]):
        return None
    return (tensor.shape[dim] if tensor.dim() else 1), tensor.element_size()


def _fits_a_warp(row: int, item: int) -> bool:
    return row <= _WARP_ROW[0] and row * item <= _WARP_ROW[1]


def _softmax_forward(args: Any) -> int:
    """Two more reads of the input where its rows fit neither a warp nor a block's shared memory
    (nor split into 16-byte vectors, which the shared-memory kernel loads)."""
    rows = _rows(args[0], args[1])
    if rows is None or _fits_a_warp(*rows):
        return 0
    row, item = rows
    if row * item < SHARED_MEMORY_PER_BLOCK - _BLOCK_REDUCTION_BYTES and row % (16 // item) == 0:
        return 0
    return 2 * tensor_bytes(args[0])


def _softmax_backward(args: Any, *, product: bool) -> int:
    """A second read of the gradient where its rows do not fit a warp (the element size of the
    input's gradient, ``input_dtype``, decides); with ``product`` (softmax's), the kernel before
    it that writes the gradient times the output."""
    grad, output, dim, input_dtype = args[:4]
    rows = _rows(grad, dim)
    if rows is None:
        return 0
    extra = tensor_bytes([grad, output, grad]) if product else 0
    return extra + (0 if _fits_a_warp(rows[0], input_dtype.itemsize) else tensor_bytes(grad))


REREAD_BYTES: dict[Any, Callable[[Any], int]] = {
    aten.native_layer_norm_backward: lambda args: (
        tensor_bytes([args[0], args[1]]) if any(args[7][1:]) else 0),  # grad_out, input; output_mask
    aten._softmax: _softmax_forward,
    aten._log_softmax: _softmax_forward,
    aten._softmax_backward_data: lambda args: _softmax_backward(args, product=True),
    aten._log_softmax_backward_data: lambda args: _softmax_backward(args, product=False),
}
"""Per operator packet, the bytes its CUDA kernels read beyond its tensors, from its arguments."""
