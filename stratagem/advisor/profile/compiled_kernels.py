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

from stratagem.advisor.profile.block_reuse import tensor_bytes
from stratagem.advisor.profile.counts import Fused
from stratagem.advisor.profile.fusion import FusionTracker, Read, region_of, sums_across_rows
from stratagem.advisor.profile.flop_formulas import FLOP_FORMULAS
from stratagem.advisor.profile.measure import writes_a_gradient

aten = torch.ops.aten
_VIEWS = {aten._unsafe_view.default, operator.getitem}  # alias their input as inductor lowers them
_EXTERN = {*flop_registry, *FLOP_FORMULAS}  # kernels of their own: GEMMs, convolutions, attention


def graph_kernels(graph: torch.fx.Graph, *, backward: bool, params: int,
                  gradient_shapes: set[tuple[tuple[int, ...], torch.dtype]]) -> Fused:
    """:class:`Fused` of one partitioned graph. Its first ``params`` placeholders are the block's
    parameters: what the forward computes from them alone (autocast's copies of the weights) and
    what the backward writes as their gradients (:func:`_gradient_writes`: the gradients' casts)
    are counted apart, per parameter (``*_param_op_bytes``), and left out here.
    The forward's outputs are written (what backward reads, and the block's output)."""
    tracker, group, separate = FusionTracker(), ("block", backward), 0  # separate: kernels of the parameters' casts
    alias: dict[torch.fx.Node, Hashable] = {}  # a view or a tuple's element -> what it reads from
    from_params = set() if backward else {n for n in graph.find_nodes(op="placeholder")[:params]}
    gradients = _gradient_writes(graph, params, gradient_shapes) if backward else set()
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
        values, operands = _tensors(node), [t for arg in inputs for t in _tensors(arg)]
        if not values:
            continue
        if node in gradients:
            separate += 1
            continue
        fusible = getattr(node.target, "overloadpacket", None) not in _EXTERN
        reads = [Read(alias.get(arg, arg), tensor_bytes(tensors), region_of(tensors[0]) if len(tensors) == 1 else None)
                 for arg in inputs if (tensors := _tensors(arg)) and tensor_bytes(tensors)]
        refs = [(node, index) for index in range(len(values))] if isinstance(node.meta["val"], (tuple, list)) else [node]
        writes = [(ref, tensor_bytes(value)) for ref, value in zip(refs, values)]
        tracker.op(group, fusible=fusible, reads=reads, writes=writes,
                   sums=[write for write, value in zip(writes, values) if fusible and sums_across_rows(operands, value)])
    num_bytes, kernels = tracker.fused().get(group, (0, 0))
    return Fused(num_bytes, kernels + separate)


def _gradient_writes(graph: torch.fx.Graph, params: int,
                     gradient_shapes: set[tuple[tuple[int, ...], torch.dtype]]) -> set[torch.fx.Node]:
    """The backward graph's operators that write a parameter's gradient from tensors of its shape
    (:func:`~stratagem.advisor.profile.measure.writes_a_gradient`: a cast back to its dtype, tied
    parameters' gradients summed): those its first ``params`` outputs, the parameters' gradients,
    come from through such operators and views. Found from the outputs, not by shape alone: an
    activation flattened to ``[tokens, width]`` has a square weight's shape where the tokens the
    profile runs equal the width (OPT-1.3B's 2,048 at 2 × 1,024)."""
    (output,) = graph.find_nodes(op="output")
    stack = [grad for grad in output.args[0][:params] if isinstance(grad, torch.fx.Node)]
    seen: set[torch.fx.Node] = set()
    found: set[torch.fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        values = _tensors(node)
        operands = [t for arg in node.all_input_nodes for t in _tensors(arg)]
        if not _is_view(node):
            if not values or not writes_a_gradient(values[0], operands, gradient_shapes):
                continue
            found.add(node)
        stack.extend(node.all_input_nodes)
    return found


def _is_view(node: torch.fx.Node) -> bool:
    """Whether the operator returns a view of its input (no kernel, no bytes)."""
    return node.target in _VIEWS or bool(getattr(node.target, "is_view", False))


def _tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    """The tensors of ``node``'s value (its fake result, or results)."""
    return [value for value in tree_flatten(node.meta.get("val"))[0] if isinstance(value, torch.Tensor)]
