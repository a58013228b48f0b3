"""The convolutions a fake step runs, as the cost models read them (:class:`ConvLayer`): channels,
window, stride, groups, the positions they compute and how their input is laid out in memory.

A convolution's FLOPs are counted with every other operator's (``torch.utils.flop_counter``);
what is recorded here is what its time depends on beyond them: the implicit GEMM cuDNN runs it as,
and whether its tensors are in the channels-last layout cuDNN's tensor-core kernels read or in
torch's default NCHW, which they transform to and from (docs/cost-model.md, "Rates").
"""

from __future__ import annotations

import math
from typing import Any

import torch

from stratagem.advisor.profile.model_profile import ConvLayer

_CONVOLUTION = torch.ops.aten.convolution.default
_ARGUMENTS = tuple(argument.name for argument in _CONVOLUTION._schema.arguments)


def conv_layer(args: tuple, kwargs: dict[str, Any], out: torch.Tensor, *, name: str) -> ConvLayer | None:
    """The :class:`ConvLayer` of one ``aten.convolution`` call (its arguments as dispatched and its
    output), run by the module ``name``; None for a transposed convolution (a data gradient's
    GEMM, which these shapes do not describe)."""
    bound = {**dict(zip(_ARGUMENTS, args)), **kwargs}
    if bound["transposed"]:
        return None
    source, weight = bound["input"], bound["weight"]
    batch_positions = source.shape[0] * math.prod(source.shape[2:])
    return ConvLayer(
        name=name, in_channels=int(source.shape[1]), out_channels=int(weight.shape[0]),
        kernel=tuple(int(k) for k in weight.shape[2:]), stride=tuple(int(s) for s in bound["stride"]),
        groups=int(bound["groups"]), rows=int(out.shape[0] * math.prod(out.shape[2:])),
        input_rows=int(batch_positions), channels_last=is_channels_last(source),
        input_grad=bool(source.requires_grad))


def is_channels_last(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (an image batch, ``[N, C, H, W]`` or ``[N, C, D, H, W]``) is laid out with
    its channels innermost (NHWC), which for one channel or one position is NCHW as well."""
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(tensor.dim())
    return layout is not None and tensor.is_contiguous(memory_format=layout)


def memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """The layout a fake copy of ``tensor`` keeps: channels-last where ``tensor`` is in it and not
    also contiguous (a model moved to ``torch.channels_last``), else contiguous (what every
    other tensor is made as)."""
    if is_channels_last(tensor) and not tensor.is_contiguous():
        return torch.channels_last if tensor.dim() == 4 else torch.channels_last_3d
    return torch.contiguous_format
