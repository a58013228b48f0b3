"""The advisor's predictions for the GPU runs measured so far: uncalibrated (catalog figures), and
calibrated where the run's machine left its calibration file in ``bench/calibrations/``.

Each case is a plan someone ran on a GPU, with what they measured: step time and peak memory
(CUDA's max allocated). This script only predicts, on the CPU, so the table can be rebuilt after
every change to the cost model; the measurements stay as they were recorded (card, software and
date in ``SOURCE``), as do the calibrations (``stratagem calibrate`` on that machine).

    .venv/bin/python bench/gpu_predictions.py
"""

from __future__ import annotations

import importlib.metadata
import json
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

from stratagem.advisor.calibrate.calibration import Calibration
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.cost.optimizer import uncalibrated_host_step
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.advisor.profile.profiler import profile_model
from stratagem.plan import Workload
from stratagem.units import format_bytes, format_seconds

from plans import given_plan  # bench/plans.py

GIB = 2**30

SOURCE = {
    "H100": "one H100 80GB, bf16 autocast, AdamW (the runs that opened the accuracy work, 2026-11)",
    "H200": "one H200, torch 2.11, CUDA 13, bench/gpu_check.sh (2026-11-26)",
    "H100b": "one H100 80GB HBM3, torch 2.11, CUDA 13, bench/gpu_check.sh at fcd334a, models never tuned on "
             "(2026-11-26)",
    "H100c": "one H100 80GB HBM3, torch 2.11, CUDA 13, bench/gpu_check.sh at 9e3b6fa, calibration with attention "
             "(2026-11-27)",
    "H200b": "one H200, torch 2.11, CUDA 13, bench/gpu_check.sh table at ffbe4d4, models never tuned on; its "
             "calibration (format 8) read without its host optimizer figure, timed over tensors the host's cache "
             "held (2026-11-28)",
    "H200c": "one H200, torch 2.11, CUDA 13, transformers 4.x, bench/gpu_check.sh table at d2ccb8a, models never "
             "tuned on; its calibration (format 9) read without its host optimizer figure, timed on the GPU "
             "(2026-11-28)",
}


FOR_LOOP_HOST_STEP = frozenset({"H100", "H200", "H100b", "H100c", "H200b", "H200c"})
"""The cards whose offloaded runs stepped the host's optimizer one tensor at a time (torch's
default on CPU tensors): every run before the plugins built it fused (plugins/host_optimizer.py,
0a02fe6), which the cost model prices now. Their offloaded runs are left out, and a line says so;
a card added since ran the fused step and counts."""


class Case(NamedTuple):
    card: str  # a key of SOURCE
    model: str
    batch: int
    seq_len: int | None
    plan: dict
    seconds: float  # measured step time
    peak_gib: float  # measured peak allocated
    precision: str = "bf16-mixed"
    transformers: str = ""  # the major version an hf: run builds a different model on otherwise


PYTHIA = "hf:bench/configs/pythia-410m"
BLOOM = "hf:bench/configs/bloom-560m"
OPT = "hf:bench/configs/opt-1.3b"
GEMMA2 = "hf:bench/configs/gemma-2-2b"

GPU_CHECK = (("gpt2-large", 8, 1024, {}), ("gpt2-large", 8, 1024, {"zero": 3, "offload": "params"}),
             (PYTHIA, 8, 1024, {}), (PYTHIA, 8, 1024, {"zero": 3, "offload": "params"}), ("vit-l-16", 64, None, {}))
"""The runs ``bench/gpu_check.sh`` makes of the models it verifies with two plans each, compiled
(model, batch, sequence, plan beyond the micro-batch and compilation)."""


def gpu_check_runs(card: str, *measured: tuple[float, float]) -> tuple[Case, ...]:
    """:data:`GPU_CHECK`'s runs on ``card`` with what each measured: (step seconds, peak GiB)."""
    return tuple(Case(card, model, batch, seq_len, {"micro_batch_size": batch, **plan, "compile": True}, *run)
                 for (model, batch, seq_len, plan), run in zip(GPU_CHECK, measured, strict=True))


