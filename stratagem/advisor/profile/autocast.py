"""CUDA autocast's float32 list, applied to a GPU profile that runs under CPU autocast.

The profile runs a ``*-mixed`` step under ``torch.autocast("cpu")`` on fake CPU tensors, and the
two devices' autocast policies differ: CUDA's runs the operators of :data:`CUDA_FP32_FUNCTIONS`
in float32, whatever 16-bit tensors reach them (PyTorch's AMP reference, "CUDA Ops that can
autocast to float32"), where the CPU's runs most of them in the input's dtype. A model that feeds
16-bit tensors to them (a softmax over the scores of a bf16 matmul, a loss on bf16 logits, a
``pow`` or ``exp`` of a bf16 activation) saves and moves float32 tensors on a GPU, and the casts
that make them. :class:`CudaAutocast` casts those inputs as CUDA's autocast would, so that
autograd records the casts and the float32 results.

Models whose residual stream is float32 under autocast (GPT-2, ViT, Llama's presets) pass float32
to these operators anyway and are unchanged; Hugging Face's eager attention names its softmax's
dtype, which autocast respects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

CUDA_FP32_FUNCTIONS = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss", "rms_norm",
})
"""The torch functions CUDA's autocast runs in float32: PyTorch's AMP reference ("CUDA Ops that can
autocast to float32"), and ``rms_norm`` (PyTorch PR #174824). Called with an explicit ``dtype=`` or
``out=``, or in place, they are not autocast."""

_HALF = (torch.float16, torch.bfloat16)


def _to_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in _HALF else tensor


class CudaAutocast(TorchFunctionMode):
    """While CPU autocast is on, each call of a :data:`CUDA_FP32_FUNCTIONS` function gets its 16-bit
    floating tensors cast to float32 first, as CUDA's autocast casts them."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (getattr(func, "__name__", None) in CUDA_FP32_FUNCTIONS and kwargs.get("dtype") is None
                and kwargs.get("out") is None and torch.is_autocast_enabled("cpu")):
            args, kwargs = tree_map_only(torch.Tensor, _to_float32, (args, kwargs))
        return func(*args, **kwargs)
