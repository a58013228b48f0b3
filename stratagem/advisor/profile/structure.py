"""Find a model's repeated blocks: the units of FSDP sharding, checkpointing and pipeline splits.

The blocks are the children of the ``nn.ModuleList`` (or ``nn.Sequential``) whose children hold
the most parameters: a transformer's layers, a ViT's encoder blocks, a ResNet's bottlenecks.
Everything outside them is the embedding (what runs before the first block) or the head (what
runs after the last), which the profiler tells apart by execution order.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from stratagem.advisor.profile.model_profile import LinearLayer
from stratagem.plan.stages import tied_weights
from stratagem.units import format_list

# Attribute names under which attention modules commonly keep their head counts (reference
# presets, nn.MultiheadAttention, Hugging Face, nanoGPT-style code).
_HEAD_ATTRS = ("n_heads", "num_heads", "num_attention_heads", "n_head")
_KV_HEAD_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStructure:
    """Where the blocks are: the container's FQN and each block's FQN, in order."""

    container: str | None
    blocks: tuple[str, ...]


def num_unique_params(module: nn.Module) -> int:
    """Number of parameter elements, each shared parameter counted once."""
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module) -> ModelStructure:
    """The children of the ModuleList/Sequential holding the most parameters (at least two)."""
    best: tuple[int, str, nn.Module] | None = None
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        held = sum(num_unique_params(child) for child in module)
        # Strictly more: on a tie the outer container (seen first) wins.
        if held > 0 and (best is None or held > best[0]):
            best = (held, fqn, module)
    if best is None:
        return ModelStructure(container=None, blocks=())
    _, fqn, container = best
    prefix = f"{fqn}." if fqn else ""
    return ModelStructure(container=fqn, blocks=tuple(f"{prefix}{name}" for name, _ in container.named_children()))


def pp_unavailable(model: nn.Module, structure: ModelStructure) -> str | None:
    """Why the blocks cannot become pipeline stages, or None: there are no blocks, or a
    parameter is shared in a way stages cannot keep (:func:`~stratagem.plan.stages.tied_weights`:
    a tied embedding and head are copied to the first and last stage)."""
    if structure.container is None:
        return "no repeated blocks to split into stages"
    return tied_weights(model, block_container=structure.container)[1]


def class_wrap_extra(model: nn.Module, structure: ModelStructure) -> str | None:
    """The modules other than the blocks whose class name is a block's, which wrapping FSDP units
    by class name (Accelerate's ``TRANSFORMER_BASED_WRAP``) wraps too, e.g. ``'Sequential: stem'``;
    None when there are none (or no blocks)."""
    blocks = set(structure.blocks)
    names = {type(model.get_submodule(fqn)).__name__ for fqn in blocks}
    extra = [fqn for fqn, module in model.named_modules() if type(module).__name__ in names and fqn not in blocks]
    if not extra:
        return None
    return f"{'/'.join(sorted(names))}: {format_list([name or 'the model itself' for name in extra])}"


def pp_tied_params(model: nn.Module, structure: ModelStructure) -> int:
    """Elements of the weights the first and last pipeline stage each hold a copy of (a tied
    embedding and head: :func:`~stratagem.plan.stages.tied_weights`), once each; 0 without, or
    without blocks to split."""
    if structure.container is None:
        return 0
    tied, _ = tied_weights(model, block_container=structure.container)
    return sum(model.get_parameter(group[0]).numel() for group in tied)


def linear_layers(block: nn.Module, rows: dict[str, int] | None = None) -> tuple[LinearLayer, ...]:
    """Every ``nn.Linear`` inside ``block``, in registration order, with the ``rows`` each
    multiplied where recorded."""
    rows = rows or {}
    return tuple(
        LinearLayer(name=name, in_features=m.in_features, out_features=m.out_features, bias=m.bias is not None,
                    rows=rows.get(name, 0))
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear)
    )


def attention_heads(model: nn.Module) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) read off the first module that names them, else None."""
    heads = kv_heads = None
    for module in model.modules():
        config = getattr(module, "config", None)
        for source in (module, config):
            if source is None:
                continue
            heads = heads or _int_attr(source, _HEAD_ATTRS)
            kv_heads = kv_heads or _int_attr(source, _KV_HEAD_ATTRS)
        if heads:
            break
    return heads, (kv_heads or heads)


def _int_attr(obj: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
