"""Plan → DeepSpeed: the JSON config ``deepspeed.initialize(config=...)`` reads.

:func:`to_deepspeed_config` writes what a DeepSpeed config can hold: batch sizes, ZeRO stage
with CPU offload, ``bf16``/``fp16``, the activation-checkpointing section. The pipeline degree
is not a config key: it goes to ``deepspeed.pipe.PipelineModule(num_stages=pp)`` in the model
code, as :func:`deepspeed_notes` says. Tensor parallelism, ZeRO-2/3 with pipelining, schedules
other than 1F1B and pure bf16 are not DeepSpeed training configs: a :class:`UsageError`.
:func:`validate_deepspeed_config` checks a config with DeepSpeed's own ``DeepSpeedConfig``
when the ``deepspeed`` extra is installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stratagem.plan import Plan
from stratagem.plan.precision import get_precision
from stratagem.advisor.search.targets import deepspeed_excludes
from stratagem.errors import UsageError

__all__ = ["check_deepspeed_plan", "deepspeed_notes", "export_deepspeed_config", "to_deepspeed_config",
           "validate_deepspeed_config"]

# DeepSpeed's documented defaults (config-json: "reduce_bucket_size", "allgather_bucket_size"),
# elements; written out so the file says what it does.
BUCKET_ELEMENTS = 500_000_000


def check_deepspeed_plan(plan: Plan) -> None:
    """Raise :class:`UsageError` unless a DeepSpeed config runs ``plan`` as it is."""
    reason = deepspeed_excludes(plan)
    if reason:
        raise UsageError(f"DeepSpeed cannot run {plan.name}: {reason}\nHINT: advise with --target deepspeed")
    if get_precision(plan.precision).param_dtype != "float32":  # bf16-true, fp16-true
        raise UsageError(f"DeepSpeed's half-precision modes keep fp32 master weights; it has no "
                         f"pure-{plan.precision.removesuffix('-true')} training\nHINT: advise with --precision "
                         f"{plan.precision.replace('-true', '-mixed')}")


def to_deepspeed_config(plan: Plan) -> dict[str, Any]:
    """The DeepSpeed JSON config (as a dict) that trains ``plan``."""
    check_deepspeed_plan(plan)
    zero: dict[str, Any] = {"stage": plan.zero, "overlap_comm": plan.shards_optimizer, "contiguous_gradients": True,
                            "reduce_bucket_size": BUCKET_ELEMENTS}
    if plan.shards_optimizer and not plan.shards_parameters:  # stages 1-2 all-gather the updated weights
        zero["allgather_bucket_size"] = BUCKET_ELEMENTS
    if plan.offloads:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.offloads_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        # A DeepSpeed pipeline runs gradient_accumulation_steps micro-batches per step.
        "gradient_accumulation_steps": plan.grad_accum * plan.microbatches,
        "zero_optimization": zero,
    }
    if plan.precision == "bf16-mixed":
        config["bf16"] = {"enabled": True}
    elif plan.precision == "fp16-mixed":
        config["fp16"] = {"enabled": True, "loss_scale": 0}  # 0: dynamic loss scaling
    if plan.checkpoints:
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                              "contiguous_memory_optimization": False}
    return config


def deepspeed_notes(plan: Plan) -> list[str]:
    """What the model code must do that the config cannot say."""
    notes = []
    if plan.pp > 1:
        notes.append(f"Build the model as deepspeed.pipe.PipelineModule(layers, num_stages={plan.pp}); each step "
                     f"runs {plan.microbatches} micro-batches of {plan.micro_batch_size} (train_batch). An embedding "
                     "and a head that share their weight go in as two deepspeed.pipe.TiedLayerSpec of one key, "
                     "which DeepSpeed keeps equal across the stages.")
    if plan.recomputes_blocks:
        notes.append("Checkpoint every block with deepspeed.checkpointing.checkpoint "
                     "(PipelineModule(activation_checkpoint_interval=1) in a pipeline).")
    if plan.checkpoints_selectively:
        notes.append("Checkpoint every block with torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False, "
                     "context_fn=functools.partial(stratagem.plugins.checkpointing.selective_context, "
                     f"{plan.activation_checkpointing!r})): DeepSpeed's own checkpointing keeps whole blocks' inputs only.")
    return notes


def export_deepspeed_config(plan: Plan, path: str | Path) -> Path:
    """Write :func:`to_deepspeed_config` as JSON to ``path`` (validated by DeepSpeed when it is
    installed); returns the path."""
    path = Path(path)
    config = to_deepspeed_config(plan)
    validate_deepspeed_config(config, plan)
    try:
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write the DeepSpeed config to {path}: {err.strerror}\n"
                         "HINT: give a path in a folder that exists and is writable") from None
    return path


def validate_deepspeed_config(config: dict[str, Any], plan: Plan) -> bool:
    """Check ``config`` with DeepSpeed's ``DeepSpeedConfig`` (it raises on a bad one); returns
    False, without checking, when deepspeed is not installed."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        return False
    # Without a process group DeepSpeedConfig takes a data-parallel world of 1: give it one
    # replica's share of the batch.
    DeepSpeedConfig({**config, "train_batch_size": config["train_batch_size"] // plan.dp})
    return True
