"""Train a preset under `accelerate launch` with an Accelerator built from a stratagem plan.

Advise a plan for the cluster, write the Accelerate config with it, then launch. On CPU processes
Accelerate runs only DDP, so pin a DDP plan there; on GPUs `--target accelerate` picks any plan
Accelerate can train (FSDP2, HSDP, DeepSpeed through Accelerate):

    .venv/bin/advise --model llama-tiny --cluster 8xA100 --precision bf16-mixed \\
        --emit accelerate --output accelerate.yaml --format json > plan.json
    accelerate launch --config_file accelerate.yaml examples/accelerate_train.py --plan plan.json

    # two CPU processes (the config says so too: ACCELERATE_USE_CPU=1)
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate.yaml examples/accelerate_train.py --plan plan.json

Every process sees the same global batches and takes its data-parallel slice of each, split into
the plan's ``grad_accum`` micro-batches; ``make_accelerator(plan, model=model)`` sets the
accumulation, the precision and the FSDP/DeepSpeed/ParallelismConfig plugins, and refuses, before
any training, a plan made for another model (blocks, tensor-parallel layout or pipeline stages this
preset lacks) or for another number of processes than were launched. With ``--out DIR`` the main process
writes the per-step losses (``losses.json``) and the final weights (``weights.pt``).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from stratagem.errors import UsageError
from stratagem.plan import Plan
from stratagem.integrations.accelerate import make_accelerator
from stratagem.models import get_preset


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--plan", type=Path, required=True, help="a plan, or `advise --format json` output")
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for losses.json and weights.pt")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    plan = Plan.from_json(args.plan.read_text())
    preset = get_preset(args.preset)
    torch.manual_seed(args.seed)
    model = preset.build()
    try:  # a plan for another model or launch is refused here, before any training
        accelerator = make_accelerator(plan, model=model)
    except UsageError as error:
        raise SystemExit(f"accelerate_train.py: {error}") from None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)

    generator = torch.Generator().manual_seed(args.seed)
    local = plan.micro_batch_size * plan.grad_accum
    mine = slice(accelerator.process_index // plan.tp * local, (accelerator.process_index // plan.tp + 1) * local)
    losses = []
    for _ in range(args.steps):
        (tokens,), targets = preset.make_batch(plan.global_batch_size, args.seq_len, generator=generator)
        step_loss = torch.zeros((), device=accelerator.device)
        for micro_tokens, micro_targets in zip(tokens[mine].split(plan.micro_batch_size),
                                               targets[mine].split(plan.micro_batch_size)):
            with accelerator.accumulate(model):  # steps the optimizer every grad_accum micro-batches
                loss = preset.loss(model(micro_tokens.to(accelerator.device)), micro_targets.to(accelerator.device))
                accelerator.backward(loss)  # divides by grad_accum
                optimizer.step()
                optimizer.zero_grad()
            step_loss += loss.detach() / plan.grad_accum
        losses.append(accelerator.reduce(step_loss, "mean").item())
        accelerator.print(f"step {len(losses)}: loss {losses[-1]:.4f}")

    accelerator.wait_for_everyone()
    weights = accelerator.get_state_dict(model)  # a collective for sharded plans
    if args.out is not None and accelerator.is_main_process:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "losses.json").write_text(json.dumps({"num_processes": accelerator.num_processes,
                                                          "distributed_type": accelerator.distributed_type.value,
                                                          "plan": plan.name, "losses": losses}))
        torch.save(weights, args.out / "weights.pt")
    del model, optimizer  # docs/platform.md: gloo can abort at exit while DDP holds the group
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
