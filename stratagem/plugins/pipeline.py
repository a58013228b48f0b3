"""Pipeline parallelism: split a model into the Plan's stages and run a schedule over them.

Stages follow ``plan.blocks_per_stage`` (the partition the advisor costed): stage ``s`` runs a
contiguous run of the blocks (children of ``plan.block_container``), stage 0 also what runs
before the blocks (embedding), the last stage what runs after them (norm, head); pipeline rank
``r`` holds stages ``r, r + pp, …`` (``pp_virtual`` of them). The user's model is not
restructured; a stage module keeps the original parameter FQNs, so a stage's state dict loads
into the unsplit model. Two ways to build a stage:

* by removal (:func:`stratagem.plan.stages.removal_convention` recognizes the models), for models
  whose forward passes hidden states through what a stage does not hold: ``nn.Sequential``
  (whose blocks are its own children), the reference :class:`~stratagem.models.Transformer`
  (``tok_embeddings``/``pos_embeddings`` set to None: the input is hidden states; ``norm`` and
  ``output`` set to None: it returns them) and Hugging Face Llama-family decoders
  (:data:`~stratagem.plan.stages.HF_DECODERS`: ``embed_tokens``, ``norm`` and ``lm_head`` replaced by
  ``nn.Identity``). The stage is a shallow copy of the model with the other blocks dropped
  (kept blocks keep their indices), so tensor parallelism, activation checkpointing and
  per-block FSDP apply to it unchanged;
* by tracing, for any other model whose forward runs its blocks in order (ViT, ResNet, Hugging
  Face models outside those families): :mod:`stratagem.plugins.traced_stages`.

Schedules (``plan.pp_schedule``): ``gpipe`` → ``ScheduleGPipe``, ``1f1b`` → ``Schedule1F1B``,
``interleaved-1f1b`` → ``ScheduleInterleaved1F1B``, ``interleaved-zb`` →
``ScheduleInterleavedZeroBubble`` (weight-gradient passes apart from input-gradient passes,
filling the bubble; not with data parallelism or checkpointing:
:func:`~stratagem.plan.zero_bubble_refuses`); ``plan.microbatches`` micro-batches per
step, each micro-batch's loss divided by their number, so that the gradients are the mean over
micro-batches; not the schedule's ``scale_grads``, which divides every gradient the parameters
hold, so that a second step accumulated into the same gradients divided the first's again.

A weight tied between the embedding and the head is copied to the first and last stage and the
copies kept equal (:func:`tied_parameters`, :class:`Pipeline`; docs/design.md, "Pipeline stages").
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves, tree_map_only

from stratagem.plan import MeshAxis, Plan
from stratagem.errors import UsageError
from stratagem.plugins.blocks import find_blocks
from stratagem.plugins.grad_norm import clip_grad_norm_
from stratagem.plugins.mesh import local_part
from stratagem.plugins.precision import autocast_context
from stratagem.plugins.tensor_parallel import vocab_parallel_loss
from stratagem.plugins.traced_stages import traced_stages
from stratagem.plan.stages import (
    TIED_OFFLOAD,
    RemovalConvention,
    removal_convention,
    tied_copies_allow,
    tied_weights,
)

__all__ = ["Pipeline", "build_schedule", "first_last_group", "rank_module", "split_stages", "stage_indices",
           "tied_parameters"]

log = logging.getLogger(__name__)

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
              "interleaved-zb": ScheduleInterleavedZeroBubble}


def stage_indices(plan: Plan, pp_rank: int) -> tuple[int, ...]:
    """The stages pipeline rank ``pp_rank`` runs: ``pp_rank, pp_rank + pp, …``."""
    return tuple(range(pp_rank, plan.num_stages, plan.pp))


def split_stages(module: nn.Module, plan: Plan, *, pp_rank: int,
                 example_inputs: tuple[Tensor, ...]) -> list[nn.Module]:
    """This pipeline rank's stage modules, in stage order (see the module docstring).

    ``example_inputs``: one micro-batch of the model's positional inputs (tracing specializes
    the graph to its shapes). Raises :class:`UsageError` when the plan's partition does not fit
    the model's blocks.
    """
    blocks = find_blocks(module, plan)
    plan.check(world_size=plan.world_size, num_blocks=len(blocks))
    bounds = _bounds(plan.blocks_per_stage(len(blocks)))
    mine = stage_indices(plan, pp_rank)
    convention = removal_convention(module, block_container=plan.block_container)
    if convention is not None:
        stages = [_removal_stage(module, plan, convention, bounds, s) for s in mine]
        how = "removal"
    else:
        stages = traced_stages(module, plan, bounds, mine, example_inputs)
        how = "tracing"
    log.info("pipeline: rank %d runs stages %s (blocks %s) built by %s", pp_rank, mine,
             [f"{bounds[s]}-{bounds[s + 1] - 1}" for s in mine], how)
    return stages


def tied_parameters(module: nn.Module, plan: Plan) -> tuple[tuple[str, ...], ...]:
    """The names of each parameter the model ties (:func:`~stratagem.plan.stages.tied_weights`),
    of which the first and the last stage each hold a copy that :class:`Pipeline` keeps equal.
    :class:`UsageError` for ties stages cannot keep, and under CPU offload
    (:data:`~stratagem.plan.stages.TIED_OFFLOAD`)."""
    shared, why = tied_weights(module, block_container=plan.block_container)
    if shared and why is None and not tied_copies_allow(pp=plan.pp, offload=plan.offload):
        why = TIED_OFFLOAD
    if why:
        raise UsageError(f"plan {plan.name} pipelines a model with tied weights: {why}\n"
                         "HINT: untie them (e.g. tie_word_embeddings=False) or pick a plan with pp=1")
    return shared


def first_last_group(mesh: DeviceMesh) -> tuple[dist.ProcessGroup | None, int]:
    """The process group of the first and the last rank of this rank's pipeline (the ranks that
    differ from it on the ``pp`` axis alone), None on a rank that is neither, and the first's
    global rank. Every rank creates every such group (``new_group`` is collective)."""
    pp_dim = mesh.mesh_dim_names.index(str(MeshAxis.PP))
    lines = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.mesh.size(pp_dim)).tolist()
    mine, first = None, -1
    for line in lines:
        group = dist.new_group([line[0], line[-1]])
        if dist.get_rank() in (line[0], line[-1]):
            mine, first = group, line[0]
    return mine, first


def _bounds(stage_blocks: tuple[int, ...]) -> list[int]:
    bounds = [0]
    for count in stage_blocks:
        bounds.append(bounds[-1] + count)
    return bounds


def _removal_stage(module: nn.Module, plan: Plan, convention: RemovalConvention, bounds: list[int],
                   stage: int) -> nn.Module:
    """A shallow copy of ``module`` holding stage ``stage``'s blocks, under their original indices,
    and the outer modules only where the stage runs them (shared with ``module``, never between
    stages)."""
    shell = _shallow_copy(module)
    kept = nn.ModuleList()
    container = module.get_submodule(plan.block_container)
    for index in range(bounds[stage], bounds[stage + 1]):
        kept.add_module(str(index), container[index])
    if plan.block_container == "":  # nn.Sequential: the blocks are the model's own children
        shell._modules = dict(kept._modules)
        return shell
    _set_submodule(shell, plan.block_container, kept)
    removed = (convention.embed if stage > 0 else ()) + (convention.head if stage < len(bounds) - 2 else ())
    for fqn in removed:
        _set_submodule(shell, fqn, nn.Identity() if convention.identity else None)
    if convention.hf_output:
        shell.register_forward_pre_hook(_without_cache, with_kwargs=True)
        shell.register_forward_hook(_logits)
        if getattr(shell.config, "tie_word_embeddings", False):
            # A stage holds one of the tied pair (the Pipeline keeps the copies equal); its own
            # tie_weights(), which initialising a meta-built stage runs, would look for the other
            # (by the mapping transformers 5 computed when it built the model, and by the config).
            shell.config = copy.copy(shell.config)
            shell.config.tie_word_embeddings = False
            shell.all_tied_weights_keys = {}
    return shell


def _without_cache(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {**kwargs, "use_cache": False}


def _logits(_: nn.Module, __: tuple, output: Any) -> Tensor:
    return output.logits


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s children and tensors but with its own child,
    parameter, buffer and hook tables, so a stage can drop children and take hooks alone."""
    shell = copy.copy(module)
    shell.__dict__ = {k: copy.copy(v) if isinstance(v, dict) else v for k, v in module.__dict__.items()}
    return shell