CASES = (
    Case("H100", "gpt2-medium", 8, 1024, {"micro_batch_size": 8}, 0.0939, 16.9),
    Case("H100", "gpt2-medium", 8, 1024, {"micro_batch_size": 8, "compile": True}, 0.0846, float("nan")),
    Case("H100", "gpt2-medium", 8, 1024, {"micro_batch_size": 8, "zero": 3, "offload": "params"}, 0.880, 10.7),
    Case("H100", "gpt2-xl", 4, 1024, {"micro_batch_size": 4}, 0.1848, float("nan")),
    Case("H100", "gpt2-xl", 4, 1024, {"micro_batch_size": 4, "compile": True}, 0.1786, float("nan")),
    Case("H100", "vit-b-16", 128, None, {"micro_batch_size": 128}, 0.0562, float("nan")),
    Case("H100", "vit-b-16", 128, None, {"micro_batch_size": 128, "compile": True}, 0.0429, float("nan")),
    Case("H100", "llama-2-7b", 8, 1024, {"micro_batch_size": 8, "zero": 3, "offload": "params"}, 11.1, 40.7),
    Case("H100", "resnet-50", 256, None, {"micro_batch_size": 256}, 0.116, 10.9),
    Case("H100", "qwen2-0.5b-shape", 4, 1024, {"micro_batch_size": 4}, 0.383, 30.1, "fp32"),
    Case("H200", "llama-2-7b", 4, 2048, {"micro_batch_size": 1, "grad_accum": 4}, 1.02, 125.6),
    Case("H200", "gpt2", 16, 1024, {"micro_batch_size": 16}, 0.0797, 16.6),
    Case("H200", "gpt2", 16, 1024, {"micro_batch_size": 16, "zero": 3, "offload": "params"}, 0.300, 13.8),
    Case("H200", "vit-b-16", 128, None, {"micro_batch_size": 128}, 0.0508, 10.3),
    Case("H200", "vit-b-16", 128, None, {"micro_batch_size": 128, "zero": 3, "offload": "params"}, 0.2275, 7.4),
    *gpu_check_runs("H100b", (0.152, 26.9), (1.41, 16.0), (0.0671, 17.0), (0.872, 11.5), (0.0738, 14.1)),
    Case("H100b", "resnet-101", 128, None, {"micro_batch_size": 128, "compile": True}, 0.0751, 9.5),
    *gpu_check_runs("H100c", (0.154, 26.9), (1.40, 16.0), (0.0720, 17.0), (0.753, 11.5), (0.0710, 14.1)),
    Case("H100c", "trainer:llama-1b", 4, 1024, {"micro_batch_size": 4, "compile": True}, 0.0993, 25.0),
    Case("H200b", BLOOM, 8, 1024, {"micro_batch_size": 8, "compile": True}, 0.131, 48.8),
    Case("H200b", BLOOM, 8, 1024, {"micro_batch_size": 8, "zero": 3, "offload": "params", "compile": True}, 1.13, 41.1),
    Case("H200b", "resnet-101", 128, None, {"micro_batch_size": 128}, 0.0821, 8.4),
    Case("H200b", "trainer:bench/configs/qwen2.5-1.5b/config.json", 4, 1024, {"micro_batch_size": 4, "compile": True},
         0.132, 40.0),
    Case("H200c", OPT, 8, 1024, {"micro_batch_size": 8, "compile": True}, 0.158, 32.4),
    Case("H200c", OPT, 8, 1024, {"micro_batch_size": 8, "zero": 3, "offload": "params", "compile": True}, 2.64, 14.5),
    Case("H200c", BLOOM, 8, 1024, {"micro_batch_size": 8, "compile": True}, 0.130, 48.8),
    Case("H200c", BLOOM, 8, 1024, {"micro_batch_size": 8, "zero": 3, "offload": "params", "compile": True}, 1.07, 41.1),
    Case("H200c", "resnet-101", 128, None, {"micro_batch_size": 128}, 0.0833, 8.4),
    Case("H200c", GEMMA2, 8, 1024, {"micro_batch_size": 8}, 0.448, 98.0, transformers="4"),
    Case("H200c", "trainer:bench/configs/qwen2.5-1.5b/config.json", 4, 1024, {"micro_batch_size": 4, "compile": True},
         0.131, 40.0),
)
"""Measured runs (step time, peak memory; nan where the run did not record it). Where a run's
step times ranged (GPT-2 and ViT offloaded on the H200: 249-352 and 220-235 ms), the middle. The
Qwen2's run recorded no precision: fp32 is inferred (the Trainer's default, and the step time
its prediction then gave, 315 ms, is an fp32 step's; bf16 would take about a quarter of it);
its training_step was not recorded either (``bench/trainer_hf.py`` runs one that is). The
TinyLlama-shaped run of the H100c set and the Qwen2.5-1.5B-shaped one of the H200b set ran through
``bench/trainer_hf.py`` (``trainer:SHAPE`` or ``trainer:CONFIG``: its
``training_step`` profiled, the model called with its key/value cache, as the Lightning strategy
profiles it); the H100b set's is left out (dynamo left 14 of its 22 compiled layers eager). The
H100c set's ResNet-101 did not finish compiling within its limit. A Hugging Face model's profile
follows the transformers installed where this runs: the H200c set's Gemma-2-2B ran on 4.x, whose
Gemma 2 takes SDPA (its soft-capping dropped), as a transformers 4.57.1 put first on ``PYTHONPATH``
reproduces; 5.x runs it eager, the scores written out (predicted at 521 ms and 111.9 GiB, not
measured: ``bench/configs/gemma-2-2b-eager`` asks for that on either)."""

