"""What the Lightning and Fabric strategies share, without processes: reading pinned plans,
precision names, capturing forward's inputs from a step, and materialising meta models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from stratagem.plan import Plan
from stratagem.errors import UsageError
from stratagem.integrations.planning import (
    check_choice,
    check_plan_precision,
    forward_inputs,
    load_plan,
    stratagem_precision,
)
from stratagem.models import get_preset
from stratagem.plugins.materialize import has_meta_tensors, materialize

PLAN = Plan(dp_shard=2, zero=3, micro_batch_size=2, precision="fp32")


def test_load_plan_from_plan_dict_and_files(tmp_path: Path) -> None:
    assert load_plan(PLAN) is PLAN
    assert load_plan(PLAN.to_dict()) == PLAN
    (tmp_path / "plan.json").write_text(PLAN.to_json())
    assert load_plan(tmp_path / "plan.json") == PLAN
    (tmp_path / "advice.json").write_text(json.dumps({"plans": [{"plan": PLAN.to_dict()}]}))
    assert load_plan(str(tmp_path / "advice.json")) == PLAN


def test_load_plan_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read the plan file"):
        load_plan(tmp_path / "nope.json")


def test_precision_names() -> None:
    assert stratagem_precision("32-true") == "fp32"
    with pytest.raises(UsageError, match="16-mixed.*valid: 32-true, bf16-mixed, bf16-true"):
        stratagem_precision("16-mixed")
    with pytest.raises(UsageError, match="trains in fp32 but the run is set to bf16-mixed"):
        check_plan_precision(PLAN, "bf16-mixed")


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.ran = False

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        self.ran = True
        return self.linear(x) * scale


def test_forward_inputs_stops_the_step_at_forward() -> None:
    module = _Wrapper()
    x = torch.randn(3, 4)

    def step() -> torch.Tensor:
        loss = module(x * 2).sum()
        raise AssertionError("the step goes on after forward")  # never reached
        return loss

    (captured,) = forward_inputs(module, step)
    assert torch.equal(captured, x * 2) and not module.ran
    assert forward_inputs(module, lambda: module(x=x))["x"] is x
    assert not module._forward_pre_hooks  # the hook is gone


def test_forward_inputs_errors() -> None:
    module = _Wrapper()
    with pytest.raises(UsageError, match="never called on the batch"):
        forward_inputs(module, lambda: module.linear(torch.randn(1, 4)))
    with pytest.raises(UsageError, match="positional and keyword inputs at once"):
        forward_inputs(module, lambda: module(torch.randn(1, 4), scale=2.0))


def test_materialize_runs_init_weights_of_a_meta_model() -> None:
    preset = get_preset("llama-tiny")
    with torch.device("meta"):
        model = preset.build()
    assert has_meta_tensors(model)
    torch.manual_seed(0)
    materialize(model, torch.device("cpu"))
    assert not has_meta_tensors(model)
    norm = model.layers[0].attention_norm.weight
    assert torch.equal(norm, torch.ones_like(norm))  # init_weights: norms are ones
    std = model.layers[0].attention.wq.weight.std().item()
    assert 0.015 < std < 0.025  # N(0, 0.02)


def test_materialize_without_an_initialiser_is_a_usage_error() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3, device="meta"))

    with pytest.raises(UsageError, match="Bare define neither init_weights"):
        materialize(nn.Sequential(Bare()), torch.device("cpu"))


def test_choice_is_checked_before_any_process_starts() -> None:
    assert check_choice(target="lightning", objective="memory", constraints={"zero": 3}) == {"zero": 3}
    with pytest.raises(UsageError, match="unknown objective 'fast'"):
        check_choice(target="lightning", objective="fast", constraints=None)
    with pytest.raises(UsageError, match="constraints on micro_batch_size: the dataloader"):
        check_choice(target="lightning", objective="throughput", constraints={"micro_batch_size": 4})
    with pytest.raises(UsageError, match="unknown constraint"):
        check_choice(target="lightning", objective="throughput", constraints={"zer0": 3})
    with pytest.raises(UsageError, match="unknown target"):
        check_choice(target="megatron", objective="throughput", constraints=None)


def test_lightning_advises_pipelines_for_the_child_it_splits() -> None:
    """The strategy splits the LightningModule's child holding the blocks, so the profile (of the
    LightningModule, whose stages would be traced) takes that child's pipeline facts."""
    import dataclasses

    import lightning.pytorch as pl

    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.integrations.lightning import _as_pipelined

    profile = dataclasses.replace(profile_spec("llama-tiny"), block_container="model.layers", pp_traced=True)
    module = pl.LightningModule()
    for preset, traced in (("llama-tiny", False), ("vit-tiny", True)):
        module.model = get_preset(preset).build()
        assert _as_pipelined(module, profile).pp_traced is traced
    top_level = _as_pipelined(module, dataclasses.replace(profile, block_container="layers"))
    assert "splits a child module holding the blocks" in top_level.pp_unavailable


def test_a_dataloader_batch_runs_unpiped_or_split_into_micro_batches() -> None:
    """One batch is one rank's step: no pipeline, or a pipeline splitting it into at least one
    micro-batch per stage; constraints narrow the shapes, and a model without stages gets none."""
    import dataclasses

    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.integrations.planning import _pipeline_shapes

    profile = dataclasses.replace(profile_spec("llama-tiny"), batch_size=4)
    assert _pipeline_shapes(profile, 4, {}) == [(1, 1), (2, 2), (2, 4), (4, 4)]
    assert _pipeline_shapes(profile, 4, {"pp": 2}) == [(2, 2), (2, 4)]
    assert _pipeline_shapes(profile, 4, {"microbatches": 3}) == []
    assert _pipeline_shapes(dataclasses.replace(profile, pp_unavailable="tied"), 4, {}) == [(1, 1)]