def _set_submodule(root: nn.Module, fqn: str, child: nn.Module | None) -> None:
    parent_name, _, name = fqn.rpartition(".")
    if parent_name:  # copy the path down so the original model keeps its container
        parent = _shallow_copy(root.get_submodule(parent_name))
        _set_submodule(root, parent_name, parent)
        root = parent
    root._modules[name] = child


def build_schedule(stage_modules: list[nn.Module], plan: Plan, mesh: DeviceMesh, *,
                   loss_fn: Callable[[Any, Tensor], Tensor]) -> Any:
    """The ``torch.distributed.pipelining`` schedule running ``stage_modules`` (this rank's, as
    parallelized) over the mesh's ``pp`` axis, ``plan.microbatches`` micro-batches per step."""
    pp_mesh = mesh[str(MeshAxis.PP)]
    pp_rank = pp_mesh.get_local_rank()
    device = torch.device(mesh.device_type)
    for module in stage_modules:
        if isinstance(module, DistributedDataParallel):
            # PipelineStage prepares DDP's reducer itself for a step's last backward. DDP's own
            # per-forward preparation, armed by the schedule's metadata-inference forward (run
            # outside no_sync), would make the reducer count every parameter twice and fail its
            # bucket rebuild (GPipe, or 1F1B with as many micro-batches as stages).
            module.require_backward_grad_sync = False
        _shield_buffers_from_first_forward(unwrap(module))
    stages = [PipelineStage(m, index, plan.num_stages, device, group=pp_mesh.get_group())
              for m, index in zip(stage_modules, stage_indices(plan, pp_rank))]
    cls = _SCHEDULES[plan.pp_schedule]
    first = stages if plan.is_interleaved else stages[0]
    return cls(first, plan.microbatches, loss_fn=lambda output, target: loss_fn(output, target) / plan.microbatches,
               scale_grads=False)


