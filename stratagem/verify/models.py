"""The models ``verify`` trains, built for real in every rank: the forms ``advise`` accepts.

:func:`real_model` reads the name in the parent process too, so that what can be checked without
building (an unknown preset, a factory that does not import, a bad config) is a
:class:`~stratagem.errors.UsageError` before any rank is spawned. In the rank,
:func:`~stratagem.verify.runner.measure_plan` seeds torch's generator first, so every rank of a
plan builds the same model and batch.

* A preset: its random batch (token ids or images) and its loss, as before.
* ``pkg.module:factory``: the factory called for real (not under ``FakeTensorMode``) on the
  rank's device, with ``batch_size`` (the samples a rank runs per forward: micro-batch ×
  pipeline micro-batches) and ``seq_len`` where it declares them. Every step trains on the example
  inputs it returned (the same batch each step: no synthetic data), with the loss it returned or,
  without one, the profiler's fallback (an output's scalar ``.loss``, a scalar output, else the
  sum of the outputs). The batch comes with the model, so it counts in the measured memory; a
  first call under ``FakeTensorMode`` (as advise's) loads what the factory imports on first use.
  Parameters left on ``meta`` are materialized once the plan is applied.
* ``hf:PATH``: ``AutoModelForCausalLM.from_config`` in fp32 with random weights, token ids
  uniform below the vocabulary, labels = the inputs, and the model's own loss
  (``loss_function``, the shifted cross entropy its forward computes from labels) on its logits;
  a first build on ``meta`` loads the model's modules outside the measured memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from stratagem.advisor.profile.hf_configs import build_causal_lm, build_hf_config, read_hf_config
from stratagem.advisor.profile.sources import factory_arguments, factory_fake_mode, load_factory
from stratagem.errors import UsageError

__all__ = ["Batch", "Built", "RealModel", "fallback_loss", "real_model"]


@dataclass(frozen=True, slots=True)
class Batch:
    """One rank's batch: the model's positional and keyword inputs, and the targets its loss
    reads (None where the loss needs none: a factory's)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    targets: Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        """The same batch with every tensor on ``device``."""
        def move(value: Any) -> Any:
            return value.to(device) if isinstance(value, Tensor) else value

        return Batch(tree_map(move, self.args), tree_map(move, self.kwargs), move(self.targets))


@dataclass(frozen=True, slots=True)
class Built:
    """A model built in a rank, the batch it trains on and ``loss(output, targets)``."""

    module: nn.Module
    batch: Batch
    loss: Callable[[Any, Tensor | None], Tensor]


@dataclass(frozen=True, slots=True)
class RealModel:
    """How a rank builds a model: ``prepare(samples)`` first, loading what building imports and caches
    on first use (library code, left outside the measured memory as torch's own is; None: nothing
    to load); ``make_batch(samples)``, outside the measured memory too (None where the build makes
    the batch: a factory's example inputs); then ``build(samples, batch)`` on the ambient device."""

    name: str
    build: Callable[[int, Batch | None], Built]
    make_batch: Callable[[int], Batch] | None = None
    prepare: Callable[[int], None] | None = None

    @property
    def builds_module_alone(self) -> bool:
        """Whether ``build`` makes the module and nothing the step reads (its batch comes from
        ``make_batch``), so that it can build on ``meta`` and be materialized once split."""
        return self.make_batch is not None


def real_model(spec: str, *, seq_len: int | None) -> RealModel:
    """The model ``spec`` names (a preset, ``pkg.module:factory`` or ``hf:PATH``) as ranks build
    it for real; a :class:`UsageError` for what is wrong with the name, found without building."""
    if spec.startswith("hf:"):
        return _hf_model(spec[3:], seq_len=seq_len)
    if ":" in spec:
        return _factory_model(spec, seq_len=seq_len)
    return _preset_model(spec, seq_len=seq_len)


def _preset_model(name: str, *, seq_len: int | None) -> RealModel:
    from stratagem.models import PRESETS

    if name not in PRESETS:
        raise UsageError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}\n"
                         "HINT: a model is a preset name, 'pkg.module:factory' or 'hf:PATH/config.json'")
    preset = PRESETS[name]
    seq = seq_len or preset.default_seq_len

    def make_batch(samples: int) -> Batch:
        inputs, targets = preset.make_batch(samples, seq)
        return Batch(inputs, targets=targets)

    def build(_: int, batch: Batch | None) -> Built:
        assert batch is not None  # make_batch made it
        return Built(preset.build(), batch, preset.loss)

    return RealModel(name=name, build=build, make_batch=make_batch)


