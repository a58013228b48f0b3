"""``Fabric(strategy="auto-parallel")`` on CPU ranks trains what one process trains.

Fabric's launcher re-runs the script for the other ranks, so the tests run this file as a
script (``python test_fabric.py OUT JOB ...``) in a subprocess: one launch trains every job, each
under its own Fabric (spawning costs seconds). Rank 0 writes each job's per-step losses
(``fabric.all_reduce``'d over ranks) and final weights (gathered whole). Data reach the ranks
through ``fabric.setup_dataloaders``, so through the strategy's ``distributed_sampler_kwargs``:
:func:`dataset` orders the samples so that the sampler hands data-parallel rank ``r`` the
``r``-th slice of each global batch, as the single-process reference in ``training.py`` takes
them (tensor-parallel ranks of one group read the same slice).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from lightning.fabric import Fabric
from test_data_parallel import CLIP, CLIP_VALUE, FP32, assert_matches_single_process
from test_tensor_parallel import TP_FP32, TWO_RANKS
from torch.utils.data import DataLoader, TensorDataset
from training import (OPTIMIZERS, SEED, SEQ_LEN, STEPS, Case, Run, assert_no_weight_repeats_its_half, global_batches,
                      initial_weights)

from stratagem.plan import Plan
from stratagem.integrations.fabric import AutoParallelFabricStrategy
from stratagem.plugins.state_dict import model_state_dict

BATCH = 2  # per data-parallel rank
_PINNED = {"micro_batch_size": BATCH, "precision": "fp32", "block_container": "layers"}
ZERO3 = Case("fabric_zero3", Plan(dp_shard=2, zero=3, **_PINNED))
ZERO1 = Case("fabric_zero1", Plan(dp_shard=2, zero=1, **_PINNED))
META_BF16 = Case("fabric_meta_bf16", Plan(dp_shard=2, zero=3, **{**_PINNED, "precision": "bf16-mixed"}))
TP = Case("fabric_tp", TWO_RANKS["tp"].plan, clip=CLIP)  # both ranks read every sample; clipped by fabric
TP_VALUE = Case("fabric_tp_value", TWO_RANKS["tp"].plan, clip=CLIP_VALUE, clip_by="value")


def dataset(case: Case) -> TensorDataset:
    """The STEPS global batches of ``case``, each reordered so that a non-shuffling
    ``DistributedSampler`` (rank ``r`` reads samples ``r, r + dp, …``) with ``batch_size=BATCH``
    gives data-parallel rank ``r`` the ``r``-th BATCH-sized slice of the global batch."""
    dp = case.plan.dp
    tokens, targets = [], []
    for (batch_tokens,), batch_targets in global_batches(case):
        tokens.append(batch_tokens.unflatten(0, (dp, BATCH)).transpose(0, 1).flatten(0, 1))
        targets.append(batch_targets.unflatten(0, (dp, BATCH)).transpose(0, 1).flatten(0, 1))
    return TensorDataset(torch.cat(tokens), torch.cat(targets))


def job(case: Case | None, *, steps: int = STEPS, save: Path | None = None, full: bool = False,
        resume: Path | None = None, empty_init: bool = False, loss_fn: bool = False) -> str:
    """One training job of the script: ``case``'s plan (``None``: ``Fabric(strategy="auto-parallel")``
    chooses one from the model's ``example_input_array``, or with ``loss_fn`` from
    ``AutoParallelFabricStrategy(example_inputs=..., loss_fn=...)``; data as for ZERO3), trained
    up to step ``steps``, then saved to ``save`` (sharded, or one file when ``full``); or resumed
    from ``resume`` (a model built from another seed, which the checkpoint must overwrite); with
    ``empty_init`` built on meta; its gradients clipped with ``fabric.clip_gradients`` where ``case``
    clips."""
    return json.dumps({"plan": case and case.plan.to_dict(), "steps": steps, "save": save and str(save),
                       "full": full, "resume": resume and str(resume), "empty_init": empty_init, "loss_fn": loss_fn,
                       "clip": case and case.clip, "clip_by": case and case.clip_by})


class Launch(NamedTuple):
    """What one run of the script left: rank 0's losses and weights per job, its stdout and folder."""

    runs: dict[str, Run]
    stdout: str
    out: Path


