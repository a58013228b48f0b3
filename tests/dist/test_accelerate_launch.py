"""A real `accelerate launch` of the config `advise --emit accelerate` writes: two CPU processes
train examples/accelerate_train.py with `make_accelerator(plan, model=model)`, and match one
process; a plan made for another model is refused before any training.

Accelerate runs only DDP on CPU (docs/platform.md), so for a CPU cluster the advisor recommends
DDP; the emitted file starts both processes through `accelerate launch`'s own torchrun launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spawn import free_port
from training import SEED, SEQ_LEN, STEPS, Case, train_single

from stratagem.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = Path(sys.executable).with_name("accelerate")


@pytest.mark.timeout(600)
def test_accelerate_launch_ddp_plan_matches_single_process(tmp_path):
    plan_file, config = tmp_path / "advice.json", tmp_path / "accelerate.yaml"
    advise = [sys.executable, "-m", "stratagem", "advise", "--model", "llama-tiny", "--cluster", "2xcpu",
              "--global-batch-size", "8", "--seq-len", str(SEQ_LEN), "--precision", "fp32"]
    emitted = subprocess.run([*advise, "--emit", "accelerate", "--output", str(config), "--format", "json"],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "STRATAGEM_CACHE_DIR": str(tmp_path)})
    assert emitted.returncode == 0, emitted.stderr[-3000:]
    plan_file.write_text(emitted.stdout)  # the `advise --format json` report, for the training script
    plan = Plan.from_json(plan_file.read_text())  # the best plan of the `advise --format json` document
    assert (plan.dp_replicate, plan.zero) == (2, 0) and f"plan {plan.name} on 1x2xcpu" in config.read_text()

    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [str(ACCELERATE), "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
               str(ROOT / "examples" / "accelerate_train.py"), "--plan", str(plan_file), "--steps", str(STEPS),
               "--seq-len", str(SEQ_LEN), "--seed", str(SEED), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    result = json.loads((tmp_path / "out" / "losses.json").read_text())
    assert result["num_processes"] == 2 and result["distributed_type"] == "MULTI_CPU"
    reference = train_single(Case("accelerate-ddp", plan))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference.losses), rtol=1e-5, atol=0)
    weights = torch.load(tmp_path / "out" / "weights.pt")
    for name, expected in reference.weights.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.timeout(300)
def test_accelerate_launch_refuses_a_plan_for_another_model(tmp_path):
    from stratagem.advisor.hardware import parse_cluster
    from stratagem.integrations.accelerate import export_accelerate_config

    plan = Plan(dp_replicate=2, precision="fp32", block_container="transformer.h")  # not llama-tiny's blocks
    plan_file, config = tmp_path / "plan.json", tmp_path / "accelerate.yaml"
    plan_file.write_text(plan.to_json())
    export_accelerate_config(plan, parse_cluster("2xcpu"), config)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [str(ACCELERATE), "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
               str(ROOT / "examples" / "accelerate_train.py"), "--plan", str(plan_file), "--steps", "2"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=250)
    assert done.returncode != 0 and "step 1:" not in done.stdout, done.stdout[-2000:]
    assert "accelerate_train.py: plan dp2 mb=1 was not made for this Transformer" in done.stderr, done.stderr[-3000:]
    assert "'transformer.h' is not one of its submodules" in done.stderr and "HINT:" in done.stderr
