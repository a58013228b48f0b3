"""How many graphs torch.compile makes of a Hugging Face Llama's layers compiled one by one (as
the plan's ``compile`` applies it), run with its key/value cache and without.

    .venv/bin/python bench/compile_graphs.py [--layers 6]

Dynamo only (``backend="eager"``: no code generated, so it runs on CPU in seconds); the count is
``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` after one training step. Each layer
indexes the cache by its own ``layer_idx``, on which dynamo specializes: with the cache every
layer is a graph of its own, without it the layers share one (the profile's note,
``stratagem.advisor.profile.compiled.kv_cache_note``).
"""

from __future__ import annotations

import argparse

import torch


def unique_graphs(layers: int, *, use_cache: bool) -> int:
    """Graphs dynamo compiled for a ``layers``-layer Llama's layers over one forward and backward."""
    import transformers
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = transformers.LlamaForCausalLM(config)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, layers)
    for layer in model.model.layers:
        layer.compile(backend="eager")
    ids = torch.randint(0, 256, (2, 16))
    model(ids, labels=ids, use_cache=use_cache).loss.backward()
    return counters["stats"]["unique_graphs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    for use_cache in (True, False):
        print(f"use_cache={use_cache}: {unique_graphs(args.layers, use_cache=use_cache)} graph(s) for "
              f"{args.layers} layers (torch {torch.__version__})")


if __name__ == "__main__":
    main()