ATTENTION_CORES = (("H100b", "gpt2-large", 8, 1024, 9.4e-3), ("H100b", "vit-l-16", 64, None, 5.3e-3),
                   ("H200", "vit-b-16", 128, None, 4.7e-3), ("H100c", "gpt2-large", 8, 1024, 9.4e-3),
                   ("H100c", "vit-l-16", 64, None, 6.3e-3))
"""Device time a step's attention kernels took, forward and backward: ``bench/gpu_kernels.py``'s
attention family on the H100 runs' compiled steps (H100c: GPT-2 large's first profiled run,
ViT-L's only one), ``bench/gpu_phases.py``'s on the H200's eager one (docs/benchmarks.md)."""

CLUSTERS = {"H100": "1xH100-SXM-80GB", "H200": "1xH200", "H100b": "1xH100-SXM-80GB", "H100c": "1xH100-SXM-80GB",
            "H200b": "1xH200", "H200c": "1xH200"}

CALIBRATIONS = {"H100b": Path(__file__).parent / "calibrations" / "h100-sxm5-80gb-2026-11-26.json",
                "H100c": Path(__file__).parent / "calibrations" / "h100-sxm5-80gb-2026-11-27.json",
                "H200b": Path(__file__).parent / "calibrations" / "h200-sxm-141gb-2026-11-28.json",
                "H200c": Path(__file__).parent / "calibrations" / "h200-sxm-141gb-2026-11-28b.json"}
"""The calibration file the card's machine wrote before its runs (``bench/gpu_check.sh``)."""

HF_CONFIGS = {"qwen2-0.5b-shape": {
    "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 4096,
    "tie_word_embeddings": True}}
"""Models given as Hugging Face configs (the Qwen2 ran through Trainer(strategy="auto-parallel") with
cross-entropy in training_step, as ``bench/trainer_hf.py`` does; here its own loss, the same one)."""


def model_spec(name: str, folder: Path) -> str:
    """A preset's name, or ``hf:`` a config written into ``folder``."""
    if name not in HF_CONFIGS:
        return name
    path = folder / f"{name}.json"
    path.write_text(json.dumps(HF_CONFIGS[name]))
    return f"hf:{path}"


@cache
def trainer_profile(shape: str, batch: int, seq_len: int, precision: str) -> ModelProfile:
    """The profile of ``bench/trainer_hf.py``'s ``CausalLM`` of ``shape`` (one of its shapes, or a
    config.json's path; built on meta) through its ``training_step`` on a batch of random tokens, as
    the Lightning strategy takes it."""
    from trainer_hf import SHAPES, CausalLM  # bench/trainer_hf.py, beside this script

    config = SHAPES[shape] if shape in SHAPES else json.loads(Path(shape).read_text())
    with torch.device("meta"):
        module = CausalLM(config, batch, seq_len)
    tokens = torch.randint(0, module.vocab, (batch, seq_len))
    return profile_model(module, ((tokens,),), step_fn=lambda m, b: m.training_step(b, 0), precision=precision,
                         batch_size=batch, seq_len=seq_len)


def predict(case: Case, folder: Path, *, calibrated: bool = False) -> tuple[float, float, str]:
    """Predicted step seconds, peak bytes and the plan's name: from catalog figures, or with the
    card's calibration applied (``calibrated``)."""
    cluster = parse_cluster(CLUSTERS[case.card])
    if calibrated:
        cluster = Calibration.load(CALIBRATIONS[case.card]).apply(cluster)
    workload = Workload(global_batch_size=case.batch, seq_len=case.seq_len, precision=case.precision)
    trainer = case.model.startswith("trainer:")
    profile = (trainer_profile(case.model.removeprefix("trainer:"), case.batch, case.seq_len, case.precision)
               if trainer else profile_spec(model_spec(case.model, folder), seq_len=case.seq_len,
                                            precision=case.precision))
    estimate = evaluate(profile, cluster, workload, given_plan(case.plan, profile, cluster, workload))
    return estimate.time.step_seconds, estimate.memory.total, estimate.plan.name


def host_step_as_sum(case: Case, folder: Path) -> float:
    """The uncalibrated predicted step of an offloaded ``case`` were its host optimizer step the
    sum of :func:`~stratagem.advisor.cost.optimizer.uncalibrated_host_step`'s streaming and
    launching, where the model takes the longer of the two."""
    cluster = parse_cluster(CLUSTERS[case.card])
    workload = Workload(global_batch_size=case.batch, seq_len=case.seq_len, precision=case.precision)
    profile = profile_spec(model_spec(case.model, folder), seq_len=case.seq_len, precision=case.precision)
    plan = given_plan(case.plan, profile, cluster, workload)
    time = evaluate(profile, cluster, workload, plan).time
    return time.step_seconds - time.optimizer + sum(uncalibrated_host_step(
        rank_step(profile, cluster=cluster, workload=workload, plan=plan)))