def run_script(out: Path, jobs: dict[str, str]) -> Launch:
    """Run this file as the training script: every job (by name) on the same two ranks, one
    Fabric each (one launch, one process group)."""
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, __file__, str(out), *jobs.values()]
    done = subprocess.run(args, capture_output=True, text=True, timeout=400, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    results = json.loads((out / "results.json").read_text())
    runs = [Run(r["losses"], torch.load(out / f"weights_{i}.pt", weights_only=True),
                facts={"plan": r["plan"], "head": r.get("head"), "foreach": r["foreach"],
                       "grad_norms": r["grad_norms"], "grad_clip": r.get("grad_clip")})
            for i, r in enumerate(results)]
    return Launch(dict(zip(jobs, runs, strict=True)), done.stdout, out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    out = tmp_path_factory.mktemp("fabric")
    return run_script(out, {
        "zero3": job(ZERO3, steps=3, save=out / "zero3"),
        "zero3_resumed": job(ZERO3, resume=out / "zero3"),
        "zero1": job(ZERO1, steps=3, save=out / "zero1.pt", full=True),
        "zero1_resumed": job(ZERO1, resume=out / "zero1.pt"),
        "tp": job(TP),
        "tp_value": job(TP_VALUE),
        "chosen": job(None),
        "chosen_with_loss": job(None, loss_fn=True),
        "meta": job(META_BF16, empty_init=True),
        "meta_start": job(ZERO3, empty_init=True, steps=0),
    })


def _resumed(launch: Launch, name: str) -> Run:
    """Job ``name``'s 3 steps, then its resumed job's 2 steps and final weights."""
    first, resumed = launch.runs[name], launch.runs[f"{name}_resumed"]
    assert resumed.facts["plan"] == first.facts["plan"]
    return Run(first.losses + resumed.losses, resumed.weights)


@pytest.mark.timeout(600)
def test_zero3_matches_single_process_across_a_sharded_checkpoint(two_ranks: Launch) -> None:
    assert (two_ranks.out / "zero3").is_dir()  # every rank wrote its shards
    assert_matches_single_process(ZERO3, _resumed(two_ranks, "zero3"), FP32)


@pytest.mark.timeout(600)
def test_zero1_matches_single_process_across_a_full_checkpoint(two_ranks: Launch) -> None:
    saved = torch.load(two_ranks.out / "zero1.pt", weights_only=False)
    assert saved["optimizer_states"][0]["state"]  # ZeRO-1's shards consolidated into the file
    assert_matches_single_process(ZERO1, _resumed(two_ranks, "zero1"), FP32)


@pytest.mark.timeout(600)
def test_tp_matches_single_process(two_ranks: Launch) -> None:
    assert_matches_single_process(TP, two_ranks.runs["tp"], TP_FP32)
    assert_matches_single_process(TP_VALUE, two_ranks.runs["tp_value"], TP_FP32)
    assert min(two_ranks.runs["tp"].facts["grad_norms"]) > CLIP  # clipped by fabric.clip_gradients at every step
    # the user's AdamW mixes the split Linears' DTensors with the plain norms: it steps them one at a time
    assert two_ranks.runs["tp"].facts["foreach"] == [False]
    assert two_ranks.runs["zero3"].facts["foreach"] == [None]  # FSDP's are all DTensors: torch's choice


@pytest.mark.timeout(600)
def test_auto_parallel_by_name_chooses_a_plan(two_ranks: Launch) -> None:
    chosen = two_ranks.runs["chosen"]
    assert f"auto-parallel: chose plan {chosen.facts['plan']}" in two_ranks.stdout
    assert len(chosen.losses) == STEPS and all(map(math.isfinite, chosen.losses))


@pytest.mark.timeout(600)
def test_the_loss_fn_given_is_profiled(two_ranks: Launch) -> None:
    """Rank 0's profile holds the loss: its backward writes the fp32 logits' gradient, where the
    sum of the outputs seeds a smaller one. The clipping the strategy was told of is priced."""
    logits = BATCH * SEQ_LEN * ZERO3.model.vocab_size * 4
    given, chosen = two_ranks.runs["chosen_with_loss"], two_ranks.runs["chosen"]
    assert given.facts["head"]["bwd_largest_output_bytes"] >= logits > chosen.facts["head"]["bwd_largest_output_bytes"]
    assert given.facts["head"]["saved_bytes"] > chosen.facts["head"]["saved_bytes"]
    assert len(given.losses) == STEPS and all(map(math.isfinite, given.losses))
    assert given.facts["grad_clip"] == "norm" and chosen.facts["grad_clip"] is None


@pytest.mark.timeout(600)
def test_meta_initialised_model_trains_in_bf16(two_ranks: Launch) -> None:
    meta = two_ranks.runs["meta"]
    assert all(map(math.isfinite, meta.losses))
    assert meta.weights.keys() == initial_weights(META_BF16).keys()
    assert all(torch.isfinite(w).all() and w.abs().sum() > 0 for w in meta.weights.values())


@pytest.mark.timeout(600)
def test_a_meta_built_model_on_cpu_ranks_gets_a_whole_models_values(two_ranks: Launch) -> None:
    """Initialised after FSDP sharded it on a CPU mesh, each rank's shard of a weight got the same
    values (every rank draws DTensor's random values from its own generator: the halves of every
    weight equal under dp_shard=2); the strategy initialises such a model whole first."""
    weights = two_ranks.runs["meta_start"].weights
    assert_no_weight_repeats_its_half(weights)


def train(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train llama-tiny as ``spec`` (from :func:`job`) says, under a new Fabric; returns the
    losses and plan name, and the full weights on rank 0."""
    pinned = spec["plan"] is not None
    case = Case("job", Plan.from_dict(spec["plan"])) if pinned else ZERO3
    strategy: Any = "auto-parallel"
    (tokens,), targets = case.model.make_batch(BATCH, SEQ_LEN)
    if pinned:
        strategy = AutoParallelFabricStrategy(plan=case.plan, verbose=False,
                                              save_distributed_checkpoint=not spec["full"])
    elif spec["loss_fn"]:
        strategy = AutoParallelFabricStrategy(example_inputs=tokens, loss_fn=lambda out: case.model.loss(out, targets),
                                              grad_clip="norm")
    precision = {"fp32": "32-true"}.get(case.plan.precision, case.plan.precision)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
    fabric.launch()  # the first job starts the other ranks and the process group; later ones reuse them
    torch.manual_seed(SEED + 1 if spec["resume"] else SEED)
    with fabric.init_module(empty_init=spec["empty_init"]):
        model = case.model.build()
    if not pinned:
        model.example_input_array = tokens
    cls, options = OPTIMIZERS[case.optimizer]
    model, optimizer = fabric.setup(model, cls(model.parameters(), **options))
    loader = fabric.setup_dataloaders(DataLoader(dataset(case), batch_size=BATCH))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if spec["resume"]:
        fabric.load(spec["resume"], state)
    losses, norms = [], []
    for step, (tokens, targets) in enumerate(loader):
        if not state["step"] <= step < spec["steps"]:
            continue
        loss = case.model.loss(model(tokens), targets)
        fabric.backward(loss)
        if spec["clip"] is not None and spec["clip_by"] == "value":
            fabric.clip_gradients(model, optimizer, clip_val=spec["clip"])
        elif spec["clip"] is not None:
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=spec["clip"]).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        state["step"] = step + 1
    if spec["save"]:
        fabric.save(spec["save"], state)
    result: dict[str, Any] = {"losses": losses, "plan": fabric.strategy.plan.name, "grad_norms": norms,
                              "foreach": [group["foreach"] for group in optimizer.param_groups]}
    if (advice := fabric.strategy.advice) is not None:
        result["head"] = {"saved_bytes": advice.profile.head.saved_bytes,
                          "bwd_largest_output_bytes": advice.profile.head.bwd_largest_output_bytes}
        result["grad_clip"] = advice.workload.grad_clip
    return result, model_state_dict(model.module, full=True)


def main() -> None:
    """Run the jobs given as JSON arguments on two CPU ranks; rank 0 writes the results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("jobs", nargs="+", type=json.loads)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for index, spec in enumerate(args.jobs):
        result, weights = train(spec)
        results.append(result)
        if torch.distributed.get_rank() == 0:
            torch.save(weights, args.out / f"weights_{index}.pt")
    if torch.distributed.get_rank() == 0:
        (args.out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
