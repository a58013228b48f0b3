"""The calibration's timing helpers on a one-rank gloo group in this process."""

from __future__ import annotations

import time

import torch

from stratagem.advisor.calibrate.benchmarks import interleaved


def test_interleaved_rounds_keep_ratios_on_a_drifting_host(one_rank):
    """Each round runs every function once in turn, so a host that slows down as it goes (here:
    every call sleeps longer than the one before) slows them alike and their ratio holds."""
    calls: list[str] = []

    def work(name: str, seconds: float):
        def run() -> None:
            calls.append(name)
            time.sleep(seconds * (1 + 0.25 * len(calls)))
        return run

    short, long = interleaved([work("short", 0.004), work("long", 0.008)], torch.device("cpu"), repeats=5)
    assert calls == ["short", "long"] * 6  # a warm-up round, then five
    assert 1.6 < long / short < 2.6
