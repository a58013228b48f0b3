"""A TP rank's DTensors and plain tensors reach torch.optim's multi-tensor step in separate groups
(plugins/parameter_groups.py): the step GPUs take by default, which DTensor refuses to run on a
mix. On one gloo rank, whose 1-device mesh makes real DTensors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from stratagem.errors import UsageError
from stratagem.plugins.parameter_groups import separate_dtensors, step_mixed_groups_per_tensor


def _mixed() -> list[torch.nn.Parameter]:
    mesh = init_device_mesh("cpu", (1,))
    split = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Replicate()]))
    return [torch.nn.Parameter(torch.randn(4)), split, torch.nn.Parameter(torch.randn(8))]


def _step(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()


def test_a_mix_steps_on_the_multi_tensor_path_in_two_groups(one_rank):
    params = _mixed()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        _step(torch.optim.AdamW(params, foreach=True))  # what a GPU's default would run
    groups = separate_dtensors(params)
    assert [len(group["params"]) for group in groups] == [1, 2]
    _step(torch.optim.AdamW(groups, foreach=True))
    plain = [torch.nn.Parameter(torch.randn(3))]
    assert separate_dtensors(plain) == plain  # one kind: as given


def test_a_users_mixed_group_steps_one_tensor_at_a_time(one_rank):
    optimizer = torch.optim.AdamW(_mixed())
    assert step_mixed_groups_per_tensor(optimizer) == 1
    assert optimizer.param_groups[0]["foreach"] is False
    _step(optimizer)
    apart = torch.optim.AdamW(separate_dtensors(_mixed()))
    assert step_mixed_groups_per_tensor(apart) == 0
    assert all(group["foreach"] is None for group in apart.param_groups)


@pytest.mark.parametrize("asked", ["foreach", "fused"])
def test_a_users_mixed_group_that_asks_for_a_multi_tensor_step_is_refused(one_rank, asked):
    optimizer = torch.optim.AdamW(_mixed(), **{asked: True})
    with pytest.raises(UsageError, match=f"{asked}=True.*mixes the DTensors"):
        step_mixed_groups_per_tensor(optimizer)
