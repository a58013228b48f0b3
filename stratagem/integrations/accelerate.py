"""Plan → Accelerate: the config file ``accelerate launch`` reads, and the Accelerator it builds.

:func:`to_accelerate_config` translates a Plan into the fields of accelerate's own
``ClusterConfig``, the YAML keys ``accelerate launch`` turns into the ``FSDP_*``,
``PARALLELISM_CONFIG_*`` and ``ACCELERATE_DEEPSPEED_*`` variables its plugin dataclasses read;
:func:`export_accelerate_config` writes them with ``ClusterConfig(...).to_yaml_file`` and puts
the advisor's notes in YAML comments (accelerate rejects unknown keys). :func:`make_accelerator`
builds the same plugins in a script. Accelerate's vocabulary appears only in this module.

What Accelerate can express: DDP (``MULTI_GPU``), FSDP2 for ZeRO-2/3 (``reshard_after_forward``
False/True) with CPU offload, HSDP and tensor parallelism through ``ParallelismConfig``, and
ZeRO-1/2/3 through DeepSpeed (``deepspeed=True``). A plan it cannot run — pipeline stages,
ZeRO-1 without DeepSpeed, pure bf16, selective checkpointing, Megatron sequence parallelism,
anything but DDP on CPU ranks — is a :class:`UsageError`, never a file that runs something else.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stratagem.advisor.hardware import Cluster
from stratagem.plan import Plan
from stratagem.advisor.search.targets import accelerate_excludes, deepspeed_excludes
from stratagem.errors import UsageError

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn

__all__ = ["MIXED_PRECISION", "accelerate_notes", "accelerate_version", "accelerator_kwargs", "check_accelerate_plan",
           "distributed_type", "export_accelerate_config", "make_accelerator", "to_accelerate_config"]

MIXED_PRECISION = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
"""stratagem precision → Accelerate's ``mixed_precision``; ``bf16-true`` has no Accelerate mode."""
FSDP2_MIN_VERSION = "1.6"  # FullyShardedDataParallelPlugin(fsdp_version=2)
PARALLELISM_CONFIG_MIN_VERSION = "1.10"  # accelerate.parallelism_config.ParallelismConfig
MAIN_PROCESS_IP = "MAIN_NODE_IP"  # multi-node placeholder: the user writes node 0's address
MAIN_PROCESS_PORT = 29500  # torchrun's default
# FSDP plugin keyword → the fsdp_config key `accelerate launch` turns into that plugin field.
_FSDP_KEYS = {
    "fsdp_version": "fsdp_version",
    "reshard_after_forward": "fsdp_reshard_after_forward",
    "cpu_offload": "fsdp_offload_params",
    "activation_checkpointing": "fsdp_activation_checkpointing",
    "auto_wrap_policy": "fsdp_auto_wrap_policy",
    "transformer_cls_names_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "state_dict_type": "fsdp_state_dict_type",
}


def accelerate_version() -> str:
    """The installed accelerate's version."""
    return importlib.metadata.version("accelerate")


def distributed_type(plan: Plan, *, deepspeed: bool = False) -> str:
    """Accelerate's ``distributed_type`` for ``plan``: ``DEEPSPEED``, ``FSDP``, ``MULTI_GPU`` or ``NO``."""
    if deepspeed:
        return "DEEPSPEED"
    if plan.uses_fsdp or plan.tp > 1:
        return "FSDP"
    return "MULTI_GPU" if plan.world_size > 1 else "NO"


