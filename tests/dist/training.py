"""Train a tiny preset for a few optimizer steps, once in one process and once under a Plan on ranks.

Both runs start from the same seed and see the same global batches. Under a Plan,
data-parallel rank ``r`` takes the ``r``-th equal slice of each and splits it into
``grad_accum`` micro-batches (each loss divided by ``grad_accum``); the per-step loss is
averaged over ranks. The single process runs the very same micro-batches one after another
and accumulates their gradients (each loss divided by ``grad_accum × dp``), so the two runs
differ only in where gradients are summed: across ranks, or in one process.

Buffers a forward updates (BatchNorm's running statistics) are not reduced by any plan: each
data-parallel replica updates its own from its own micro-batches (FSDP), or from rank 0's at the
start of every forward (DDP's ``broadcast_buffers``), after which data-parallel rank 0 holds
what it computed from its own micro-batches alone. The single process therefore keeps one set
of buffers per data-parallel rank, each updated by that rank's micro-batches only (normalization
in training uses the batch's statistics, so this changes no output), and a run's ``buffers`` are
those of data-parallel rank 0 (every pipeline stage's).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.func import functional_call
from torch.nn.parallel import DistributedDataParallel

from stratagem.plan import Plan
from stratagem.models import Preset, get_preset
from stratagem.plugins import (apply_plan, autocast_context, build_mesh, build_optimizer, clip_grad_norm_,
                               clip_grad_value_, vocab_parallel_loss)
from stratagem.plugins.pipeline import unwrap
from stratagem.plugins.precision import apply_param_dtype, fp32_norm_names
from spawn import RANK_THREADS

STEPS = 5
SEQ_LEN = 16
SEED = 1234
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    # AdamW hardly sees a gradient's scale; SGD's update is proportional to it.
    "sgd": (torch.optim.SGD, {"lr": 0.5}),
    # The multi-tensor step torch.optim takes on GPUs (on CPU it steps one tensor at a time): a TP
    # rank's DTensors and plain tensors must reach it in separate groups (plugins/parameter_groups.py).
    "adamw-foreach": (torch.optim.AdamW, {"lr": 1e-3, "foreach": True}),
}

Reference = Literal["fp32", "autocast-bf16", "bf16-params"]
"""How the single process computes: in fp32; under ``torch.autocast(bfloat16)`` (what DDP with
a ``*-mixed`` plan does); or forward/backward through bfloat16 copies of fp32 master weights
with fp32 gradients, BatchNorm's weights left fp32 and floating inputs cast to bfloat16 (what
FSDP2's ``MixedPrecisionPolicy`` does, as the plugins apply it)."""


@dataclass(frozen=True, slots=True)
class Case:
    """One plan to train, the preset it trains and how its single-process reference computes."""

    name: str
    plan: Plan
    preset: str | Preset = "llama-tiny"
    reference: Reference = "fp32"
    optimizer: Literal["adamw", "sgd", "adamw-foreach"] = "adamw"
    clip: float | None = None  # clip the gradients to this global norm (or value) before each step
    clip_by: Literal["norm", "value"] = "norm"

    @property
    def model(self) -> Preset:
        """The preset, by name, or given as one (a variant of a named preset)."""
        return self.preset if isinstance(self.preset, Preset) else get_preset(self.preset)

    def build_optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        """The single-process optimizer for ``module``."""
        cls, options = OPTIMIZERS[self.optimizer]
        return cls(module.parameters(), **options)


@dataclass(frozen=True, slots=True)
class Run:
    """Per-step losses, the final full weights by parameter FQN, data-parallel rank 0's final
    buffers by FQN (module docstring) and, for a plan, what its first step showed (``facts``:
    wrapper and optimizer class, output dtype, and whether a block's parameters were sharded
    between forward and backward)."""

    losses: list[float]
    weights: dict[str, Tensor]
    buffers: dict[str, Tensor] = field(default_factory=dict)
    facts: dict[str, object] = field(default_factory=dict)


