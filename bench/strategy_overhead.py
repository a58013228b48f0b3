"""What ``Trainer(strategy="auto-parallel")`` costs over Lightning's own ``strategy="ddp"``.

On 2 CPU processes (gloo), the same LightningModule (llama-tiny, AdamW, fixed synthetic data)
trains under Lightning's ``"ddp"`` and under ``AutoParallelStrategy`` with a pinned DDP plan, in
alternating order (ddp, auto / auto, ddp, …) inside one launched process group, so machine noise
hits both alike. A step is the time between consecutive ``on_train_batch_start`` calls on rank 0
(forward, backward, all-reduce, optimizer step, data and hooks), the first ``--warmup`` steps of
every fit left out. Other work on a shared machine only ever lengthens a step, so a fit's figure
is its lower-quartile step. Prints, per round, each strategy's figure and their ratio, then the
median ratio over rounds; beside it the same for rank 0's CPU seconds per step (median), which
waiting for a core hardly moves: what the strategy's own code adds shows there. Then the
unpinned strategy trains once: rank 0's ``choose_plan`` (hardware probe and gather, profile on
fake tensors, search, broadcast; first-use imports included) is timed inside that run as the
one-off set-up cost.
Targets (issue 4): ratio ≤ 1.03, set-up ≤ 5 s.

    .venv/bin/python bench/strategy_overhead.py [--rounds 10] [--steps 30] [--warmup 5] [--batch 8]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

import stratagem.integrations.lightning as auto_parallel
from stratagem.plan import Plan
from stratagem.integrations.lightning import AutoParallelStrategy
from stratagem.models import get_preset

PRESET = "llama-tiny"
SEQ_LEN = 64
DEVICES = 2


class _Model(pl.LightningModule):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.preset = get_preset(PRESET)
        torch.manual_seed(0)
        self.model = self.preset.build()
        (tokens,), _ = self.preset.make_batch(batch, seq_len=SEQ_LEN)
        self.example_input_array = tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return self.preset.loss(self(tokens), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _StepTimer(pl.Callback):
    """Wall-clock and CPU seconds between consecutive batch starts: every step but the last."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append((time.perf_counter(), time.process_time()))

    def steps(self, warmup: int) -> dict[str, list[float]]:
        pairs = list(zip(self.starts[warmup:], self.starts[warmup + 1:]))
        return {"wall": [b[0] - a[0] for a, b in pairs], "cpu": [b[1] - a[1] for a, b in pairs]}


def _fit(strategy: Any, args: argparse.Namespace, steps: int) -> dict[str, list[float]]:
    """Train a fresh model for ``steps`` steps under ``strategy``; the step times after warm-up."""
    timer = _StepTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=DEVICES, strategy=strategy, max_steps=steps, max_epochs=-1,
                         callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    (tokens,), targets = get_preset(PRESET).make_batch(steps * DEVICES * args.batch, seq_len=SEQ_LEN,
                                                        generator=torch.Generator().manual_seed(1))
    trainer.fit(_Model(args.batch), DataLoader(TensorDataset(tokens, targets), batch_size=args.batch))
    return timer.steps(args.warmup)


def _lower_quartile(times: list[float]) -> float:
    return statistics.quantiles(times, n=4)[0]


class _Timed:
    """Wraps a function and keeps the seconds of its last call."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.seconds = float("nan")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds = time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out at the start of every fit")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    plan = Plan(dp_replicate=DEVICES, zero=0, micro_batch_size=args.batch, precision="fp32")
    strategies: dict[str, Callable[[], Any]] = {
        "ddp": lambda: "ddp",
        "auto": lambda: AutoParallelStrategy(plan=plan, verbose=False),
    }
    steps = args.warmup + args.steps + 1
    rounds = []
    for round_ in range(args.rounds):
        order = list(strategies) if round_ % 2 == 0 else list(reversed(strategies))
        rounds.append({name: _fit(strategies[name](), args, steps) for name in order})

    timed = _Timed(auto_parallel.choose_plan)
    auto_parallel.choose_plan = timed  # the name AutoParallelStrategy calls
    _fit("auto-parallel", args, args.warmup + 2)
    if rank_zero_only.rank != 0:
        return
    print(f"$ {shlex.join([sys.executable, *sys.argv])}")
    print(f"{PRESET}, seq {SEQ_LEN}, batch {args.batch} per rank, {DEVICES} CPU processes (gloo), "
          f"{args.steps} timed steps per fit after {args.warmup} warm-up steps")
    print(f"{'':>5} {'wall ms/step (lower quartile)':^32} {'rank-0 CPU ms/step (median)':^32}")
    print(f"{'round':>5} {'ddp':>10} {'auto':>10} {'auto/ddp':>10} {'ddp':>10} {'auto':>10} {'auto/ddp':>10}")
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    for index, fits in enumerate(rounds):
        row = []
        for clock, figure in (("wall", _lower_quartile), ("cpu", statistics.median)):
            ddp, auto = (figure(fits[name][clock]) for name in ("ddp", "auto"))
            ratios[clock].append(auto / ddp)
            row.append(f"{ddp * 1e3:>10.2f} {auto * 1e3:>10.2f} {auto / ddp:>10.3f}")
        print(f"{index:>5} {' '.join(row)}")
    print(f"step-time ratio auto-parallel (pinned DDP plan) / ddp: {statistics.median(ratios['wall']):.3f} "
          f"(median over {args.rounds} rounds; target <= 1.03); rank-0 CPU time per step: "
          f"{statistics.median(ratios['cpu']):.3f}")
    print(f"set-up of the unpinned strategy (choose_plan on rank 0): {timed.seconds:.2f} s (target <= 5 s)")


if __name__ == "__main__":
    main()
