"""The auto-parallel strategy prices the gradient clipping the Trainer was given: a real fit on
this CPU, one rank, whose advice's workload clips as the Trainer does."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from stratagem.advisor.report.content import workload_line
from stratagem.integrations.lightning import AutoParallelStrategy, _grad_clip
from stratagem.models import get_preset


@pytest.mark.parametrize("arguments, expected", [
    ({}, None),
    ({"gradient_clip_val": 0}, None),
    ({"gradient_clip_val": 1.0}, "norm"),
    ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"}, "norm"),
    ({"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, "value"),
])
def test_the_trainer_s_clipping_is_the_workload_s(arguments, expected):
    assert _grad_clip(pl.Trainer(accelerator="cpu", logger=False, **arguments)) == expected


def test_an_advised_fit_prices_the_trainer_s_clipping(one_rank):
    preset = get_preset("llama-tiny")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = preset.build()

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            return preset.loss(self.model(tokens), targets)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    (tokens,), targets = preset.make_batch(4, seq_len=8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="32-true", gradient_clip_val=0.5, max_steps=1,
                         strategy=AutoParallelStrategy(verbose=False), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), DataLoader(TensorDataset(tokens, targets), batch_size=4))
    advice = trainer.strategy.advice
    assert advice is not None and advice.workload.grad_clip == "norm"
    assert "adamw, gradients clipped by norm" in workload_line(advice)
