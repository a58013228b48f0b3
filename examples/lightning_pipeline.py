"""Train a reference decoder with a pipeline plan: ``Trainer(strategy=AutoParallelStrategy(plan=...))``
on two CPU processes, one pipeline stage each.

The plan is pinned here (the advisor seldom picks a pipeline for a model this small): 1F1B over
two stages with the partition the advisor balances for this model, four micro-batches per step.
For a pipeline plan the LightningModule gives its loss as ``loss_fn(output, target)`` and its
batches as ``(inputs..., target)``; the strategy runs the schedule in place of ``training_step``
and ``validation_step`` and logs the last stage's loss as ``train_loss``/``val_loss``.

    python examples/lightning_pipeline.py [--steps 8]
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from stratagem.advisor.search.partition import balanced_stage_blocks
from stratagem.plan import Plan
from stratagem.advisor.profile.cache import profile_spec
from stratagem.integrations.lightning import AutoParallelStrategy
from stratagem.models import get_preset

PRESET = "llama-tiny"
MICRO_BATCH, MICROBATCHES = 2, 4
SEQ_LEN = 32


class LanguageModel(pl.LightningModule):
    """A preset decoder: ``self.model`` holds the blocks the pipeline splits."""

    def __init__(self) -> None:
        super().__init__()
        self.preset = get_preset(PRESET)
        self.model = self.preset.build()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss the schedule computes on the last stage."""
        return self.preset.loss(logits, targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch  # used by plans without pipelining
        return self.loss_fn(self(tokens), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def pipeline_plan() -> Plan:
    """1F1B over two stages, partitioned as the advisor balances this model's profile."""
    profile = profile_spec(PRESET, batch_size=MICRO_BATCH, seq_len=SEQ_LEN, precision="fp32", kernels="cpu")
    return Plan(pp=2, pp_schedule="1f1b", microbatches=MICROBATCHES, micro_batch_size=MICRO_BATCH,
                precision="fp32", block_container=f"model.{profile.block_container}",
                stage_blocks=balanced_stage_blocks(profile, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    batch = MICRO_BATCH * MICROBATCHES  # one data-parallel rank's batch: every micro-batch of a step
    (tokens,), targets = get_preset(PRESET).make_batch(args.steps * batch, seq_len=SEQ_LEN)
    loader = DataLoader(TensorDataset(tokens, targets), batch_size=batch)
    plan = pipeline_plan()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=AutoParallelStrategy(plan=plan, verbose=False),
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(LanguageModel(), loader)
    if trainer.is_global_zero:
        print(f"plan {plan.name} (stages of {list(plan.stage_blocks)} blocks): "
              f"final loss {trainer.callback_metrics['train_loss'].item():.4f}")


if __name__ == "__main__":
    main()
