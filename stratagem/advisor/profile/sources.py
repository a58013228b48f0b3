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
  built (:func:`check_hf_config`), so a bad config is a :class:`UsageError`, never a hang.

Factories run user code (importing their module, then calling them): that is by design.
Whatever goes wrong in it, other than ``KeyboardInterrupt``, becomes a :class:`UsageError`.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import json
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from stratagem.errors import UsageError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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
                         f"{_describe(err)}\nHINT: fix the module so that 'import {module_name}' works") from None
    walked = module_name
    for name in attr.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise UsageError(f"cannot load factory {spec!r}: {walked} has no attribute {name!r}\n"
                             f"{_FACTORY_HINT}") from None
        except Exception as err:  # a module-level __getattr__ that fails
            raise UsageError(f"cannot load factory {spec!r}: reading {name!r} raised {_describe(err)}\n"
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
        raise UsageError(f"factory {spec!r} raised {_describe(err)}\n{hint}") from err
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


def _describe(err: BaseException) -> str:
    """An exception in one line: its type and message (shortened), or what sys.exit was called with."""
    if isinstance(err, SystemExit):
        return f"SystemExit (it called sys.exit({err.code!r}))"
    try:
        text = " ".join(str(err).split())  # one line, however many the message had
    except Exception:  # an exception whose __str__ fails
        text = ""
    text = text if len(text) <= 300 else f"{text[:297]}..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _call_text(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def close_matches(word: str, choices: list[str]) -> str:
    """' (did you mean a, b?)' for the choices close to ``word``, else ''."""
    found = difflib.get_close_matches(word[:100], choices, n=3)
    return f" (did you mean {', '.join(found)}?)" if found else ""


# Hugging Face configs: read, check, then build. The checks come first, so a config that would
# build for minutes (or divide by zero) is refused at once.

# name: (the keys configs spell it with, least, most, why the most). The bounds sit far above any
# published model, and keep every weight's element count (at most 2**60, a fused expert weight's)
# and every sum of them inside a 64-bit index.
_SIZE_LIMITS: dict[str, tuple[tuple[str, ...], int, int, str]] = {
    "num_hidden_layers": (("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 1, 1024,
                          "the deepest published language models have under 200 layers"),
    "hidden_size": (("hidden_size", "n_embd", "d_model"), 1, 2**18,
                    "the widest published model, PaLM 540B, has 18,432"),
    "num_attention_heads": (("num_attention_heads", "n_head", "num_heads", "n_heads"), 1, 2**16,
                            "published models have at most a few hundred heads"),
    "num_key_value_heads": (("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"),
                            1, 2**16, "published models have at most a few hundred heads"),
    "head_dim": (("head_dim", "kv_channels", "attention_head_size", "qk_head_dim", "qk_nope_head_dim", "v_head_dim"),
                 1, 2**18, "published heads have at most a few hundred dimensions"),
    "intermediate_size": (("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size",
                           "moe_intermediate_size"), 1, 2**20,
                          "the widest published feed-forward layer, PaLM 540B's, has 73,728"),
    "vocab_size": (("vocab_size", "padded_vocab_size"), 1, 2**22,
                   "published vocabularies have at most about 262,000 tokens"),
    "max_position_embeddings": (("max_position_embeddings", "n_positions", "n_ctx"), 1, 2**24,
                                "the longest published context is about 10 million tokens"),
    "num_local_experts": (("num_local_experts", "num_experts", "n_routed_experts"), 0, 2**21,
                          "the most published, PEER's, has about a million (1024 x 1024)"),
    "num_experts_per_tok": (("num_experts_per_tok",), 0, 2**12, "published routers pick a handful of experts"),
}

_PER_LAYER = frozenset({"intermediate_size"})  # may be a list, one per layer (Gemma 3n)


def check_hf_config(data: Mapping[str, Any], where: str) -> None:
    """Check a config's JSON before transformers sees it: a ``model_type`` transformers builds a
    causal LM for, and every shape-giving number present (the top level and ``text_config``) a
    positive integer within ``_SIZE_LIMITS``, the heads dividing the hidden size. Fast: no model
    is built. Raises a UsageError naming ``where`` (the file)."""
    _check_model_type(data, where)
    _check_sizes(data, where, head_dim_given=_head_dim_given(data))
    text = data.get("text_config")
    if isinstance(text, Mapping):
        _check_sizes(text, f"{where} (text_config)", head_dim_given=_head_dim_given(text))


def check_resolved_config(config: Any, data: Mapping[str, Any], where: str) -> None:
    """The same checks on the sizes a built transformers (text) config holds, the model type's
    defaults included: a key the file leaves out takes a default the file's others must fit."""
    values = {}
    for name in _SIZE_LIMITS.keys() - {"max_position_embeddings"}:  # XLNet's is -1: unlimited
        try:
            values[name] = getattr(config, name, None)
        except Exception:  # a property that cannot answer: nothing to check
            values[name] = None
    text = data.get("text_config")
    given = _head_dim_given(data) or (isinstance(text, Mapping) and _head_dim_given(text))
    _check_sizes(values, f"{where} (with the model type's defaults)", head_dim_given=given)


def _check_model_type(data: Mapping[str, Any], where: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = data.get("model_type")
    hint = 'HINT: set "model_type" to the name transformers knows the architecture by, e.g. "llama" or "gpt2"'
    if model_type is None:
        raise UsageError(f"{where} has no model_type: transformers picks the architecture by it\n{hint}")
    if not isinstance(model_type, str):
        raise UsageError(f"{where}: model_type must be a string, got {_show(model_type)}\n{hint}")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UsageError(f"{where}: model_type {_show(model_type)} is not a model type this transformers knows"
                         f"{close_matches(model_type, list(CONFIG_MAPPING_NAMES))}\n{hint} (or upgrade transformers)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{where}: model_type {model_type!r} has no causal language model in transformers, and "
                         "hf: builds one (AutoModelForCausalLM)\nHINT: give the config of a decoder model "
                         "(llama, gpt2, mistral, ...), or a factory ('pkg.module:factory') for this one")


def _check_sizes(values: Mapping[str, Any], where: str, *, head_dim_given: bool) -> None:
    """Every size in ``values`` an integer within its limits; heads dividing the width."""
    found: dict[str, int] = {}
    for name, (keys, least, most, why) in _SIZE_LIMITS.items():
        for key in keys:
            value = values.get(key)
            if name in _PER_LAYER and isinstance(value, list) and 0 < len(value) <= _SIZE_LIMITS[
                    "num_hidden_layers"][2]:
                for item in value:  # one size per layer
                    _check_size(key, item, least, most, why, where)
            elif value is not None:
                found.setdefault(name, _check_size(key, value, least, most, why, where))
    hidden, heads, kv_heads = (found.get(n) for n in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    if hidden and heads and not head_dim_given and hidden % heads:
        raise UsageError(f"{where}: num_attention_heads ({heads}) does not divide hidden_size ({hidden}); each "
                         "head gets hidden_size / num_attention_heads dimensions\nHINT: choose a head count that "
                         "divides hidden_size, or give head_dim explicitly")
    if heads and kv_heads and heads % kv_heads:
        raise UsageError(f"{where}: num_key_value_heads ({kv_heads}) does not divide num_attention_heads "
                         f"({heads}); each key/value head serves a whole group of query heads\nHINT: choose "
                         "a key/value head count that divides the number of attention heads")


def _check_size(key: str, value: Any, least: int, most: int, why: str, where: str) -> int:
    kind = "a positive" if least > 0 else "a non-negative"
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"{where}: {key} must be {kind} integer, got {_show(value)} ({type(value).__name__})\n"
                         f"HINT: write {key} as a JSON integer, e.g. 64, without quotes or a decimal point")
    if value < least:
        raise UsageError(f"{where}: {key} must be {kind} integer, got {_show(value)}\n"
                         f"HINT: {key} is a size or a count; give the model's real one")
    if value > most:
        raise UsageError(f"{where}: {key} = {_show(value)} is above {most:,}, the most stratagem accepts ({why})\n"
                         f"HINT: check {key}; a model that size could not be built or held")
    return value


def _head_dim_given(values: Mapping[str, Any]) -> bool:
    return any(values.get(key) is not None for key in _SIZE_LIMITS["head_dim"][0])


def _show(value: Any) -> str:
    """A value for a message, short: no 5,000-digit integers or megabyte strings."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"
    try:
        text = json.dumps(value)  # as the JSON file spells it: true, NaN, "64"
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def read_hf_config(path: str) -> tuple[Path, dict[str, Any]]:
    """The file ``hf:path`` names (the file itself, or ``config.json`` in a folder) and its JSON
    object, or a UsageError naming the file."""
    hint = "HINT: give hf:PATH/config.json (any file name) or a folder holding config.json"
    config_path = Path(path)
    try:
        if config_path.is_dir():
            config_path = config_path / "config.json"
        found = config_path.is_file()
    except OSError as err:  # a name too long, a folder we may not enter
        raise UsageError(f"cannot read {_show(path)}: {err.strerror or err}\n{hint}") from None
    if not found:
        raise UsageError(f"no Hugging Face config at {_show(path)}\n{hint}")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UsageError(f"cannot read {config_path}: {err.strerror or err}\n{hint}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{config_path} is not UTF-8 text: a config is a JSON file\n{hint}") from None
    except (ValueError, RecursionError) as err:
        raise UsageError(f"{config_path} is not valid JSON ({err or 'nested too deeply'})\n"
                         "HINT: a config.json is one JSON object, as transformers saves it") from None
    if not isinstance(data, dict):
        raise UsageError(f"{config_path} holds a JSON {type(data).__name__}, not an object\n"
                         "HINT: a config.json is one JSON object, as transformers saves it")
    return config_path, data


def build_hf_config(data: Mapping[str, Any], where: str) -> PretrainedConfig:
    """The transformers config of a checked ``data`` (:func:`check_hf_config` runs first), its
    resolved sizes (defaults included) checked too, an encoder's made a decoder (:func:`is_encoder`);
    whatever transformers raises becomes a UsageError."""
    if importlib.util.find_spec("transformers") is None:
        raise UsageError("hf: models need transformers\nHINT: pip install 'stratagem[hf]'")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    check_hf_config(data, where)
    model_type = data["model_type"]
    if model_type == "mistral" and "layer_types" in data:
        model_type = "ministral"  # as AutoConfig reads such a config
    try:
        config = CONFIG_MAPPING[model_type].from_dict(dict(data), attn_implementation=data.get("attn_implementation"))
        text = config.get_text_config(decoder=True)  # what a causal LM builds
    except Exception as err:
        raise UsageError(f"transformers cannot read {where}: {_describe(err)}\n"
                         "HINT: check the config against the model type's documented fields") from None
    check_resolved_config(text, data, where)
    if is_encoder(data):  # built as the causal language model transformers makes of it: a decoder
        text.is_decoder = True
    return config


def is_encoder(data: Mapping[str, Any]) -> bool:
    """Whether a config's model type also trains as a masked language model (BERT, RoBERTa, ...):
    an encoder, which :func:`build_hf_config` makes a decoder for the causal language model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return data["model_type"] in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def build_causal_lm(config: Any, **kwargs: Any) -> tuple[nn.Module, str | None]:
    """``AutoModelForCausalLM.from_config(config, **kwargs)`` on the attention its config names,
    else on SDPA, as CUDA runs it fused, where the model type implements it; else eager (BLOOM's
    ALiBi, Gemma 2's soft-capping from transformers 5), with a note that says so (else None)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class, chosen = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None), config._attn_implementation_internal
    if chosen or model_class is None or getattr(model_class, "_supports_sdpa", True):
        return AutoModelForCausalLM.from_config(config, attn_implementation=chosen or "sdpa", **kwargs), None
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **kwargs)
    if not any("attention" in type(module).__name__.lower() for module in model.modules()):
        return model, None  # no attention to run (Mamba's state-space layers)
    return model, (f"{model_class.__name__} has no SDPA attention in transformers: its attention runs eager "
                   "(the scores written out, an explicit softmax), and is profiled so.")


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
        raise UsageError(f"transformers cannot build the causal language model of {config_path}: {_describe(err)}\n"
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
