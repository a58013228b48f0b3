"""A process group this package starts ends with ``destroy_process_group``: nothing torch imports
later keeps it (and its gloo threads) alive into the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys

AFTER_AN_OPTIMIZER_STEP = """
import gc
from pathlib import Path

import torch
import torch.distributed as dist

from stratagem.distributed import free_port, init_process_group

init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
weight = torch.nn.Parameter(torch.ones(4))
weight.grad = torch.ones(4)
torch.optim.AdamW([weight]).step()  # imports torch._dynamo, and torch.distributed.nn.functional with it
dist.destroy_process_group()
gc.collect()
print(sorted({(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}))
"""


def test_no_gloo_thread_outlives_the_group_after_an_optimizer_step() -> None:
    done = subprocess.run([sys.executable, "-c", AFTER_AN_OPTIMIZER_STEP], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gloo" not in done.stdout, done.stdout