def check_accelerate_plan(plan: Plan, cluster: Cluster, *, deepspeed: bool = False) -> None:
    """Raise :class:`UsageError` unless Accelerate (with DeepSpeed when ``deepspeed``) runs
    ``plan`` on ``cluster`` as it is, with the accelerate installed here."""
    cluster.check_runnable("the Accelerate config")
    plan.check(world_size=cluster.world_size, devices_per_node=cluster.devices_per_node)
    _check_expressible(plan, deepspeed=deepspeed)
    if not cluster.is_gpu and distributed_type(plan, deepspeed=deepspeed) not in ("MULTI_GPU", "NO"):
        raise UsageError(f"Accelerate runs only DDP on CPU processes, and {plan.name} is not DDP: its FSDP "
                         "plugin would be dropped for DDP, ParallelismConfig and DeepSpeed need GPUs\n"
                         "HINT: advise for a GPU cluster, or train the plan with Trainer(strategy='auto-parallel')")
    _check_version(plan, deepspeed=deepspeed)


def _check_expressible(plan: Plan, *, deepspeed: bool) -> None:
    """Raise :class:`UsageError` for what Accelerate (with DeepSpeed when ``deepspeed``) cannot run
    as it is on any cluster: pipeline stages, a precision it lacks, sequence parallelism, ..."""
    runtime = "Accelerate with DeepSpeed" if deepspeed else "Accelerate"
    hint = "\nHINT: advise with --target " + ("deepspeed" if deepspeed else "accelerate")
    if plan.pp > 1:
        raise UsageError(f"{runtime} trains no pipeline parallelism; the plan has pp={plan.pp}{hint}")
    if plan.precision not in MIXED_PRECISION:
        raise UsageError(f"{runtime} has no {plan.precision} mode (valid: {', '.join(MIXED_PRECISION)})"
                         "\nHINT: advise with --precision bf16-mixed")
    if plan.sequence_parallel:
        raise UsageError(f"{runtime} has no Megatron-style sequence parallelism (ParallelismConfig's sp is "
                         f"DeepSpeed Ulysses){hint}")
    reason = deepspeed_excludes(plan) if deepspeed else accelerate_excludes(plan)
    if reason:
        raise UsageError(f"{runtime} cannot run {plan.name}: {reason}{hint}")


def _check_version(plan: Plan, *, deepspeed: bool) -> None:
    from packaging.version import Version

    installed = accelerate_version()
    needs = []
    if distributed_type(plan, deepspeed=deepspeed) == "FSDP":
        needs.append((FSDP2_MIN_VERSION, "FSDP2"))
    if _parallelism_sizes(plan, deepspeed=deepspeed):
        needs.append((PARALLELISM_CONFIG_MIN_VERSION, "ParallelismConfig (HSDP, tensor parallelism)"))
    for version, feature in needs:
        if Version(installed) < Version(version):
            raise UsageError(f"{plan.name} needs {feature}, which accelerate {installed} lacks (since {version})"
                             f"\nHINT: pip install --upgrade 'accelerate>={version}'")


def _parallelism_sizes(plan: Plan, *, deepspeed: bool = False) -> dict[str, int]:
    """ParallelismConfig sizes: for HSDP and TP plans (plain DDP/FSDP need none)."""
    if deepspeed or not (plan.is_hsdp or plan.tp > 1):
        return {}
    return {"dp_replicate_size": plan.dp_replicate, "dp_shard_size": plan.dp_shard, "tp_size": plan.tp}


def _fsdp_settings(plan: Plan, block_classes: Sequence[str]) -> dict[str, Any]:
    """FSDP2 plugin keywords for ``plan`` (see ``_FSDP_KEYS`` for their YAML names)."""
    if not block_classes:
        raise UsageError(f"{plan.name} shards per block, and Accelerate wraps blocks by class name\n"
                         "HINT: pass block_classes=(type(block).__name__,), as profile.block_classes holds them")
    return {
        "fsdp_version": 2,
        "reshard_after_forward": plan.shards_parameters,
        "cpu_offload": plan.offloads_parameters,
        "activation_checkpointing": plan.recomputes_blocks,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_cls_names_to_wrap": list(block_classes),
        "state_dict_type": "SHARDED_STATE_DICT",
    }


