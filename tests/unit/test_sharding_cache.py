"""Verification's account of DTensor's first-time sharding decisions, on a one-rank gloo group in
this process."""

from __future__ import annotations


import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from stratagem.verify.sharding_cache import ShardingCacheMisses


@pytest.fixture
def mesh(one_rank):
    return init_device_mesh("cpu", (1,))


def test_only_shapes_met_for_the_first_time_count(mesh):
    """A routed expert's matmul meets a new row count now and then: each new one propagates its
    shardings from scratch; a count seen before is decided from the cache."""
    weight = distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)])

    def expert(rows: int) -> None:
        tokens = distribute_tensor(torch.randn(rows, 4), mesh, [Replicate()])
        torch.mm(tokens, weight)

    with ShardingCacheMisses() as first:
        expert(3)
    with ShardingCacheMisses() as again:
        expert(3)
    with ShardingCacheMisses() as new:
        expert(5)
    assert first.count > 0 and first.seconds > 0
    assert again.count == 0 and again.seconds == 0.0
    assert first.count == new.count == 1


def test_leaving_restores_dtensor(mesh):
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    with ShardingCacheMisses():
        assert "propagate_op_sharding_non_cached" in vars(propagator)
    assert "propagate_op_sharding_non_cached" not in vars(propagator)
