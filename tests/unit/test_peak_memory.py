"""PeakMemory on CPU counts the tensors alive at once, in a fresh process (it sets malloc's policy)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import torch
from stratagem.peak_memory import PeakMemory

memory = PeakMemory(torch.device("cpu"))
held = torch.ones(4 * 2**20)  # 16 MiB held
for size in range(1, 9):  # 1..8 MiB, each freed before the next
    torch.ones(size * 2**18).add_(1)
peak = memory.stop()
torch.ones(64 * 2**18)  # after stop: not counted
print(peak / 2**20, memory.grown() / 2**20)
"""


def test_cpu_peak_is_the_tensors_alive_at_once_until_stopped() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    peak, after_stop = map(float, out.split())
    assert 22 < peak < 28  # 16 MiB held + the largest freed one (8 MiB)
    assert after_stop == peak
