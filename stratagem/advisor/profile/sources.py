"""Turn what a user names as a model into a module, example inputs and a loss, allocating nothing.

Accepted forms (``load_model``):

* a preset name (``gpt2``, ``llama-2-70b``, ``vit-b-16``, …; see ``stratagem.models``);
* ``pkg.module:factory`` — a callable returning the module, or ``(module, example_inputs)``, or
  ``(module, example_inputs, loss_fn)``; it is called under ``FakeTensorMode`` (the tensors it
  makes, weights and labels a loss closes over included, allocate nothing) and gets
  ``batch_size``/``seq_len`` keyword arguments when it declares them;
* ``hf:PATH`` — a Hugging Face ``config.json`` (or the folder holding it), built with
  ``AutoModelForCausalLM.from_config`` on meta, the language-model head and loss included.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from stratagem.errors import UsageError


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    """A model ready to profile: the module (on meta or fake tensors), its example inputs and its loss."""

    name: str
    module: nn.Module
    example_inputs: tuple | dict
    loss_fn: Callable[[Any], torch.Tensor] | None
    notes: tuple[str, ...] = ()


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
        raise UsageError(f"{name} takes images, not token sequences: --seq-len does not apply to it")
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


def _from_factory(spec: str, *, batch_size: int, seq_len: int | None) -> ModelSource:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise UsageError(f"cannot load factory {spec!r}: {err}\n"
                         "HINT: give 'pkg.module:callable' with the package importable (on PYTHONPATH)") from None
    wanted = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in (("batch_size", batch_size), ("seq_len", seq_len)) if k in wanted}
    with FakeTensorMode(allow_non_fake_inputs=True):
        made = factory(**kwargs)
    if isinstance(made, nn.Module):
        raise UsageError(f"{spec} returned only a module; the profiler needs example inputs too\n"
                         "HINT: return (module, example_inputs) or (module, example_inputs, loss_fn)")
    if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module)):
        raise UsageError(f"{spec} must return a module, (module, example_inputs) or "
                         f"(module, example_inputs, loss_fn); it returned {type(made).__name__}")
    module, inputs, *loss = made
    return ModelSource(name=spec, module=module, example_inputs=inputs, loss_fn=loss[0] if loss else None)


def _from_hf_config(path: str, *, batch_size: int, seq_len: int | None) -> ModelSource:
    try:
        import transformers
    except ImportError:
        raise UsageError("hf: models need transformers\nHINT: pip install 'stratagem[hf]'") from None
    config_path = Path(path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    if not config_path.is_file():
        raise UsageError(f"no Hugging Face config at {path!r}\nHINT: give hf:PATH/config.json or a folder holding it")
    config = transformers.AutoConfig.from_pretrained(str(config_path.parent))
    seq_len = seq_len or min(getattr(config, "max_position_embeddings", 2048) or 2048, 4096)
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    name = getattr(config, "_name_or_path", "") or config.model_type
    return ModelSource(name=f"hf:{name}", module=module, example_inputs={"input_ids": ids, "labels": ids, "use_cache": False}, loss_fn=None)
