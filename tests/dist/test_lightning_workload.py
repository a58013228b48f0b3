"""The Workload ``Trainer(strategy="auto-parallel")`` plans for is the one the run steps with: a
global batch of the dataloader's batch × data-parallel ranks × ``accumulate_grad_batches`` (the
plan's ``grad_accum``), the optimizer ``configure_optimizers`` returns, and the gradients clipped
as ``gradient_clip_val`` and ``gradient_clip_algorithm`` say.

The planning function is tested directly, without processes, on a 2-rank CPU cluster; one real
fit on two CPU ranks (this file run as the training script, which Lightning re-runs for rank 1)
checks the strategy wires both in and trains.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from stratagem.advisor.cost.memory import estimate_memory
from stratagem.advisor.hardware.parse import parse_cluster
from stratagem.errors import UsageError
from stratagem.integrations.lightning import AutoParallelStrategy, _grad_clip
from stratagem.integrations.planning import (
    _advise,
    check_plan_accumulation,
    workload_optimizer,
)
from stratagem.models import get_preset
from stratagem.plan import Plan

BATCH = 4  # per data-parallel rank
ACCUMULATE = 2
WORLD = 2
STEPS = 2
SOURCE = "CNN.configure_optimizers"


class CNN(pl.LightningModule):
    """A small CNN classifying 16×16 images, stepped by ``optimizer`` (SGD, lr 0.1, by default)."""

    def __init__(self, optimizer: Any = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(8, 10))
        self.optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.parameters())


def dataset() -> TensorDataset:
    """Enough samples for STEPS optimizer steps of ACCUMULATE batches on WORLD ranks."""
    generator = torch.Generator().manual_seed(0)
    samples = STEPS * ACCUMULATE * WORLD * BATCH
    return TensorDataset(torch.randn(samples, 3, 16, 16, generator=generator),
                         torch.randint(0, 10, (samples,), generator=generator))


def advise_for(module: nn.Module, inputs: Any, *, accumulate: int = 1, optimizer: Any = None,
               constraints: dict[str, Any] | None = None) -> Any:
    """What rank 0 of a 2-rank CPU Trainer advises for ``module`` on one rank's ``inputs``."""
    return _advise(module, inputs, parse_cluster("1x2xcpu"), world=WORLD, precision="fp32", target="lightning",
                   objective="throughput", constraints=constraints or {}, verbose=False, pipelined=None,
                   accumulate=accumulate, optimizer=optimizer)


def _names(returned: Any) -> tuple[str, tuple[str, ...]]:
    return workload_optimizer(lambda: returned, SOURCE)


def test_the_optimizer_configure_optimizers_returns_names_the_workloads() -> None:
    """SGD and Adam(W), alone or with schedulers in Lightning's list/tuple/dict forms, name the
    cost model's optimizer; what it does not price, several it prices differently, none or a
    failing configure_optimizers leave AdamW, and a note says which and why."""
    params = list(nn.Linear(4, 2).parameters())
    momentum = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(momentum, step_size=1)
    assert _names(momentum) == ("sgd", ())
    assert _names({"optimizer": momentum, "lr_scheduler": {"scheduler": scheduler}}) == ("sgd", ())
    assert _names(([momentum], [scheduler])) == ("sgd", ())
    assert _names(torch.optim.AdamW(params)) == _names([torch.optim.Adam(params)]) == ("adamw", ())
    name, notes = _names(torch.optim.SGD(params, lr=0.1))
    assert name == "sgd" and "SGD without momentum" in notes[0] and "upper bound" in notes[0]
    assert "amsgrad" in _names(torch.optim.Adam(params, amsgrad=True))[1][0]
    name, notes = _names(torch.optim.Adagrad(params))
    assert name == "adamw" and notes[0].startswith(f"{SOURCE} gives Adagrad, which the cost model does not price")
    name, notes = _names([momentum, torch.optim.AdamW(params)])
    assert name == "adamw" and "2 optimizers (SGD, AdamW)" in notes[0]
    none = f"No torch optimizer came from {SOURCE}, so the advice assumes adamw (its states and step)"
    assert _names(None) == ("adamw", (none,))

    def broken() -> None:
        raise RuntimeError("no trainer attached\nmore")

    name, notes = workload_optimizer(broken, SOURCE)
    assert name == "adamw" and notes[0].startswith(f"{SOURCE} raised RuntimeError: no trainer attached, so")


