"""``stratagem advise`` on every causal language model type the sweep names, as a new user would bring one.

For each Hugging Face ``model_type`` in :data:`MODEL_TYPES` (``--types`` for others), this writes
the config transformers makes for it by default, cut to two layers (the per-layer lists a config
keeps cut with it), and runs ``stratagem advise --model hf:…`` on 8 H100s in a process of its own,
as a user runs it. Each ends in a plan (``ok``), a usage error (its message's first line: what
the user reads), no answer within ``--limit`` seconds, or anything else (a traceback: a bug),
timed. Transformers' default configs are not all ones a model runs with (some leave sizes
unset): their usage errors say so.

    .venv/bin/python bench/hf_model_types.py           # about nine minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # a default config's own warnings are not outcomes

MODEL_TYPES = (
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe qwen3_next gemma gemma2 gemma3_text phi phi3 phimoe "
    "falcon falcon_h1 gpt2 gpt_neox gptj gpt_bigcode bloom opt mpt olmo olmo2 olmoe starcoder2 stablelm cohere "
    "cohere2 dbrx deepseek_v2 deepseek_v3 granite granitemoe jamba mamba mamba2 rwkv recurrent_gemma codegen "
    "persimmon nemotron glm4 internlm3 jetmoe minimax smollm3 gpt_oss ernie4_5 exaone4 helium bitnet zamba2 lfm2 "
    "llama4_text hunyuan_v1_dense seed_oss").split()
"""Decoders of the last years' families, dense, mixture-of-experts and state-space."""

PER_LAYER_LISTS = ("layer_types", "layers_block_type", "attn_layer_indices", "no_rope_layers", "moe_layers")
"""Config fields that list something per layer: cut to the layers kept, or transformers refuses the config."""

LAYERS = 2


def write_config(model_type: str, folder: Path) -> Path:
    """transformers' default config for ``model_type``, cut to :data:`LAYERS` layers, as config.json."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    config.num_hidden_layers = LAYERS
    data = config.to_dict()
    for key in PER_LAYER_LISTS:
        if isinstance(data.get(key), list):
            data[key] = data[key][:LAYERS]
    path = folder / model_type / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data, default=str))
    return path


def advise(config: Path, limit: float) -> tuple[str, str, float]:
    """``(outcome, what the user reads, seconds)`` of ``stratagem advise`` on ``config``, stopped
    after ``limit`` seconds."""
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "stratagem", "advise", "--model", f"hf:{config}", "--cluster",
                               "8xH100-SXM-80GB", "--global-batch-size", "8", "--seq-len", "256", "--no-cache"],
                              capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as err:
        last = (err.stderr or b"").decode().strip().splitlines()[-1:]
        return "timed out", f"still at: {last[0] if last else 'nothing printed'}", time.perf_counter() - started
    seconds = time.perf_counter() - started
    lines = [line for line in done.stderr.splitlines() if line.startswith("stratagem advise: error:")]
    if done.returncode == 0:
        return "ok", "", seconds
    if done.returncode == 2 and lines:
        return "usage error", lines[0].removeprefix("stratagem advise: error: "), seconds
    return f"exit {done.returncode}", " | ".join(done.stderr.strip().splitlines()[-2:]), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=MODEL_TYPES, help="Hugging Face model types")
    parser.add_argument("--limit", type=float, default=120, help="seconds one advise may take (default: 120)")
    args = parser.parse_args()
    outcomes: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as folder:
        for model_type in args.types:
            outcome, message, seconds = advise(write_config(model_type, Path(folder)), args.limit)
            outcomes[outcome] += 1
            print(f"{model_type:<18} {outcome:<12} {seconds:6.1f} s  {message[:160]}", flush=True)
    print(", ".join(f"{outcome} {count}" for outcome, count in outcomes.most_common()), f"of {len(args.types)}")


if __name__ == "__main__":
    main()
