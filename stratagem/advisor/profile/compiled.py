"""What a block compiled by ``torch.compile`` keeps for backward, measured on fake tensors.

AOTAutograd traces a compiled block's forward and backward as one graph and its min-cut
partitioner (``min_cut_rematerialization_partition``, inductor's default) decides what the forward
saves: the tensors the backward cannot cheaply recompute (matmul and attention outputs,
reductions' statistics), while element-wise results (a norm's output, an activation's, a
weight's cast to 16 bits) are recomputed from them in backward. The eager step saves those too.

The profile traces each kind of block once more the way inductor does (its decompositions, the
same partitioner, no code generated) on the input the fake step gave it (:mod:`.block_inputs`),
and counts the storages the partitioned forward saves. On one H100 the peaks of compiled plans
followed it: GPT-2 large 26.9 GiB measured, 28.9 predicted from the eager step's activations and
26.8 from the compiled ones; ViT-L/16 14.1, 15.8 and 14.0 (docs/benchmarks.md, "GPU figures").
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from stratagem.advisor.profile.attention import CudaAttention
from stratagem.advisor.profile.autocast import CudaAutocast
from stratagem.advisor.profile.block_inputs import fresh
from stratagem.advisor.profile.block_reuse import block_signature
from stratagem.advisor.profile.compiled_kernels import graph_kernels
from stratagem.advisor.profile.counts import CompiledBlock, Fused

if TYPE_CHECKING:
    from stratagem.advisor.profile.counts import RunRecord


def measure_compiled(blocks: dict[str, nn.Module], calls: dict[str, tuple[tuple, dict]],
                     state: dict[str, torch.Tensor], record: RunRecord, *, autocast_dtype: torch.dtype | None) -> None:
    """Set ``compiled`` of every block ``record`` measured: :func:`compiled_block` of the first
    block of each kind (its signature) on its first call (``calls``, by FQN), for all blocks of
    that kind. Where the trace fails, the blocks stay unmeasured (priced eager) and
    ``record.compiled_note`` says why: a call with objects the trace cannot take (a Hugging Face
    cache, which makes tensors inside the block) is not traced without them, since what the block
    compiled keeps with them is what the plan runs (:data:`UNTRACED_CALL`). Blocks called with a
    key/value cache get ``record.cache_note`` (:func:`kv_cache_note`)."""
    record.cache_note = kv_cache_note(calls)
    by_kind: dict[tuple, CompiledBlock] = {}
    for fqn, (args, kwargs) in calls.items():
        kind = block_signature(blocks[fqn])
        if kind in by_kind or fqn in record.measured_as:
            continue
        prefix = f"{fqn}."
        block_state = {name[len(prefix):]: tensor for name, tensor in state.items() if name.startswith(prefix)}
        try:
            by_kind[kind] = compiled_block(blocks[fqn], block_state, *fresh(args, kwargs),
                                           autocast_dtype=autocast_dtype)
        except Exception as err:  # noqa: BLE001  (any model's error: reported, priced as eager)
            objects = sorted({type(x).__name__ for x in tree_flatten((args, kwargs))[0]
                              if not isinstance(x, (torch.Tensor, *_PLAIN))})
            first_line = (str(err).strip().splitlines() or [""])[0]
            why = (UNTRACED_CALL.format(fqn=fqn, objects=", ".join(objects)) if objects else
                   f"tracing {fqn} as torch.compile does failed ({type(err).__name__}: {first_line})")
            record.compiled_note = f"compiled plans keep the eager step's activations: {why}"
            return
    for fqn, module in blocks.items():
        if fqn not in record.measured_as and (measured := by_kind.get(block_signature(module))):
            record.segments[fqn].compiled = measured  # a block the step never called: nothing either way


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)

UNTRACED_CALL = ("{fqn} is called with {objects}, which the trace on fake tensors cannot take; traced without "
                 "it, a Hugging Face Llama of TinyLlama's shape at 4 × 1024 tokens was predicted at 21.2 GiB "
                 "compiled, where on one H100 its compiled step with the cache kept what the eager one is "
                 "predicted to (25.0 GiB measured, 24.8 predicted eager)")
"""Why blocks called with objects the trace cannot take are priced with their eager bytes."""


def kv_cache_note(calls: dict[str, tuple[tuple, dict]]) -> str:
    """What the report says when the step calls its blocks with a Hugging Face key/value cache
    (``use_cache=True``, a Llama config's default, in a ``training_step`` that does not turn it
    off), else "". Each layer indexes the cache by its own ``layer_idx``, on which dynamo
    specializes: torch 2.13's dynamo compiled 6 graphs for a 6-layer Llama run with its cache and 1
    without (``counters["stats"]["unique_graphs"]``, bench/compile_graphs.py)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None or not calls:
        return ""
    found = {type(x).__name__ for args_kwargs in calls.values() for x in tree_flatten(args_kwargs)[0]
             if isinstance(x, cache_utils.Cache)}
    if not found:
        return ""
    return (f"the step runs its {len(calls)} blocks with a key/value cache ({', '.join(sorted(found))}: "
            "use_cache=True, the config's default), which training never reads; under torch.compile each "
            "block then compiles a graph of its own (the compile time shown counts one per kind of block); "
            "pass use_cache=False to the model in training")


