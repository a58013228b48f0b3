"""What sequence parallelism saves of a TP rank's memory, predicted against measured, on CPU ranks.

Four gloo ranks train llama-small (fp32, AdamW, sequence 128, micro-batch 8) under ``tp4`` and under
``tp4+sp``, each in fresh processes as ``verify`` runs a plan, and the memory model predicts both
(its tensors: no framework bytes, uncalibrated). The difference between the two plans is what SP
saves: the peaks' shares that are not the plan's tensors (the process beyond them) cancel in it. Korthikanti et
al.'s eq. 4 splits every activation of a block over the TP ranks; torch's SP all-gathers the
column Linears' inputs and autograd keeps them gathered for the weights' gradients, which the
model counts (``SegmentProfile.tp_gathered_bytes``; docs/cost-model.md, "Per block").

    .venv/bin/python bench/sequence_parallel_memory.py     # about half a minute on 2 cores
"""

from __future__ import annotations

from stratagem.advisor.cost.memory import estimate_memory
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Plan, Workload
from stratagem.verify import verify_plan

MIB = 2**20
MODEL, SEQ_LEN, MICRO_BATCH, TP = "llama-small", 128, 8, 4


def main() -> None:
    profile = profile_spec(MODEL, seq_len=SEQ_LEN, precision="fp32", kernels="cpu")
    workload = Workload(global_batch_size=MICRO_BATCH, optimizer="adamw")
    peaks = {}
    for sp in (False, True):
        plan = Plan(tp=TP, sequence_parallel=sp, micro_batch_size=MICRO_BATCH, precision="fp32",
                    tp_layout=profile.tp_layout, block_container=profile.block_container)
        predicted = estimate_memory(profile, workload, plan)
        measured = verify_plan(MODEL, plan, seq_len=SEQ_LEN, optimizer="adamw", steps=1).peak_bytes
        peaks[sp] = predicted.total, measured
        print(f"{MODEL} {plan.name:<12} predicted {predicted.total / MIB:6.1f} MiB "
              f"(activations {predicted.activations / MIB:5.1f}), measured {measured / MIB:6.1f} MiB", flush=True)
    saved = [peaks[False][i] - peaks[True][i] for i in range(2)]
    print(f"SP saves: predicted {saved[0] / MIB:.1f} MiB, measured {saved[1] / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
