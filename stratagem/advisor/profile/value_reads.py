"""Values a model's forward reads from its tensors, answered on fake tensors as a real step answers them.

Fake tensors hold no values, so a forward that branches on one cannot be profiled, yet two such
branches are common in Hugging Face models and have one answer for the step being planned, and
a third only warns:

* **Attention masks that pad nothing.** Before it drops an attention mask and lets SDPA apply
  causality itself (``is_causal``: the flash kernel), transformers asks whether the mask holds only
  ones: ``torch.all(mask == 1)`` in ``AttentionMaskConverter._ignore_causal_mask_sdpa`` (4.x models
  that build their own mask, OPT's of ones where none is given), ``padding_mask.all()`` in
  ``masking_utils._ignore_causal_mask_sdpa``. 4.x reads the value (transformers 4.57's OPT failed to
  profile); 5.x skips the check on fake tensors and keeps the mask, which a real step of the same
  batch drops. The profile's batches pad nothing: :class:`ValueReads` hands the checks no mask
  where a fake one was given.
* **LayerDrop's draw.** 47 ``modeling_*.py`` files of transformers 5.24 (BART, Whisper; OPT in 4.x;
  ``grep -rlF 'torch.rand([])' --include='modeling_*.py'`` in its ``models`` folder) draw
  ``torch.rand([])`` before each layer and skip it when the draw falls below ``config.layerdrop``,
  0 by default. A draw of one element is made a constant at the top of its range (the largest
  value below 1 in its dtype): a real draw, below no probability under 1, so every layer runs:
  the step without LayerDrop, and an upper bound on one with it.
* **The padding warning.** 4.x models warn when a row's first or last token is the pad token and
  no mask was given (``warn_if_padding_and_no_attention_mask``), reading the tokens: GPT-2's and
  XGLM's profiles failed on 4.57.1 with a ``pad_token_id`` set. On fake tokens it is skipped, as
  5.x skips it.

The profile notes the first two answers where it gave them (docs/cost-model.md, "Values read in
forward").
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

_CHECKS = (("transformers.modeling_attn_mask_utils", "AttentionMaskConverter", "_ignore_causal_mask_sdpa", "mask"),
           ("transformers.masking_utils", None, "_ignore_causal_mask_sdpa", "mask"),
           ("transformers.modeling_utils", "PreTrainedModel", "warn_if_padding_and_no_attention_mask", "warning"))
"""(module, class or None, function, kind): transformers' checks that read tokens or masks; ``mask``
takes the mask first, ``warning`` is a method taking the tokens first."""


class ValueReads(TorchFunctionMode):
    """While entered, transformers' mask checks take a fake mask for one that pads nothing, and a
    ``torch.rand`` of one element is the largest value below 1 (module docstring); :meth:`note`
    says which of them the step met."""

    def __init__(self) -> None:
        super().__init__()
        self.masks = self.draws = 0
        self._patched: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> ValueReads:
        for module_name, class_name, name, kind in _CHECKS:
            module = sys.modules.get(module_name)  # a model that never imported it never calls it
            owner = getattr(module, class_name, None) if class_name else module
            if owner is None or name not in vars(owner):
                continue
            original = vars(owner)[name]
            static = isinstance(original, staticmethod)
            wrap = self._unpadded if kind == "mask" else _unwarned
            wrapped = wrap(original.__func__ if static else original)
            setattr(owner, name, staticmethod(wrapped) if static else wrapped)
            self._patched.append((owner, name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in self._patched:
            setattr(owner, name, original)
        self._patched.clear()
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.rand and not kwargs.get("out") and math.prod(size := _size(args, kwargs)) == 1:
            self.draws += 1
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            top = torch.tensor(1 - torch.finfo(dtype).eps / 2, dtype=dtype, device=kwargs.get("device"))
            return top.reshape(size)  # a constant the fake mode carries through comparisons
        return func(*args, **kwargs)

    def _unpadded(self, check: Callable[..., bool]) -> Callable[..., bool]:
        @functools.wraps(check)
        def run(mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> bool:
            if isinstance(mask, torch.Tensor) and is_fake(mask) and mask.dim() == 2:
                self.masks += 1
                mask = None
            return check(mask, *args, **kwargs)

        return run

    def note(self) -> str | None:
        """What the profile took the values it could not read to be; None if it read none."""
        said = []
        if self.masks:
            said.append("transformers drops an attention mask that pads nothing and runs SDPA causal, as the "
                        "profile's batch does (batches with padding keep the mask, and SDPA a slower kernel)")
        if self.draws:
            said.append(f"{self.draws} random scalars drawn in the step (LayerDrop's) were taken as the largest "
                        "value below 1: every layer runs, an upper bound where config.layerdrop > 0")
        return "; ".join(said) or None


def _unwarned(warn: Callable[..., None]) -> Callable[..., None]:
    """``warn`` (a model's ``warn_if_padding_and_no_attention_mask``), skipped on fake tokens."""
    @functools.wraps(warn)
    def run(model: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(input_ids, torch.Tensor) and is_fake(input_ids):
            return None  # the profile's batch pads nothing: nothing to warn of
        return warn(model, input_ids, *args, **kwargs)

    return run


def _size(args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The size ``torch.rand(*args, **kwargs)`` draws: ``size=``, its integers, or the one sequence
    of them it was given."""
    if "size" in kwargs:
        return tuple(kwargs["size"])
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(a for a in args if isinstance(a, int))