def _deepspeed_settings(plan: Plan) -> dict[str, Any]:
    """DeepSpeed plugin keywords for ``plan`` (the same names in ``deepspeed_config``)."""
    settings: dict[str, Any] = {
        "zero_stage": plan.zero,
        "offload_optimizer_device": "cpu" if plan.offloads else "none",
        "offload_param_device": "cpu" if plan.offloads_parameters else "none",
        "gradient_accumulation_steps": plan.grad_accum,
    }
    if plan.shards_parameters:
        settings.update(zero3_init_flag=True, zero3_save_16bit_model=True)
    return settings


def to_accelerate_config(plan: Plan, cluster: Cluster, *, block_classes: Sequence[str] = (),
                         deepspeed: bool = False) -> dict[str, Any]:
    """The ``ClusterConfig`` fields that run ``plan`` on ``cluster`` with ``accelerate launch``.

    ``block_classes`` name the model's block classes (``profile.block_classes``), which FSDP wraps;
    ``deepspeed`` runs ZeRO through Accelerate's DeepSpeed plugin instead of FSDP.
    """
    check_accelerate_plan(plan, cluster, deepspeed=deepspeed)
    kind = distributed_type(plan, deepspeed=deepspeed)
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": kind, "debug": False,
        "mixed_precision": MIXED_PRECISION[plan.precision], "use_cpu": not cluster.is_gpu,
        "num_processes": plan.world_size, "num_machines": cluster.num_nodes, "machine_rank": 0,
    }
    if cluster.num_nodes > 1:
        config.update(main_process_ip=MAIN_PROCESS_IP, main_process_port=MAIN_PROCESS_PORT, same_network=False,
                      rdzv_backend="static")
    if kind == "FSDP":
        config["fsdp_config"] = {_FSDP_KEYS[k]: ",".join(v) if isinstance(v, list) else v
                                 for k, v in _fsdp_settings(plan, block_classes).items()}
    if kind == "DEEPSPEED":
        config["deepspeed_config"] = _deepspeed_settings(plan)
        if cluster.num_nodes > 1:
            config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"  # torchrun, not pdsh
    sizes = _parallelism_sizes(plan, deepspeed=deepspeed)
    if sizes:
        config["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in sizes.items()}
    return config


def accelerate_notes(plan: Plan, cluster: Cluster, *, deepspeed: bool = False) -> list[str]:
    """What a user must know to run the config: batch sizes, CPU and multi-node launch, TP."""
    notes = [f"Written by stratagem for plan {plan.name} on {cluster.spec}, "
             f"accelerate {accelerate_version()}.",
             f"Per-process batch {plan.micro_batch_size}; global batch {plan.global_batch_size}; "
             f"Accelerator(gradient_accumulation_steps={plan.grad_accum}) (make_accelerator(plan) sets it)."]
    if not cluster.is_gpu:
        notes.append("CPU ranks: launch with ACCELERATE_USE_CPU=1 accelerate launch --config_file FILE SCRIPT. "
                     "MULTI_GPU selects launch's torchrun launcher and the variable makes the processes "
                     "MULTI_CPU over gloo; without it each process trains alone.")
    if cluster.num_nodes > 1:
        notes.append(f"On each of the {cluster.num_nodes} nodes set machine_rank (0 on the main node) and "
                     f"main_process_ip ({MAIN_PROCESS_IP} here) to the main node's address.")
    if plan.tp > 1:
        notes.append(f"tp_size {plan.tp}: Accelerate applies the model's own TP plan (transformers' "
                     "base_model_tp_plan); a model without one fails in Accelerator.prepare.")
    if deepspeed and plan.checkpoints:
        notes.append(f"activation checkpointing ({plan.activation_checkpointing}) is the model's to do under "
                     "DeepSpeed, e.g. model.gradient_checkpointing_enable().")
    return notes


def export_accelerate_config(plan: Plan, cluster: Cluster, path: str | Path, *, block_classes: Sequence[str] = (),
                             deepspeed: bool = False) -> Path:
    """Write the Accelerate YAML for ``plan`` to ``path`` through accelerate's ``ClusterConfig``,
    with :func:`accelerate_notes` as comments on top; returns the path."""
    from accelerate.commands.config.config_args import ClusterConfig

    path = Path(path)
    config = ClusterConfig(**to_accelerate_config(plan, cluster, block_classes=block_classes, deepspeed=deepspeed))
    notes = accelerate_notes(plan, cluster, deepspeed=deepspeed)
    try:
        config.to_yaml_file(str(path))
        path.write_text("".join(f"# {line}\n" for line in notes) + path.read_text(encoding="utf-8"),
                        encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write the Accelerate config to {path}: {err.strerror}\n"
                         "HINT: give a path in a folder that exists and is writable") from None
    return path


def accelerator_kwargs(plan: Plan, *, block_classes: Sequence[str] = (), deepspeed: bool = False) -> dict[str, Any]:
    """``Accelerator`` keywords for ``plan``: ``mixed_precision``, ``gradient_accumulation_steps``
    and the matching ``fsdp_plugin``, ``parallelism_config`` or ``deepspeed_plugin``."""
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    kwargs: dict[str, Any] = {"mixed_precision": MIXED_PRECISION[plan.precision],
                              "gradient_accumulation_steps": plan.grad_accum}
    kind = distributed_type(plan, deepspeed=deepspeed)
    if kind == "FSDP":
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(**_fsdp_settings(plan, block_classes))
    if kind == "DEEPSPEED":
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(**_deepspeed_settings(plan))
    sizes = _parallelism_sizes(plan, deepspeed=deepspeed)
    if sizes:
        from accelerate.parallelism_config import ParallelismConfig

        kwargs["parallelism_config"] = ParallelismConfig(**sizes)
    return kwargs


def make_accelerator(plan: Plan, *, model: nn.Module | None = None, block_classes: Sequence[str] = (),
                     deepspeed: bool = False, **kwargs: Any) -> Accelerator:
    """An ``accelerate.Accelerator`` that trains ``plan`` (see :func:`accelerator_kwargs`);
    ``kwargs`` go to the Accelerator too.

    Before building it, raises :class:`UsageError` for a plan Accelerate cannot run as it is and,
    given the ``model`` to train, for a plan made for another model
    (:func:`~stratagem.plugins.check_plan_fits`); the model's blocks then give ``block_classes``
    when not passed. After, raises it when the processes Accelerate started are not the plan's:
    another world size, or DDP where the plan shards."""
    from accelerate import Accelerator

    _check_expressible(plan, deepspeed=deepspeed)
    if model is not None:
        from stratagem.plugins import check_plan_fits

        check_plan_fits(model, plan)
        block_classes = block_classes or _block_classes(model, plan)
    accelerator = Accelerator(**accelerator_kwargs(plan, block_classes=block_classes, deepspeed=deepspeed), **kwargs)
    if accelerator.num_processes != plan.world_size:
        raise UsageError(f"{plan.name} is for {plan.world_size} processes but Accelerate runs "
                         f"{accelerator.num_processes}\nHINT: accelerate launch --num_processes {plan.world_size} "
                         "(on CPU with ACCELERATE_USE_CPU=1)")
    expected = distributed_type(plan, deepspeed=deepspeed)
    got = accelerator.distributed_type.value
    if plan.world_size > 1 and got != expected and not (expected == "MULTI_GPU" and got == "MULTI_CPU"):
        raise UsageError(f"{plan.name} needs Accelerate's {expected} but it runs {got}\n"
                         "HINT: launch on GPUs; on CPU Accelerate runs DDP only")
    return accelerator


def _block_classes(model: nn.Module, plan: Plan) -> tuple[str, ...]:
    """Class names of ``model``'s blocks (``plan.block_container``'s children), which FSDP wraps."""
    if plan.block_container is None:
        return ()
    return tuple(dict.fromkeys(type(block).__name__ for block in model.get_submodule(plan.block_container)))
