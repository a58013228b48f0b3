"""The bytes and kernels of a compiled block's operators without FLOPs, counted on the graphs
inductor lowers: the forward and backward AOTAutograd hands it after its decompositions and its
partitioner (:func:`~stratagem.advisor.profile.compiled.compiled_block` traces them).

Counted on those graphs rather than on the eager step, the count follows what the compiler runs:
the partitioner's choice of what the forward writes for backward and what backward computes
again, decompositions (LayerNorm's backward as its sums), one cast where autocast cast an
activation once per operator. Each operator is given to a :class:`~.fusion.FusionTracker`, which
groups them into kernels as inductor does between its extern kernels (GEMMs, attention).
"""

from __future__ import annotations

import operator
from collections.abc import Hashable

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from stratagem.advisor.profile.counts import Fused
from stratagem.advisor.profile.fusion import FusionTracker, sums_leading_dims
from stratagem.advisor.profile.measure import CPU_ATTENTION_FLOPS

aten = torch.ops.aten
_VIEWS = {aten._unsafe_view.default, operator.getitem}  # alias their input as inductor lowers them
_EXTERN = {*flop_registry, *CPU_ATTENTION_FLOPS}  # kernels of their own: GEMMs, convolutions, attention


def graph_kernels(graph: torch.fx.Graph, *, backward: bool, params: int,
                  gradient_shapes: set[tuple[tuple[int, ...], torch.dtype]]) -> Fused:
    """:class:`Fused` of one partitioned graph. Its first ``params`` placeholders are the block's
    parameters: what the forward computes from them alone (autocast's copies of the weights) and
    what the backward computes of a parameter's shape and dtype from tensors of that shape (the
    gradients' casts) are counted apart, per parameter (``*_param_op_bytes``), and left out here.
    The forward's outputs are written (what backward reads, and the block's output)."""
    tracker, group, separate = FusionTracker(), ("block", backward), 0  # separate: kernels of the parameters' casts
    alias: dict[torch.fx.Node, Hashable] = {}  # a view or a tuple's element -> what it reads from
    from_params = set() if backward else {n for n in graph.find_nodes(op="placeholder")[:params]}
    for node in graph.nodes:
        inputs = [arg for arg in tree_flatten((node.args, node.kwargs))[0] if isinstance(arg, torch.fx.Node)]
        if node.op == "output":
            for out in inputs if not backward else ():
                tracker.saved(alias.get(out, out))
            continue
        if node.op != "call_function":
            continue
        if inputs and all(arg in from_params for arg in inputs):
            from_params.add(node)
            separate += not _is_view(node)
            continue
        if node.target is operator.getitem:
            alias[node] = (alias.get(inputs[0], inputs[0]), node.args[1])
            continue
        if _is_view(node):
            alias[node] = alias.get(inputs[0], inputs[0])
            continue
        values = [v for v in tree_flatten(node.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        if not values:
            continue
        if backward and _parameter_sized(values, inputs, gradient_shapes):
            separate += 1
            continue
        fusible = getattr(node.target, "overloadpacket", None) not in _EXTERN
        reads = [(alias.get(arg, arg), _bytes(arg)) for arg in inputs if _bytes(arg)]
        refs = [(node, index) for index in range(len(values))] if isinstance(node.meta["val"], (tuple, list)) else [node]
        writes = [(ref, _tensor_bytes(value)) for ref, value in zip(refs, values)]
        operands = [v for arg in inputs for v in tree_flatten(arg.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        tracker.op(group, fusible=fusible, reads=reads, writes=writes,
                   sums=[write for write, value in zip(writes, values) if fusible and sums_leading_dims(operands, value)])
    num_bytes, kernels = tracker.fused().get(group, (0, 0))
    return Fused(num_bytes, kernels + separate)


def _is_view(node: torch.fx.Node) -> bool:
    """Whether the operator returns a view of its input (no kernel, no bytes)."""
    target = node.target
    return target in _VIEWS or bool(getattr(target, "is_view", False))


def _tensor_bytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def _bytes(node: torch.fx.Node) -> int:
    """Bytes of the tensors ``node`` holds (its value's), 0 for what holds none."""
    return sum(_tensor_bytes(v) for v in tree_flatten(node.meta.get("val"))[0] if isinstance(v, torch.Tensor))


def _parameter_sized(values: list[torch.Tensor], inputs: list[torch.fx.Node],
                     gradient_shapes: set[tuple[tuple[int, ...], torch.dtype]]) -> bool:
    """Whether a backward operator writes a parameter's gradient from tensors of its shape alone (a
    cast of it, tied parameters' gradients summed): as many bytes at any batch size."""
    out = values[0]
    shapes = [v.shape for arg in inputs for v in tree_flatten(arg.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
    return (tuple(out.shape), out.dtype) in gradient_shapes and all(shape == out.shape for shape in shapes)
