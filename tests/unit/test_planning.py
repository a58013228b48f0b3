"""What the Lightning and Fabric strategies share, without processes: reading pinned plans,
precision names, capturing forward's inputs from a step, profiling the training step (or forward
alone, with a note, when it cannot run on fake tensors), and materialising meta models."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stratagem.plan import Plan
from stratagem.errors import UsageError
from stratagem.integrations.planning import (
    adapt_optimizer,
    check_choice,
    check_plan_precision,
    load_plan,
    stratagem_precision,
)
from stratagem.integrations.steps import fabric_step, forward_inputs, lightning_step, profile_for_plan
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


def test_a_plan_whose_loss_runs_on_vocabulary_shards_is_refused_with_the_change_that_runs_it() -> None:
    """The strategies run the user's own loss, which sees whole logits: ``vocab_loss`` is refused,
    with the layout entry that gathers them instead."""
    layout = (("layers.*.attention.wq", "colwise"), ("output", "vocab_loss"))
    plan = Plan(tp=2, micro_batch_size=2, precision="fp32", block_container="layers", tp_layout=layout)
    with pytest.raises(UsageError, match=r"vocab_loss.*\n.*\('output', 'vocab_head'\) in tp_layout"):
        load_plan(plan.to_dict())
    gathered = Plan.from_dict({**plan.to_dict(), "tp_layout": [list(layout[0]), ["output", "vocab_head"]]})
    assert load_plan(gathered) is gathered


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


def test_materialize_for_cpu_offload_puts_the_parameters_in_host_memory_and_the_buffers_on_the_device() -> None:
    """FSDP2's CPU offload refuses parameter shards anywhere but the host; the buffers (BatchNorm's
    running statistics) are the device's. ``meta`` stands for the GPU this host lacks."""
    with torch.device("meta"):
        model = get_preset("resnet-tiny").build()
    materialize(model, torch.device("meta"), params_on_host=True)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {b.device.type for b in model.buffers()} == {"meta"}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_hooks_on_a_meta_module_s_dtensor_parameters_fire_once_after_materialize(one_rank) -> None:
    """``to_empty`` swaps a DTensor parameter in place, the engine's hook staying with the tensor
    swapped out, and replaces a plain one: hooks on either never ran (the TP plugin's on a split
    embedding's gradient, after verify built the model on meta: each rank kept the whole table's
    gradient). Each fires once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    model.weight = nn.Parameter(distribute_tensor(model.weight, mesh, [Shard(0)]))
    model.bias = nn.Parameter(torch.empty(2, device="meta"))
    calls = []
    for parameter in model.parameters():
        parameter.register_hook(lambda grad, name=type(parameter).__name__: calls.append(name) or grad)
    materialize(model, torch.device("cpu"))
    model.weight.sum().backward()
    model.bias.sum().backward()
    assert calls == ["DTensor", "Parameter"]


def test_materialize_without_an_initialiser_is_a_usage_error() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3, device="meta"))

    with pytest.raises(UsageError, match="Bare define neither init_weights"):
        materialize(nn.Sequential(Bare()), torch.device("cpu"))


@pytest.mark.parametrize(("changes", "hooked"), [
    ({"tp": 2, "sequence_parallel": True}, True), ({"tp": 2}, False),
    ({"tp": 2, "sequence_parallel": True, "dp_shard": 2, "zero": 3}, False),  # FSDP reduces them
])
def test_a_strategy_s_optimizer_sums_sp_norm_gradients_once_a_step(changes, hooked) -> None:
    """The optimizer a Lightning or Fabric user hands the strategy gets the step pre-hook that sums
    the sequence-parallel norms' gradients (plugins.tensor_parallel.reduce_norm_grads_once), once."""
    optimizer = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    plan = Plan(block_container="layers", tp_layout=(("layers.*.w", "colwise"),), **changes)
    for _ in range(2):
        adapt_optimizer(optimizer, plan, rank=0)
    assert len(optimizer._optimizer_step_pre_hooks) == (1 if hooked else 0)


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
    from stratagem.integrations.lightning_pipeline import as_pipelined

    profile = dataclasses.replace(profile_spec("llama-tiny"), block_container="model.layers", pp_traced=True)
    module = pl.LightningModule()
    module.loss_fn = lambda output, target: output.float().mean()  # what the last stage computes
    for preset, traced in (("llama-tiny", False), ("vit-tiny", True)):
        module.model = get_preset(preset).build()
        assert as_pipelined(module, profile).pp_traced is traced
    top_level = as_pipelined(module, dataclasses.replace(profile, block_container="layers"))
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
    with pytest.raises(UsageError, match="microbatches=3 cannot run one dataloader batch of 4"):
        _pipeline_shapes(profile, 4, {"microbatches": 3})
    assert _pipeline_shapes(dataclasses.replace(profile, pp_unavailable="tied"), 4, {}) == [(1, 1)]


