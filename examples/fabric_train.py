"""Train a small transformer with ``Fabric(strategy="auto-parallel")`` on two CPU processes.

The model is a reference preset (``llama-tiny`` by default) on synthetic tokens. In
``fabric.setup`` rank 0 profiles it on ``example_input_array``, prints the advisor's table and the
plan it chose; every rank applies that plan and trains, the dataloader's sampler following the
plan. The run ends with a sharded checkpoint; ``--resume`` loads it back (model, optimizer and
step) and trains on. Run it as a plain script: Fabric starts the second rank by running this file
again, which is why the import below must stay at the top level.

    python examples/fabric_train.py [--preset gpt2-tiny] [--steps 8] [--resume]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import stratagem.integrations.fabric  # noqa: F401  (registers strategy="auto-parallel")
from stratagem.models import get_preset

BATCH = 4  # per data-parallel rank
SEQ_LEN = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-tiny", help="a model preset (default: llama-tiny)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/fabric_train"))
    parser.add_argument("--resume", action="store_true", help="load --checkpoint first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="auto-parallel")
    fabric.launch()
    fabric.seed_everything(0)
    preset = get_preset(args.preset)
    model = preset.build()
    (model.example_input_array,), _ = preset.make_batch(BATCH, seq_len=SEQ_LEN)  # what the advisor profiles
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    (tokens,), targets = preset.make_batch(args.steps * 2 * BATCH, seq_len=SEQ_LEN)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(tokens, targets), batch_size=BATCH))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.checkpoint, state)
    for tokens, targets in loader:
        loss = preset.loss(model(tokens), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        fabric.print(f"step {state['step']}: loss {fabric.all_reduce(loss.detach()).item():.4f}")
    fabric.save(args.checkpoint, state)
    fabric.print(f"plan {fabric.strategy.plan.name}; checkpoint in {args.checkpoint}")


if __name__ == "__main__":
    main()
