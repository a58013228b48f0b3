"""Where a CPU rank's memory peaks while ``verify`` measures a plan, and how much of it is tensors.

For each plan, its ranks run ``stratagem.verify.runner.measure_plan`` on gloo twice. The first run
measures as ``verify`` does (the resident set's peak above the baseline), while a thread on rank 0
samples the anonymous resident set and, at each new high, the main thread's Python frames: the
innermost few of torch's distributed code say in which collective the peak fell (function names
only: formatting source lines would read files into memory that the measure would count). After
each warm-up step the measure spans it prints how far the anonymous resident set stands above the built model's,
less the optimizer's states (the tensors a step leaves beside the parameters). The
second run puts rank 0 under torch's ``MemTracker``, whose peak counts the tensors alone: what the
memory model prices, less the framework bytes. The difference is the process's own.

    .venv/bin/python bench/cpu_rank_memory.py        # about a minute on 2 cores
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from stratagem.advisor.profile.cache import profile_spec
from stratagem.distributed import host_store, join_group
from stratagem.plan import Plan
from stratagem.verify import runner
from stratagem.verify.models import real_model

MIB = 2**20
MODEL, SEQ_LEN = "llama-small", 128


def _anonymous() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _where(frame) -> str:
    """The innermost frames of torch.distributed's code on the stack, by name (and an FSDP unit's)."""
    names = []
    while frame is not None and len(names) < 6:
        if "torch/distributed" in frame.f_code.co_filename:
            unit = getattr(frame.f_locals.get("self"), "_module_fqn", None)
            names.append(f"{frame.f_code.co_name}({unit})" if unit else frame.f_code.co_name)
        frame = frame.f_back
    return " ← ".join(names) or "outside torch.distributed (compute)"


class _Sampled(runner.PeakMemory):
    """``verify``'s measure, with rank 0's anonymous resident set sampled beside it."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.base, self.high, self.at, self.on = _anonymous(), 0, "", True
        main = threading.main_thread().ident
        threading.Thread(target=self._sample, args=(main,), daemon=True).start()

    def _sample(self, main: int) -> None:
        while self.on:
            now = _anonymous()
            if now > self.high:
                self.high, self.at = now, _where(sys._current_frames().get(main))
            time.sleep(0.0003)

    def stop(self) -> int:
        self.on = False
        peak = super().stop()
        print(f"  peak {peak / MIB:.1f} MiB as verify measures it; the resident set's highest sample inside "
              f"{self.at}", flush=True)
        return peak


class _Tracked(runner.PeakMemory):
    """``verify``'s measure with MemTracker following the tensors over the same steps."""

    def __init__(self, device) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        class PerForward(MemTracker):  # one module's forward per tracker context, unless reset
            def _pre_fw_hook(self, module, inputs):
                try:
                    return super()._pre_fw_hook(module, inputs)
                except NotImplementedError:
                    self.reset_mod_stats()
                    return super()._pre_fw_hook(module, inputs)

        super().__init__(device)
        self.tracker = PerForward()
        self.tracker.__enter__()

    def stop(self) -> int:
        self.tracker.__exit__(None, None, None)
        peak = super().stop()
        tensors = max(snapshot["Total"] for snapshot in self.tracker.get_tracker_snapshot("peak").values())
        print(f"  tensors at their peak {tensors / MIB:.2f} MiB (MemTracker)", flush=True)
        return peak


def _rank(rank: int, port: int, plan_json: str, tracked: bool) -> None:
    plan = Plan.from_json(plan_json)
    join_group("gloo", ("127.0.0.1", port), rank=rank, world_size=plan.world_size)
    if rank == 0:
        runner.PeakMemory = _Tracked if tracked else _Sampled
    base, states = [0], [0]

    def count_states(optimizer: torch.optim.Optimizer, *_) -> None:
        tensors = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        states[0] = sum((t.to_local() if isinstance(t, DTensor) else t).untyped_storage().nbytes() for t in tensors)

    register_optimizer_step_post_hook(count_states)

    def on_event(kind: str, **fields) -> None:
        if kind == "built":
            base[0] = _anonymous()
        elif rank == 0 and not tracked and fields.get("phase") == "warm-up" and fields["index"] <= runner.MEMORY_STEPS:
            beyond = _anonymous() - base[0] - states[0]
            print(f"  after warm-up step {fields['index']}: anonymous resident set {beyond / MIB:+.1f} MiB over "
                  f"the built model's and the optimizer's {states[0] / MIB:.1f} MiB of states", flush=True)

    runner.measure_plan(real_model(MODEL, seq_len=SEQ_LEN), plan, optimizer="adamw", steps=1, warmup=1,
                        on_event=on_event)


def main() -> None:
    profile = profile_spec(MODEL, seq_len=SEQ_LEN, precision="fp32", kernels="cpu")
    common = {"micro_batch_size": 2, "precision": "fp32", "block_container": profile.block_container}
    for plan in (Plan(dp_shard=4, zero=3, **common), Plan(tp=4, grad_accum=4, tp_layout=profile.tp_layout, **common)):
        print(f"{MODEL} {plan.name}, {plan.world_size} gloo ranks, rank 0:", flush=True)
        for tracked in (False, True):
            store = host_store()
            mp.start_processes(_rank, args=(store.port, plan.to_json(), tracked), nprocs=plan.world_size,
                               start_method="spawn", join=True)


if __name__ == "__main__":
    main()
