"""Plan → Lightning: Trainer arguments with the auto-parallel strategy pinned to a plan file,
as a LightningCLI YAML, and Lightning's own equivalent strategy where there is one. The
auto-parallel form runs: a Trainer built from the written file trains on this CPU."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import yaml

from stratagem.advisor.hardware import parse_cluster
from stratagem.plan import Plan
from stratagem.cli import main
from stratagem.errors import UsageError
from stratagem.integrations.lightning_config import builtin_strategy, export_lightning_config, trainer_arguments

TWO_NODES = parse_cluster("2x8xH100-SXM-80GB:ib-ndr")


def test_trainer_arguments_pin_the_plan():
    plan = Plan(dp_replicate=2, dp_shard=8, zero=3, grad_accum=4)
    arguments = trainer_arguments(plan, TWO_NODES, plan_file="p.json")
    assert arguments == {"accelerator": "gpu", "devices": 8, "num_nodes": 2, "precision": "bf16-mixed",
                         "accumulate_grad_batches": 4,
                         "strategy": {"class_path": "stratagem.integrations.lightning.AutoParallelStrategy",
                                      "init_args": {"plan": "p.json"}}}


@pytest.mark.parametrize("plan, expected", [
    (Plan(dp_replicate=16), '"ddp"'),
    (Plan(dp_shard=16, zero=3, activation_checkpointing="full", offload="params"),
     'FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block}, '
     "activation_checkpointing_policy={Block}, cpu_offload=True)"),
    (Plan(dp_replicate=2, dp_shard=8, zero=2),
     'FSDPStrategy(sharding_strategy="_HYBRID_SHARD_ZERO2", auto_wrap_policy={Block}, device_mesh=(2, 8))'),
    (Plan(tp=4, dp_shard=4, zero=3), "ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=4)"),
    (Plan(dp_shard=16, zero=1), "DeepSpeedStrategy(stage=1)"),
    (Plan(dp_shard=16, zero=2, offload="optimizer"), "DeepSpeedStrategy(stage=2, offload_optimizer=True)"),
    (Plan(pp=2, dp_replicate=8, microbatches=2), None),
    (Plan(dp_shard=16, zero=3, activation_checkpointing="selective"), None),
    (Plan(dp_shard=16, zero=3, activation_checkpointing="selective-op"), None),
])
def test_builtin_equivalent(plan, expected):
    code, why = builtin_strategy(plan, block_classes=("Block",))
    assert code == expected and why


def test_a_precision_the_strategy_does_not_run_is_a_usage_error():
    with pytest.raises(UsageError, match="does not run fp16-mixed"):
        trainer_arguments(Plan(dp_replicate=16, precision="fp16-mixed"), TWO_NODES, plan_file="p.json")


def test_the_written_config_trains_with_the_auto_parallel_strategy(tmp_path, monkeypatch):
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from stratagem.integrations.lightning import AutoParallelStrategy
    from stratagem.models import get_preset

    monkeypatch.chdir(tmp_path)
    plan = Plan(precision="fp32", micro_batch_size=2, grad_accum=2, block_container="layers")
    path = export_lightning_config(plan, parse_cluster("1xcpu"), "trainer.yaml", block_classes=("TransformerBlock",))
    assert "No built-in" not in path.read_text() and '"auto"' in path.read_text()
    arguments = yaml.safe_load(path.read_text())["trainer"]
    strategy = arguments.pop("strategy")
    assert strategy["class_path"] == f"{AutoParallelStrategy.__module__}.{AutoParallelStrategy.__name__}"

    preset = get_preset("llama-tiny")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = preset.build()

        def forward(self, tokens):
            return self.model(tokens)

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            return preset.loss(self(tokens), targets)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    (tokens,), targets = preset.make_batch(8, seq_len=8)
    module = Module()
    before = next(module.parameters()).detach().clone()
    trainer = pl.Trainer(**arguments, strategy=AutoParallelStrategy(**strategy["init_args"], verbose=False),
                         max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with mock.patch.dict(os.environ):  # Lightning sets this rank's LOCAL_RANK, MASTER_PORT: not for later scripts
        trainer.fit(module, DataLoader(TensorDataset(tokens, targets), batch_size=plan.micro_batch_size))
    assert trainer.strategy.plan == plan and trainer.global_step == 2
    assert not torch.equal(next(module.parameters()).detach(), before)


def test_advise_emit_lightning(tmp_path, capsys):
    path = tmp_path / "trainer.yaml"
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "8xA100", "--global-batch-size", "32",
                 "--emit", "lightning", "--output", str(path)]) == 0
    assert "target lightning" in capsys.readouterr().out
    config = yaml.safe_load(path.read_text())
    pinned = Plan.from_json((tmp_path / "trainer.plan.json").read_text())
    assert config["trainer"]["strategy"]["init_args"]["plan"] == str(tmp_path / "trainer.plan.json")
    assert pinned.world_size == 8 and pinned.global_batch_size == 32


def _jsonargparse(monkeypatch, *, installed: bool, version: str = "4.40.0") -> None:
    """Pretend jsonargparse[signatures] is (or is not) importable here, at ``version``."""
    import importlib.metadata
    import importlib.util

    find_spec, real_version = importlib.util.find_spec, importlib.metadata.version
    signatures = ("jsonargparse", "docstring_parser", "typeshed_client")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        (find_spec("yaml") if installed else None) if name in signatures else find_spec(name, *args)))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "jsonargparse"
                        else real_version(name))


@pytest.mark.parametrize(("installed", "version", "missing"), [(True, "4.40.0", False), (True, "4.20.0", True),
                                                               (False, "4.40.0", True)])
def test_lightning_cli_missing_says_what_to_install(monkeypatch, installed, version, missing):
    from stratagem.integrations.lightning_config import lightning_cli_missing

    _jsonargparse(monkeypatch, installed=installed, version=version)
    assert lightning_cli_missing() == ("pip install 'jsonargparse[signatures]>=4.27.7'" if missing else None)


@pytest.mark.parametrize("installed", [True, False])
def test_emit_lightning_says_when_lightning_cli_cannot_read_it(monkeypatch, tmp_path, capsys, installed):
    _jsonargparse(monkeypatch, installed=installed)
    path = tmp_path / "trainer.yaml"
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "2xcpu", "--emit", "lightning",
                 "--output", str(path)]) == 0
    err, header = capsys.readouterr().err, path.read_text().split("trainer:")[0]
    pip = "pip install 'jsonargparse[signatures]>=4.27.7'"
    assert (pip in err and "advise: note: LightningCLI" in err) is not installed
    assert (f"LightningCLI needs jsonargparse[signatures]>=4.27.7, not installed where this file was written: {pip}"
            in header) is not installed
    assert yaml.safe_load(path.read_text())["trainer"]["strategy"]["class_path"].endswith("AutoParallelStrategy")


def test_a_pipeline_plan_without_the_blocks_child_names_the_lightning_modules_module_lists():
    """A plan given by hand with no block_container: the hint names the blocks' ModuleList as the
    LightningModule reaches it (``model.model.layers`` for a model kept in ``self.model`` whose
    own blocks are ``model.layers``), not the model's own name for it."""
    import lightning.pytorch as pl
    from torch import nn

    from stratagem.integrations.lightning_pipeline import pipelined_child

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Wrapped()

    with pytest.raises(UsageError, match="module lists: 'model.model.layers'"):
        pipelined_child(Module(), Plan(pp=2, microbatches=2))