def global_batches(case: Case) -> list[tuple[tuple[Tensor, ...], Tensor]]:
    """The ``STEPS`` global batches every run of ``case`` sees; floating inputs (images) in
    bfloat16 for a ``bf16-true`` plan, as a training loop feeds a model cast whole."""
    generator = torch.Generator().manual_seed(SEED)
    preset = case.model
    batches = [preset.make_batch(case.plan.global_batch_size, SEQ_LEN, generator=generator) for _ in range(STEPS)]
    if case.plan.precision != "bf16-true":
        return batches
    return [(tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs), targets)
            for inputs, targets in batches]


@contextmanager
def rank_threads() -> Iterator[None]:
    """Run as many intra-op threads as each spawned rank (:data:`spawn.RANK_THREADS`): oneDNN's
    convolution weight gradients sum in an order that follows the thread count, so a reference
    with more threads differs from the ranks in the last bits, which AdamW magnifies where a
    gradient is near zero (on an AVX-512 host the traced ResNet pipeline's weights left the fp32
    tolerance within five steps)."""
    before = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_single(case: Case) -> Run:
    """Train ``case``'s preset in this process on the same global batches, taken as the same
    micro-batches the plan's ranks take, one after another, gradients accumulated, with the
    ranks' thread count (:func:`rank_threads`)."""
    with rank_threads():
        return _train_single(case)


def _train_single(case: Case) -> Run:
    plan, preset = case.plan, case.model
    torch.manual_seed(SEED)
    model = preset.build()
    apply_param_dtype(model, plan)  # the model the plan trains: bf16-true casts it (BatchNorm apart)
    optimizer = case.build_optimizer(model)
    replicas = [_buffers(model)] * plan.dp  # each data-parallel rank's buffers (module docstring)
    losses, norms = [], []  # norms: the gradients' global norm at each step, where the case clips
    for inputs, targets in global_batches(case):
        step_loss = torch.zeros(())
        for rank in range(plan.dp):
            _load_buffers(model, replicas[rank])
            for micro_inputs, micro_targets in micro_batches(inputs, targets, plan, rank=rank):
                output = _reference_forward(model, micro_inputs, case.reference)
                loss = preset.loss(output, micro_targets) / (plan.microbatches * plan.grad_accum * plan.dp)
                loss.backward()
                step_loss += loss.detach()
            replicas[rank] = _buffers(model)
        if case.clip is not None and case.clip_by == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), case.clip)
        elif case.clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss.item())
    return Run(losses, {name: p.detach().clone() for name, p in model.named_parameters()}, replicas[0],
               {"grad_norms": norms})


