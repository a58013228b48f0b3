"""Find the input embedding and the output head tensor parallelism can split by vocabulary, and
prove the split on fake tensors (the ``vocab_embedding`` and ``vocab_head`` styles of
docs/design.md, Megatron's vocabulary-parallel layers: Shoeybi et al. 2019, §3).

During the profiling step we record the first call of every ``nn.Embedding`` and ``nn.Linear``
outside the blocks. The input embedding is the Embedding that reads one of the step's own input
tensors (the token ids) before the first block; the output head is the Linear that runs after
the last block and writes that vocabulary (its ``out_features`` is the embedding's
``num_embeddings``). Each is then run alone on its recorded input with its table or weight split
two ways (the first rank's rows, as DTensor shards an odd vocabulary): the embedding must give its
output's shape, the head its output with the vocabulary halved. A weight shared with a module
other than these two (tied anywhere but embedding and head), an Embedding that renormalizes its
rows or has sparse gradients, or a model's own TP plan that splits either another way (Hugging
Face's ``tp_plan``: ``embedding_rowwise`` and ``colwise_gather_output`` are ours) leaves it out,
with the reason; a tied pair is split together or not at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from stratagem.advisor.profile.fake_tensor_log import quiet_fake_tensor_log
from stratagem.advisor.profile.measure import HEAD
from stratagem.advisor.profile.model_profile import LinearLayer

Layout = tuple[tuple[str, str], ...]

# Hugging Face's names (transformers' ParallelInterface) for the two vocabulary styles.
HF_VOCAB_STYLES = {"embedding_rowwise": "vocab_embedding", "colwise_gather_output": "vocab_head",
                   "colwise_rep": "vocab_head"}


@dataclass(frozen=True, slots=True)
class _Call:
    input: torch.Tensor
    output: torch.Tensor
    before_blocks: bool  # no block had started
    after_blocks: bool  # every block had ended


class VocabCallRecorder:
    """While active, records the first call of each Embedding and Linear outside ``blocks``, and
    where it ran relative to the blocks."""

    def __init__(self, model: nn.Module, blocks: tuple[str, ...]) -> None:
        self._model = model
        self._blocks = blocks
        self.calls: dict[str, _Call] = {}
        self._started: set[str] = set()
        self._ended: set[str] = set()
        self._handles: list = []

    def __enter__(self) -> VocabCallRecorder:
        prefixes = tuple(f"{b}." for b in self._blocks)
        for fqn in self._blocks:
            block = self._model.get_submodule(fqn)
            self._handles.append(block.register_forward_pre_hook(lambda *_, fqn=fqn: self._started.add(fqn)))
            self._handles.append(block.register_forward_hook(lambda *_, fqn=fqn: self._ended.add(fqn)))
        for name, sub in self._model.named_modules():
            if isinstance(sub, (nn.Embedding, nn.Linear)) and not name.startswith(prefixes) and name not in self._blocks:
                self._handles.append(sub.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, name: str):
        def hook(module, args, output):
            if name not in self.calls and args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                self.calls[name] = _Call(args[0], output, before_blocks=not self._started,
                                         after_blocks=len(self._ended) == len(self._blocks))
        return hook


def find_vocab_layout(model: nn.Module, recorder: VocabCallRecorder, inputs: Any,
                      state: Mapping[str, torch.Tensor]) -> tuple[Layout, str | None]:
    """The vocabulary pairs of the TP layout (``(fqn, "vocab_embedding")``, ``(fqn,
    "vocab_head")``) and, when it lacks either, why. ``inputs``: the step's own inputs, as it
    received them; ``state``: the fake parameters by name. Must run inside the fake mode that
    made them and the recorded calls."""
    ids = {id(t) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    embedding = next((name for name, call in recorder.calls.items()
                      if isinstance(model.get_submodule(name), nn.Embedding)
                      and call.before_blocks and id(call.input) in ids), None)
    if embedding is None:
        return (), "no Embedding outside the blocks reads the model's inputs before them"
    vocab = model.get_submodule(embedding).num_embeddings
    head = next((name for name, call in recorder.calls.items()
                 if isinstance(model.get_submodule(name), nn.Linear) and call.after_blocks
                 and model.get_submodule(name).out_features == vocab), None)
    found = {embedding: "vocab_embedding", **({head: "vocab_head"} if head else {})}
    reasons = {name: why for name, style in found.items()
               if (why := _refuses(model, name, style, recorder.calls[name], state, found))}
    if _tied(model, embedding, head) and reasons:
        reasons = {name: reasons.get(name) or f"its weight is tied to {other}'s, which is not split"
                   for name, other in ((embedding, head), (head, embedding))}
    layout = tuple((name, style) for name, style in found.items() if name not in reasons)
    missing = [f"{name} ({why})" for name, why in reasons.items()]
    if head is None:
        missing.append(f"no Linear after the blocks writes the {vocab:,}-token vocabulary")
    return layout, "; ".join(missing) or None


def _refuses(model: nn.Module, name: str, style: str, call: _Call, state: Mapping[str, torch.Tensor],
             found: dict[str, str]) -> str | None:
    """Why ``name`` is not split as ``style``, or None."""
    module = model.get_submodule(name)
    declared = _declared_plan(model).get(name)
    if declared is not None and HF_VOCAB_STYLES.get(declared) != style:
        return f"the model's own TP plan makes it {declared!r}"
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
        return "it renormalizes its rows (max_norm)" if module.max_norm is not None else "its gradients are sparse"
    sharers = [other for other, sub in model.named_modules()
               if other != name and sub._parameters.get("weight") is module.weight]
    if any(other not in found for other in sharers):
        return f"its weight is shared with {', '.join(sharers)}"
    return _try_vocab_split(module, name, call, state)


def _tied(model: nn.Module, embedding: str, head: str | None) -> bool:
    return head is not None and model.get_submodule(head).weight is model.get_submodule(embedding).weight


def _declared_plan(model: nn.Module) -> dict[str, str]:
    """The model's own TP plan, FQNs from its root (Hugging Face's ``tp_plan``), else empty."""
    plan = getattr(model, "tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) else {}


def _try_vocab_split(module: nn.Module, name: str, call: _Call, state: Mapping[str, torch.Tensor]) -> str | None:
    """Run ``module`` on its recorded input with its vocabulary split two ways (the first rank's
    ``ceil(V / 2)`` rows of the weight, and of a head's bias); why that fails, or None."""
    own = {key[len(name) + 1:]: t for key, t in state.items() if key.startswith(f"{name}.")}
    rows = -(-module.weight.shape[0] // 2)
    split = {key: torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) if key in ("weight", "bias") else t
             for key, t in own.items()}
    expected = tuple(call.output.shape) if isinstance(module, nn.Embedding) else (*call.output.shape[:-1], rows)
    try:  # a failing split is an answer here, not an error to log
        with torch.no_grad(), quiet_fake_tensor_log():
            output = torch.func.functional_call(module, split, (call.input,))
    except Exception as err:  # noqa: BLE001 — any failure means the split is unsafe
        return f"split two ways it fails: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
    if tuple(output.shape) != expected:
        return f"split two ways its output is {tuple(output.shape)}, not {expected}"
    return None


def vocab_segment_fields(model: nn.Module, layout: Layout, recorder: VocabCallRecorder,
                         owners: Mapping[str, str], head_widths: Mapping[int, list[int]]) -> dict[str, dict[str, Any]]:
    """The :class:`~stratagem.advisor.profile.model_profile.SegmentProfile` fields the vocabulary
    split sets, by segment: ``vocab_params``, the parameters of the split modules each segment owns
    (``owners``: segment by parameter name, a tied weight under its first name), and on the head
    its split Linear with the rows it multiplied (``linears``) and what it saved and moved as wide
    as the vocabulary it writes (``vocab_saved_bytes``, ``vocab_*_op_bytes``: of ``head_widths``,
    the head's bytes by the width its tensors had, ``SegmentCounts.by_width``)."""
    first_names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first_names.setdefault(id(param), name)
    fields: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for fqn, style in layout:
        module = model.get_submodule(fqn)
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                segment = fields.setdefault(owners[first_names[id(param)]], {"vocab_params": 0})
                segment["vocab_params"] += param.numel()
        if style == "vocab_head":
            call = recorder.calls[fqn]
            head = fields.setdefault(HEAD, {"vocab_params": 0})
            head["linears"] = (LinearLayer(name=fqn, in_features=module.in_features, out_features=module.out_features,
                                           bias=module.bias is not None,
                                           rows=call.input.numel() // module.in_features),)
            saved, forward, backward = head_widths.get(module.out_features, (0, 0, 0))
            head.update(vocab_saved_bytes=saved, vocab_fwd_op_bytes=forward, vocab_bwd_op_bytes=backward)
    return fields
