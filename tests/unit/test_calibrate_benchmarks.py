"""The calibration's timing helpers on a one-rank gloo group in this process."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist

from stratagem.advisor.calibrate.benchmarks import interleaved


@pytest.fixture
def one_rank():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
