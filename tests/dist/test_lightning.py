"""``Trainer(strategy=AutoParallelStrategy(...))`` on CPU ranks trains what one process trains.

Lightning's CPU launcher re-runs the script for the other ranks, so each test runs this file
as a script (``python test_lightning.py OUT [options]``) in a subprocess; rank 0 writes the
per-step losses (logged with ``sync_dist=True``, so averaged over ranks by the strategy's
``reduce``), the plan and the final weights (gathered whole). The single-process reference is a
plain loop over the same global batches. Tolerances as in ``test_data_parallel.py`` and
``test_tensor_parallel.py`` (fp32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from spawn import free_port
from test_data_parallel import CLIP, CLIP_VALUE
from test_tensor_parallel import LLAMA_LAYOUT, TP_FP32, VOCAB
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from training import assert_no_weight_repeats_its_half

from stratagem.plan import Plan
from stratagem.errors import UsageError
from stratagem.integrations.lightning import AutoParallelStrategy
from stratagem.advisor.profile.profiler import profile_model
from stratagem.models import get_preset
from stratagem.models.transformer import Transformer
from stratagem.plugins.state_dict import model_state_dict

STEPS = 5
BATCH = 2  # per data-parallel rank
SEQ_LEN = 16
SEED = 1234
FP32 = {"rtol": 1e-5, "atol": 1e-6}
# Micro-batches sum a step's gradients in another order; AdamW turns that rounding noise on a
# near-zero gradient into a visible update (one element moved 4e-6 in 5 steps; test_pipeline.py).
PIPE_FP32 = {"rtol": 1e-5, "atol": 1e-5}
_PINNED = {"micro_batch_size": BATCH, "precision": "fp32", "block_container": "model.layers"}
DDP = Plan(dp_replicate=2, zero=0, **_PINNED)
ZERO1 = Plan(dp_shard=2, zero=1, **_PINNED)
ZERO3 = Plan(dp_shard=2, zero=3, **_PINNED)
OFFLOAD = Plan(dp_shard=2, zero=3, offload="params", **_PINNED)
TP_FSDP = Plan(dp_shard=2, zero=3, tp=2, tp_layout=tuple((f"model.{p}", s) for p, s in (*LLAMA_LAYOUT, *VOCAB)),
               **_PINNED)
# A pipeline takes the data-parallel rank's batch (BATCH samples) as micro-batches of one.
_PIPE = {**_PINNED, "micro_batch_size": 1, "microbatches": BATCH}
GPIPE_DDP = Plan(pp=2, dp_replicate=2, pp_schedule="gpipe", stage_blocks=(1, 3), **_PIPE)
INTERLEAVED = Plan(pp=2, pp_virtual=2, pp_schedule="interleaved-1f1b", **_PIPE)
PP_TP = Plan(pp=2, tp=2, tp_layout=TP_FSDP.tp_layout, **_PIPE)


class TinyLlama(pl.LightningModule):
    """llama-tiny on a fixed synthetic dataset, AdamW at lr 1e-3; the model is built in
    ``configure_model`` (on meta under ``trainer.init_module(empty_init=True)``), with a
    vocabulary of ``vocab`` tokens when given (the data's stay below 256)."""

    def __init__(self, example: bool = True, vocab: int | None = None) -> None:
        super().__init__()
        self.preset = get_preset("llama-tiny")
        self.vocab = vocab
        if example:
            (tokens,), _ = self.preset.make_batch(BATCH, seq_len=SEQ_LEN)
            self.example_input_array = tokens

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            torch.manual_seed(SEED)
            config = self.preset.config
            self.model = Transformer(dataclasses.replace(config, vocab_size=self.vocab or config.vocab_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = self.preset.loss(self(tokens), targets)
        self.log("loss", loss, sync_dist=True, on_step=True, prog_bar=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val_loss", self.preset.loss(self(tokens), targets), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("test_loss", self.preset.loss(self(tokens), targets), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """What a pipeline plan's predictions equal: forward's output for the batch's tokens."""
        tokens, _ = batch
        return self(tokens)

    def loss_fn(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """For pipeline plans: the schedule computes the loss on the last stage."""
        return self.preset.loss(output, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ItemLlama(TinyLlama):
    """A ``training_step`` reading its loss's value, which fake tensors do not have."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()
        return loss


def dataset(dp: int) -> TensorDataset:
    """STEPS global batches of dp × BATCH token sequences."""
    (tokens,), targets = get_preset("llama-tiny").make_batch(
        STEPS * dp * BATCH, seq_len=SEQ_LEN, generator=torch.Generator().manual_seed(SEED + 1))
    return TensorDataset(tokens, targets)


def rank_batches(dp: int, accumulate: int = 1) -> list[list[list[list[int]]]]:
    """Per step, per batch of its accumulation window, the samples each data-parallel rank reads.
    Every epoch is one step (``limit_train_batches`` the window), so a checkpoint after any step
    ends an epoch and resumes exactly (Lightning restarts a plain DataLoader's epoch from its
    start). Lightning's DistributedSampler shuffles with seed ``0 + epoch`` and gives rank ``r``
    every ``dp``-th index from ``r``."""
    steps = []
    for epoch in range(STEPS):
        order = torch.randperm(STEPS * dp * BATCH, generator=torch.Generator().manual_seed(epoch)).tolist()
        steps.append([[order[r::dp][k * BATCH:(k + 1) * BATCH] for r in range(dp)] for k in range(accumulate)])
    return steps


def train_single(dp: int, accumulate: int = 1, clip: float | None = None,
                 clip_by: str = "norm") -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: one process runs each step's rank batches one after another and
    accumulates their gradients (each loss divided by dp and by the accumulation window), as in
    ``training.py``, clipped to ``clip`` (a global norm, or a value) where given; the loss of each
    batch, averaged over ranks."""
    module = TinyLlama()
    module.configure_model()
    optimizer = module.configure_optimizers()
    losses = []
    data = dataset(dp)
    for step in rank_batches(dp, accumulate):
        optimizer.zero_grad()
        for batch in step:
            batch_loss = 0.0
            for indices in batch:
                tokens, targets = data[indices]
                loss = module.preset.loss(module(tokens), targets) / dp
                (loss / accumulate).backward()
                batch_loss += loss.item()
            losses.append(batch_loss)
        if clip is not None and clip_by == "value":
            torch.nn.utils.clip_grad_value_(module.parameters(), clip)
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
    return losses, {k: v.detach() for k, v in module.state_dict().items()}


def run_script(out: Path, *options: str, plan: Plan | None = None) -> tuple[dict[str, Any], str]:
    """Run this file as the training script; returns rank 0's results and the script's stdout."""
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, __file__, str(out), *options]
    if plan is not None:
        (out / "plan.json").write_text(plan.to_json())
        args += ["--plan", str(out / "plan.json")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads((out / "results.json").read_text()), done.stdout


def assert_matches_single_process(losses: list[float], out: Path, dp: int = 2, tolerance: dict = FP32,
                                  accumulate: int = 1, clip: float | None = None, clip_by: str = "norm") -> None:
    """``losses`` (all STEPS × ``accumulate`` of them) and the weights ``out`` holds match one process."""
    expected_losses, weights = train_single(dp, accumulate, clip, clip_by)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **tolerance)
    trained = torch.load(out / "weights.pt", weights_only=True)
    assert trained.keys() == weights.keys()
    for name, weight in weights.items():
        torch.testing.assert_close(trained[name], weight, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def test_ddp_plan_matches_single_process_then_validates(tmp_path: Path) -> None:
    results, _ = run_script(tmp_path, "--validate", plan=DDP)
    assert results["plan"] == DDP.name
    assert_matches_single_process(results["losses"], tmp_path)
    assert results["val_loss"] > 0  # validate after fit on the same Trainer and process group


def test_an_offloaded_plan_steps_the_users_adamw_fused_and_matches_single_process(tmp_path: Path) -> None:
    """An offloaded plan's optimizer steps on the host: the strategy makes the AdamW that
    ``configure_optimizers`` returned fused before its first step (plugins/host_optimizer.py),
    and the run still trains what one process trains with torch's default AdamW."""
    results, _ = run_script(tmp_path, plan=OFFLOAD)
    assert results["plan"] == OFFLOAD.name and results["fused"] == [True]
    assert_matches_single_process(results["losses"], tmp_path)


def test_tp_fsdp_plan_matches_single_process(tmp_path: Path) -> None:
    results, _ = run_script(tmp_path, "--devices", "4", plan=TP_FSDP)
    assert results["plan"] == TP_FSDP.name
    assert_matches_single_process(results["losses"], tmp_path, tolerance=TP_FP32)


def test_pipeline_plans_match_single_process(tmp_path: Path) -> None:
    """gpipe × DDP on 4 ranks with an uneven partition, resumed from a sharded checkpoint (and that
    checkpoint resumed by two DDP ranks without a pipeline), then test and predict; interleaved
    1F1B (two stages per rank), clipped by value, then validate, test and predict; 1F1B × TP on 4
    ranks, its gradients clipped by their norm over both stages."""
    losses, out = _resumed(tmp_path / "gpipe", GPIPE_DDP, "--devices", "4", "--test")
    assert_matches_single_process(losses, out, tolerance=PIPE_FP32)
    assert_predicts_trained_model(out, dp=2)
    ddp, _ = run_script(tmp_path / "ddp", "--resume", str(tmp_path / "gpipe" / "three.ckpt"), plan=DDP)
    assert_matches_single_process(losses[:3] + ddp["losses"], tmp_path / "ddp", tolerance=PIPE_FP32)
    results, _ = run_script(tmp_path / "interleaved", "--validate", "--test", "--clip", str(CLIP_VALUE),
                            "--clip-by", "value", plan=INTERLEAVED)
    assert results["plan"] == INTERLEAVED.name
    assert_matches_single_process(results["losses"], tmp_path / "interleaved", dp=1, tolerance=PIPE_FP32,
                                  clip=CLIP_VALUE, clip_by="value")
    assert results["val_loss"] == results["test_loss"] > 0  # the same data, forward only
    assert_predicts_trained_model(tmp_path / "interleaved", dp=1)
    assert "splits each batch into 2 micro-batches on dim 0, but got shapes [(3, 16)]" in results["predict"]
    results, _ = run_script(tmp_path / "tp", "--devices", "4", "--clip", str(CLIP), plan=PP_TP)  # gradient_clip_val
    assert_matches_single_process(results["losses"], tmp_path / "tp", dp=1, tolerance=TP_FP32, clip=CLIP)


def test_a_pipeline_accumulating_gradients_over_batches_matches_single_process(tmp_path: Path) -> None:
    """accumulate_grad_batches=2 under interleaved 1F1B: the schedule runs backward inside
    training_step, so the strategy averages the window's batches itself, as Lightning's other
    strategies do by dividing each batch's loss (and each schedule step adds to the gradients the
    window's earlier batches left, undivided)."""
    results, _ = run_script(tmp_path, "--accumulate", "2", plan=INTERLEAVED)
    assert len(results["losses"]) == 2 * STEPS
    assert_matches_single_process(results["losses"], tmp_path, dp=1, tolerance=PIPE_FP32, accumulate=2)


def assert_predicts_trained_model(out: Path, dp: int) -> None:
    """Rank 0's predictions (pipeline rank 0: sent from the last stage) are one process's outputs
    under the weights the run ended with, for the samples of data-parallel rank 0 (Lightning's
    predict sampler gives rank ``r`` every ``dp``-th sample from ``r``, in order)."""
    module = TinyLlama()
    module.configure_model()
    module.load_state_dict(torch.load(out / "weights.pt", weights_only=True))
    tokens = dataset(dp).tensors[0][::dp]
    with torch.no_grad():
        expected = module.eval()(tokens)
    torch.testing.assert_close(torch.load(out / "predictions.pt", weights_only=True), expected, **FP32)


def _resumed(tmp_path: Path, plan: Plan, *options: str) -> tuple[list[float], Path]:
    """Train 3 steps and save; resume from that checkpoint in a fresh Trainer for 2 more steps."""
    first, _ = run_script(tmp_path / "first", "--steps", "3", "--save", str(tmp_path / "three.ckpt"), *options,
                          plan=plan)
    second, _ = run_script(tmp_path / "second", "--resume", str(tmp_path / "three.ckpt"), *options, plan=plan)
    return first["losses"] + second["losses"], tmp_path / "second"


def test_zero3_resumes_from_a_sharded_checkpoint(tmp_path: Path) -> None:
    losses, out = _resumed(tmp_path, ZERO3)
    assert (tmp_path / "three.ckpt").is_dir()  # every rank wrote its shards
    assert_matches_single_process(losses, out)


def test_zero1_resumes_from_a_full_checkpoint(tmp_path: Path) -> None:
    losses, out = _resumed(tmp_path, ZERO1, "--full-checkpoint")
    saved = torch.load(tmp_path / "three.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["state"]  # ZeRO-1's shards consolidated into the file
    assert_matches_single_process(losses, out)


def test_auto_parallel_on_two_nodes_chooses_a_plan_from_a_training_batch(tmp_path: Path) -> None:
    """Two "nodes" of one process each (Lightning's NODE_RANK environment, as a cluster launcher
    sets it), no example_input_array: rank 0 profiles training_step on the first batch, the
    cross-entropy over a 32k vocabulary included; then a second Trainer fits a module whose
    training_step calls .item(): forward alone is profiled, the notes say why, a plan is chosen."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = [sys.executable, __file__, str(tmp_path), "--no-example", "--devices", "1", "--num-nodes", "2",
            "--vocab", str(VOCAB), "--then-item"]
    nodes = [subprocess.Popen(args, env={**env, "NODE_RANK": str(n)}, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in range(2)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(out[-3000:] + err[-4000:] for out, err in outputs)
    results = json.loads((tmp_path / "results.json").read_text())
    stdout = outputs[0][0]
    assert "on 2x1xcpu" in stdout  # the advisor saw two nodes of one rank
    assert f"auto-parallel: chose plan {results['plan']}" in stdout
    assert len(results["losses"]) == STEPS and all(map(torch.isfinite, torch.tensor(results["losses"])))
    hparams = next(tmp_path.glob("lightning_logs/*/hparams.yaml")).read_text()
    assert "plan/name" in hparams
    assert_profiled_the_loss(results)
    fallback = results["item"]
    assert f"auto-parallel: chose plan {fallback['plan']}" in stdout and len(fallback["losses"]) == STEPS
    assert any("ItemLlama.training_step could not run on fake tensors (DataDependentOutputException" in note
               for note in fallback["notes"])
    assert any("backward was seeded with the sum of the outputs" in note for note in fallback["notes"])
    assert fallback["head"]["bwd_largest_output_bytes"] < VOCAB_LOGITS


VOCAB = 32_000
VOCAB_LOGITS = BATCH * SEQ_LEN * VOCAB * 4  # one rank's logits in fp32


def assert_profiled_the_loss(results: dict[str, Any]) -> None:
    """The profile the plan was chosen from holds the cross-entropy: the fp32 log-probabilities
    it saves and the logits' gradient, which seeding backward with the sum of the logits lacks."""
    module = TinyLlama(vocab=VOCAB)
    module.configure_model()
    summed = profile_model(module, (dataset(1).tensors[0][:BATCH],), precision="fp32").head
    head = results["head"]
    assert not [note for note in results["notes"] if "fake tensors" in note or "sum of the outputs" in note]
    assert head["saved_bytes"] >= VOCAB_LOGITS > summed.saved_bytes
    assert head["bwd_largest_output_bytes"] >= VOCAB_LOGITS > summed.bwd_largest_output_bytes
    print(f"head saved {head['saved_bytes']:,} (summed: {summed.saved_bytes:,}) B, largest backward output "
          f"{head['bwd_largest_output_bytes']:,} (summed: {summed.bwd_largest_output_bytes:,}) B")


def test_meta_initialised_model_trains_in_bf16(tmp_path: Path) -> None:
    plan = Plan(**{**_PINNED, "dp_shard": 2, "zero": 3, "precision": "bf16-mixed"})
    results, _ = run_script(tmp_path, "--empty-init", plan=plan)
    assert all(map(torch.isfinite, torch.tensor(results["losses"])))
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    reference = TinyLlama()
    reference.configure_model()
    assert weights.keys() == reference.state_dict().keys()
    assert all(torch.isfinite(w).all() and w.abs().sum() > 0 for w in weights.values())


def test_a_meta_built_model_on_cpu_ranks_gets_a_whole_models_values(tmp_path: Path) -> None:
    """On a CPU mesh every rank draws DTensor's random values from its own generator: initialised
    after FSDP sharded it, each rank's shard of a weight got the same values (the halves of every
    weight equal under dp_shard=2). The strategy initialises such a model whole before sharding."""
    run_script(tmp_path, "--empty-init", "--steps", "0", plan=ZERO3)
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert_no_weight_repeats_its_half(weights)


class _Record(pl.Callback):
    """Collect the rank-averaged loss per step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        self.losses.append((metrics["loss"] if "loss" in metrics else metrics["train_loss"]).item())


def _trainer(args: argparse.Namespace, plan: Plan | None, record: _Record) -> pl.Trainer:
    """A Trainer on CPU ranks running ``plan`` (None: "auto-parallel" by name chooses one)."""
    strategy = "auto-parallel" if plan is None else AutoParallelStrategy(
        plan=plan, verbose=False, save_distributed_checkpoint=not args.full_checkpoint)
    precision = {"fp32": "32-true"}.get(plan.precision, plan.precision) if plan else "32-true"
    return pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                      max_steps=args.steps, limit_train_batches=args.accumulate, accumulate_grad_batches=args.accumulate,
                      max_epochs=-1, precision=precision, gradient_clip_val=args.clip,
                      gradient_clip_algorithm=args.clip_by,
                      callbacks=[record], logger=plan is None, default_root_dir=args.out, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def _advice(trainer: pl.Trainer) -> dict[str, Any]:
    """What rank 0's advice profiled in the head, and its notes (nothing where there is none)."""
    advice = trainer.strategy.advice
    if advice is None:
        return {}
    head = advice.profile.head
    return {"head": {"saved_bytes": head.saved_bytes, "bwd_largest_output_bytes": head.bwd_largest_output_bytes},
            "notes": list(advice.notes)}


def main() -> None:
    """Train TinyLlama on CPU ranks ("auto-parallel" by name when no plan file is given; the
    module-level import of stratagem.integrations.lightning registered it on every rank)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--plan")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--clip", type=float, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--clip-by", default="norm", help="Trainer(gradient_clip_algorithm=...)")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step (one epoch)")
    parser.add_argument("--save", type=Path, help="save a checkpoint here when training ends")
    parser.add_argument("--resume", type=Path, help="trainer.fit(ckpt_path=...)")
    parser.add_argument("--full-checkpoint", action="store_true")
    parser.add_argument("--validate", action="store_true", help="trainer.validate after fit")
    parser.add_argument("--test", action="store_true", help="trainer.test and trainer.predict after fit, "
                        "then trainer.predict on batches of the wrong size")
    parser.add_argument("--no-example", action="store_true", help="leave example_input_array unset")
    parser.add_argument("--empty-init", action="store_true", help="build the model on meta")
    parser.add_argument("--vocab", type=int, help="a vocabulary of this many tokens (llama-tiny's: 256)")
    parser.add_argument("--then-item", action="store_true", help="then fit an ItemLlama under a new Trainer")
    args = parser.parse_args()

    torch.set_num_threads(1)
    record = _Record()
    plan = None if args.plan is None else Plan.from_json(Path(args.plan).read_text())
    trainer = _trainer(args, plan, record)
    dp = plan.dp if plan else 2
    loader = DataLoader(dataset(dp), batch_size=BATCH)
    module = TinyLlama(example=not args.no_example, vocab=args.vocab)
    if args.empty_init:
        with trainer.init_module(empty_init=True):
            module.configure_model()
    trainer.fit(module, loader, ckpt_path=args.resume)
    results: dict[str, Any] = {"losses": record.losses, "plan": trainer.strategy.plan.name, **_advice(trainer),
                               "fused": [group["fused"] for optimizer in trainer.optimizers
                                         for group in optimizer.param_groups]}
    if args.then_item:
        record = _Record()
        item = _trainer(args, None, record)
        item.fit(ItemLlama(example=not args.no_example, vocab=args.vocab), loader)
        results["item"] = {"losses": record.losses, "plan": item.strategy.plan.name, **_advice(item)}
    if args.save:
        trainer.save_checkpoint(args.save)
    if args.validate:
        results["val_loss"] = trainer.validate(module, DataLoader(dataset(dp), batch_size=BATCH),
                                               verbose=False)[0]["val_loss"]
    if args.test:
        results["test_loss"] = trainer.test(module, DataLoader(dataset(dp), batch_size=BATCH),
                                            verbose=False)[0]["test_loss"]
        predictions = trainer.predict(module, DataLoader(dataset(dp), batch_size=BATCH))
        if trainer.is_global_zero:
            torch.save(torch.cat(predictions), args.out / "predictions.pt")
        try:
            trainer.predict(module, DataLoader(dataset(dp), batch_size=BATCH + 1))
        except UsageError as err:
            results["predict"] = str(err)
    # A collective gathering DTensor shards to rank 0; a pipeline rank holds its stage (TP shards gathered).
    if plan and plan.pp > 1:
        weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}
    else:
        weights = model_state_dict(module, full=True)
    every: list[dict[str, torch.Tensor]] = [{} for _ in range(trainer.world_size)]
    torch.distributed.all_gather_object(every, weights)
    weights = {name: tensor for part in every for name, tensor in part.items()}
    if trainer.is_global_zero:
        torch.save(weights, args.out / "weights.pt")
        (args.out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
