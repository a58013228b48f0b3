"""What a block compiled by ``torch.compile`` keeps for backward, measured on fake tensors.

AOTAutograd traces a compiled block's forward and backward as one graph and its min-cut
partitioner (``min_cut_rematerialization_partition``, inductor's default) decides what the forward
saves: the tensors the backward cannot cheaply recompute (matmul and attention outputs,
reductions' statistics), while element-wise results (a norm's output, an activation's, a
weight's cast to 16 bits) are recomputed from them in backward. The eager step saves those too.

The profile traces each kind of block once more the way inductor does (its decompositions, the
same partitioner, no code generated) on the input the fake step gave it, and counts the storages
the partitioned forward saves. On one H100 the peak of compiled plans followed it: GPT-2 large
26.9 GiB measured, 28.9 predicted from the eager step's activations; ViT-L/16 14.1 against 15.8
(docs/benchmarks.md, "GPU figures").
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from stratagem.advisor.profile.attention import CudaAttention
from stratagem.advisor.profile.autocast import CudaAutocast
from stratagem.advisor.profile.block_reuse import block_signature

if TYPE_CHECKING:
    from stratagem.advisor.profile.counts import RunRecord
    from stratagem.advisor.profile.measure import CostCounter


class FirstCalls:
    """Forward pre-hooks that keep the first call of each kind of block (its signature): the
    arguments as they were, objects other than tensors copied before the call can change them
    (a Hugging Face layer's cache entry), with ``counter``'s counting suppressed meanwhile."""

    def __init__(self, model: nn.Module, blocks: tuple[str, ...], counter: CostCounter) -> None:
        self._modules = {fqn: model.get_submodule(fqn) for fqn in blocks}
        self._counter = counter
        self.calls: dict[str, tuple[tuple, dict]] = {}  # the first block of each kind -> (args, kwargs)
        self._kinds: set[tuple] = set()
        self._handles: list = []

    def __enter__(self) -> FirstCalls:
        for fqn, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(
                lambda _module, args, kwargs, fqn=fqn: self._record(fqn, args, kwargs), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _record(self, fqn: str, args: tuple, kwargs: dict) -> None:
        kind = block_signature(self._modules[fqn])
        if kind in self._kinds:
            return
        self._kinds.add(kind)
        leaves, spec = tree_flatten((args, kwargs))
        self._counter.suppressed += 1
        try:
            self.calls[fqn] = tree_unflatten([x if isinstance(x, torch.Tensor) else copy.deepcopy(x) for x in leaves],
                                             spec)
        finally:
            self._counter.suppressed -= 1

    def measure(self, state: dict[str, torch.Tensor], record: RunRecord, *,
                autocast_dtype: torch.dtype | None) -> None:
        """Set ``compiled_saved_bytes`` of every block ``record`` measured (each kind's first
        call's :func:`compiled_saved_bytes`, for all blocks of that kind); where tracing fails,
        leave them at 0 and say why in ``record.compiled_unmeasured``."""
        by_kind = {}
        for fqn, (args, kwargs) in self.calls.items():
            prefix = f"{fqn}."
            block_state = {name[len(prefix):]: tensor for name, tensor in state.items() if name.startswith(prefix)}
            try:
                by_kind[block_signature(self._modules[fqn])] = compiled_saved_bytes(
                    self._modules[fqn], block_state, args, kwargs, autocast_dtype=autocast_dtype)
            except Exception as err:  # noqa: BLE001  (any model's error: reported, priced as eager)
                first_line = (str(err).strip().splitlines() or [""])[0]
                record.compiled_unmeasured = f"tracing {fqn} as torch.compile does failed ({type(err).__name__}: {first_line})"
                return
        for fqn, module in self._modules.items():
            if fqn not in record.measured_as:  # a block the step never called saves nothing either way
                record.segments[fqn].compiled_saved_bytes = by_kind.get(block_signature(module), 0)


def compiled_saved_bytes(block: nn.Module, state: dict[str, torch.Tensor], args: tuple, kwargs: dict, *,
                         autocast_dtype: torch.dtype | None) -> int:
    """Bytes ``block`` keeps for backward compiled (each storage once, its parameters not): its
    forward and backward on ``args``/``kwargs`` traced by AOTAutograd with inductor's
    decompositions and partitioner, under the GPU profile's autocast and attention kernel
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

    traced = aot_function(forward, fw_compiler=nop, bw_compiler=nop, decompositions=select_decomp_table(),
                          partition_fn=min_cut_rematerialization_partition)
    params = [state[name] for name in names]
    inputs = [leaves[i].detach().requires_grad_(leaves[i].requires_grad) for i in where]
    with CudaAttention(), CudaAutocast():
        traced(params, inputs)  # traced and partitioned once; the second call runs the partitioned forward
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
    return sum(tensor.untyped_storage().nbytes() for tensor in saved.values())


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
