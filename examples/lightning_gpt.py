"""Train a small GPT with ``Trainer(strategy="auto-parallel")`` on two CPU processes.

The model is the reference ``gpt2-tiny`` preset (GPT-2's block: LayerNorm, learned positions,
GELU MLP) on synthetic tokens. Rank 0 profiles its ``training_step`` (the loss included) on
fake tensors shaped like the first batch, prints the advisor's table and the plan it chose;
every rank applies that plan, trains, and the run ends with a sharded checkpoint that
``trainer.fit(ckpt_path=...)`` would resume from. Run it as a plain script: Lightning starts
the second rank by running this file again, which is why the import below must stay at the top
level.

    python examples/lightning_gpt.py [--preset llama-tiny] [--steps 8] [--accelerator gpu --devices 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem.integrations.lightning  # noqa: F401  (registers strategy="auto-parallel")
from stratagem.models import get_preset

BATCH = 4  # per rank
SEQ_LEN = 32


class LanguageModel(pl.LightningModule):
    """A preset transformer trained on next-token prediction."""

    def __init__(self, preset: str) -> None:
        super().__init__()
        self.preset = get_preset(preset)
        self.model = self.preset.build()
        (tokens,), _ = self.preset.make_batch(BATCH, seq_len=SEQ_LEN)
        self.example_input_array = tokens  # one rank's batch: profiled alone if training_step cannot be

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = self.preset.loss(self(tokens), targets)
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-tiny", help="a model preset (default: gpt2-tiny)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accelerator", default="cpu", help="Lightning's accelerator (default: cpu)")
    parser.add_argument("--devices", type=int, default=2, help="processes, one per device (default: 2)")
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/lightning_gpt.ckpt"))
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    (tokens,), targets = get_preset(args.preset).make_batch(args.steps * 2 * BATCH, seq_len=SEQ_LEN)
    loader = DataLoader(TensorDataset(tokens, targets), batch_size=BATCH)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, strategy="auto-parallel",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_model_summary=False,
                         log_every_n_steps=1)
    trainer.fit(LanguageModel(args.preset), loader)
    trainer.save_checkpoint(args.checkpoint, weights_only=False)  # with optimizer and loop state
    if trainer.is_global_zero:
        print(f"plan {trainer.strategy.plan.name}: final loss {trainer.callback_metrics['loss'].item():.4f}; "
              f"checkpoint in {args.checkpoint}")


if __name__ == "__main__":
    main()
