"""Plan → Lightning: the ``Trainer`` arguments that run a plan, as a LightningCLI YAML.

:func:`trainer_arguments` gives the Trainer keywords (accelerator, devices, nodes, precision,
accumulation) with ``strategy="auto-parallel"`` pinned to a plan file; :func:`export_lightning_config`
writes them as the ``trainer:`` block of a LightningCLI config, the plan next to it, and — in
comments — the same run as Python and, where the plan is expressible there, Lightning's own
equivalent strategy (``ddp``, ``FSDPStrategy``, ``ModelParallelStrategy``, ``DeepSpeedStrategy``).
Imports no Lightning: the ``advise`` command writes these files. LightningCLI reads them only with
``jsonargparse[signatures]`` installed (:func:`lightning_cli_missing` says when it is not).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stratagem.advisor.hardware import Cluster
from stratagem.plan import Plan
from stratagem.errors import UsageError

__all__ = ["LIGHTNING_CLI_REQUIREMENT", "builtin_strategy", "export_lightning_config", "lightning_cli_missing",
           "lightning_precision", "trainer_arguments"]

STRATEGY_CLASS = "stratagem.integrations.lightning.AutoParallelStrategy"
LIGHTNING_CLI_REQUIREMENT = "jsonargparse[signatures]>=4.27.7"
"""What LightningCLI imports to read a config: ``lightning.pytorch.cli`` checks this requirement
(Lightning 2.6) and raises ``ModuleNotFoundError`` without it. Lightning itself does not install it."""
# The modules jsonargparse and its 'signatures' extra provide (jsonargparse's pyproject.toml).
_SIGNATURES_MODULES = ("jsonargparse", "docstring_parser", "typeshed_client")


def lightning_cli_missing() -> str | None:
    """The pip command that installs what LightningCLI needs to read the YAML
    (:data:`LIGHTNING_CLI_REQUIREMENT`) when it is missing or too old here, else None."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    command = f"pip install '{LIGHTNING_CLI_REQUIREMENT}'"
    if any(importlib.util.find_spec(module) is None for module in _SIGNATURES_MODULES):
        return command
    try:
        installed = Version(importlib.metadata.version("jsonargparse"))
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None  # importable but without readable metadata: let LightningCLI judge
    return None if installed in Requirement(LIGHTNING_CLI_REQUIREMENT).specifier else command


def lightning_precision(plan: Plan) -> str:
    """Lightning's name for the plan's precision, as the auto-parallel strategy runs it."""
    from stratagem.integrations.planning import LIGHTNING_PRECISIONS

    names = {ours: theirs for theirs, ours in LIGHTNING_PRECISIONS.items()}
    if plan.precision not in names:
        raise UsageError(f"the auto-parallel strategy does not run {plan.precision}; "
                         f"valid: {', '.join(names)}\nHINT: advise with --precision bf16-mixed")
    return names[plan.precision]


def trainer_arguments(plan: Plan, cluster: Cluster, *, plan_file: str | Path) -> dict[str, Any]:
    """``Trainer`` keywords that run ``plan`` on ``cluster`` with the auto-parallel strategy
    pinned to ``plan_file`` (``strategy`` in LightningCLI's ``class_path`` form)."""
    cluster.check_runnable("the Lightning config")
    plan.check(world_size=cluster.world_size, devices_per_node=cluster.devices_per_node)
    return {
        "accelerator": "gpu" if cluster.is_gpu else "cpu",
        "devices": cluster.devices_per_node,
        "num_nodes": cluster.num_nodes,
        "precision": lightning_precision(plan),
        "accumulate_grad_batches": plan.grad_accum,
        "strategy": {"class_path": STRATEGY_CLASS, "init_args": {"plan": str(plan_file)}},
    }


