"""`stratagem advise` end to end: profile, search and report; exit 0 / 1 / 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stratagem.plan import Plan
from stratagem.cli import main


def test_json_for_gpt2_on_8xa100(capsys):
    assert main(["advise", "--model", "gpt2", "--cluster", "8xA100", "--json", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["parameters"] == 124_439_808
    assert data["cluster"]["world_size"] == 8
    assert data["workload"] == {"global_batch_size": 8, "seq_len": 1024, "precision": "bf16-mixed",
                                "optimizer": "adamw", "grad_clip": None}
    assert 1 <= len(data["plans"]) <= 3
    for entry in data["plans"]:
        assert Plan.from_dict(entry["plan"]).world_size == 8
        assert entry["fits"] and entry["memory"]["total"] <= entry["capacity_bytes"]
        assert entry["time"]["step_seconds"] > 0 and entry["tokens_per_second"] > 0 and 0 < entry["mfu"] < 1
    assert data["num_evaluated"] > 0


def test_table_names_the_winner(capsys):
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "2x4xA100:ib-hdr", "--global-batch-size", "32",
                 "--optimizer", "sgd", "--target", "accelerate"]) == 0
    out = capsys.readouterr().out
    assert "Top plans" in out and "Winner:" in out and "GiB" in out and "target accelerate" in out
    assert "sgd" in out and "evaluated" in out


def test_a_clipped_workload_is_priced_and_said(capsys):
    """``--grad-clip``: each step clips the gradients first, which the optimizer term holds."""
    args = ["advise", "--model", "gpt2-tiny", "--cluster", "2xA100", "--json", "--top", "1"]
    runs = {}
    for clip in (None, "norm", "value"):
        assert main([*args, *(("--grad-clip", clip) if clip else ())]) == 0
        runs[clip] = json.loads(capsys.readouterr().out)
    assert [runs[clip]["workload"]["grad_clip"] for clip in ("norm", "value")] == ["norm", "value"]
    unclipped = runs[None]["plans"][0]
    for clip in ("norm", "value"):
        entry = runs[clip]["plans"][0]
        assert entry["name"] == unclipped["name"] and entry["time"]["optimizer"] > unclipped["time"]["optimizer"]
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "2xA100", "--grad-clip", "value"]) == 0
    assert "adamw, gradients clipped by value" in capsys.readouterr().out


def test_image_model_reports_samples_per_second(capsys):
    assert main(["advise", "--model", "vit-tiny", "--cluster", "2xL4", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["seq_len"] is None
    assert all("samples_per_second" in entry for entry in data["plans"])


def test_nothing_fits_exits_1_with_the_report(capsys):
    assert main(["advise", "--model", "llama-2-70b", "--cluster", "1xL4"]) == 1
    out = capsys.readouterr().out
    assert "Nothing fits" in out and "llama-2-70b" in out


def test_html_to_a_file_says_where_it_went(capsys, tmp_path):
    path = tmp_path / "advise.html"
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "2xH100", "--format", "html",
                 "--output", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and str(path) in captured.err
    assert path.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "8xNoSuchGPU"], "unknown device"),
    (["--seq-len", "128", "--model", "vit-tiny"], "does not apply"),
    (["--precision", "fp8"], "unknown precision"),
    (["--output", "/no/such/folder/report.md", "--format", "markdown"], "cannot write the report"),
])
def test_usage_errors_exit_2(capsys, argv, message):
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "2xA100", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--target", "megatron"], ["--top", "0"], ["--format", "pdf"], ["--grad-clip", "l2"],
                                  []])
def test_bad_arguments_exit_2(argv):
    model = ["--model", "gpt2-tiny"] if argv else []
    with pytest.raises(SystemExit) as exc:
        main(["advise", *model, *argv])
    assert exc.value.code == 2


def test_advise_help_does_not_import_torch():
    code = ("import sys\nfrom stratagem.cli import main\ntry:\n    main(['advise', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, 'rich' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--global-batch-size" in out.stdout and out.stdout.strip().endswith("False False")


def test_impossible_workload_exits_2(capsys):
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "2x8xH100:ib-ndr", "--global-batch-size", "3"]) == 2
    assert "HINT:" in capsys.readouterr().err
