"""Turn what a user names as a model into a module, example inputs and a loss, allocating nothing.

Accepted forms (``load_model``):

* a preset name (``gpt2``, ``llama-2-70b``, ``vit-b-16``, …; see ``stratagem.models``);
* ``pkg.module:factory`` — a callable returning the module, or ``(module, example_inputs)``, or
  ``(module, example_inputs, loss_fn)``; it is called under ``FakeTensorMode`` (the tensors it
  makes, weights and labels a loss closes over included, allocate nothing) and gets
  ``batch_size``/``seq_len`` keyword arguments when it declares them (``seq_len`` only when given,
  and a usage error when given to one that does not declare it). The profile takes what it was
  told (or the ``seq_len`` default it declares) as the inputs' batch and sequence, whatever their
  layout; a factory that declares no ``batch_size`` is profiled at its first input's dimension 0.
  A factory's loss (which may hold the batch's targets), keyword inputs, or a first input whose
  dimension 0 is not the batch leave pipeline plans out (``profile.cache``);
* ``hf:PATH`` — a Hugging Face config file (``config.json`` or any other name) or the folder
  holding ``config.json``, built with ``AutoModelForCausalLM.from_config`` on meta, the
  language-model head and loss included. Its shape-giving numbers are checked before anything is
  built (:mod:`~stratagem.advisor.profile.hf_configs`), so a bad config is a :class:`UsageError`,
  never a hang.

Factories run user code (importing their module, then calling them): that is by design.
Whatever goes wrong in it, other than ``KeyboardInterrupt``, becomes a :class:`UsageError`.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from stratagem.advisor.profile.hf_configs import build_causal_lm, build_hf_config, is_encoder, read_hf_config
from stratagem.errors import UsageError, describe


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    """A model ready to profile: the module (on meta or fake tensors), its example inputs and its loss."""

    name: str
    module: nn.Module
    example_inputs: tuple | dict
    loss_fn: Callable[[Any], torch.Tensor] | None
    notes: tuple[str, ...] = ()
    batch_size: int | None = None  # what the inputs hold where a factory was told (None: read off them)
    seq_len: int | None = None


def load_model(spec: str, *, batch_size: int = 1, seq_len: int | None = None) -> ModelSource:
    """Build the model named by ``spec`` without allocating it (see the module docstring)."""
    if batch_size < 1:
        raise UsageError(f"batch size must be at least 1, got {batch_size}")
    if seq_len is not None and seq_len < 1:
        raise UsageError(f"sequence length must be at least 1, got {seq_len}")
    if spec.startswith("hf:"):
        return _from_hf_config(spec[3:], batch_size=batch_size, seq_len=seq_len)
    if ":" in spec:
        return _from_factory(spec, batch_size=batch_size, seq_len=seq_len)
    return _from_preset(spec, batch_size=batch_size, seq_len=seq_len)


def _from_preset(name: str, *, batch_size: int, seq_len: int | None) -> ModelSource:
    from stratagem.models import PRESETS

    if name not in PRESETS:
        raise UsageError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}\n"
                         "HINT: a model is a preset name, 'pkg.module:factory' or 'hf:PATH/config.json'")
    preset = PRESETS[name]
    if preset.input_kind != "tokens" and seq_len is not None:
        raise UsageError(f"{name} takes images, not token sequences: --seq-len does not apply to it\n"
                         "HINT: leave out --seq-len for image models")
    seq_len = seq_len or preset.default_seq_len
    with torch.device("meta"):
        module = preset.build()
        inputs, _ = preset.make_batch(batch_size, seq_len, device="meta")

    def loss_fn(output: Any) -> torch.Tensor:
        # Called inside the profiler's fake mode, so the targets made here are fake too.
        _, targets = preset.make_batch(batch_size, seq_len, device="cpu")
        return preset.loss(output, targets)

    return ModelSource(name=name, module=module, example_inputs=inputs, loss_fn=loss_fn,
                       notes=tuple(getattr(preset, "notes", ())))


# Factories: 'pkg.module:factory'. Each step turns what the user's code raises into a UsageError.

_FACTORY_HINT = "HINT: give 'pkg.module:callable' with the package importable (on PYTHONPATH)"
_SUPPLIED = ("batch_size", "seq_len")  # the only arguments stratagem passes a factory


def parse_factory_spec(spec: str) -> tuple[str, str]:
    """``(module, attribute)`` of ``'pkg.module:factory'``, each a dotted Python name, or a UsageError."""
    module_name, _, attr = spec.partition(":")
    for part, what in ((module_name, "module"), (attr, "factory")):
        if not part:
            raise UsageError(f"model {spec!r} names no {what}: a factory is 'pkg.module:factory'\n{_FACTORY_HINT}")
        if not all(piece.isidentifier() for piece in part.split(".")):
            raise UsageError(f"model {spec!r}: {part!r} is not a dotted Python name, as a {what} must be\n"
                             f"{_FACTORY_HINT}")
    return module_name, attr


def load_factory(spec: str) -> Callable[..., Any]:
    """Import the callable ``spec`` names (running its module's code), or raise a UsageError."""
    module_name, attr = parse_factory_spec(spec)
    try:
        target: Any = importlib.import_module(module_name)
    except SyntaxError as err:
        raise UsageError(f"cannot load factory {spec!r}: {err.filename}:{err.lineno} has a syntax error "
                         f"({err.msg})\nHINT: fix the module so that 'import {module_name}' works") from None
    except ImportError as err:
        raise UsageError(f"cannot load factory {spec!r}: {err}\n{_FACTORY_HINT}") from None
    except (Exception, SystemExit) as err:  # the module's own code failed while being imported
        raise UsageError(f"cannot load factory {spec!r}: importing {module_name} raised "
                         f"{describe(err)}\nHINT: fix the module so that 'import {module_name}' works") from None
    walked = module_name
    for name in attr.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise UsageError(f"cannot load factory {spec!r}: {walked} has no attribute {name!r}\n"
                             f"{_FACTORY_HINT}") from None
        except Exception as err:  # a module-level __getattr__ that fails
            raise UsageError(f"cannot load factory {spec!r}: reading {name!r} raised {describe(err)}\n"
                             f"{_FACTORY_HINT}") from None
        walked = f"{walked}.{name}"
    if not callable(target):
        raise UsageError(f"factory {spec!r} is not callable (it is of type {type(target).__name__}): a factory "
                         "is called to build the model\nHINT: name a function (or class) that returns the model")
    return target


def factory_arguments(spec: str, factory: Callable[..., Any], *, batch_size: int,
                      seq_len: int | None) -> dict[str, int]:
    """The keyword arguments ``factory`` gets: ``batch_size`` and ``seq_len`` where it declares them
    and they are given (a factory's own default stands otherwise); a UsageError if it requires
    an argument nobody supplies."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}  # no signature to read (some builtins): call it without arguments
    given = {"batch_size": batch_size, "seq_len": seq_len}
    kwargs, missing = {}, []
    for name, parameter in parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        keyword = parameter.kind is not parameter.POSITIONAL_ONLY
        if keyword and name in given and given[name] is not None:
            kwargs[name] = given[name]
        elif parameter.default is parameter.empty:
            missing.append(name)
    if given["seq_len"] is not None and "seq_len" not in kwargs:
        raise UsageError(f"factory {spec!r} declares no seq_len parameter: --seq-len does not apply to it\n"
                         "HINT: leave out --seq-len, or give the factory a seq_len parameter")
    if "seq_len" in missing:
        raise UsageError(f"factory {spec!r} requires seq_len and none was given\n"
                         "HINT: pass --seq-len N (seq_len=N from Python), or give the factory's seq_len a default")
    if missing:
        raise UsageError(f"factory {spec!r} requires {', '.join(map(repr, missing))}; stratagem passes a factory "
                         f"only {' and '.join(_SUPPLIED)} (by keyword)\nHINT: give those parameters defaults, "
                         "or name a function of no other arguments that calls this one")
    return kwargs


@contextmanager
def factory_fake_mode() -> Iterator[None]:
    """The FakeTensorMode a factory runs under, without the warning torch gives when a module
    deep-copies its fake parameters (``nn.TransformerEncoder`` clones its layer): ``data_ptr``
    of a fake tensor is read there and nowhere that matters."""
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
        yield


def _from_factory(spec: str, *, batch_size: int, seq_len: int | None) -> ModelSource:
    factory = load_factory(spec)
    kwargs = factory_arguments(spec, factory, batch_size=batch_size, seq_len=seq_len)
    try:
        with factory_fake_mode():
            made = factory(**kwargs)
    except (Exception, SystemExit) as err:  # KeyboardInterrupt still stops the run
        hint = ("HINT: a factory must return the model, not exit: find the sys.exit() it reaches"
                if isinstance(err, SystemExit) else
                f"HINT: call {spec.replace(':', '.')}({_call_text(kwargs)}) yourself to see the traceback")
        raise UsageError(f"factory {spec!r} raised {describe(err)}\n{hint}") from err
    return _unpack_factory_result(spec, made, batch_size=kwargs.get("batch_size"),
                                  seq_len=kwargs.get("seq_len", _default(factory, "seq_len")))


def _default(factory: Callable[..., Any], name: str) -> int | None:
    """The integer default of ``factory``'s parameter ``name``, or None: what it builds when not told."""
    try:
        parameter = inspect.signature(factory).parameters.get(name)
    except (TypeError, ValueError):
        return None
    default = parameter.default if parameter is not None else None
    return default if isinstance(default, int) and not isinstance(default, bool) and default > 0 else None


def _unpack_factory_result(spec: str, made: Any, *, batch_size: int | None, seq_len: int | None) -> ModelSource:
    if isinstance(made, nn.Module):
        raise UsageError(f"{spec} returned only a module; the profiler needs example inputs too\n"
                         "HINT: return (module, example_inputs) or (module, example_inputs, loss_fn)")
    if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module)):
        raise UsageError(f"{spec} must return a module, (module, example_inputs) or (module, example_inputs, "
                         f"loss_fn); it returned {type(made).__name__}\nHINT: return (module, example_inputs)")
    module, inputs, *loss = made
    if not isinstance(inputs, (tuple, list, Mapping, torch.Tensor)):
        raise UsageError(f"{spec} returned example inputs of type {type(inputs).__name__}; they must be a tuple "
                         "of positional arguments or a dict of keyword arguments\nHINT: return (module, (x,))")
    loss_fn = loss[0] if loss else None
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"{spec} returned a loss of type {type(loss_fn).__name__}, not a callable\n"
                         "HINT: return loss_fn as a function of the module's output, or leave it out")
    inputs = tuple(inputs) if isinstance(inputs, list) else inputs
    return ModelSource(name=spec, module=module, example_inputs=inputs, loss_fn=loss_fn,
                       batch_size=batch_size, seq_len=seq_len)


