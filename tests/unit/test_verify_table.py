"""``stratagem verify``'s table of predicted against measured."""

from __future__ import annotations

import io

from rich.console import Console

from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.hardware import parse_cluster
from stratagem.plan import Plan, Workload
from stratagem.advisor.profile.cache import profile_spec
from stratagem.cli.verify_cmd import verification_table
from stratagem.verify import Measured, Verified


def _rendered(*measured: Measured) -> str:
    profile = profile_spec("llama-tiny", seq_len=16, precision="fp32")
    plan = Plan(dp_replicate=2, micro_batch_size=2, precision="fp32")
    cluster = parse_cluster("2xcpu")
    estimate = evaluate(profile, cluster, Workload(global_batch_size=4, seq_len=16, precision="fp32"), plan)
    out = io.StringIO()
    Console(file=out, width=200).print(verification_table([Verified(estimate, m) for m in measured], cluster=cluster))
    return " ".join(out.getvalue().split())


def test_first_time_sharding_decisions_left_out_are_said():
    text = _rendered(Measured(step_seconds=0.5, peak_bytes=2**20, reserved_bytes=None, steps=3,
                              sharding_seconds=0.02),
                     Measured(step_seconds=0.4, peak_bytes=2**20, reserved_bytes=None, steps=3))
    assert "500 ms" in text and "up to 20.0 ms a step" in text and "measured on 1x2xcpu" in text


def test_no_note_when_every_shape_was_decided_before():
    text = _rendered(Measured(step_seconds=0.5, peak_bytes=2**20, reserved_bytes=None, steps=3))
    assert "500 ms" in text and "sharding" not in text
