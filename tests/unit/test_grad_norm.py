"""``plugins.clip_grad_norm_`` and ``clip_grad_value_`` on one gloo rank agree with torch's on the
same gradients, DTensor and plain ones mixed (which torch's own refuses there), for finite and
infinite norms and a parameter without elements. Several ranks: the equality tests in tests/dist."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from stratagem.errors import UsageError
from stratagem.plugins import clip_grad_norm_, clip_grad_value_


def _params(*, dtensors: bool) -> list[torch.nn.Parameter]:
    """The same four parameters and gradients, the 2-D ones as DTensors where ``dtensors``."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,)) if dtensors else None
    params = []
    for shape in ((8, 4), (4,), (0,), (3, 5)):
        value, grad = torch.randn(shape), torch.randn(shape) * 3
        if mesh is not None and len(shape) == 2:
            value, grad = (distribute_tensor(t, mesh, [Shard(0)]) for t in (value, grad))
        param = torch.nn.Parameter(value)
        param.grad = grad
        params.append(param)
    return params


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_the_norm_and_the_clipped_gradients_are_torchs(one_rank, norm_type):
    ours, theirs = _params(dtensors=True), _params(dtensors=False)
    total = clip_grad_norm_(ours, 1.0, norm_type)
    # torch's has no infinity norm of an empty tensor; ours gives it no share
    expected = torch.nn.utils.clip_grad_norm_([p for p in theirs if p.numel()], 1.0, norm_type)
    torch.testing.assert_close(total, expected)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(_local(mine.grad), reference.grad)


def test_a_gradient_left_unreduced_beyond_a_1d_mesh_is_refused(one_rank):
    """Only a 1-D mesh's ``Partial`` gradients (SP's norms) are summed before clipping; one on a
    2-D mesh, which no plan the plugins apply leaves, is a usage error rather than a wrong norm."""
    params = _params(dtensors=False)
    params[0].grad = DTensor.from_local(params[0].grad, init_device_mesh("cpu", (1, 1)), [Partial(), Replicate()])
    with pytest.raises(UsageError, match="unreduced"):
        clip_grad_norm_(params, 1.0)


def test_a_non_finite_norm_is_refused_where_asked(one_rank):
    params = _params(dtensors=True)
    _local(params[0].grad)[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_clipping_by_value_is_torchs(one_rank):
    ours, theirs = _params(dtensors=True), _params(dtensors=False)
    clip_grad_value_(ours, 0.5)
    torch.nn.utils.clip_grad_value_(theirs, 0.5)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(_local(mine.grad), reference.grad)
