"""Pipeline stages built by tracing (:mod:`stratagem.plugins.pipeline`): for a model whose
stages cannot be built by removing what they do not run, ``torch.distributed.pipelining.pipeline``
exports the forward and splits the graph before each stage's first block. A traced stage calls no
submodule ``forward``, so it takes neither tensor parallelism nor per-block checkpointing,
compilation or FSDP units (:func:`check_traced_stage_plan`; FSDP shards the stage as one unit).
"""

from __future__ import annotations

import gc
import inspect

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import SplitPoint, pipeline

from stratagem.errors import UsageError
from stratagem.plan import Plan
from stratagem.plan.stages import TRACED_STAGE_LIMITS, traced_stages_allow

__all__ = ["check_traced_stage_plan", "rebuild_generated_code", "traced_stages"]


def traced_stages(module: nn.Module, plan: Plan, bounds: list[int], mine: tuple[int, ...],
                  example_inputs: tuple[Tensor, ...]) -> list[nn.Module]:
    """Stages ``mine`` of ``module`` traced and split before the blocks at ``bounds`` (one
    micro-batch of ``example_inputs`` fixes the graph's shapes), each passing on what a later stage
    reads of what came before it (:func:`_carry`). :class:`UsageError` when the model does not
    export, or its forward does not run the blocks in order."""
    split = {f"{plan.block_container}.{bounds[s]}": SplitPoint.BEGINNING for s in range(1, plan.num_stages)}
    own_forward = {fqn: module.get_submodule(fqn).__dict__.get("forward") for fqn in split}
    # A Hugging Face model returns its KV cache, which torch.export refuses in an output and
    # training does not use: traced without it, the stages never make one.
    config = getattr(module, "config", None)
    use_cache = getattr(config, "use_cache", None)
    try:
        if use_cache:
            config.use_cache = False
        pipe = pipeline(module, mb_args=tuple(example_inputs), split_spec=split)
    except Exception as err:  # export failures carry pages of graph; the first line says it
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(f"{type(module).__name__} could not be traced into pipeline stages: "
                         f"{type(err).__name__}: {first}\nHINT: pick a plan with pp=1 (the model's "
                         "forward must run its blocks in order and be exportable with torch.export)") from err
    finally:
        if use_cache:
            config.use_cache = use_cache
        for fqn, forward in own_forward.items():  # pipeline() marks split points by replacing forward
            block = module.get_submodule(fqn)
            block.__dict__.pop("_orig_forward", None)
            block.__dict__.pop("forward", None)
            if forward is not None:
                block.forward = forward
    if pipe.num_stages != plan.num_stages:
        raise UsageError(f"tracing {type(module).__name__} gave {pipe.num_stages} stages, the plan has "
                         f"{plan.num_stages}: its forward does not run {plan.block_container!r} in order\n"
                         "HINT: pick a plan with pp=1")
    inputs = [list(inspect.signature(pipe.get_stage_module(s).forward).parameters) for s in range(pipe.num_stages)]
    stages = [pipe.get_stage_module(s) for s in mine]
    transient = _non_persistent_buffers(module)
    for index, stage in zip(mine, stages):
        _run_generated_code(stage)
        _keep_out_of_state_dict(stage, transient)
        if index + 1 < pipe.num_stages:
            _carry(stage, inputs[index], inputs[index + 1])
    del pipe
    gc.collect()  # export leaves graph modules of the whole model in reference cycles, holding its parameters
    return stages


def _carry(stage: nn.Module, own: list[str], following: list[str]) -> None:
    """Make ``stage`` hand the next stage, besides its outputs, the inputs it takes too (by their
    names in the traced graph, ``own`` and ``following``): the split gives a stage only what the
    one before it computes, and a value computed before the first split and read by every block
    (a Hugging Face model's rotary tables and mask) reaches the second stage alone, so a third
    failed for want of it. Its outputs and the carried inputs go in the order the next stage
    takes them."""
    if not set(own) & set(following):
        return
    forward = stage.forward

    def forward_and_carry(*args: Tensor) -> tuple[Tensor, ...]:
        out = forward(*args)
        computed = iter(out if isinstance(out, tuple) else (out,))
        return tuple(args[own.index(name)] if name in own else next(computed) for name in following)

    stage.forward = forward_and_carry


def _non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s buffers kept out of its state dict (a Hugging Face rotary
    embedding's ``inv_freq``)."""
    return {f"{prefix}.{name}" if prefix else name for prefix, submodule in module.named_modules()
            for name in submodule._buffers if name in submodule._non_persistent_buffers_set}


def _keep_out_of_state_dict(stage: nn.Module, names: set[str]) -> None:
    """Keep the buffers of ``stage`` called ``names`` out of its state dict, as the model kept them:
    export makes every buffer of a traced stage persistent, and its checkpoint would hold keys the
    model's has not."""
    for prefix, submodule in stage.named_modules():
        for name in submodule._buffers:
            if (f"{prefix}.{name}" if prefix else name) in names:
                submodule._non_persistent_buffers_set.add(name)


def _run_generated_code(stage: nn.Module) -> None:
    """Make a traced stage's submodules run their graphs' generated Python code rather than
    ``torch.fx.Interpreter``, which unflattened export modules default to (one Python call per
    graph node, on top of the operator's own dispatch)."""
    for submodule in stage.modules():
        if hasattr(submodule, "_run_with_interpreter"):
            submodule._run_with_interpreter = False


def rebuild_generated_code(stage: nn.Module) -> None:
    """Rebuild the generated-code GraphModule each traced submodule keeps (its ``graph_module``,
    whose class's ``forward`` it runs on itself) from the submodule as the plan left it. That
    GraphModule holds its own references to the parameters it was built with, which FSDP then
    replaces with shards: the stage's whole unsharded parameters stayed alive beside them
    (docs/design.md, "Pipeline stages")."""
    for submodule in stage.modules():
        if submodule.__dict__.get("graph_module") is not None:
            submodule.__dict__["graph_module"] = torch.fx.GraphModule(submodule, submodule.graph)


def check_traced_stage_plan(plan: Plan) -> None:
    """Raise :class:`UsageError` for what a traced stage cannot take (see the module docstring)."""
    if not traced_stages_allow(tp=plan.tp, activation_checkpointing=plan.activation_checkpointing,
                               compile=plan.compile):
        raise UsageError(f"plan {plan.name}: this model's pipeline stages are traced graphs, and "
                         f"{TRACED_STAGE_LIMITS}\nHINT: use tp=1, activation_checkpointing='none' and "
                         "compile=false with pp>1 for this model")
