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
The other way round, the CPU's flash kernel takes no dropout and no value head size other than the
query's (DeepSeek's multi-head latent attention), where CUDA's fused kernels take both: such a
call runs CUDA's kernel's operator itself on the fake tensors (its shapes and what it saves are
device-independent), not the CPU's math path with its s×s scores.

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

MATH_ATTENTION_NOTE = ("attention runs PyTorch's math SDPA kernel on CUDA for these inputs, its s×s scores saved "
                       "for backward and counted")
"""The beginning of the profile's note when some SDPA call runs on the math path
(:class:`CudaAttention`; :func:`math_attention_note`)."""


def math_attention_note(reasons: set[str]) -> str:
    """The profile's note for SDPA calls on CUDA's math path, with why no fused kernel took them."""
    return f"{MATH_ATTENTION_NOTE}: {'; '.join(sorted(reasons))}"


def cuda_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dtype: torch.dtype,
                 attn_mask: torch.Tensor | None = None, is_causal: bool = False, enable_gqa: bool = True) -> str:
    """The kernel CUDA's SDPA runs for these dense 4-D inputs in ``dtype``: ``"flash"``,
    ``"efficient"`` or ``"math"`` (tried in that order, as PyTorch's default priority). Flash
    attention takes grouped key/value heads only where the call says ``enable_gqa``
    (``check_batch_size_and_num_heads_dense``); without it, fewer key heads broadcast on the math path."""
    if query.dim() != 4:
        return "math"
    head_dim = query.shape[-1]
    same_head_dims = head_dim == key.shape[-1] == value.shape[-1]
    grouped = not (query.shape[1] == key.shape[1] == value.shape[1])
    square = query.shape[-2] == key.shape[-2]
    if (dtype in FLASH_DTYPES and attn_mask is None and same_head_dims and head_dim <= FLASH_MAX_HEAD_DIM
            and (square or not is_causal) and (enable_gqa or not grouped)):
        return "flash"
    aligned = head_dim * dtype.itemsize % EFFICIENT_ALIGNMENT_BYTES == 0
    if dtype in EFFICIENT_DTYPES and not grouped and aligned:
        return "efficient"
    return "math"


def math_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dtype: torch.dtype,
                attn_mask: torch.Tensor | None = None) -> str:
    """Why neither fused kernel takes inputs :func:`cuda_backend` sends to the math path."""
    grouped = not (query.shape[1] == key.shape[1] == value.shape[1]) if query.dim() == 4 else False
    if grouped and dtype not in FLASH_DTYPES:
        return (f"grouped key/value heads in {str(dtype).removeprefix('torch.')} (flash attention takes 16-bit "
                "inputs only, the memory-efficient kernel no grouped heads; a 16-bit precision runs flash attention)")
    if grouped and attn_mask is not None:
        return ("grouped key/value heads with an explicit mask (flash attention takes no mask, the memory-efficient "
                "kernel no grouped heads)")
    if grouped:
        return ("grouped key/value heads without enable_gqa (flash attention takes them only with it, the "
                "memory-efficient kernel not at all)")
    if query.dim() != 4:
        return f"{query.dim()}-D inputs (the fused kernels take [batch, heads, tokens, head size])"
    return (f"a head size of {query.shape[-1]} in {str(dtype).removeprefix('torch.')} (flash attention takes 16-bit "
            f"inputs up to {FLASH_MAX_HEAD_DIM}, the memory-efficient kernel rows of whole 16-byte vectors)")


def _arguments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> tuple:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _cuda_kernel(backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """The output of CUDA's ``backend`` kernel's operator run on these (fake) tensors, as SDPA
    calls it: a boolean mask made additive and broadcast to the scores' shape."""
    if backend == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                  scale=scale)[0]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, query.requires_grad or key.requires_grad or value.requires_grad,
        dropout_p, is_causal, scale=scale)[0]


class CudaAttention(TorchFunctionMode):
    """While active, every SDPA call CUDA would run on its math path runs on it (``math_reasons``
    collects why), and one CUDA runs fused but the CPU's flash kernel would not takes CUDA's
    kernel's operator (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.math_reasons: set[str] = set()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _arguments(*args, **kwargs)
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        backend = cuda_backend(query, key, value, dtype=dtype, attn_mask=attn_mask, is_causal=is_causal,
                               enable_gqa=enable_gqa)
        if backend == "math":
            self.math_reasons.add(math_reason(query, key, value, dtype=dtype, attn_mask=attn_mask))
            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        if dropout_p == 0 and query.shape[-1] == value.shape[-1]:  # the CPU's flash kernel takes it
            return func(*args, **kwargs)
        if torch.is_autocast_enabled("cpu"):  # autocast casts SDPA's inputs; the kernels' operators it leaves
            query, key, value = (t.to(dtype) for t in (query, key, value))
        return _cuda_kernel(backend, query, key, value, attn_mask, dropout_p, is_causal, scale)


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