def _buffers(model: nn.Module) -> dict[str, Tensor]:
    """Copies of ``model``'s buffers by FQN."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _load_buffers(model: nn.Module, buffers: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


def _reference_forward(model: nn.Module, inputs: tuple[Tensor, ...], reference: Reference) -> Tensor:
    if reference == "autocast-bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(*inputs)
    if reference == "bf16-params":  # autograd casts the bf16 gradients back to the fp32 masters
        fp32 = {f"{norm}.{name}" for norm in fp32_norm_names(model)  # FSDP keeps BatchNorm float32
                for name, _ in model.get_submodule(norm).named_parameters()}
        params = {name: p if name in fp32 else p.to(torch.bfloat16) for name, p in model.named_parameters()}
        inputs = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs)  # as FSDP's root
        return functional_call(model, params, inputs)
    return model(*inputs)


def train_plans(rank: int, world_size: int, cases: list[Case]) -> dict[str, Run]:
    """On every rank: train each case under its plan (for :func:`spawn.run_on_ranks`)."""
    return {case.name: _train_plan(case, rank=rank, world_size=world_size) for case in cases}


def _train_plan(case: Case, *, rank: int, world_size: int) -> Run:
    plan, preset = case.plan, case.model
    if plan.pp > 1:
        return _train_pipeline(case, rank=rank, world_size=world_size)
    torch.manual_seed(SEED)
    model = apply_plan(preset.build(), plan, build_mesh(plan, device_type="cpu"))
    cls, options = OPTIMIZERS[case.optimizer]
    optimizer = build_optimizer(model, plan, cls, **options)
    facts: dict[str, object] = {"wrapper": type(model).__name__, "optimizer": type(optimizer).__name__,
                                **_embedding_facts(model)}
    losses, norms = [], []  # norms: the gradients' global norm at each step, where the case clips
    for inputs, targets in global_batches(case):
        step_loss = torch.zeros(())
        for micro_inputs, micro_targets in micro_batches(inputs, targets, plan, rank=dp_rank(plan, rank)):
            with vocab_parallel_loss(plan):
                with autocast_context(plan, "cpu"):
                    output = model(*micro_inputs)
                    loss = preset.loss(output, micro_targets) / plan.grad_accum
                facts.setdefault("output_dtype", output.dtype)
                facts.setdefault("logits_on_shards", isinstance(output, DTensor))
                facts.setdefault("sharded_between_forward_and_backward", _block_is_sharded(model, plan))
                loss.backward()
            step_loss += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        if case.clip is not None and case.clip_by == "value":
            clip_grad_value_(model.parameters(), case.clip)
        elif case.clip is not None:
            norms.append(clip_grad_norm_(model.parameters(), case.clip).item())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(step_loss)  # gloo has no AVG: sum, then divide (TP ranks repeat a loss)
        losses.append(step_loss.item() / world_size)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    facts["grad_norms"] = norms
    return Run(losses, _full_weights(model), _buffers(inner), facts)  # rank 0's: data-parallel rank 0


def _train_pipeline(case: Case, *, rank: int, world_size: int) -> Run:
    """Train ``case`` as a pipeline: each step runs the data-parallel rank's slice of the global
    batch through the schedule (its micro-batches); every rank's stage weights are gathered."""
    plan, preset = case.plan, case.model
    torch.manual_seed(SEED)
    size = plan.micro_batch_size * plan.microbatches
    mine = slice(dp_rank(plan, rank) * size, (dp_rank(plan, rank) + 1) * size)
    local = [(tuple(t[mine] for t in inputs), targets[mine]) for inputs, targets in global_batches(case)]
    example = tuple(t[:plan.micro_batch_size] for t in local[0][0])
    model = preset.build()
    built = [weakref.ref(p) for p in model.parameters()]
    pipe = apply_plan(model, plan, build_mesh(plan, device_type="cpu"), loss_fn=preset.loss, example_inputs=example)
    del model  # no gc.collect(): what a caller that drops the model is left with
    held = {id(p) for p in pipe.parameters()}
    stale = sum((p := ref()) is not None and id(p) not in held for ref in built)
    cls, options = OPTIMIZERS[case.optimizer]
    optimizer = build_optimizer(pipe.modules, plan, cls, **options)
    facts: dict[str, object] = {"wrapper": [type(m).__name__ for m in pipe.modules],
                                "optimizer": type(optimizer).__name__, "stale_parameters": _gather_objects(stale)}
    losses, norms = [], []  # norms: the gradients' global norm at each step, where the case clips
    for step, (inputs, targets) in enumerate(local):
        with SavedBytes(pipe.parameters()) as saved:
            loss = pipe.step(*inputs, target=targets)
        if step == 1:  # the first step also infers the stages' shapes
            facts["peak_saved_bytes"] = _gather_objects(saved.peak)  # per rank
        if case.clip is not None and case.clip_by == "value":
            clip_grad_value_(pipe.parameters(), case.clip)
        elif case.clip is not None:
            norms.append(pipe.clip_grad_norm_(case.clip).item())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss)  # every rank holds its replica's loss: sum, then divide
        losses.append(loss.item() / world_size)
    facts["state_dict_keys"] = _gather_objects(sorted(pipe.state_dict()))  # per rank
    mine = {name: b for m in pipe.modules for name, b in _buffers(unwrap(m)).items()} \
        if dp_rank(plan, rank) == 0 else {}
    buffers = {name: b for part in _gather_objects(mine) for name, b in part.items()}  # before evaluate's forward
    inputs, targets = local[0]
    facts["eval_loss"] = _gather_objects(pipe.evaluate(*inputs, target=targets).item())  # trained weights
    if "vocab_loss" in plan.vocab_tp_styles:  # the logits come back whole, plain
        predicted = pipe.predict(*inputs)
        facts["predicted"] = (type(predicted).__name__, tuple(predicted.shape))
    weights: dict[str, Tensor] = {}
    for part in _gather_objects({name: w for m in pipe.modules for name, w in _full_weights(m).items()}):
        weights.update(part)
    facts["grad_norms"] = norms
    return Run(losses, weights, buffers, facts)


