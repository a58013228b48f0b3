"""FLOP formulas torch's counter (:mod:`torch.utils.flop_counter`) lacks, which the profile adds
to it: the CPU's flash-attention kernel (counted as CUDA's), grouped GEMMs (a mixture of
experts' in one call) and the fused recurrent kernels (oneDNN's LSTM layer on CPU, cuDNN's RNN)."""

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


def _rnn_flops(input, weights) -> int:
    """The GEMMs of a recurrent kernel's forward: each token (a sequence's time step) meets
    every 2-D weight once, 2 FLOPs per multiply-add."""
    # Per layer and direction, per token: x·W_ihᵀ ([I] × [I, G·H]), h·W_hhᵀ ([H or P] × [H or P, G·H]),
    # with a projection also h·W_hrᵀ ([H] × [H, P]) — G gates (LSTM 4, GRU 3), as torch's own
    # decomposition (aten/src/ATen/native/RNN.cpp) runs them as mm/addmm; the biases (1-D) add no GEMM.
    tokens = math.prod(input[:-1])  # [T, B, I], [B, T, I], or packed [ΣB, I]
    return 2 * tokens * sum(math.prod(w) for w in weights if w is not None and len(w) == 2)


def _mkldnn_rnn_layer_flops(input, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    """``aten.mkldnn_rnn_layer``: one layer and direction of the CPU's LSTM (oneDNN), which runs
    instead of the decomposition torch's counter would count (``aten.lstm`` without a projection)."""
    return _rnn_flops(input, (w_ih, w_hh))


def _mkldnn_rnn_layer_backward_flops(input, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    """Its backward: the inputs' and the weights' gradients, twice the forward (it computes both)."""
    return 2 * _rnn_flops(input, (w_ih, w_hh))


def _cudnn_rnn_flops(input, weight, *args, out_shape=None, **kwargs) -> int:
    """``aten._cudnn_rnn``: every layer and direction of a CUDA RNN, LSTM or GRU, in one call;
    ``weight`` lists each one's W_ih, W_hh, biases and W_hr (a projection)."""
    return _rnn_flops(input, weight)


def _cudnn_rnn_backward_flops(input, weight, *args, out_shape=None, **kwargs) -> int:
    """Its backward: the inputs' gradient always (it mutates the reserve), the weights' where
    ``output_mask[3]`` asks (aten/src/ATen/native/cudnn/RNN.cpp), each as many FLOPs as the forward."""
    output_mask = args[19] if len(args) > 19 else kwargs["output_mask"]
    return (1 + bool(output_mask[3])) * _rnn_flops(input, weight)


RNN_FLOPS = {
    aten.mkldnn_rnn_layer: _mkldnn_rnn_layer_flops,
    aten.mkldnn_rnn_layer_backward: _mkldnn_rnn_layer_backward_flops,
    aten._cudnn_rnn: _cudnn_rnn_flops,
    aten._cudnn_rnn_backward: _cudnn_rnn_backward_flops,
}


FLOP_FORMULAS = {**CPU_ATTENTION_FLOPS, **RNN_FLOPS, aten._grouped_mm: _grouped_mm_flops}
"""The FLOP formulas the profile adds to torch's counter's (:mod:`torch.utils.flop_counter`)."""