def _shield_buffers_from_first_forward(module: nn.Module) -> None:
    """Run ``module``'s first forward on copies of its buffers, then put the buffers back. That
    forward is the schedule's metadata inference, on the first micro-batch (first stage) or on
    uninitialised tensors (the others), which BatchNorm would count in its running statistics.
    Copies, not a restore: the inference's backward reads what its forward saved."""
    kept: list[tuple[nn.Module, str, Tensor]] = []

    def swap_in(mod: nn.Module, _: tuple) -> None:
        kept.extend((sub, name, buffer) for sub in mod.modules() for name, buffer in sub.named_buffers(recurse=False))
        for sub, name, buffer in kept:
            setattr(sub, name, buffer.clone())

    def swap_back(*_: Any) -> None:
        for sub, name, buffer in kept:
            setattr(sub, name, buffer)
        before.remove()
        after.remove()

    before = module.register_forward_pre_hook(swap_in)
    after = module.register_forward_hook(swap_back)


@dataclass(eq=False)
class Pipeline:
    """This rank's part of a pipeline-parallel model and the schedule that trains it, evaluates
    it and predicts with it (:func:`~stratagem.plugins.apply.apply_plan` builds it). Every call
    splits its batch into ``plan.microbatches`` equal micro-batches (of ``plan.micro_batch_size``
    samples, as the plan was costed).

    ``modules``: this rank's stage modules as parallelized (DDP wrappers or FSDP modules), in
    stage order: give their parameters to the optimizer (``build_optimizer(pipeline.modules,
    plan, …)``). ``is_first``/``is_last``: whether this rank runs the first / last stage.
    """

    plan: Plan
    modules: nn.ModuleList
    schedule: Any
    pp_group: dist.ProcessGroup
    device_type: str
    is_first: bool
    is_last: bool
    tied: tuple[tuple[str, ...], ...] = ()  # tied_parameters: names of one parameter the first and last stage copy
    tied_group: dist.ProcessGroup | None = None  # first_last_group: the first and last stage's ranks
    tied_source: int = -1  # the first stage's global rank, whose copies the others start from
    _tied_equal: bool = field(default=False, init=False)

    def step(self, *inputs: Tensor, target: Tensor) -> Tensor:
        """Forward and backward of one batch (``plan.microbatches`` × micro-batch size samples),
        gradients accumulated in the stage parameters; the mean loss over micro-batches, on
        every rank (sent from the last stage). The last stage keeps no micro-batch's outputs
        (torch's schedules otherwise hold them all and concatenate them: twice the batch's logits).
        The copies of a tied weight on the first and last stage then both hold the sum of their
        gradients, the weight's whole gradient: the last stage's copy starts the step without one
        (what earlier accumulation steps left, equal on both, stays in the first's), and the two
        are all-reduced after it."""
        copies = self._tied_copies()
        if dist.get_rank() != self.tied_source:
            for param in copies:
                param.grad = None
        loss = self._run(self.schedule.step, inputs, target, return_outputs=False)
        for param in copies:
            if param.grad is not None:
                dist.all_reduce(local_part(param.grad), group=self.tied_group)
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False) -> Tensor:
        """Clip the gradients of every stage by the whole model's norm, as one process would
        (:func:`~stratagem.plugins.grad_norm.clip_grad_norm_`), a tied weight counted on the first
        stage; the norm before clipping, on every rank."""
        elsewhere = self._tied_copies() if dist.get_rank() != self.tied_source else []
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite,
                               pp_group=self.pp_group, counted_elsewhere=elsewhere)

    def evaluate(self, *inputs: Tensor, target: Tensor) -> Tensor:
        """Forward only (no gradients): the mean loss over micro-batches, on every rank."""
        with torch.no_grad():
            return self._run(self.schedule.eval, inputs, target)

    def predict(self, *inputs: Tensor) -> Any:
        """Forward only, without the loss: the model's output for the batch (the last stage's
        micro-batch outputs concatenated on dim 0, e.g. logits), on every rank (sent from the
        last stage)."""
        self._check_batch(inputs)
        self._equal_tied_copies()
        loss_fn, self.schedule._loss_fn = self.schedule._loss_fn, None  # with a loss, eval needs a target
        try:
            with torch.no_grad(), autocast_context(self.plan, self.device_type):
                outputs = self.schedule.eval(*(inputs if self.is_first else ()))
        finally:
            self.schedule._loss_fn = loss_fn
        return self._from_last_stage(tree_map_only(DTensor, DTensor.full_tensor, outputs))  # vocab_loss's logits

    def _from_last_stage(self, outputs: Any) -> Any:
        """``outputs`` (tensors in any pytree) of the last pipeline rank on every rank: their
        shapes and dtypes first (as meta tensors), then the tensors."""
        box = [tree_map_only(Tensor, lambda t: t.to("meta"), outputs) if self.is_last else None]
        dist.broadcast_object_list(box, group_src=self.plan.pp - 1, group=self.pp_group)
        if not self.is_last:
            device = torch.device(self.device_type)
            outputs = tree_map_only(Tensor, lambda t: torch.empty_like(t, device=device), box[0])
        for tensor in tree_leaves(outputs):
            if isinstance(tensor, Tensor):
                dist.broadcast(tensor, group_src=self.plan.pp - 1, group=self.pp_group)
        return outputs

    def _check_batch(self, tensors: tuple[Tensor, ...]) -> None:
        """:class:`UsageError` unless every tensor splits on dim 0 into ``plan.microbatches``
        equal, non-empty micro-batches (the schedule would split it unevenly or run empty ones)."""
        m = self.plan.microbatches
        wrong = [tuple(t.shape) for t in tensors if t.dim() == 0 or t.size(0) < m or t.size(0) % m]
        if wrong:
            raise UsageError(f"plan {self.plan.name} splits each batch into {m} micro-batches on dim 0, but got "
                             f"shapes {wrong}\nHINT: give batches of a multiple of {m} samples, "
                             f"{m * self.plan.micro_batch_size} as the plan was costed (e.g. "
                             f"DataLoader(batch_size={m * self.plan.micro_batch_size}, drop_last=True))")

    def _tied_copies(self) -> list[nn.Parameter]:
        """This rank's copies of the tied weights (none on a rank between the first and last)."""
        held = {id(p): p for module in self.modules for group in self.tied for name in group
                if (p := _parameter(unwrap(module), name)) is not None}
        return list(held.values())

    def _equal_tied_copies(self) -> None:
        """Before the first forward: the last stage's copies of the tied weights take the first's
        values (each rank initialised its own, and a stage built on meta initialises the head's
        as a head)."""
        if not self._tied_equal:
            with torch.no_grad():
                for param in self._tied_copies():
                    dist.broadcast(local_part(param), src=self.tied_source, group=self.tied_group)
            self._tied_equal = True

    def _run(self, run: Callable[..., Any], inputs: tuple[Tensor, ...], target: Tensor, **options: Any) -> Tensor:
        self._check_batch((*inputs, target))
        self._equal_tied_copies()
        losses: list[Tensor] = []
        args = inputs if self.is_first else ()
        with vocab_parallel_loss(self.plan), autocast_context(self.plan, self.device_type):  # forward and loss
            run(*args, target=target if self.is_last else None, losses=losses if self.is_last else None, **options)
        # each micro-batch's loss comes divided by their number (build_schedule): the sum is the mean
        loss = torch.stack([local_part(x).detach().float() for x in losses]).sum() if self.is_last else \
            torch.zeros((), device=self.device_type)  # NCCL broadcasts device tensors only
        dist.broadcast(loss, group_src=self.plan.pp - 1, group=self.pp_group)
        return loss

    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of this rank's stages."""
        return self.modules.parameters()

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages' state under the original model's FQNs (DTensor shards under
        FSDP/TP), loadable into the unsplit model."""
        state: dict[str, Any] = {}
        for module in self.modules:
            state.update(unwrap(module).state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the entries of ``state`` (original FQNs, e.g. a whole model's) this rank's stages
        hold; :class:`UsageError` when one is missing."""
        for module in self.modules:
            inner = unwrap(module)
            missing = [k for k in inner.state_dict() if k not in state]
            if missing:
                raise UsageError(f"the state has no {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''} "
                                 "for this rank's pipeline stages\nHINT: load a state dict of the whole model "
                                 "(or of this rank's stages) under the model's own parameter names")
            inner.load_state_dict({k: state[k] for k in inner.state_dict()})


