"""What the strategies profile to choose a plan: the training step the run trains with.

A LightningModule's ``training_step`` on a dataloader batch, or under Fabric the model and the
``loss_fn`` the user names, runs on fake tensors (:func:`profile_model`'s ``step_fn``), so the
loss and whatever the step computes around forward (a large vocabulary's fp32 logits and their
gradients) are in the profile. When the step cannot run on fake tensors (a ``.item()``,
data-dependent control flow, an operator fake tensors lack), forward alone is profiled as before
and the profile's notes say why. Imports neither Lightning nor Fabric.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from stratagem.errors import UsageError

if TYPE_CHECKING:
    from stratagem.advisor.profile.model_profile import ModelProfile

__all__ = ["TrainingStep", "as_inputs", "fabric_step", "forward_inputs", "lightning_step", "positional",
           "profile_for_plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingStep:
    """One training step to profile in place of forward alone: ``run(module, *inputs)`` (keyword
    ``inputs`` for a dict) returns the loss. ``forward_inputs`` are forward's inputs in that step,
    which give the batch size and sequence length (None: read from ``inputs``); ``fallback()``
    gives the inputs forward is profiled on when the step cannot run; ``name`` is the step's, for
    the note saying so; ``in_forward``: the strategy runs the whole step as the module's forward
    (Lightning's under FSDP), so its loss runs inside the root FSDP unit's forward wherever the
    step computes it (``ModelProfile.loss_in_forward``)."""

    run: Callable[..., Tensor]
    inputs: tuple[Any, ...] | Mapping[str, Any]
    forward_inputs: Any
    fallback: Callable[[], Any]
    name: str
    in_forward: bool = False


def as_inputs(inputs: Any) -> tuple[Any, ...] | Mapping[str, Any]:
    """Forward's inputs as :func:`profile_model` takes them: a tensor becomes a 1-tuple."""
    return inputs if isinstance(inputs, (tuple, list, Mapping)) else (inputs,)


def profile_for_plan(module: nn.Module, example: Any, *, precision: str, kernels: str = "gpu") -> ModelProfile:
    """The profile a plan is chosen from: ``example`` a :class:`TrainingStep` traced on fake
    tensors, else forward's inputs (backward seeded as :func:`profile_model` does without a loss).
    A step that cannot run is profiled as forward alone on its ``fallback()``, with a note (and a
    warning) giving the reason; a model that fails there too raises that error. ``kernels``: whose
    (``profile_model``)."""
    from stratagem.advisor.profile.profiler import profile_model

    if not isinstance(example, TrainingStep):
        return profile_model(module, as_inputs(example), precision=precision, kernels=kernels)
    profile = _step_profile(module, example, precision=precision, kernels=kernels)
    return profile.with_loss_in_forward() if example.in_forward else profile


def _step_profile(module: nn.Module, example: TrainingStep, *, precision: str, kernels: str) -> ModelProfile:
    """:func:`profile_for_plan` of a step: traced, else forward alone with the note."""
    from stratagem.advisor.profile.profiler import input_shape, profile_model

    shape = (None, None) if example.forward_inputs is None else input_shape(as_inputs(example.forward_inputs))
    try:
        return profile_model(module, example.inputs, step_fn=example.run, precision=precision,
                             batch_size=shape[0], seq_len=shape[1], kernels=kernels)
    except Exception as err:  # any failure of the step: forward alone is profiled, and the note says why
        cause = err.__cause__ or err
        reason = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
    note = (f"{example.name} could not run on fake tensors ({reason}), so forward was profiled alone: the loss "
            "and whatever the step computes around forward are not in the profile")
    log.warning("auto-parallel: %s", note)
    profile = profile_model(module, as_inputs(example.fallback()), precision=precision, kernels=kernels)
    return replace(profile, notes=(*profile.notes, note))


def fabric_step(inputs: Any, loss_fn: Callable[[Any], Tensor]) -> TrainingStep:
    """Fabric's step: ``loss_fn(model(*inputs))``."""
    inputs = as_inputs(inputs)

    def run(model: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
        return loss_fn(model(*args, **kwargs))

    return TrainingStep(run=run, inputs=inputs, forward_inputs=inputs, fallback=lambda: inputs, name="loss_fn")


def lightning_step(module: nn.Module, batch: Any, fallback: Callable[[], Any]) -> TrainingStep:
    """``module.training_step(batch, 0)``, its loss (a tensor, or a dict's ``"loss"``) profiled;
    the batch size and sequence length are forward's in that step (captured on the real batch,
    stopping at forward), or the batch's when the step calls a child rather than ``self(...)``."""
    try:
        with _outside_the_loop(module):
            forward = forward_inputs(module, lambda: module.training_step(batch, 0))
    except Exception:  # the step calls a child, or fails before forward: the traced step says why, if it does
        forward = None
    return TrainingStep(run=_training_step, inputs=(batch,), forward_inputs=forward, fallback=fallback,
                        name=f"{type(module).__name__}.training_step", in_forward=True)


class _Captured(Exception):
    """Raised by the forward pre-hook of :func:`forward_inputs` to stop the step it caught."""

    def __init__(self, inputs: Any) -> None:
        super().__init__()
        self.inputs = inputs


def positional(inputs: Any) -> tuple[Any, ...]:
    """``inputs`` as positional arguments: a tuple or list's items, else the one value."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def forward_inputs(module: nn.Module, step: Callable[[], Any]) -> tuple[Any, ...] | dict[str, Any]:
    """The inputs of ``module``'s first forward call in ``step()`` (e.g. a ``training_step`` on one
    batch), without running the forward: a tuple of positional or a dict of keyword arguments."""

    def capture(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise _Captured((args, kwargs))

    handle = module.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        step()
    except _Captured as caught:
        args, kwargs = caught.inputs
    else:
        raise UsageError(f"{type(module).__name__} was never called on the batch, so there is nothing to profile\n"
                         "HINT: call self(...) in the step, or set example_input_array")
    finally:
        handle.remove()
    if args and kwargs:
        raise UsageError(f"{type(module).__name__}.forward takes positional and keyword inputs at once, which the "
                         "profiler cannot take\nHINT: set example_input_array to one of the two")
    return args or kwargs


def _training_step(module: nn.Module, batch: Any) -> Tensor:
    """The loss ``module.training_step(batch, 0)`` returns, run as :func:`_outside_the_loop`."""
    if not getattr(module, "automatic_optimization", True):
        raise UsageError("training_step runs its own backward and optimizer step (manual optimization)")
    with _outside_the_loop(module):
        output = module.training_step(batch, 0)
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if loss is None:
        raise UsageError("training_step returned no loss for the batch (it skips it)")
    return loss


def _no_op(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``self.log``/``self.log_dict`` while the step is profiled."""


@contextmanager
def _outside_the_loop(module: nn.Module) -> Iterator[None]:
    """Run a step outside Lightning's loop: ``self.log``/``log_dict`` do nothing (in setup there
    is no result collection or hook name for them, and ``sync_dist`` would wait on the other
    ranks), and the module's public attributes are put back afterwards, so that nothing the step
    stores (a list of outputs it appends to) keeps a fake tensor."""
    state = vars(module)
    saved = {key: (value, _contents(value)) for key, value in state.items() if not key.startswith("_")}
    state["log"] = state["log_dict"] = _no_op
    try:
        yield
    finally:
        for key in [key for key in state if not key.startswith("_") and key not in saved]:
            del state[key]
        for key, (value, contents) in saved.items():
            state[key] = value
            if isinstance(value, list):
                value[:] = contents
            elif isinstance(value, (dict, set)):
                value.clear()
                value.update(contents)


def _contents(value: Any) -> Any:
    """A copy of a list's, dict's or set's items (put back in place after the step); None otherwise."""
    return copy.copy(value) if isinstance(value, (list, dict, set)) else None