def test_the_advice_plans_the_accumulated_global_batch_and_the_modules_optimizer() -> None:
    """accumulate_grad_batches=2 on 2 ranks of batch 4: a global batch of 16, as micro-batches of
    4 accumulated twice; SGD's one state per parameter is half of AdamW's two."""
    module = CNN()
    images = dataset().tensors[0][:BATCH]
    advice = advise_for(module, images, accumulate=ACCUMULATE,
                        optimizer=lambda: workload_optimizer(module.configure_optimizers, SOURCE))
    assert advice.workload.global_batch_size == BATCH * WORLD * ACCUMULATE == 16
    assert advice.workload.optimizer == "sgd"
    assert any(note.startswith(f"{SOURCE} gives SGD without momentum") for note in advice.notes)
    for estimate in advice.plans:
        assert (estimate.plan.micro_batch_size, estimate.plan.grad_accum) == (BATCH, ACCUMULATE)
        assert estimate.plan.global_batch_size == 16
    best = advice.best
    adamw = estimate_memory(advice.profile, dataclasses.replace(advice.workload, optimizer="adamw"), best.plan)
    assert best.memory.optimizer == adamw.optimizer / 2 > 0
    shard = best.plan.dp if best.plan.zero >= 1 else 1
    assert best.memory.optimizer == advice.profile.num_params * 4 / shard  # one fp32 state per parameter

    once = advise_for(module, images)  # nothing accumulated, no optimizer known: as before
    assert (once.workload.global_batch_size, once.workload.optimizer) == (BATCH * WORLD, "adamw")
    assert once.best.plan.grad_accum == 1
    assert once.best.time.step_seconds < best.time.step_seconds  # one batch a step, not two


def test_accumulating_over_batches_leaves_out_the_advisors_pipelines() -> None:
    """The advisor's pipeline plans accumulate nothing: with accumulate_grad_batches > 1 none are
    searched (a note says why), and constraints pinning one are refused, naming the reason."""
    preset = get_preset("llama-tiny")
    (tokens,), _ = preset.make_batch(2, seq_len=16)
    model = preset.build()
    advice = advise_for(model, tokens, accumulate=ACCUMULATE)
    assert all(e.plan.pp == 1 and e.plan.grad_accum == ACCUMULATE for e in advice.plans)
    assert any(note.startswith("No pipeline plans: accumulate_grad_batches=2") for note in advice.notes)
    with pytest.raises(UsageError, match=r"constraints pin a pipeline \(pp=2.*accumulate_grad_batches=2"):
        advise_for(model, tokens, accumulate=ACCUMULATE, constraints={"pp": 2})


def test_a_tensor_parallel_group_shares_its_batch_so_tp_plans_are_searched() -> None:
    """Both ranks of a tp=2 group read one batch: its global batch is one batch (it had been
    planned as two, which no plan of one batch a step could take, so TP was never chosen)."""
    preset = get_preset("llama-tiny")
    (tokens,), _ = preset.make_batch(2, seq_len=16)
    advice = advise_for(preset.build(), tokens, constraints={"tp": 2})
    assert advice.best.plan.tp == 2 and advice.workload.global_batch_size == 2
    assert advice.best.plan.grad_accum == 1 and advice.best.plan.micro_batch_size == 2
    # each shape's search is pinned to its tp and pp: the advice shown lists no pin the user did not set
    unpinned = advise_for(preset.build(), tokens).excluded
    assert not any(why.startswith(("constraint tp in", "constraint pp in", "constraint microbatches in"))
                   for why in unpinned)
    assert any(why.startswith("constraint tp in [2]") for why in advice.excluded)  # the user's own pin


