"""Generated inputs at every boundary a user types into end in a clean usage error or a valid
result, never another exception and never a hang (``fuzz_inputs`` holds the generators; more
than a thousand cases a run, derandomized so that every run tries the same)."""

from __future__ import annotations

import argparse

import pytest
from fuzz_inputs import NUMBER_TEXTS, USAGE_ERROR, VALID, classify, cluster_specs, plan_dicts, plan_texts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.search.advice import advise
from stratagem.cli import build_parser, main
from stratagem.integrations.planning import load_plan
from stratagem.plan import Plan, Workload
from stratagem.plan.checks import MAX_SAMPLES, MAX_WORLD_SIZE


def _examples(count: int) -> settings:
    return settings(max_examples=count, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@_examples(400)
@given(plan_dicts())
def test_a_plan_dict_makes_a_plan_that_round_trips_or_a_usage_error(data):
    def load():
        plan = load_plan(data)
        assert Plan.from_json(plan.to_json()) == plan and plan.world_size <= MAX_WORLD_SIZE

    assert classify(load) in (VALID, USAGE_ERROR)


@_examples(250)
@given(plan_texts())
def test_plan_text_makes_a_plan_or_a_usage_error(text):
    assert classify(lambda: Plan.from_json(text)) in (VALID, USAGE_ERROR)


@_examples(400)
@given(cluster_specs())
def test_a_cluster_spec_makes_a_bounded_cluster_or_a_usage_error(spec):
    def parse():
        cluster = parse_cluster(spec)
        assert 1 <= cluster.world_size <= MAX_WORLD_SIZE

    assert classify(parse) in (VALID, USAGE_ERROR)


@_examples(150)
@given(batch=NUMBER_TEXTS, seq=NUMBER_TEXTS)
def test_numbers_on_the_command_line_are_bounded_or_refused(batch, seq):
    try:
        args = build_parser().parse_args(["advise", "--model", "llama-tiny", "--global-batch-size", batch,
                                          "--seq-len", seq])
    except SystemExit as exit:  # argparse's usage message
        assert exit.code == 2
        return
    assert 1 <= args.global_batch_size <= MAX_SAMPLES and 1 <= args.seq_len <= MAX_SAMPLES


@pytest.fixture(scope="module")
def tiny():
    return profile_spec("llama-tiny", seq_len=16)


@_examples(40)
@given(batch=st.one_of(st.integers(1, 4096), st.sampled_from([MAX_SAMPLES, 10**9, 2**30 * 3, 997 * 991])),
       spec=st.sampled_from(["2xcpu", "4xcpu", "8xH100", "2x8xH100:ib-ndr", "1xL4"]))
def test_any_batch_the_bounds_admit_is_searched_quickly_or_refused(tiny, batch, spec):
    with pytest.MonkeyPatch.context():
        assert classify(lambda: advise(tiny, parse_cluster(spec), Workload(global_batch_size=batch, seq_len=16),
                                       top=1)) in (VALID, USAGE_ERROR)


def test_the_generators_reach_both_outcomes():
    """A generator that only ever produces errors (or only valid inputs) would test little."""
    outcomes = {name: set() for name in ("plans", "clusters")}

    @_examples(120)
    @given(plan_dicts(), cluster_specs())
    def sample(data, spec):
        outcomes["plans"].add(classify(lambda: Plan.from_dict(data)))
        outcomes["clusters"].add(classify(lambda: parse_cluster(spec)))

    sample()
    assert outcomes == {"plans": {VALID, USAGE_ERROR}, "clusters": {VALID, USAGE_ERROR}}


def test_number_texts_are_argparse_types():
    assert isinstance(build_parser(), argparse.ArgumentParser)


@_examples(25)
@given(st.one_of(st.text(max_size=300), st.sampled_from(["dp2 mb=4", "dp2.fsdp1 mb=4", "fsdp2 zero3 mb=4", "a" * 5000])))
def test_explain_takes_any_plan_text_as_a_name_a_file_or_json_or_refuses_it(text):
    # a comparison (0) or a usage error (2); any other exception fails the test
    assert main(["explain", "--model", "llama-tiny", "--seq-len", "16", "--cluster", "2xcpu",
                 "--global-batch-size", "8", "--plan", text]) in (0, 2)
