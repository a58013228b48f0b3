"""torchtitan's compiled and eager runs of Llama 3.1 8B on H100s, a public target the compile
model was never tuned on: the speed-up and the memory compiling each block brings, predicted
against what torchtitan published (torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md``,
December 2024, Tables 1 and 3: FSDP on 8 and on 128 GPUs, local batch 2 × 8,192 tokens,
op-level selective activation checkpointing, AdamW; eager, then with ``torch.compile``).

    .venv/bin/python bench/torchtitan_compile.py

The model is the Hugging Face Llama of Llama 3.1 8B's shape (``bench/configs/llama-3.1-8b``),
whose eager operators are those torchtitan's model runs: RMSNorm in fp32 (torchtitan's ``RMSNorm``
casts its input up, normalises, casts back), SwiGLU, SDPA, a rotary embedding of a few
element-wise operators (torchtitan's multiplies complex numbers in fp32; Hugging Face's rotates
halves in bf16: about the same bytes). The presets' own rotary embedding moves more (eight fp32
operators), so it is not the model here.

Ratios only. torchtitan's cards were H100s with 96 GB of HBM2e (2.4 TB/s) at a 500 W power
limit, "between SXM and NVL" in peak FLOP/s by their own account, a card the catalog does not
hold; the step is costed on the catalog's H100 SXM5 80GB and only its compiled-over-eager ratio
is compared. The memory column is torchtitan's peak reserved (the allocator's segments); the
model predicts allocated bytes, so it is printed beside, not scored.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Workload

from plans import given_plan  # bench/plans.py

MODEL, SEQ_LEN, LOCAL_BATCH = "hf:bench/configs/llama-3.1-8b", 8192, 2


class Row(NamedTuple):
    """One published pair: GPUs, tokens per second per GPU eager and compiled, and peak reserved
    GiB eager and compiled."""

    gpus: int
    eager: float
    compiled: float
    eager_gib: float
    compiled_gib: float


ROWS = (Row(8, 5762, 6667, 82.4, 77.0), Row(128, 5605, 6514, 67.0, 62.0))


def predict(gpus: int, compiled: bool) -> tuple[float, float]:
    """Tokens per second per GPU and peak allocated GiB per GPU, FSDP over ``gpus`` H100s."""
    nodes = gpus // 8
    cluster = parse_cluster(f"{nodes}x8xH100-SXM-80GB:ib-ndr" if nodes > 1 else "8xH100-SXM-80GB")
    profile = profile_spec(MODEL, seq_len=SEQ_LEN, precision="bf16-mixed")
    workload = Workload(global_batch_size=gpus * LOCAL_BATCH, seq_len=SEQ_LEN, precision="bf16-mixed")
    plan = given_plan({"dp_shard": gpus, "zero": 3, "micro_batch_size": LOCAL_BATCH,
                       "activation_checkpointing": "selective-op", "compile": compiled}, profile, cluster, workload)
    estimate = evaluate(profile, cluster, workload, plan)
    return LOCAL_BATCH * SEQ_LEN / estimate.time.step_seconds, estimate.memory.total / 2**30


def main() -> None:
    started = time.perf_counter()
    print(f"{'GPUs':>5} {'published':>22} {'predicted (H100 SXM5)':>24} {'speed-up':>17} {'error':>6}"
          f"  {'GiB reserved':>13} {'GiB allocated':>14}")
    errors = []
    for row in ROWS:
        (eager, eager_gib), (compiled, compiled_gib) = (predict(row.gpus, c) for c in (False, True))
        published, predicted = row.compiled / row.eager, compiled / eager
        errors.append(predicted / published - 1)
        print(f"{row.gpus:>5} {row.eager:>10,.0f} → {row.compiled:>7,.0f} {eager:>12,.0f} → {compiled:>7,.0f} "
              f"{published:>7.3f} {predicted:>7.3f}   {errors[-1]:>+5.1%}  {row.eager_gib:>5.1f} → {row.compiled_gib:>4.1f}"
              f"  {eager_gib:>5.1f} → {compiled_gib:>4.1f}")
    print(f"compiled over eager (tokens/s per GPU): mean |error| {sum(map(abs, errors)) / len(errors):.1%} over "
          f"{len(errors)} pairs; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
