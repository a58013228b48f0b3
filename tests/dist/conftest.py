"""One spawn per world size trains every plan the dist tests compare (spawning costs seconds)."""

from __future__ import annotations

import pytest
import test_batchnorm
import test_data_parallel
import test_pipeline
import test_tensor_parallel
from spawn import run_on_ranks
from training import Run, train_plans

_MODULES = (test_data_parallel, test_tensor_parallel, test_pipeline, test_batchnorm)


@pytest.fixture(scope="session")
def two_ranks() -> dict[str, Run]:
    cases = [case for module in _MODULES for case in module.TWO_RANKS.values()]
    return run_on_ranks(train_plans, cases, world_size=2)


@pytest.fixture(scope="session")
def four_ranks() -> dict[str, Run]:
    cases = [case for module in _MODULES for case in module.FOUR_RANKS.values()]
    return run_on_ranks(train_plans, cases, world_size=4)


@pytest.fixture(scope="session")
def eight_ranks() -> dict[str, Run]:
    return run_on_ranks(train_plans, list(test_pipeline.EIGHT_RANKS.values()), world_size=8)