class SavedBytes:
    """While active: the bytes autograd keeps for backward, each storage once, parameters
    excluded (what the profiler counts as ``saved_bytes``), live (released as backward frees
    them) and at their ``peak``."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        self._params = {StorageWeakRef(p.untyped_storage()) for p in params}
        self._holders: dict[StorageWeakRef, int] = {}
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: Tensor) -> object:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref in self._params:
            return _Held(tensor, None)
        if not self._holders.get(ref):
            self.live += tensor.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self._holders[ref] = self._holders.get(ref, 0) + 1
        return _Held(tensor, partial(self._release, ref, tensor.untyped_storage().nbytes()))

    def _release(self, ref: StorageWeakRef, num_bytes: int) -> None:
        self._holders[ref] -= 1
        if not self._holders[ref]:
            self.live -= num_bytes


class _Held:
    """A saved tensor as autograd keeps it; dropping it (backward done) tells the counter."""

    def __init__(self, tensor: Tensor, release: Callable[[], None] | None) -> None:
        self.tensor, self._release = tensor, release

    def __del__(self) -> None:
        if self._release is not None:
            self._release()


def _gather_objects(obj: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def dp_rank(plan: Plan, rank: int) -> int:
    """The data-parallel rank of global rank ``rank`` (mesh pp × dp_replicate × dp_shard × tp)."""
    return (rank // plan.tp) % plan.dp


def _embedding_facts(model: nn.Module) -> dict[str, object]:
    """For a model with a token embedding: the table's rows this rank holds (``embedding_rows``) and
    whether the output layer still shares its weight (``tied``)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    embedding = getattr(inner, "tok_embeddings", None)
    if embedding is None:
        return {}
    weight = embedding.weight
    rows = (weight.to_local() if isinstance(weight, DTensor) else weight).shape[0]
    return {"embedding_rows": rows, "tied": inner.output.weight is weight}


def _block_is_sharded(model: nn.Module, plan: Plan) -> bool:
    """Whether the first block's parameters are DTensor shards right now (FSDP registers the
    unsharded tensors while parameters are gathered)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return isinstance(next(inner.get_submodule(plan.block_container or "layers")[0].parameters()), DTensor)


def assert_no_weight_repeats_its_half(weights: dict[str, Tensor]) -> None:
    """No weight of ``weights`` (full tensors) has two equal halves along dim 0: what initialising a
    model after FSDP sharded it over two CPU ranks gave (each rank drew its shard's values from its
    own generator, the same ones)."""
    split = {name: w for name, w in weights.items() if w.dim() == 2 and w.shape[0] % 2 == 0}
    assert split and not [name for name, w in split.items() if torch.equal(*w.chunk(2))]


def initial_weights(case: Case) -> dict[str, Tensor]:
    """The weights every run of ``case`` starts from."""
    torch.manual_seed(SEED)
    return {name: p.detach() for name, p in case.model.build().named_parameters()}


def micro_batches(inputs: tuple[Tensor, ...], targets: Tensor, plan: Plan,
                  *, rank: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """Data-parallel rank ``rank``'s slice of the global batch, as ``microbatches × grad_accum``
    micro-batches (:func:`dp_rank` gives a global rank's data-parallel rank)."""
    local = plan.micro_batch_size * plan.microbatches * plan.grad_accum
    mine = slice(rank * local, (rank + 1) * local)
    split = [t[mine].split(plan.micro_batch_size) for t in (*inputs, targets)]
    for *micro_inputs, micro_targets in zip(*split):
        yield tuple(micro_inputs), micro_targets


def _full_weights(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter in full, under its unwrapped FQN (a collective for FSDP's DTensors)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in inner.named_parameters()
    }
