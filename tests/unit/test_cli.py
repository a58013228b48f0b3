"""The command line: `stratagem profile`, entry points, exit codes, and a light import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.cli import main


def test_profile_json_has_the_totals_and_every_block(capsys):
    assert main(["profile", "gpt2", "--seq-len", "256", "--batch-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"] == 124_439_808
    assert data["flops_per_step"] == data["fwd_flops"] + data["bwd_flops"] > 0
    assert len(data["blocks"]) == 12
    for block in data["blocks"]:
        assert {"num_params", "flops", "saved_bytes", "output_bytes", "linears"} <= set(block)
    assert (data["batch_size"], data["seq_len"], data["num_heads"]) == (2, 256, 12)


def test_profile_table(capsys):
    assert main(["profile", "vit-tiny", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "head + loss" in out and "total" in out and "fp32" in out


@pytest.mark.parametrize("argv, message", [
    (["profile", "no-such-model"], "unknown model 'no-such-model'"),
    (["profile", "resnet-50", "--seq-len", "128"], "does not apply"),
    (["profile", "gpt2", "--precision", "fp8"], "unknown precision"),
    (["profile", "gpt2", "--batch-size", "0"], "at least 1"),
])
def test_usage_errors_exit_2_without_a_traceback(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_scripts_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "stratagem", "--help"], capture_output=True, text=True, check=True)
    assert "profile" in out.stdout and "hardware" in out.stdout


def test_importing_stratagem_and_the_cli_stays_light():
    code = ("import sys, stratagem, stratagem.cli, stratagem.advisor.profile.profiler; "
            "print(sorted(m for m in ('lightning', 'accelerate', 'transformers', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_own_model_example_advises(capsys):
    import runpy

    example = Path(__file__).resolve().parents[2] / "examples" / "advise_own_model.py"
    runpy.run_path(str(example), run_name="example")["main"]("2xL4")
    out = capsys.readouterr().out
    assert "UNetish" in out and "samples/s" in out
