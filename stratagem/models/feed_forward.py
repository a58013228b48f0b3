"""The position-wise feed-forward of a transformer block, and the shared weight initialisation."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from stratagem.models.config import TransformerConfig

__all__ = ["INIT_STD", "FeedForward", "init_linear"]

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of linear and embedding weights (GPT-2's)."""


def init_linear(linear: nn.Linear, *, std: float) -> None:
    """Normal weights of standard deviation ``std``, zero bias."""
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class FeedForward(nn.Module):
    """Position-wise MLP: GELU (``w1`` up, ``w2`` down) or SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=config.bias)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=config.bias)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=config.bias) if config.mlp == "swiglu" else None

    def init_weights(self, *, out_std: float) -> None:
        """Initialise in place; ``out_std`` is for the down projection ``w2``."""
        init_linear(self.w1, std=INIT_STD)
        if self.w3 is not None:
            init_linear(self.w3, std=INIT_STD)
        init_linear(self.w2, std=out_std)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``[..., dim]`` → ``[..., dim]``."""
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))
