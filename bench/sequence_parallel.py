"""What sequence parallelism changes on a TP rank, predicted against measured, on CPU ranks: its
peak memory and its step time.

Four gloo ranks train llama-small (fp32, AdamW, sequence 128, micro-batch 8) under ``tp4`` and under
``tp4+sp``, each in fresh processes as ``verify`` runs a plan, twice (the faster run kept).

Memory: the memory model alone predicts both (its tensors: no framework bytes, uncalibrated), and
the difference between the two plans is what SP saves: the peaks' shares that are not the plan's
tensors (the process beyond them) cancel in it. Korthikanti et al.'s eq. 4 splits every
activation of a block over the TP ranks; torch's SP all-gathers the column Linears' inputs and
autograd keeps them gathered for the weights' gradients, which the model counts
(``SegmentProfile.tp_gathered_bytes``; docs/cost-model.md, "Per block").

Time: the advisor prices both on this host as a calibration taken first measures it, and the
difference is what SP adds to a step: the norms' operators on DTensors
(``SegmentProfile.sp_norm_ops``), the collectives at the sequence-parallel region's edges and the
norms' gradients' all-reduce, less the residual stream's work that TP alone runs whole on every
rank (``tp_replicated_op_bytes``); docs/cost-model.md, "Sequence parallelism's own costs". First
it prints those two profiled figures of a block, as CPU ranks and as a GPU run it.

    .venv/bin/python bench/sequence_parallel.py     # about two minutes on 2 cores
"""

from __future__ import annotations

from stratagem.advisor.calibrate.run import calibrate
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.cost.memory import estimate_memory
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Plan, Workload
from stratagem.units import format_seconds
from stratagem.verify import verify_plan

MIB = 2**20
MODEL, SEQ_LEN, MICRO_BATCH, TP, ROUNDS = "llama-small", 128, 8, 4, 2


def main() -> None:
    for kernels in ("cpu", "gpu"):
        block = profile_spec(MODEL, seq_len=SEQ_LEN, precision="fp32", kernels=kernels).blocks[0]
        print(f"{MODEL} block, {kernels} kernels: {block.sp_norm_ops} operators in its sequence norms, "
              f"{block.tp_replicated_op_bytes / block.fwd_op_bytes:.0%} of its forward's bytes without FLOPs "
              "on the whole residual stream", flush=True)
    profile = profile_spec(MODEL, seq_len=SEQ_LEN, precision="fp32", kernels="cpu")
    workload = Workload(global_batch_size=MICRO_BATCH, seq_len=SEQ_LEN, precision="fp32", optimizer="adamw")
    cluster = calibrate(nproc=TP).apply(parse_cluster(f"{TP}xcpu"))
    plans = [Plan(tp=TP, sequence_parallel=sp, micro_batch_size=MICRO_BATCH, precision="fp32",
                  tp_layout=profile.tp_layout, block_container=profile.block_container) for sp in (False, True)]
    runs = {plan.name: [verify_plan(MODEL, plan, seq_len=SEQ_LEN, optimizer="adamw", steps=3)
                        for _ in range(ROUNDS)] for plan in plans}
    figures = []
    for plan in plans:
        memory = estimate_memory(profile, workload, plan)
        time = evaluate(profile, cluster, workload, plan).time
        fastest = min(runs[plan.name], key=lambda run: run.step_seconds)
        peak = min(run.peak_bytes for run in runs[plan.name])
        figures.append((memory.total, peak, time.step_seconds, fastest.step_seconds))
        print(f"{MODEL} {plan.name:<10} memory predicted {memory.total / MIB:6.1f} MiB (activations "
              f"{memory.activations / MIB:5.1f}), measured {peak / MIB:6.1f} MiB · step predicted "
              f"{format_seconds(time.step_seconds)} (TP collectives {format_seconds(time.tp_comm)}, host "
              f"{format_seconds(time.dispatch)}), measured {format_seconds(fastest.step_seconds)}", flush=True)
    (tp_mem, tp_peak, tp_step, tp_took), (sp_mem, sp_peak, sp_step, sp_took) = figures
    print(f"SP saves of the peak: predicted {(tp_mem - sp_mem) / MIB:.1f} MiB, "
          f"measured {(tp_peak - sp_peak) / MIB:.1f} MiB")
    print(f"SP adds to the step: predicted {format_seconds(sp_step - tp_step)}, "
          f"measured {format_seconds(sp_took - tp_took)}")


if __name__ == "__main__":
    main()