def compiled_block(block: nn.Module, state: dict[str, torch.Tensor], args: tuple, kwargs: dict, *,
                   autocast_dtype: torch.dtype | None) -> CompiledBlock:
    """:class:`CompiledBlock` of ``block``: the bytes it keeps for backward (each storage once, its
    parameters not) and the kernels of the graphs inductor would lower: its forward and backward on
    ``args``/``kwargs`` traced by AOTAutograd with inductor's decompositions and partitioner, under
    the GPU profile's autocast and attention kernel
    (:mod:`~stratagem.advisor.profile.autocast`, :mod:`~stratagem.advisor.profile.attention`).
    ``state`` holds the block's fake parameters and buffers by their names in it (buffers are
    inputs too: BatchNorm updates its running statistics in place); must run inside the
    FakeTensorMode that made them. What is computed from the parameters alone (autocast's 16-bit
    copies of the weights) is left out, as the eager step counts it apart (``saved_param_copy_bytes``)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.compilers import nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    names = list(state)
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def forward(tensors: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
        filled = list(leaves)
        for i, tensor in zip(where, inputs):
            filled[i] = tensor
        call_args, call_kwargs = tree_unflatten(filled, spec)
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            return torch.func.functional_call(block, dict(zip(names, tensors)), call_args, call_kwargs)

    params = [state[name] for name in names]
    gradient_shapes = {(tuple(p.shape), p.dtype) for p in params if p.requires_grad}
    kernels: dict[bool, Fused] = {}

    def counted(backward: bool) -> Callable:
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            kernels[backward] = graph_kernels(gm.graph, backward=backward, params=len(params),
                                              gradient_shapes=gradient_shapes)
            return nop(gm, example_inputs)
        return compiler

    traced = aot_function(forward, fw_compiler=counted(False), bw_compiler=counted(True),
                          decompositions=select_decomp_table(), partition_fn=min_cut_rematerialization_partition)
    inputs = [leaves[i].detach().requires_grad_(leaves[i].requires_grad) for i in where]
    with CudaAttention(), CudaAutocast():
        outputs = [out for out in tree_flatten(traced(params, inputs))[0]  # traced and partitioned
                   if isinstance(out, torch.Tensor) and out.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(out) for out in outputs])  # backward's graph counted
    derived = _ParamDerived(params)  # the parameters and what is computed from them alone (autocast's copies)
    saved: dict[StorageWeakRef, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in derived.storages:
            saved.setdefault(ref, tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), CudaAttention(), CudaAutocast(), \
            derived:
        traced(params, [tensor.detach().requires_grad_(tensor.requires_grad) for tensor in inputs])
    return CompiledBlock(sum(tensor.untyped_storage().nbytes() for tensor in saved.values()),
                         kernels[False], kernels.get(True, Fused(0, 0)))


class _ParamDerived(TorchDispatchMode):
    """Follows, operator by operator, the storages computed from the given tensors alone."""

    def __init__(self, roots: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {StorageWeakRef(tensor.untyped_storage()) for tensor in roots}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors and all(StorageWeakRef(t.untyped_storage()) in self.storages for t in tensors):
            self.storages.update(StorageWeakRef(t.untyped_storage()) for t in tree_flatten(out)[0]
                                 if isinstance(t, torch.Tensor))
        return out
