"""`stratagem explain`: two plans side by side, term by term; one plan against the advisor's best;
plans that do not fit, or do not suit the workload or the cluster (exit 2)."""

from __future__ import annotations

import json

import pytest

from stratagem.advisor.report.content import MEMORY_TERMS, TIME_TERMS
from stratagem.advisor.search.explain import MEMORY_LABELS, TERM_LABELS
from stratagem.cli import main

DDP = '{"dp_replicate": 8, "micro_batch_size": 4}'
FSDP = '{"dp_shard": 8, "zero": 3, "micro_batch_size": 4}'
TINY = ["--model", "gpt2-tiny", "--cluster", "8xA100"]


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # sentences on one line each


def _json(capsys, *argv: str) -> dict:
    assert main(["explain", *argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_two_plans_side_by_side(capsys):
    assert main(["explain", *TINY, "--plan", FSDP, "--plan", DDP]) == 0
    out = capsys.readouterr().out
    assert "fsdp8 zero3 mb=4" in out and "dp8 mb=4" in out and "B − A" in out
    for label, _ in (*MEMORY_TERMS.values(), *TIME_TERMS.values()):
        assert label in out
    assert "memory / GPU" in out and "tokens/s" in out and "MFU" in out and "global batch 32" in out


def test_the_reason_names_the_deciding_term(capsys):
    data = _json(capsys, *TINY, "--plan", FSDP, "--plan", DDP)
    assert data["winner"] == "B" and data["reasons"][0].startswith("B wins:")
    time_rows = [r for r in data["rows"] if r["section"] == "time"]
    assert [r["label"] for r in time_rows] == [label for label, _ in TIME_TERMS.values()]
    deciding = min(time_rows, key=lambda r: r["delta"])  # where A, the loser, costs most more
    assert data["reasons"][1].startswith(f"A's {TERM_LABELS[deciding['key']]} add")
    step = next(r for r in data["rows"] if r["key"] == "step_seconds")
    assert step["delta"] == pytest.approx(step["B"] - step["A"]) and step["delta"] < 0
    assert data["plans"]["A"]["plan"]["block_container"] == "layers"  # completed as the search would


def test_one_plan_against_the_advisors_best(capsys):
    data = _json(capsys, "--model", "llama-tiny", "--cluster", "8xA100", "--plan",
                 '{"pp": 2, "dp_replicate": 4, "microbatches": 2, "micro_batch_size": 4}')
    assert data["plans"]["B"]["source"] == "the advisor's best"
    assert data["workload"]["global_batch_size"] == 32  # the plan's, as --global-batch-size was not given
    pipeline = data["plans"]["A"]["plan"]
    assert len(pipeline["stage_blocks"]) == 2 and sum(pipeline["stage_blocks"]) == 4  # the balanced partition
    assert data["winner"] in ("A", "B") and len(data["reasons"]) >= 2


def test_a_plan_that_does_not_fit(capsys):
    huge = '{"dp_replicate": 8, "micro_batch_size": 262144}'
    lean = '{"dp_shard": 8, "zero": 3, "micro_batch_size": 32768, "grad_accum": 8, "activation_checkpointing": "full"}'
    assert main(["explain", *TINY, "--plan", huge, "--plan", lean]) == 0
    out = capsys.readouterr().out
    assert "A does not fit: it needs" in out and "GiB per GPU," in out and "over the 74.0 GiB usable, so B wins" in out
    assert f"A's {MEMORY_LABELS['activations']} take" in out and "does not fit)" in out


def test_a_plan_file_from_advise(capsys, tmp_path):
    assert main(["advise", *TINY, "--global-batch-size", "32", "--no-compile", "--json"]) == 0
    path = tmp_path / "advice.json"
    path.write_text(capsys.readouterr().out)
    data = _json(capsys, *TINY, "--plan", str(path), "--plan", FSDP)
    assert data["plans"]["A"]["source"] == str(path) and data["plans"]["A"]["name"] == "dp8 mb=4"


@pytest.mark.parametrize("plan, message", [
    ('{"dp_shard": 4, "zero": 3, "micro_batch_size": 8}', "spans 4 ranks"),  # another world size
    ('{"pp": 2, "dp_shard": 4, "zero": 3, "offload": "params", "microbatches": 2}',
     "cannot run here: CPU offload of a pipeline's tied weights"),
    ('{"dp": 8}', "unknown Plan field(s) dp"),
    ("[1, 2]", "a plan must be a JSON object, got list"),  # inline JSON, not a plan's name
    ('{"dp_replicate": 8, "micro_batch_size": 4, "block_container": "transformer.h"}',
     "names block_container='transformer.h'"),  # another model's plan
    ("no/such/plan.json", "cannot read the plan file"),
    ("", "--plan is empty"),  # it had been read as the current folder: "Is a directory"
])
def test_plans_that_cannot_run_here_exit_2(capsys, plan, message):
    assert main(["explain", *TINY, "--plan", plan, "--plan", DDP]) == 2
    err = capsys.readouterr().err
    assert message in err and "plan A" in err and "Traceback" not in err


def test_global_batch_mismatch_says_what_would_match(capsys):
    assert main(["explain", *TINY, "--global-batch-size", "64", "--plan", DDP]) == 2
    err = capsys.readouterr().err
    assert "global batch of 32" in err and "HINT: set grad_accum=2 in the plan" in err
    assert main(["explain", *TINY, "--plan", DDP, "--plan", '{"dp_replicate": 8, "micro_batch_size": 4, "precision": "fp32"}']) == 2
    assert "trains in fp32" in capsys.readouterr().err


def test_at_most_two_plans(capsys):
    assert main(["explain", *TINY, "--plan", DDP, "--plan", DDP, "--plan", DDP]) == 2
    assert "compares two plans" in capsys.readouterr().err


def test_a_plan_by_the_name_advise_prints(capsys):
    assert main(["advise", *TINY, "--global-batch-size", "32", "--json"]) == 0
    names = [entry["name"] for entry in json.loads(capsys.readouterr().out)["plans"]]
    dotted = next(name for name in names[1:] if "·" in name)  # a runner-up whose name has a ·
    data = _json(capsys, *TINY, "--global-batch-size", "32", "--plan", dotted.replace("·", "."))  # as one types it
    assert data["plans"]["A"]["name"] == dotted and data["plans"]["A"]["source"] == "by name"
    assert data["plans"]["B"]["name"] == names[0]


def test_a_name_no_plan_has_says_the_closest_and_a_name_needs_the_batch(capsys):
    assert main(["explain", *TINY, "--global-batch-size", "32", "--plan", "fsdp8 zero3 mb=3"]) == 2
    err = capsys.readouterr().err
    assert "no plan named 'fsdp8 zero3 mb=3'" in err and "HINT: the closest: " in err and "fsdp8 zero3" in err
    assert "it builds fsdp8 zero3 with each data-parallel rank taking 4 samples a step" in err  # 32 over 8
    assert main(["explain", *TINY, "--plan", "fsdp8 zero3 mb=4"]) == 2
    assert "does not say its global batch" in capsys.readouterr().err
    assert main(["explain", *TINY, "--global-batch-size", "32", "--plan", "a" * 5000]) == 2  # no file could have it
    err = capsys.readouterr().err
    assert "no plan named 'aaaa" in err and "..." in err and "Traceback" not in err