def _factory_model(spec: str, *, seq_len: int | None) -> RealModel:
    factory = load_factory(spec)
    factory_arguments(spec, factory, batch_size=1, seq_len=seq_len)  # a required argument nobody passes

    def call(samples: int, how: str) -> Any:
        kwargs = factory_arguments(spec, factory, batch_size=samples, seq_len=seq_len)
        try:
            return factory(**kwargs)
        except (Exception, SystemExit) as err:  # KeyboardInterrupt still stops the run
            first = (str(err).strip().splitlines() or [""])[0][:300]
            raise UsageError(f"factory {spec!r} raised {type(err).__name__}: {first} when called {how}\n"
                             "HINT: call it yourself to see the traceback") from err

    def prepare(samples: int) -> None:
        with factory_fake_mode():  # as advise calls it: nothing allocated
            call(samples, "under FakeTensorMode")

    def build(samples: int, _: Batch | None) -> Built:
        kwargs = factory_arguments(spec, factory, batch_size=samples, seq_len=seq_len)
        module, inputs, loss_fn = _unpack(spec, call(samples, "for real"))
        batch = _factory_batch(spec, inputs)
        _check_samples(spec, batch, samples, passed="batch_size" in kwargs)
        return Built(module, batch, (lambda output, _: loss_fn(output)) if loss_fn else
                     (lambda output, _: fallback_loss(output)))

    return RealModel(name=spec, build=build, prepare=prepare)


def _unpack(spec: str, made: Any) -> tuple[nn.Module, Any, Callable[[Any], Tensor] | None]:
    """(module, example inputs, loss or None) of what a factory returned."""
    if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module)):
        raise UsageError(f"{spec} must return (module, example_inputs) or (module, example_inputs, loss_fn) "
                         f"to be verified; it returned {type(made).__name__}\nHINT: return (module, (x,))")
    module, inputs, *loss = made
    loss_fn = loss[0] if loss else None
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"{spec} returned a loss of type {type(loss_fn).__name__}, not a callable\n"
                         "HINT: return loss_fn as a function of the module's output, or leave it out")
    return module, inputs, loss_fn


def _factory_batch(spec: str, inputs: Any) -> Batch:
    """A factory's example inputs as a batch: a tensor or a tuple/list are positional, a dict
    keyword arguments."""
    if isinstance(inputs, Tensor):
        return Batch((inputs,))
    if isinstance(inputs, (tuple, list)):
        return Batch(tuple(inputs))
    if isinstance(inputs, Mapping):
        return Batch((), dict(inputs))
    raise UsageError(f"{spec} returned example inputs of type {type(inputs).__name__}; they must be a tuple "
                     "of positional arguments or a dict of keyword arguments\nHINT: return (module, (x,))")


def _check_samples(spec: str, batch: Batch, samples: int, *, passed: bool) -> None:
    """A :class:`UsageError` unless the batch's first tensor (the one the profiler reads the
    batch size off) holds ``samples`` samples: the plan's predictions are for that many. A
    factory that declares ``batch_size`` was told it, as the profile was, and is trusted to
    follow it in whatever layout its inputs take (sequence-first tokens, EmbeddingBag's flat ids)."""
    if passed:
        return
    tensors = [t for t in tree_flatten((batch.args, batch.kwargs))[0] if isinstance(t, Tensor) and t.dim() > 0]
    if not tensors:
        raise UsageError(f"{spec}'s example inputs hold no tensor with a batch dimension\n"
                         "HINT: return the model's inputs for one batch, e.g. (module, (x,))")
    found = int(tensors[0].shape[0])
    if found != samples:
        hint = "give the factory a batch_size parameter (stratagem passes it by keyword)"
        raise UsageError(f"{spec}'s example inputs hold {found} samples, and each rank of this plan runs "
                         f"{samples} per forward (micro-batch x pipeline micro-batches)\nHINT: {hint}")


def fallback_loss(output: Any) -> Tensor:
    """The profiler's loss when a model comes without one: an output's scalar ``.loss``, a scalar
    output, else the sum (in fp32) of the output tensors that need gradients."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor) and loss.dim() == 0:
        return loss
    if isinstance(output, Tensor) and output.dim() == 0:
        return output
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
    if not leaves:
        raise UsageError("the model's output holds no tensor that needs gradients, so there is nothing to train\n"
                         "HINT: return a loss_fn from the factory, or check that the parameters require grad")
    return sum((t.float().sum() for t in leaves), torch.zeros((), device=leaves[0].device))


def _hf_model(path: str, *, seq_len: int | None) -> RealModel:
    config_path, data = read_hf_config(path)
    config = build_hf_config(data, str(config_path))
    text = config.get_text_config(decoder=True)
    vocab = text.vocab_size
    positions = getattr(text, "max_position_embeddings", None)
    # The sequence length load_model profiles at when none is given.
    seq = seq_len or min(positions if isinstance(positions, int) and positions > 0 else 2048, 4096)

    def make_batch(samples: int) -> Batch:
        ids = torch.randint(0, vocab, (samples, seq))
        return Batch((ids,), {"use_cache": False}, targets=ids)  # labels = inputs; the loss shifts them

    def prepare(_: int) -> None:
        with torch.device("meta"):  # the model's modules and transformers' caches load on first build
            build_module()

    def build_module() -> nn.Module:
        return build_causal_lm(config, dtype=torch.float32)[0]

    def build(_: int, batch: Batch | None) -> Built:
        assert batch is not None  # make_batch made it
        module = build_module()
        own_loss = module.loss_function

        def loss(output: Any, labels: Tensor | None) -> Tensor:
            logits = output if isinstance(output, Tensor) else output.logits  # a pipeline's last stage: logits
            return own_loss(logits=logits, labels=labels, vocab_size=vocab)

        return Built(module, batch, loss)

    return RealModel(name=f"hf:{path}", build=build, make_batch=make_batch, prepare=prepare)
