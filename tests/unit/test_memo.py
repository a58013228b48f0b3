"""Memoizing by identity: one result per object and arguments, or per the plan fields a function reads."""

from __future__ import annotations

import pytest

from stratagem.advisor.memo import by_identity, by_identity_and_plan
from stratagem.plan import Plan


def test_by_identity_keys_on_the_object_not_its_value():
    calls = []

    @by_identity
    def width(obj: list, scale: int) -> int:
        calls.append(scale)
        return len(obj) * scale

    items, equal = [1, 2], [1, 2]
    assert width(items, 2) == width(items, 2) == 4 and calls == [2]
    assert width(equal, 2) == 4 and calls == [2, 2]  # another object, though equal
    assert width(items, 3) == 6 and calls == [2, 2, 3]


def test_plans_that_differ_only_in_ignored_fields_share_one_result():
    calls = []

    @by_identity_and_plan(ignoring=("microbatches", "micro_batch_size"))
    def degrees(owner: object, plan: Plan, extra: int) -> tuple[int, int, int]:
        calls.append(plan)
        return plan.pp, plan.tp, extra

    owner = object()
    small, large = Plan(pp=2, microbatches=2), Plan(pp=2, microbatches=8, micro_batch_size=4)
    assert degrees(owner, small, 0) == degrees(owner, large, 0) == (2, 1, 0) and calls == [small]
    assert degrees(owner, Plan(tp=2), 0) == (1, 2, 0) and len(calls) == 2
    assert degrees(owner, small, 1) == (2, 1, 1) and len(calls) == 3
    assert degrees(object(), small, 0) == (2, 1, 0) and len(calls) == 4


def test_ignoring_names_plan_fields_only():
    with pytest.raises(AssertionError, match="not Plan fields"):
        by_identity_and_plan(ignoring=("micro_batch",))
