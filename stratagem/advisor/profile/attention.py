"""Scaled dot-product attention as CUDA runs it, where a CPU profile would run another kernel.

``F.scaled_dot_product_attention`` picks a kernel by its inputs, and CUDA's choice differs from
the CPU's: on fake CPU tensors it runs the CPU flash kernel for every dtype and for grouped
key/value heads, which saves the output and one log-sum-exp per row. On CUDA (PyTorch's
``sdp_utils.cpp``, sm80/sm90) flash attention takes only fp16/bf16 without an explicit mask;
the memory-efficient kernel takes fp32 and masks but not grouped key/value heads (its dense
check rejects key heads unequal to query heads); anything else runs the math path, which
materialises the s×s scores, saves the softmax's output and the repeated keys and values for
backward, and launches separate matmuls and a softmax. An fp32 model with grouped-query
attention (Hugging Face's Qwen2 and Llama 3 pass ``enable_gqa=True`` when there is no padding
mask) therefore keeps s×s scores per layer on a GPU that the CPU's kernel does not.

:class:`CudaAttention` runs each call that CUDA would send to the math path on the math path
here too, so the profile's saved bytes, FLOPs, operators and bytes moved are the math path's.

Which inputs a model hands SDPA can itself depend on values fake tensors do not have. Hugging
Face's models leave causality to SDPA's ``is_causal`` (no mask tensor, grouped heads passed as
they are) when their position ids show one unpacked sequence per row, and on fake tensors they
cannot read them, so they build an explicit mask and repeat the key/value heads instead.
:func:`unpacked_sequences` profiles them as they run on unpacked rows, which is what their own
position ids are when the caller passes none.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes CUDA's flash-attention kernel takes on sm80 and later (``check_dtypes_low_precision``)."""
EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes CUDA's memory-efficient kernel takes."""
FLASH_MAX_HEAD_DIM = 256
"""The largest head dimension the flash kernel takes (``check_head_dim_size_flash``)."""
EFFICIENT_ALIGNMENT_BYTES = 16
"""The memory-efficient kernel needs each head's row to be a whole number of 16-byte vectors:
8 half-precision or 4 single-precision elements (``check_head_dim_size_mem_efficient``)."""

MATH_ATTENTION_NOTE = ("attention runs PyTorch's math SDPA kernel on CUDA for these inputs (fp32 with grouped "
                       "key/value heads, or a head size no fused kernel takes): its s×s scores are saved for "
                       "backward and counted; a 16-bit precision runs flash attention instead")
"""The profile's note when some SDPA call runs on the math path (:class:`CudaAttention`)."""


def cuda_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dtype: torch.dtype,
                 attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> str:
    """The kernel CUDA's SDPA runs for these dense 4-D inputs in ``dtype``: ``"flash"``,
    ``"efficient"`` or ``"math"`` (tried in that order, as PyTorch's default priority)."""
    if query.dim() != 4:
        return "math"
    head_dim = query.shape[-1]
    same_head_dims = head_dim == key.shape[-1] == value.shape[-1]
    grouped = not (query.shape[1] == key.shape[1] == value.shape[1])
    square = query.shape[-2] == key.shape[-2]
    if (dtype in FLASH_DTYPES and attn_mask is None and same_head_dims and head_dim <= FLASH_MAX_HEAD_DIM
            and (square or not is_causal)):
        return "flash"
    aligned = head_dim * dtype.itemsize % EFFICIENT_ALIGNMENT_BYTES == 0
    if dtype in EFFICIENT_DTYPES and not grouped and aligned:
        return "efficient"
    return "math"


def _arguments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, *_: Any, **__: Any) -> tuple:
    return query, key, value, attn_mask, is_causal


class CudaAttention(TorchFunctionMode):
    """While active, every SDPA call CUDA would run on its math path runs on it; ``math_calls``
    counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.math_calls = 0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, attn_mask, is_causal = _arguments(*args, **kwargs)
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        if cuda_backend(query, key, value, dtype=dtype, attn_mask=attn_mask, is_causal=is_causal) != "math":
            return func(*args, **kwargs)
        self.math_calls += 1
        with sdpa_kernel(SDPBackend.MATH):
            return func(*args, **kwargs)


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """While active, Hugging Face's mask builder (``transformers.masking_utils``, when a model has
    imported it) takes every row of position ids for one unpacked sequence, as it finds them on
    real tensors when the caller passes none."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