def builtin_strategy(plan: Plan, *, block_classes: Sequence[str] = ()) -> tuple[str | None, str]:
    """Lightning's own strategy for ``plan`` as Python source (None when none runs it as it is),
    and a sentence on what it needs or why there is none."""
    blocks = "{" + ", ".join(block_classes or ("Block",)) + "}"
    if plan.pp > 1:
        return None, "Lightning has no built-in pipeline-parallel strategy."
    if plan.checkpoints_selectively:
        return None, "Lightning's strategies checkpoint whole blocks, not selected ops."
    if plan.tp > 1:
        return (f"ModelParallelStrategy(data_parallel_size={plan.dp}, tensor_parallel_size={plan.tp})",
                "configure_model must apply the tensor-parallel layout and fully_shard itself "
                "(FSDPStrategy and DeepSpeedStrategy need CUDA).")
    if plan.shards_optimizer_only or plan.offload == "optimizer":
        offload = ", offload_optimizer=True" if plan.offloads else ""
        offload += ", offload_parameters=True" if plan.offloads_parameters else ""
        return f"DeepSpeedStrategy(stage={plan.zero}{offload})", "needs CUDA and the deepspeed extra."
    if plan.uses_fsdp:
        return _fsdp_strategy(plan, blocks), "FSDPStrategy (FSDP1) needs CUDA."
    if plan.world_size == 1:
        return '"auto"', "one device."
    note = " The model checkpoints its blocks itself." if plan.checkpoints else ""
    return '"ddp"', "plain data parallelism." + note


def _fsdp_strategy(plan: Plan, blocks: str) -> str:
    hybrid = plan.is_hsdp
    sharding = {(3, False): "FULL_SHARD", (2, False): "SHARD_GRAD_OP", (3, True): "HYBRID_SHARD",
                (2, True): "_HYBRID_SHARD_ZERO2"}[plan.zero, hybrid]
    args = [f'sharding_strategy="{sharding}"', f"auto_wrap_policy={blocks}"]
    if hybrid:
        args.append(f"device_mesh=({plan.dp_replicate}, {plan.dp_shard})")
    if plan.recomputes_blocks:
        args.append(f"activation_checkpointing_policy={blocks}")
    if plan.offloads_parameters:
        args.append("cpu_offload=True")
    return f"FSDPStrategy({', '.join(args)})"


def _comments(plan: Plan, cluster: Cluster, arguments: dict[str, Any], block_classes: Sequence[str]) -> list[str]:
    plain = {k: v for k, v in arguments.items() if k != "strategy"}
    call = ", ".join(f"{k}={v!r}" for k, v in plain.items())
    plan_file = arguments["strategy"]["init_args"]["plan"]
    code, why = builtin_strategy(plan, block_classes=block_classes)
    builtin = (f"Lightning's own equivalent: Trainer({call}, strategy={code}); {why}" if code
               else f"No built-in Lightning strategy runs it: {why}")
    missing = lightning_cli_missing()
    needs = ([f"LightningCLI needs {LIGHTNING_CLI_REQUIREMENT}, not installed where this file was written: {missing}"]
             if missing else [])
    return [f"Written by stratagem for plan {plan.name} on {cluster.spec}.",
            *needs,
            "LightningCLI: python train.py fit --config THIS_FILE. In Python:",
            "  import stratagem.integrations.lightning  # registers strategy='auto-parallel'",
            f"  Trainer({call}, strategy=AutoParallelStrategy(plan={plan_file!r}))",
            f"DataLoader(batch_size={plan.micro_batch_size}) per rank; global batch {plan.global_batch_size}.",
            builtin]


def export_lightning_config(plan: Plan, cluster: Cluster, path: str | Path, *,
                            block_classes: Sequence[str] = ()) -> Path:
    """Write the LightningCLI YAML for ``plan`` to ``path`` and the pinned plan to
    ``<path stem>.plan.json`` beside it (the YAML names it as ``path`` was given: relative
    paths are relative to where training starts); returns the YAML's path."""
    import yaml

    path = Path(path)
    plan_file = path.with_name(f"{path.stem}.plan.json")
    arguments = trainer_arguments(plan, cluster, plan_file=plan_file)
    text = "".join(f"# {line}\n" for line in _comments(plan, cluster, arguments, block_classes))
    try:
        plan_file.write_text(plan.to_json(indent=2) + "\n", encoding="utf-8")
        path.write_text(text + yaml.safe_dump({"trainer": arguments}, sort_keys=False), encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write the Lightning config to {path}: {err.strerror}\n"
                         "HINT: give a path in a folder that exists and is writable") from None
    return path
