"""``Fabric(strategy="auto-parallel")`` without processes: registration, the sampler the plan
implies, and the usage errors raised before any process group or collective."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stratagem.plan import Plan
from stratagem.errors import UsageError
from stratagem.integrations.fabric import AutoParallelFabricStrategy
from stratagem.integrations.planning import sampler_kwargs

PLAN = Plan(dp_shard=2, zero=3, micro_batch_size=2, precision="fp32")


def test_fabric_resolves_auto_parallel_by_name() -> None:
    fabric = Fabric(strategy="auto-parallel", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, AutoParallelFabricStrategy)


def test_import_stratagem_registers_it_once_fabric_is_imported() -> None:
    code = ("import lightning.fabric, stratagem\n"
            "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
            "print(STRATEGY_REGISTRY['auto-parallel']['strategy'].__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["stratagem.integrations.fabric"]


def test_tensor_parallel_ranks_read_the_same_samples() -> None:
    plan = Plan(dp_shard=2, zero=3, tp=2, micro_batch_size=2, precision="fp32",
                tp_layout=(("layers.*.attention.wq", "colwise"),))
    assert [sampler_kwargs(plan, rank) for rank in range(4)] == [
        {"num_replicas": 2, "rank": 0}, {"num_replicas": 2, "rank": 0},
        {"num_replicas": 2, "rank": 1}, {"num_replicas": 2, "rank": 1}]


def test_sampler_before_the_plan_is_chosen_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="HINT: call fabric.setup"):
        AutoParallelFabricStrategy().distributed_sampler_kwargs


def test_precision_mismatch_fails_before_the_process_group() -> None:
    fabric = Fabric(strategy=AutoParallelFabricStrategy(plan=PLAN), accelerator="cpu", devices=2,
                    precision="bf16-mixed")
    with pytest.raises(UsageError, match="trains in fp32 but the run is set to bf16-mixed"):
        fabric.strategy.setup_environment()
    assert not torch.distributed.is_initialized()


def test_unpinned_strategy_needs_example_inputs() -> None:
    with pytest.raises(UsageError, match="needs example inputs.*\nHINT: pass AutoParallelFabricStrategy"):
        AutoParallelFabricStrategy(verbose=False).setup_module(nn.Linear(4, 2))


def test_checkpoints_refuse_filters_and_bare_modules(tmp_path: Path) -> None:
    strategy = AutoParallelFabricStrategy(plan=PLAN)
    with pytest.raises(UsageError, match="no storage_options or filter"):
        strategy.save_checkpoint(tmp_path / "ckpt", {"model": nn.Linear(4, 2)}, filter={"model": lambda *_: True})
    with pytest.raises(UsageError, match="HINT: fabric.load"):
        strategy.load_checkpoint(tmp_path / "ckpt", nn.Linear(4, 2))


def test_optimizer_of_another_model_is_refused_before_the_plan_is_applied() -> None:
    other = torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1)
    with pytest.raises(UsageError, match="parameters of another model"):
        AutoParallelFabricStrategy(plan=PLAN).setup_module_and_optimizers(nn.Linear(4, 2), [other])


def test_the_clipping_to_price_is_by_norm_or_by_value() -> None:
    with pytest.raises(UsageError, match="AutoParallelFabricStrategy.grad_clip='l2' is not one of 'norm', 'value'"):
        AutoParallelFabricStrategy(grad_clip="l2")


def test_a_compiled_plan_warns_of_an_epoch_s_smaller_last_batch(caplog) -> None:
    """``fabric.setup_dataloaders`` hands the strategy the loader: 10 samples in batches of 4 leave a
    last batch of 2, which compiled blocks would compile again for, symbolic."""
    strategy = AutoParallelFabricStrategy(plan=Plan(compile=True, block_container="layers", micro_batch_size=4))
    loader = DataLoader(TensorDataset(torch.zeros(10, 8)), batch_size=4)
    with caplog.at_level("WARNING", logger="stratagem.integrations.fabric"):
        assert strategy.process_dataloader(loader) is loader
    assert "last training batch holds 2 samples where the others hold 4" in caplog.text
    caplog.clear()
    strategy.process_dataloader(DataLoader(TensorDataset(torch.zeros(12, 8)), batch_size=4))
    assert not caplog.text