def _call_text(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


POSITION_OFFSETS = (0, 2)
"""Rows a learned position table holds beyond ``max_position_embeddings`` (OPT's: 2)."""


def _check_positions(module: nn.Module, positions: Any, seq_len: int, where: str) -> None:
    """:class:`UsageError` when ``seq_len`` exceeds the ``positions`` of a learned position table
    (an embedding of that many rows: GPT-2's, OPT's, BERT's), which has no row for the rest;
    rotary and ALiBi models take any length."""
    if not isinstance(positions, int) or seq_len <= positions:
        return
    if any(isinstance(m, nn.Embedding) and m.num_embeddings - positions in POSITION_OFFSETS for m in module.modules()):
        raise UsageError(f"--seq-len {seq_len} is longer than the {positions} positions the model of {where} "
                         f"learns (max_position_embeddings)\nHINT: --seq-len {positions} or less")


def _from_hf_config(path: str, *, batch_size: int, seq_len: int | None) -> ModelSource:
    config_path, data = read_hf_config(path)
    config = build_hf_config(data, str(config_path))
    positions = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    seq_len = seq_len or min(positions if isinstance(positions, int) and positions > 0 else 2048, 4096)
    try:
        with torch.device("meta"):
            module, note = build_causal_lm(config)
            ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    except Exception as err:
        raise UsageError(f"transformers cannot build the causal language model of {config_path}: {describe(err)}\n"
                         "HINT: check that transformers can build this model type "
                         "(AutoModelForCausalLM.from_config) and the config's sizes") from None
    _check_positions(module, positions, seq_len, str(config_path))
    named = data.get("_name_or_path")
    name = named if isinstance(named, str) and named else str(config_path.parent if config_path.name == "config.json"
                                                               else config_path)
    notes = (note,) if note else ()
    if is_encoder(data):
        notes += (f"{data['model_type']} models train as masked language models too; this one is profiled as "
                  f"AutoModelForCausalLM builds it ({type(module).__name__}), with causal attention, where masked "
                  "language modelling attends both ways (the same weights and activations, the attention core's "
                  "FLOPs twice under flash attention).",)
    return ModelSource(name=f"hf:{name}", module=module,
                       example_inputs={"input_ids": ids, "labels": ids, "use_cache": False}, loss_fn=None,
                       notes=notes)
