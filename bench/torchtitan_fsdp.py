"""torchtitan's FSDP2 runs, a public target the cost model was never tuned on: the advisor's
tokens per second per GPU against those torchtitan published for Llama 2 and Llama 3 trained with
FSDP2 on 64 A100 80GB GPUs (torchtitan, docs/performance.md, 2024: one table per model family).

    .venv/bin/python bench/torchtitan_fsdp.py

Each row is the Hugging Face Llama of the row's shape (``bench/configs/llama-3.1-8b``,
``llama-2-13b``, ...), whose eager operators are those torchtitan's Llama ran: RMSNorm in fp32 over
several operators (the presets run ``F.rms_norm``, one fused operator), SwiGLU, SDPA, a rotary
embedding of a few element-wise operators. Profiled on fake tensors at the row's sequence length,
costed under the row's plan: FSDP over all 64 GPUs (ZeRO-3),
the row's local batch in one micro-batch, the row's activation checkpointing (torchtitan's
op-level policy is ``selective-op``; its layer-level one, every other block checkpointed, has no
counterpart and its rows are left out), bf16 autocast, AdamW, eager (torch.compile was off in those
runs). The published table names no interconnect: the cluster is eight DGX-style nodes with eight
200 Gb/s InfiniBand NICs each, and the rows do not depend on it (a plan's exposed gradient and
parameter traffic is under 1 % of its step; the script prints it).

The table also says which runs ran out of memory (Llama 2 70B at local batch 2 with either selective
policy); the op-level one is a row here with no throughput. Each row's predicted peak is set
against what the advisor lets a plan use of an A100's 80 GiB (``usable_bytes``) and against the
whole device: a run that ran should fit, an out-of-memory one should not.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.cost.memory import usable_bytes
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Workload

from plans import given_plan  # bench/plans.py

GPUS = 64
CLUSTER = "8x8xA100-SXM4-80GB:ib-hdr"


class Row(NamedTuple):
    """One published run: the model (a Hugging Face config), tokens per sequence, sequences per
    GPU per step, the activation checkpointing, and the tokens per second per GPU torchtitan
    measured."""

    model: str
    seq_len: int
    local_batch: int
    checkpointing: str
    tokens_per_second: float | None  # None: the run ran out of memory


OOM = None


ROWS = (
    Row("hf:bench/configs/llama-3.1-8b", 8192, 1, "selective-op", 2973),  # Llama 3 8B's shape
    Row("hf:bench/configs/llama-3-70b", 8192, 1, "full", 331),
    Row("hf:bench/configs/llama-2-13b", 4096, 2, "none", 2162),
    Row("hf:bench/configs/llama-2-13b", 4096, 2, "selective-op", 1904),
    Row("hf:bench/configs/llama-2-70b", 4096, 2, "selective-op", OOM),
    Row("hf:bench/configs/llama-2-70b", 4096, 1, "selective-op", 355),
    Row("hf:bench/configs/llama-2-70b", 4096, 2, "full", 353),
)


def predict(row: Row) -> tuple[float, str, float, float]:
    """The row's predicted tokens per second per GPU, its plan's name, the share of its step the
    exposed data-parallel traffic takes, and its peak memory per GPU in GiB."""
    cluster = parse_cluster(CLUSTER)
    profile = profile_spec(row.model, seq_len=row.seq_len, precision="bf16-mixed")
    workload = Workload(global_batch_size=GPUS * row.local_batch, seq_len=row.seq_len, precision="bf16-mixed")
    given = {"dp_shard": GPUS, "zero": 3, "micro_batch_size": row.local_batch,
             "activation_checkpointing": row.checkpointing}
    estimate = evaluate(profile, cluster, workload,
                        given_plan(given, profile, cluster, workload))
    step = estimate.time.step_seconds
    return (row.local_batch * row.seq_len / step, estimate.plan.name, estimate.time.dp_comm / step,
            estimate.memory.total / 2**30)


def main() -> None:
    started = time.perf_counter()
    print(f"{'model':<28} {'seq':>5} {'batch':>5} {'checkpointing':<13} {'published':>9} {'predicted':>9} {'error':>6}"
          f"  {'dp exposed':>10} {'memory':>9}  plan")
    errors = []
    device = parse_cluster(CLUSTER).device.memory_bytes / 2**30  # GiB, as predict's memory
    usable = usable_bytes(parse_cluster(CLUSTER).device.memory_bytes) / 2**30
    outcomes = {"usable": 0, "device": 0}
    for row in ROWS:
        tokens, name, exposed, memory = predict(row)
        ran = row.tokens_per_second is not OOM
        outcomes["usable"] += (memory <= usable) == ran
        outcomes["device"] += (memory <= device) == ran
        published, error = "OOM", ""
        if ran:
            errors.append(tokens / row.tokens_per_second - 1)
            published, error = f"{row.tokens_per_second:.0f}", f"{errors[-1]:+.0%}"
        print(f"{row.model:<28} {row.seq_len:>5} {row.local_batch:>5} {row.checkpointing:<13} "
              f"{published:>9} {tokens:>9.0f} {error:>6}  {exposed:>10.1%} {memory:>5.1f} GiB  {name}")
    print(f"tokens/s per GPU on {CLUSTER}: mean |error| {sum(map(abs, errors)) / len(errors):.1%}, worst "
          f"{max(errors, key=abs):+.0%}, mean {sum(errors) / len(errors):+.1%} over {len(errors)} rows; "
          f"{time.perf_counter() - started:.0f} s")
    print(f"ran or out of memory, as published: {outcomes['usable']} of {len(ROWS)} rows predicted so against the "
          f"{usable:.1f} GiB a plan may use, {outcomes['device']} of {len(ROWS)} against the device's {device:.0f} GiB")


if __name__ == "__main__":
    main()