def test_a_pinned_plans_accumulation_is_the_trainers_or_one_batchs() -> None:
    one_batch = Plan(dp_shard=2, zero=1, micro_batch_size=BATCH, precision="fp32")
    accumulating = dataclasses.replace(one_batch, grad_accum=ACCUMULATE)
    check_plan_accumulation(one_batch, ACCUMULATE)  # Lightning accumulates a plan for one batch
    check_plan_accumulation(accumulating, ACCUMULATE)
    with pytest.raises(UsageError, match=r"over 2 batches, but the run's accumulate_grad_batches is 1.*\n"
                                         r"HINT: Trainer\(accumulate_grad_batches=2\)"):
        check_plan_accumulation(accumulating, 1)


@pytest.mark.parametrize("arguments, expected", [
    ({}, None),
    ({"gradient_clip_val": 0}, None),
    ({"gradient_clip_val": 1.0}, "norm"),
    ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"}, "norm"),
    ({"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, "value"),
])
def test_the_trainer_s_clipping_is_the_workload_s(arguments: dict[str, Any], expected: str | None) -> None:
    assert _grad_clip(pl.Trainer(accelerator="cpu", logger=False, **arguments)) == expected


def test_a_compiled_plan_warns_of_an_epoch_s_smaller_last_batch(one_rank, caplog) -> None:
    """Set up (no step run) on one rank: 10 samples in batches of 4 leave a last batch of 2, which
    compiled blocks would compile again for, symbolic (``planning.partial_batch_note``). The
    environment Lightning sets for this process's rank (``LOCAL_RANK``, ``MASTER_PORT``) is put
    back, lest the next test's script take itself for a launched rank."""
    plan = Plan(compile=True, block_container="net", micro_batch_size=BATCH, precision="fp32")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=AutoParallelStrategy(plan=plan), precision="32-true",
                         max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    images, labels = dataset().tensors
    with caplog.at_level("WARNING", logger="stratagem.integrations.lightning"), mock.patch.dict(os.environ):
        trainer.fit(CNN(), DataLoader(TensorDataset(images[:10], labels[:10]), batch_size=BATCH))
    assert "last training batch holds 2 samples where the others hold 4" in caplog.text


def test_auto_parallel_plans_and_trains_the_accumulated_sgd_step(tmp_path: Path) -> None:
    """A real fit on two CPU ranks: the advice's workload is the run's (its gradients clipped by
    value), and the chosen plan trains STEPS optimizer steps of ACCUMULATE batches each."""
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["workload"] == {"global_batch_size": 16, "seq_len": None, "precision": "fp32", "optimizer": "sgd",
                                   "grad_clip": "value"}
    assert results["grad_accum"] == ACCUMULATE and results["plan"].endswith(f"mb={BATCH} ga={ACCUMULATE}")
    assert results["global_step"] == STEPS and results["batches"] == STEPS * ACCUMULATE
    assert results["moved"]
    assert "global batch 16 · fp32 · sgd, gradients clipped by value · target lightning" in done.stdout


class _Count(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1


def main() -> None:
    """Fit CNN on two CPU ranks under "auto-parallel"; rank 0 writes what it advised and ran."""
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    count = _Count()
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="auto-parallel", precision="32-true",
                         accumulate_grad_batches=ACCUMULATE, gradient_clip_val=1.0, gradient_clip_algorithm="value",
                         max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[count])
    assert isinstance(trainer.strategy, AutoParallelStrategy)
    torch.manual_seed(0)
    module = CNN()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    after = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()  # a collective: every rank
             for name, p in module.named_parameters()}
    if trainer.is_global_zero:
        advice = trainer.strategy.advice
        moved = any(not torch.equal(after[name], weight) for name, weight in before.items())
        (out / "results.json").write_text(json.dumps({
            "workload": advice.workload.to_dict(), "plan": trainer.strategy.plan.name,
            "grad_accum": trainer.strategy.plan.grad_accum, "global_step": trainer.global_step,
            "batches": count.batches, "moved": moved}))


if __name__ == "__main__":
    main()
