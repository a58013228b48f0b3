"""Hugging Face configs, for ``hf:PATH`` models: read, checked, then built.

The checks come first, so a config that would build for minutes (or divide by zero) is refused at
once with a :class:`~stratagem.errors.UsageError` naming the file: a ``model_type`` transformers
builds a causal language model for, and every shape-giving number a positive integer within
bounds far above any published model's, the heads dividing the width. Then transformers builds
the config (its defaults checked the same way) and :func:`build_causal_lm` the model, on the
attention CUDA would run.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from stratagem.errors import UsageError, close_matches, describe

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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
        raise UsageError(f"transformers cannot read {where}: {describe(err)}\n"
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
