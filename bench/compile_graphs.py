"""How many graphs torch.compile makes of a Hugging Face Llama's layers compiled one by one (as
the plan's ``compile`` applies it), run with its key/value cache and without.

    .venv/bin/python bench/compile_graphs.py [--layers 6]

Dynamo only (``backend="eager"``: no code generated, so it runs on CPU in seconds); the count is
``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` after one training step. Each layer
indexes the cache by its own ``layer_idx``, on which dynamo specializes: with the cache every
layer is a graph of its own, without it the layers share one (the profile's note,
``stratagem.advisor.profile.compiled.kv_cache_note``).

Then ResNet-101's bottlenecks compiled one by one (two images): for each forward graph, in the
order dynamo compiles them, whether its convolutions' shapes are symbolic and whether inductor
would lay them out channels-last (``GraphLowering.decide_layout_opt``, asked with CPU's oneDNN off,
which would say channels-last whatever the shapes), beside the kinds of block
``cost.convolutions.symbolic_kinds`` prices as symbolic (docs/cost-model.md, "Compilation").
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


def resnet_layouts(name: str = "resnet-101") -> None:
    """Each forward graph of ``name``'s bottlenecks compiled one by one: symbolic or not, and
    inductor's layout decision; then the kinds the cost model prices as symbolic."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.graph import GraphLowering
    from torch.fx.experimental.symbolic_shapes import has_free_symbols

    from stratagem.advisor.cost.convolutions import symbolic_kinds
    from stratagem.advisor.cost.stages import whole_model
    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.models import PRESETS

    graphs = []

    def forward(gm: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
        convs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
        if convs:  # the backward graphs run no aten.convolution
            symbolic = any(has_free_symbols(n.args[i].meta["val"]) for n in convs for i in (0, 1))
            with torch.backends.mkldnn.flags(enabled=False):
                graphs.append((symbolic, GraphLowering.decide_layout_opt(gm, is_inference=False)))
        return gm

    torch._dynamo.reset()
    model = PRESETS[name].build()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(model.layers))
    backend = aot_autograd(fw_compiler=forward)  # one, as the plugin's: blocks share its compiled graphs
    for block in model.layers:
        block.compile(backend=backend)
    model(torch.randn(2, 3, 224, 224)).sum().backward()
    print(f"{name}: {len(graphs)} forward graphs of {len(model.layers)} bottlenecks; symbolic: "
          f"{[symbolic for symbolic, _ in graphs]}; channels-last: {[last for _, last in graphs]}")
    symbolic = symbolic_kinds(whole_model(profile_spec(name)))
    print(f"  the cost model prices {len(symbolic)} kinds as symbolic, "
          f"{sum(b.measurement in symbolic for b in profile_spec(name).blocks)} of the bottlenecks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    for use_cache in (True, False):
        print(f"use_cache={use_cache}: {unique_graphs(args.layers, use_cache=use_cache)} graph(s) for "
              f"{args.layers} layers (torch {torch.__version__})")
    resnet_layouts()


if __name__ == "__main__":
    main()
