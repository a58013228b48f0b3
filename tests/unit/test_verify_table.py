"""``stratagem verify``'s table of predicted against measured."""

from __future__ import annotations

import io

from rich.console import Console

from stratagem.advisor.calibrate.calibration import calibrated
from stratagem.advisor.profile.cache import CACHE_ENV
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.hardware import Cluster, parse_cluster
from stratagem.plan import Plan, Workload
from stratagem.advisor.profile.cache import profile_spec
from stratagem.cli.verify_cmd import verification_table, winner_line
from stratagem.verify import Measured, Verified, measured_winner, too_close_to_call


def _rendered(*measured: Measured, cluster: Cluster | None = None) -> str:
    profile = profile_spec("llama-tiny", seq_len=16, precision="fp32")
    plan = Plan(dp_replicate=2, micro_batch_size=2, precision="fp32")
    cluster = cluster or parse_cluster("2xcpu")
    estimate = evaluate(profile, cluster, Workload(global_batch_size=4, seq_len=16, precision="fp32"), plan)
    out = io.StringIO()
    Console(file=out, width=200).print(verification_table([Verified(estimate, m) for m in measured], cluster=cluster))
    return " ".join(out.getvalue().split())


def test_first_time_sharding_decisions_left_out_are_said():
    text = _rendered(Measured(step_seconds=0.5, peak_bytes=2**20, reserved_bytes=None, steps=3,
                              sharding_seconds=0.02),
                     Measured(step_seconds=0.4, peak_bytes=2**20, reserved_bytes=None, steps=3))
    assert "500 ms" in text and "up to 20.0 ms a step" in text and "measured on 1x2xcpu" in text


def test_the_clusters_notes_say_whether_a_calibration_gave_the_rates(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # no calibration stored: CPU ranks at the catalog's rates
    cluster = calibrated(parse_cluster("2xcpu"))  # as verify takes it
    text = _rendered(Measured(step_seconds=0.5, peak_bytes=2**20, reserved_bytes=None, steps=3), cluster=cluster)
    assert "uncalibrated: rates from the catalog's figures" in text and "`stratagem calibrate`" in text


def test_no_note_when_every_shape_was_decided_before():
    text = _rendered(Measured(step_seconds=0.5, peak_bytes=2**20, reserved_bytes=None, steps=3))
    assert "500 ms" in text and "sharding" not in text


def _measured(*times: float, repeats: int = 1) -> Measured:
    return Measured(step_seconds=sorted(times)[len(times) // 2], peak_bytes=2**20, reserved_bytes=None,
                    steps=len(times) // repeats, step_times=times, repeats=repeats)


def test_the_spread_stands_beside_the_error_and_says_what_it_covers():
    text = _rendered(_measured(0.4, 0.5, 0.6))
    assert "500 ms" in text and "40%" in text and "over 3 steps per plan" in text


def test_runs_pool_their_steps_and_the_spread_says_so():
    pooled = Measured.pooled([_measured(0.4, 0.5, 0.6), _measured(0.5, 0.7, 0.8)])
    assert (pooled.step_seconds, pooled.fastest, pooled.slowest, pooled.repeats) == (0.6, 0.4, 0.8, 2)
    assert Measured.from_dict(pooled.to_dict()) == pooled
    assert "over 3 steps × 2 runs per plan" in _rendered(pooled)


def _verified(*measured: Measured) -> list[Verified]:
    profile = profile_spec("llama-tiny", seq_len=16, precision="fp32")
    workload = Workload(global_batch_size=4, seq_len=16, precision="fp32")
    plans = [Plan(dp_replicate=2, micro_batch_size=2, precision="fp32"),
             Plan(dp_shard=2, zero=1, micro_batch_size=2, precision="fp32"),
             Plan(dp_replicate=2, micro_batch_size=1, grad_accum=2, precision="fp32")]
    cluster = parse_cluster("2xcpu")
    return [Verified(evaluate(profile, cluster, workload, plan), m) for plan, m in zip(plans, measured)]


def test_the_winner_is_the_fastest_median_and_overlapping_ranges_are_called_too_close():
    results = _verified(_measured(0.44, 0.52, 0.70), _measured(0.30, 0.45, 0.46), _measured(0.60, 0.65, 0.90))
    winner = measured_winner(results)
    assert winner is results[1] and too_close_to_call(results, winner) == [results[0]]
    line = winner_line(results, winner)
    assert "ranked it #2" in line and f"overlaps {results[0].plan.name}'s" in line
    clear = _verified(_measured(0.50, 0.52, 0.53), _measured(0.30, 0.31, 0.32))
    assert "overlaps" not in winner_line(clear, measured_winner(clear))


def test_a_compiled_plan_whose_blocks_broke_into_pieces_is_said():
    text = _rendered(Measured(step_seconds=0.5, peak_bytes=2**20, reserved_bytes=None, steps=3, graph_breaks=4,
                              graph_break="Call to `torch._dynamo.graph_break()`"))
    assert "broke its blocks into pieces (4 graph breaks; the first: Call to `torch._dynamo.graph_break()`)" in text
    assert "whole compiled blocks" in _rendered(Measured(step_seconds=0.5, peak_bytes=2**20, reserved_bytes=None,
                                                         steps=3, graph_breaks=1))
