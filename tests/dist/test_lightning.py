"""``Trainer(strategy=AutoParallelStrategy(...))`` on two CPU ranks matches one process.

Lightning's CPU launcher re-runs the script for the other ranks, so each test runs this file
as a script (``python test_lightning.py OUT [PLAN]``) in a subprocess; rank 0 writes the per-step
losses (logged with ``sync_dist=True``, so averaged over ranks by the strategy's ``reduce``), the
chosen plan and a checkpoint saved at the end of training. The single-process reference is a
plain loop over the same global batches. Tolerances as in ``test_data_parallel.py`` (fp32).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from stratagem.advisor.plan import Plan
from stratagem.integrations.lightning import AutoParallelStrategy
from stratagem.models import get_preset

STEPS = 5
BATCH = 2  # per rank
WORLD = 2
SEQ_LEN = 16
SEED = 1234
FP32 = {"rtol": 1e-5, "atol": 1e-6}
_PINNED = {"micro_batch_size": BATCH, "precision": "fp32", "block_container": "model.layers"}
DDP = Plan(dp_replicate=2, zero=0, **_PINNED)
ZERO3 = Plan(dp_shard=2, zero=3, **_PINNED)


class TinyLlama(pl.LightningModule):
    """llama-tiny on a fixed synthetic dataset, AdamW at lr 1e-3."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.preset = get_preset("llama-tiny")
        self.model = self.preset.build()
        (tokens,), _ = self.preset.make_batch(BATCH, seq_len=SEQ_LEN)
        self.example_input_array = tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = self.preset.loss(self(tokens), targets)
        self.log("loss", loss, sync_dist=True, on_step=True, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def dataset() -> TensorDataset:
    """STEPS global batches of WORLD × BATCH token sequences."""
    (tokens,), targets = get_preset("llama-tiny").make_batch(
        STEPS * WORLD * BATCH, seq_len=SEQ_LEN, generator=torch.Generator().manual_seed(SEED + 1))
    return TensorDataset(tokens, targets)


def rank_batches() -> list[list[list[int]]]:
    """Per step, the samples each rank reads: Lightning's DistributedSampler shuffles training
    data (seed 0, epoch 0) and gives rank ``r`` every ``WORLD``-th index from ``r``."""
    order = torch.randperm(STEPS * WORLD * BATCH, generator=torch.Generator().manual_seed(0)).tolist()
    return [[order[r::WORLD][k * BATCH:(k + 1) * BATCH] for r in range(WORLD)] for k in range(STEPS)]


def train_single() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: one process runs each step's rank batches one after another and
    accumulates their gradients (each loss divided by WORLD), as in ``training.py``."""
    module = TinyLlama()
    optimizer = module.configure_optimizers()
    losses = []
    data = dataset()
    for step in rank_batches():
        optimizer.zero_grad()
        step_loss = 0.0
        for indices in step:
            tokens, targets = data[indices]
            loss = module.preset.loss(module(tokens), targets) / WORLD
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        losses.append(step_loss)
    return losses, {k: v.detach() for k, v in module.state_dict().items()}


def run_script(tmp_path: Path, plan: Plan | None) -> tuple[dict[str, Any], str]:
    """Run this file as the training script; returns rank 0's results and the script's stdout."""
    args = [sys.executable, __file__, str(tmp_path)]
    if plan is not None:
        (tmp_path / "plan.json").write_text(plan.to_json())
        args.append(str(tmp_path / "plan.json"))
    done = subprocess.run(args, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads((tmp_path / "results.json").read_text()), done.stdout


def assert_matches_single_process(tmp_path: Path, results: dict[str, Any]) -> None:
    losses, weights = train_single()
    torch.testing.assert_close(torch.tensor(results["losses"]), torch.tensor(losses), **FP32)
    trained = torch.load(tmp_path / "final.ckpt", weights_only=True)["state_dict"]
    assert trained.keys() == weights.keys()
    for name, weight in weights.items():
        torch.testing.assert_close(trained[name], weight, **FP32, msg=lambda m, n=name: f"{n}: {m}")


def test_ddp_plan_matches_single_process(tmp_path: Path) -> None:
    results, _ = run_script(tmp_path, DDP)
    assert results["plan"] == DDP.name
    assert_matches_single_process(tmp_path, results)


def test_zero3_plan_matches_single_process(tmp_path: Path) -> None:
    results, _ = run_script(tmp_path, ZERO3)
    assert results["plan"] == ZERO3.name
    assert_matches_single_process(tmp_path, results)


def test_auto_parallel_chooses_a_plan(tmp_path: Path) -> None:
    results, stdout = run_script(tmp_path, None)
    assert f"auto-parallel: chose plan {results['plan']}" in stdout
    assert len(results["losses"]) == STEPS and all(map(torch.isfinite, torch.tensor(results["losses"])))
    hparams = next(tmp_path.glob("lightning_logs/*/hparams.yaml")).read_text()
    assert "plan/name" in hparams


class _Record(pl.Callback):
    """Collect the rank-averaged loss per step; save a checkpoint when training ends."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(trainer.callback_metrics["loss"].item())

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.out / "final.ckpt")


def main(out: Path, plan_file: str | None) -> None:
    """Train TinyLlama on two CPU ranks ("auto-parallel" by name when no plan file is given; the
    module-level import of stratagem.integrations.lightning registered it on every rank)."""

    torch.set_num_threads(1)
    record = _Record(out)
    strategy = "auto-parallel" if plan_file is None else AutoParallelStrategy(plan=plan_file, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS,
                         callbacks=[record], logger=plan_file is None, default_root_dir=out,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(dataset(), batch_size=BATCH)
    trainer.fit(TinyLlama(), loader)
    plan = trainer.strategy.plan
    if trainer.is_global_zero:
        (out / "results.json").write_text(json.dumps({"losses": record.losses, "plan": plan.name}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