def rank_module(pipeline: Pipeline) -> nn.Module:
    """One module holding all of this rank's stages under the model's own names — the stage
    itself, or, for interleaved stages built by removal (not traced ones), a shallow copy of the
    model with the blocks (and embedding or head) of every stage of the rank — for parameters,
    state dicts and optimizers; it is never run."""
    stages = [unwrap(m) for m in pipeline.modules]
    merged = stages[0]
    for stage in stages[1:]:
        merged = _union(merged, stage)
    return merged


def _union(mine: nn.Module, other: nn.Module) -> nn.Module:
    """``mine`` with the children ``other`` holds and ``mine`` lacks (None or an Identity in
    place of a removed module), merging the containers both hold."""
    merged = _shallow_copy(mine)
    for name, child in other._modules.items():
        own = merged._modules.get(name)
        if child is None or child is own or isinstance(child, nn.Identity) and own is not None:
            continue
        if own is None or isinstance(own, nn.Identity):
            merged._modules[name] = child
        else:
            merged._modules[name] = _union(own, child)
    return merged


def _parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    """``module``'s parameter ``name``, None where the stage removed its module (None or an Identity)."""
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


def unwrap(module: nn.Module) -> nn.Module:
    """The stage module inside a DDP wrapper (FSDP2 and TP change modules in place)."""
    return module.module if isinstance(module, DistributedDataParallel) else module
