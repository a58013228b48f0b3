"""The profile's FLOPs against torch's own counter on real tensors, across Hugging Face causal LMs.

Each architecture below, at a tiny random config (width 64, 2 layers, 4 heads, vocabulary 1,000),
is profiled as ``hf:`` (fake tensors, the blocks found and attributed) and then run for real
(forward with its own loss, backward) under ``torch.utils.flop_counter.FlopCounterMode`` with the
profile's own formulas for what torch's counter lacks (grouped GEMMs, fused RNN layers). It
prints both totals, each block's backward over its forward (2 where every Linear computes its
input's gradient), and the backward FLOPs counted in the embedding (none for a lookup; OPT's
``project_in`` has some): a block's operators the profile lost track of in backward show as a
block's ratio away from 2 or in the embedding (BLOOM's before 2026-11-28; docs/cost-model.md,
"Inputs and conventions"). A profile that fails says why.

    .venv/bin/python bench/hf_flop_check.py [MODEL_TYPE ...]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.flop_formulas import FLOP_FORMULAS
from stratagem.errors import UsageError

TYPES = ("gpt2", "gptj", "gpt_neox", "llama", "mistral", "mixtral", "qwen2", "qwen3", "phi", "phi3", "falcon",
         "bloom", "opt", "gemma", "gemma2", "starcoder2", "stablelm", "olmo", "codegen", "gpt_bigcode", "xglm",
         "biogpt", "mpt", "granite", "cohere")
"""Causal LMs whose tiny configs build from the common names alone."""

SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "intermediate_size": 128, "vocab_size": 1000, "ffn_dim": 128, "n_inner": 128, "head_dim": 16,
         "rotary_dim": 16, "pad_token_id": 0, "num_kv_heads": 4}
"""The tiny config's sizes, by the names most configs take (their attribute maps translate the rest)."""

BATCH, SEQ = 2, 32


def tiny_config(model_type: str, folder: Path) -> Path:
    """``model_type``'s config at :data:`SIZES`, written to ``folder``; returns the folder."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    for name, value in SIZES.items():
        if hasattr(config, name) or name in getattr(config, "attribute_map", {}):
            try:
                setattr(config, name, value)
            except AttributeError:  # derived from the others (Falcon's head_dim)
                pass
    if getattr(config, "layer_types", None):  # one per layer (sliding or full attention)
        config.layer_types = config.layer_types[:SIZES["num_hidden_layers"]]
    config.save_pretrained(folder)
    return folder


def real_flops(folder: Path) -> int:
    """FLOPs torch's counter counts for one real step (forward with the model's loss, backward)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.train()
    tokens = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ))
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        model(tokens, labels=tokens).loss.backward()
    return counter.get_total_flops()


def check(model_type: str) -> str:
    """One line on ``model_type``: the totals, the blocks' ratios, the embedding's backward."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            folder = tiny_config(model_type, Path(tmp))
        except Exception as err:  # this transformers' config of it takes other sizes
            return f"{model_type:<12} no tiny config: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
        try:
            profile = profile_spec(f"hf:{folder}", batch_size=BATCH, seq_len=SEQ, cache=False)
        except UsageError as err:
            return f"{model_type:<12} profile failed: {str(err).splitlines()[0][:140]}"
        try:
            counted = real_flops(folder)
        except Exception as err:  # the real run fails alike: the config, not the profile
            return f"{model_type:<12} the real step failed too: {type(err).__name__}: {str(err).splitlines()[0][:100]}"
    ratios = ", ".join(f"{block.bwd_flops / block.fwd_flops:.2f}" for block in profile.blocks if block.fwd_flops)
    return (f"{model_type:<12} profile {profile.flops_per_step / 1e6:8.2f} MFLOP, torch's counter "
            f"{counted / 1e6:8.2f} ({profile.flops_per_step / counted - 1:+.1%}); blocks' backward / forward "
            f"{ratios}; embedding's backward {profile.embed.bwd_flops / 1e6:.2f} MFLOP")


def main(types: list[str]) -> None:
    started = time.perf_counter()
    for model_type in types or TYPES:
        print(check(model_type), flush=True)
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
