"""FLOP formulas torch's counter (:mod:`torch.utils.flop_counter`) lacks, which the profile adds
to it: the CPU's flash-attention kernel (counted as CUDA's) and grouped GEMMs (a mixture of
experts' in one call)."""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_flash_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: QKᵀ and AV, like the CUDA kernels."""
    return sdpa_flop_count(query, *_query_heads(query, key, value))


def _cpu_flash_attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The backward of the CPU flash-attention kernel, counted as the CUDA kernels' backward."""
    return sdpa_backward_flop_count(grad_out, query, *_query_heads(query, key, value))


def _query_heads(query, *shapes) -> tuple:
    """Key and value shapes with the query's head count: grouped-query attention multiplies as
    if each query head had its own key/value head (torch before 2.13 counts only equal heads)."""
    return tuple((shape[0], query[1], *shape[2:]) for shape in shapes)


CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_flops,
}


def _grouped_mm_flops(mat_a, mat_b, *args, out_shape=None, **kwargs) -> int:
    """``aten._grouped_mm`` (a mixture of experts' GEMMs in one call: transformers' experts), which
    torch's counter does not count: each output element is a dot product over the contraction,
    ``mat_a``'s last dimension, but where both matrices are 2-D (a weight's gradient), whose groups
    split the contraction ``[M, K] × [K, N]`` into ``[G, M, N]``."""
    if len(mat_a) == 2 and len(mat_b) == 2:
        return 2 * mat_a[0] * mat_a[1] * mat_b[1]
    return 2 * math.prod(out_shape) * mat_a[-1]


FLOP_FORMULAS = {**CPU_ATTENTION_FLOPS, aten._grouped_mm: _grouped_mm_flops}
"""The FLOP formulas the profile adds to torch's counter's (:mod:`torch.utils.flop_counter`)."""