def attention_seconds(card: str, model: str, batch: int, seq_len: int | None, *, calibrated: bool = False) -> float:
    """The prediction of one step's fused attention, forward and backward, with the whole batch in
    one micro-batch (``advisor/cost/attention.py``): uncalibrated by the tile model, calibrated at
    the card's measured rates (0 where its calibration keeps attention among the GEMMs)."""
    workload = Workload(global_batch_size=batch, seq_len=seq_len)
    profile, cluster = profile_spec(model, seq_len=seq_len), parse_cluster(CLUSTERS[card])
    if calibrated:
        cluster = Calibration.load(CALIBRATIONS[card]).apply(cluster)
    plan = given_plan({"micro_batch_size": batch}, profile, cluster, workload)
    step = rank_step(profile, cluster=cluster, workload=workload, plan=plan)
    return sum(step.attention[False].seconds.values()) if step.attention else 0.0


def _error(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+6.0%}" if measured == measured else "     -"


def main() -> None:
    started = time.perf_counter()
    print(f"{'card':<5} {'model':<16} {'plan':<36} {'step pred.':>10} {'measured':>9} {'error':>6}  "
          f"{'memory pred.':>12} {'measured':>9} {'error':>6}  {'calibrated: step':>16} {'memory':>6}")
    folder = Path(tempfile.mkdtemp())
    errors, calibrated_errors = [], []
    installed = importlib.metadata.version("transformers").split(".")[0]
    for case in CASES:
        if case.transformers and case.transformers != installed:
            print(f"{case.card:<5} {case.model.removeprefix('hf:bench/configs/'):<16} left out: it ran on "
                  f"transformers {case.transformers}.x, which builds it otherwise than the {installed}.x installed")
            continue
        if case.plan.get("offload") and case.card in FOR_LOOP_HOST_STEP:
            print(f"{case.card:<5} {case.model.removeprefix('hf:bench/configs/'):<16} left out: offloaded, its host "
                  f"optimizer stepped one tensor at a time ({format_seconds(case.seconds)} a step), now fused")
            continue
        seconds, peak, name = predict(case, folder)
        errors.append(abs(seconds / case.seconds - 1))
        measured_peak = f"{case.peak_gib:.1f} GiB" if case.peak_gib == case.peak_gib else "-"
        calibrated = ""
        if case.card in CALIBRATIONS:
            step, memory, _ = predict(case, folder, calibrated=True)
            calibrated_errors.append(abs(step / case.seconds - 1))
            calibrated = f"  {_error(step, case.seconds):>16} {_error(memory, case.peak_gib * GIB):>6}"
        print(f"{case.card:<5} {case.model.removeprefix('hf:bench/configs/'):<16} {name:<36} "
              f"{format_seconds(seconds):>10} {format_seconds(case.seconds):>9} {_error(seconds, case.seconds)}  "
              f"{format_bytes(peak):>12} {measured_peak:>9} {_error(peak, case.peak_gib * GIB)}{calibrated}")
    print(f"mean |step error| uncalibrated over the {len(errors)} runs: {sum(errors) / len(errors):.1%}; "
          f"calibrated over the {len(calibrated_errors)} with a stored calibration: "
          f"{sum(calibrated_errors) / len(calibrated_errors):.1%}")
    for case in (c for c in CASES if c.plan.get("offload") and c.card not in FOR_LOOP_HOST_STEP):
        summed = host_step_as_sum(case, folder)
        print(f"{case.card:<5} {case.model.removeprefix('hf:bench/configs/'):<16} offloaded, the host's streaming and "
              f"launches summed: {format_seconds(summed)} {_error(summed, case.seconds).strip()}")
    for card, model, batch, seq_len, measured in ATTENTION_CORES:
        predicted = attention_seconds(card, model, batch, seq_len)
        line = (f"{card:<5} {model:<16} attention core {format_seconds(measured)} measured; uncalibrated tile "
                f"model {format_seconds(predicted)} {_error(predicted, measured).strip()}")
        if card in CALIBRATIONS and (curve := attention_seconds(card, model, batch, seq_len, calibrated=True)):
            line += f"; calibrated curve {format_seconds(curve)} {_error(curve, measured).strip()}"
        print(line)
    for card, source in SOURCE.items():
        print(f"{card}: {source}")
    print(f"uncalibrated: catalog figures and the GEMM shape model; calibrated: the card's stored "
          f"calibration; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
