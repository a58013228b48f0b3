"""The host time DTensor spends deciding how to shard an operator it has not run on these shapes
before: a warm-up cost that verification leaves out of the steady-state step time.

DTensor caches each operator's sharding decision per input shapes and placements; a call on new
shapes propagates shardings from scratch (milliseconds of Python, against microseconds cached).
Dense models repeat the same shapes every step, so only the first steps pay. A routed expert's
row count follows the routing, so a tensor-parallel MoE meets new shapes for as long as the
routing keeps producing counts it has not seen (``bench/accuracy.py`` prints what its
mixtral-small TP×FSDP steps left out, the "1st shard" column).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["ShardingCacheMisses"]


class ShardingCacheMisses:
    """While entered: ``count`` and ``seconds`` of the sharding propagations this process ran
    because DTensor's cache had no decision for the operator's shapes (torch's C++ fast path
    calls ``propagate_op_sharding_non_cached`` on a miss; a propagation nested in another counts
    as part of it)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._propagator: Any = None
        self._depth = 0

    def __enter__(self) -> ShardingCacheMisses:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        propagate = propagator.propagate_op_sharding_non_cached

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return propagate(*args, **kwargs)
            self._depth, start = 1, time.perf_counter()
            try:
                return propagate(*args, **kwargs)
            finally:
                self._depth = 0
                self.count += 1
                self.seconds += time.perf_counter() - start

        propagator.propagate_op_sharding_non_cached = timed
        self._propagator = propagator
        return self

    def __exit__(self, *exc_info: object) -> None:
        del self._propagator.propagate_op_sharding_non_cached  # the class's method again
        self._propagator = None
