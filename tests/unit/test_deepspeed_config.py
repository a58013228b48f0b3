"""Plan → DeepSpeed JSON: batch sizes, ZeRO and offload, precision, checkpointing; what
DeepSpeed cannot train is a usage error. DeepSpeed's own config class checks the file when the
`deepspeed` extra is installed (it is not in the dev set-up: those checks skip)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from stratagem.plan import Plan
from stratagem.cli import main
from stratagem.errors import UsageError
from stratagem.integrations.deepspeed import (
    deepspeed_notes,
    export_deepspeed_config,
    to_deepspeed_config,
    validate_deepspeed_config,
)

PLANS = {
    "ddp-fp32": Plan(dp_replicate=8, precision="fp32", grad_accum=4),
    "zero1-bf16": Plan(dp_shard=8, zero=1, micro_batch_size=2),
    "zero2-offload-fp16": Plan(dp_shard=8, zero=2, offload="optimizer", precision="fp16-mixed"),
    "zero3-offload-ckpt": Plan(dp_shard=16, zero=3, offload="params", activation_checkpointing="full"),
    "pp-zero1": Plan(pp=2, dp_shard=4, zero=1, microbatches=8, micro_batch_size=2),
}


@pytest.mark.parametrize("name", PLANS)
def test_batch_sizes_multiply_to_the_global_batch(name):
    plan = PLANS[name]
    config = to_deepspeed_config(plan)
    assert config["train_batch_size"] == plan.global_batch_size == (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * plan.dp)


def test_zero_offload_and_precision():
    config = to_deepspeed_config(PLANS["zero3-offload-ckpt"])
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    assert config["bf16"] == {"enabled": True} and "fp16" not in config and "activation_checkpointing" in config
    fp16 = to_deepspeed_config(PLANS["zero2-offload-fp16"])
    assert fp16["fp16"]["enabled"] and "offload_param" not in fp16["zero_optimization"]
    assert "bf16" not in to_deepspeed_config(PLANS["ddp-fp32"]) and "fp16" not in to_deepspeed_config(PLANS["ddp-fp32"])


def test_the_pipeline_degree_is_a_note_for_the_model_code():
    assert any("num_stages=2" in note for note in deepspeed_notes(PLANS["pp-zero1"]))
    assert deepspeed_notes(PLANS["zero1-bf16"]) == []


def test_selective_checkpointing_is_a_note_naming_the_plugins_policy():
    """No DeepSpeed setting keeps selected operators' outputs: the model code applies the policy."""
    for policy in ("selective", "selective-op"):
        notes = deepspeed_notes(Plan(dp_shard=16, zero=3, activation_checkpointing=policy))
        assert len(notes) == 1 and f"selective_context, {policy!r}" in notes[0]


@pytest.mark.parametrize("plan, match", [
    (Plan(tp=2, dp_shard=4, zero=3), "tensor parallelism"),
    (Plan(pp=2, dp_shard=4, zero=2, microbatches=2), "DeepSpeed allows ZeRO-1 only"),
    (Plan(pp=2, dp_replicate=4, microbatches=4, pp_schedule="gpipe"), "pipelines run 1F1B"),
    (Plan(dp_shard=8, zero=3, precision="bf16-true"), "no pure-bf16"),
])
def test_what_deepspeed_cannot_train_is_a_usage_error(plan, match):
    with pytest.raises(UsageError, match=match):
        to_deepspeed_config(plan)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the deepspeed extra is not installed")
@pytest.mark.parametrize("name", PLANS)
def test_deepspeed_accepts_the_config(name):
    plan = PLANS[name]
    assert validate_deepspeed_config(to_deepspeed_config(plan), plan)


def test_export_writes_json(tmp_path):
    path = export_deepspeed_config(PLANS["zero1-bf16"], tmp_path / "ds_config.json")
    assert json.loads(path.read_text()) == to_deepspeed_config(PLANS["zero1-bf16"])


def test_advise_emit_deepspeed(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "8xA100", "--global-batch-size", "32",
                 "--emit", "deepspeed", "--output", str(path)]) == 0
    out = capsys.readouterr().out
    assert "target deepspeed" in out
    config = json.loads(path.read_text())
    assert config["train_batch_size"] == 32
