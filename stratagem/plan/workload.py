"""The Workload: what one optimizer step processes, which every plan for it must serve."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stratagem.plan.checks import MAX_SAMPLES, check_choice, check_positive
from stratagem.plan.precision import PRECISIONS

OPTIMIZER_CLASSES = {"adamw": ("AdamW", "Adam"), "sgd": ("SGD",)}
"""The cost model's optimizers, each with the torch.optim classes (and their subclasses) it prices,
the first the one ``calibrate`` times: Adam keeps AdamW's two states and runs its step."""
OPTIMIZERS = tuple(OPTIMIZER_CLASSES)
OPTIMIZER_OPTIONS: dict[str, dict[str, float]] = {"adamw": {}, "sgd": {"momentum": 0.9}}
"""What the cost model's optimizers run with beyond the learning rate, wherever stratagem builds one
(``calibrate`` times it, ``verify`` trains with it): SGD with momentum, whose buffer the memory model
counts and whose step the time model streams (torch's default, momentum 0, keeps no state)."""
HOST_FUSED_OPTIMIZERS = frozenset({"adamw"})
"""The optimizers an offloaded plan steps fused on the host (plugins/host_optimizer.py): those whose
fused kernel DTensor shards (torch.distributed.tensor registers ``_fused_adam(w)_``, not
``_fused_sgd_``); the others step one tensor at a time."""
GRAD_CLIPS = ("norm", "value")
"""How a step may clip its gradients before the optimizer steps: by their global norm, or each
element by value (Lightning's ``gradient_clip_algorithm``; ``plugins.clip_grad_norm_`` and
``clip_grad_value_`` on every plan)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What one optimizer step processes: ``global_batch_size`` samples of ``seq_len`` tokens
    (None for non-sequence models) in ``precision``, updated by ``optimizer``, the gradients
    clipped first as ``grad_clip`` says (:data:`GRAD_CLIPS`; None: not clipped)."""

    global_batch_size: int
    seq_len: int | None = None
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    grad_clip: str | None = None

    def __post_init__(self) -> None:
        check_positive("Workload.global_batch_size", self.global_batch_size, maximum=MAX_SAMPLES,
                       why="samples per step are a 32-bit count, so that a step's tokens are a 64-bit index")
        if self.seq_len is not None:
            check_positive("Workload.seq_len", self.seq_len, maximum=MAX_SAMPLES,
                           why="tokens per sample are a 32-bit count, so that a step's tokens are a 64-bit index")
        check_choice("Workload.precision", self.precision, tuple(PRECISIONS))
        check_choice("Workload.optimizer", self.optimizer, OPTIMIZERS)
        if self.grad_clip is not None:
            check_choice("Workload.grad_clip", self.grad_clip, GRAD_CLIPS)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