def test_a_module_without_loss_fn_gets_no_pipeline_plans() -> None:
    """The strategy's last pipeline stage computes the loss with the module's loss_fn: without one
    a chosen pipeline plan had failed in setup."""
    import dataclasses

    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.integrations.lightning_pipeline import as_pipelined

    class NoLoss(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = get_preset("llama-tiny").build()

    class WithLoss(NoLoss):
        def loss_fn(self, output, target):
            return output.float().mean()

    profile = dataclasses.replace(profile_spec("llama-tiny"), block_container="model.layers")
    assert profile.pp_unavailable is None
    assert as_pipelined(NoLoss(), profile).pp_unavailable.endswith("loss_fn(output, target), which NoLoss lacks")
    assert as_pipelined(WithLoss(), profile).pp_unavailable is None


class _Llama(pl.LightningModule):
    """llama-tiny whose training_step logs, keeps its losses and returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.preset = get_preset("llama-tiny")
        self.model = self.preset.build()
        self.losses: list[torch.Tensor] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        tokens, targets = batch
        loss = self.preset.loss(self(tokens), targets)
        self.log("loss", loss, sync_dist=True)
        self.losses.append(loss)
        return {"loss": loss}


class _ItemLlama(_Llama):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        output = super().training_step(batch, batch_idx)
        self.last = output["loss"].item()
        return output


_BATCH = get_preset("llama-tiny").make_batch(2, seq_len=16)  # ((tokens,), targets)
_LOGITS_FP32 = 2 * 16 * 256 * 4


def test_the_training_step_is_profiled_with_its_loss_outside_the_loop() -> None:
    """The loss training_step returns (in a dict) is in the head; self.log does nothing, and what
    the step stored is put back; forward's inputs give the batch shape."""
    (tokens,), targets = _BATCH
    module = _Llama()
    step = lightning_step(module, (tokens, targets), fallback=lambda: pytest.fail("the step runs"))
    assert torch.equal(step.forward_inputs[0], tokens)
    profile = profile_for_plan(module, step, precision="fp32")
    summed = profile_for_plan(module, tokens, precision="fp32")
    assert (profile.batch_size, profile.seq_len, profile.block_container) == (2, 16, "model.layers")
    assert profile.head.bwd_largest_output_bytes >= _LOGITS_FP32 > summed.head.bwd_largest_output_bytes
    assert profile.head.saved_bytes > summed.head.saved_bytes
    assert not [n for n in profile.notes if "fake tensors" in n or "sum of the outputs" in n]
    assert module.losses == [] and "log" not in vars(module)
    # the strategy runs training_step as the module's forward under FSDP: the loss is inside the root's
    assert profile.loss_in_forward and not summed.loss_in_forward


def test_a_step_that_cannot_run_on_fake_tensors_falls_back_to_forward_with_a_note(caplog) -> None:
    (tokens,), targets = _BATCH
    module = _ItemLlama()
    profile = profile_for_plan(module, lightning_step(module, (tokens, targets), fallback=lambda: tokens),
                               precision="fp32")
    assert profile.batch_size == 2 and profile.loss_in_forward  # training_step still runs as the forward
    assert any(n.startswith("_ItemLlama.training_step could not run on fake tensors (DataDependentOutputException")
               for n in profile.notes)
    assert any("backward was seeded with the sum of the outputs" in n for n in profile.notes)
    assert "could not run on fake tensors" in caplog.text
    module.automatic_optimization = False
    manual = profile_for_plan(module, lightning_step(module, (tokens, targets), fallback=lambda: tokens),
                              precision="fp32")
    assert any("(UsageError: training_step runs its own backward and optimizer step" in n for n in manual.notes)


def test_fabric_profiles_the_loss_fn_it_is_given() -> None:
    (tokens,), targets = _BATCH
    model = get_preset("llama-tiny").build()
    step = fabric_step(tokens, lambda logits: F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))
    profile = profile_for_plan(model, step, precision="fp32")
    assert profile.head.bwd_largest_output_bytes >= _LOGITS_FP32
    assert not any("backward was seeded" in n for n in profile.notes)
    assert not profile.loss_in_forward  # Fabric's user computes it after the model's forward
    with pytest.raises(UsageError, match="failed on its example inputs"):  # forward itself fails: no fallback
        profile_for_plan(model, fabric_step(torch.randn(2, 16), lambda out: out.sum()), precision="fp32")
