"""The one configuration every transformer preset is built from (GPT-2, Llama, Mixtral, ViT)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stratagem.errors import UsageError

__all__ = ["TransformerConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerConfig:
    """Shape and flavour of a pre-norm transformer, checked on construction.

    ``vocab_size`` is the width of the output layer: the vocabulary of a language model, the
    number of classes of a ViT. ``n_kv_heads=None`` means one key/value head per query head
    (multi-head attention); fewer is grouped-query attention. ``n_experts=0`` is a dense
    feed-forward; more makes every feed-forward a Mixtral-style sparse mixture of experts that
    routes each token to ``experts_per_token`` of them.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    ffn_dim: int
    max_seq_len: int
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    pos: Literal["learned", "rope"] = "learned"
    bias: bool = True
    tie_embeddings: bool = False
    n_experts: int = 0
    experts_per_token: int = 2
    attention: Literal["sdpa", "explicit"] = "sdpa"
    dropout: float = 0.0
    causal: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            _require(getattr(self, name) >= 1, name, f"must be at least 1, got {getattr(self, name)}")
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            _require(value in choices, name, f"must be one of {', '.join(choices)}; got {value!r}")
        _require(
            self.dim % self.n_heads == 0, "n_heads",
            f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})",
        )
        kv = self.num_kv_heads
        _require(
            1 <= kv <= self.n_heads and self.n_heads % kv == 0, "n_kv_heads",
            f"must divide n_heads ({self.n_heads}), got {kv}",
        )
        _require(
            self.pos != "rope" or self.head_dim % 2 == 0, "pos",
            f"rope needs an even head_dim, got dim/n_heads = {self.head_dim}",
        )
        _require(self.n_experts >= 0, "n_experts", f"must be 0 (dense) or more, got {self.n_experts}")
        _require(
            self.n_experts == 0 or 1 <= self.experts_per_token <= self.n_experts, "experts_per_token",
            f"must be between 1 and n_experts ({self.n_experts}), got {self.experts_per_token}",
        )
        _require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        _require(self.norm_eps > 0, "norm_eps", f"must be positive, got {self.norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be positive, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads, with ``n_kv_heads=None`` resolved to ``n_heads``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


_CHOICES: dict[str, tuple[str, ...]] = {
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "swiglu"),
    "pos": ("learned", "rope"),
    "attention": ("sdpa", "explicit"),
}


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise UsageError(f"TransformerConfig.{field} {message}.")
