"""A pipeline stage's memory above its parameters and optimizer states, run alone on the CPU as
1F1B runs it, against the advisor's gradients and activations at the rank's peak.

Each stage of a two-stage plan at two micro-batches runs in this one process: the first stage
runs both forwards before its first backward (f0 f1 b0 b1; the second micro-batch's output
gradient stands for what the next stage sends), the last one f0 b0 f1 b1 with the loss, each
stage's output kept until its backward ends (torch's ``PipelineStage`` keeps it in its forward
cache, the last stage's logits too, which the loss alone would free after its forward). AdamW
steps after each, once before the measured step so its states exist; torch's profiler follows
every allocation of the measured step. No process group, no DDP: what the stage's own forward,
backward and gradients hold, which the rank's other terms (DDP's buckets, the framework's) sit on.

    .venv/bin/python bench/pipeline_stage_peak.py      # about half a minute on 2 cores
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from stratagem.advisor.cost.memory import estimate_rank_memory, state_layout
from stratagem.advisor.profile.cache import profile_spec
from stratagem.models import get_preset
from stratagem.plan import Plan
from stratagem.plugins.pipeline import split_stages

MIB = 2**20
CASES = (("llama-small", 128), ("vit-small", None))
MICRO_BATCH = 2


def peak_above_start(step) -> float:
    """Bytes the allocations of ``step()`` reach above where they start (profiler memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        step()
    events = sorted((e for e in recorded.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for event in events:
        now += event.nbytes()
        peak = max(peak, now)
    return peak


def measured(model: str, seq_len: int | None, plan: Plan, rank: int) -> float:
    """Peak bytes above the states of pipeline rank ``rank``'s stage, run alone (module docstring)."""
    preset = get_preset(model)
    torch.manual_seed(0)
    whole = preset.build()
    (inputs,), targets = preset.make_batch(plan.microbatches * MICRO_BATCH, seq_len)
    micro = [slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH) for i in range(plan.microbatches)]
    stage = split_stages(whole, plan, pp_rank=rank, example_inputs=(inputs[micro[0]],))[0]
    del whole
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-4)
    if rank == 0:
        def passes() -> None:  # f0 f1 b0 b1
            outputs = [stage(inputs[m]) for m in micro]
            for output in outputs:
                output.backward(torch.randn_like(output))
    else:
        hidden = [stage_input.detach() for stage_input in _first_stage_outputs(model, seq_len, plan, inputs, micro)]

        def passes() -> None:  # f0 b0 f1 b1, each output held through its backward as torch's stage holds it
            for m, h in zip(micro, hidden):
                output = stage(h.requires_grad_())
                (preset.loss(output, targets[m]) / plan.microbatches).backward()
                del output

    def step() -> None:
        passes()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return peak_above_start(step)


def _first_stage_outputs(model, seq_len, plan, inputs, micro) -> list[torch.Tensor]:
    """What the first stage sends the last for each micro-batch."""
    torch.manual_seed(0)
    first = split_stages(get_preset(model).build(), plan, pp_rank=0, example_inputs=(inputs[micro[0]],))[0]
    with torch.no_grad():
        return [first(inputs[m]) for m in micro]


def main() -> None:
    layout = state_layout("fp32", "adamw")
    print(f"{'model':<12} {'stage':<6} {'measured':>9} {'predicted':>9}   (MiB above parameters and states)")
    for model, seq_len in CASES:
        profile = profile_spec(model, seq_len=seq_len, precision="fp32", kernels="cpu")
        plan = Plan(pp=2, microbatches=2, micro_batch_size=MICRO_BATCH, pp_schedule="1f1b", precision="fp32",
                    block_container=profile.block_container)
        for rank, name in ((0, "first"), (1, "last")):
            predicted = estimate_rank_memory(profile, plan, layout, rank=rank)
            print(f"{model:<12} {name:<6} {measured(model, seq_len, plan, rank) / MIB:9.1f} "
                  f"{(predicted.gradients + predicted.activations) / MIB:9.1f}", flush=True)


if __name__ == "__main__":
    main()
