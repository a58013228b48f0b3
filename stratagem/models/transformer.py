"""A pre-norm decoder transformer covering GPT-2, Llama (GQA, RoPE, SwiGLU, RMSNorm) and Mixtral.

Module names follow Meta's Llama reference (``tok_embeddings``, ``layers.N.attention.wq``,
``feed_forward.w1``, ``output``) so that tensor-parallel and FSDP plans can address them by
fully qualified name. Query, key and value are separate linears: tensor parallelism splits
them column-wise and ``wo``/``w2`` row-wise, and attention reads its local head count from the
projected width at run time, so a sharded block keeps working unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stratagem.errors import UsageError
from stratagem.models.config import TransformerConfig
from stratagem.models.feed_forward import INIT_STD, FeedForward, init_linear
from stratagem.models.moe import MoEFeedForward
from stratagem.plan.stages import RemovalConvention

__all__ = ["Attention", "Block", "Transformer", "rope_tables", "rotate_pairs"]

Rope = tuple[Tensor, Tensor]


def rope_tables(seq_len: int, head_dim: int, *, theta: float, device: torch.device) -> Rope:
    """Cosines and sines of the rotary angles, each ``[seq_len, head_dim // 2]``, in fp32."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / theta**exponents
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def rotate_pairs(x: Tensor, rope: Rope) -> Tensor:
    """Rotate adjacent channel pairs of ``x`` ``[b, s, heads, head_dim]`` by the rotary angles.

    This is Meta's complex-number formulation written with real tensors: pair ``(a, b)`` at
    position ``p`` becomes ``(a·cos − b·sin, a·sin + b·cos)`` of angle ``p·θ^(−2i/head_dim)``.
    """
    cos, sin = (t[:, None, :] for t in rope)  # broadcast over heads
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def make_norm(config: TransformerConfig) -> nn.Module:
    """LayerNorm (with a bias when ``config.bias``) or RMSNorm over ``config.dim``."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.dim, eps=config.norm_eps)
    return nn.LayerNorm(config.dim, eps=config.norm_eps, bias=config.bias)


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query key/value heads and optional RoPE.

    ``config.attention="sdpa"`` calls ``F.scaled_dot_product_attention`` (GQA through
    ``enable_gqa``); ``"explicit"`` writes the Megatron-style sequence out, so that every
    intermediate the activation-memory formulas count is a real tensor.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        kv_dim = config.num_kv_heads * config.head_dim
        self.head_dim = config.head_dim
        self.causal = config.causal
        self.dropout = config.dropout
        self.explicit = config.attention == "explicit"
        self.wq = nn.Linear(config.dim, config.dim, bias=config.bias)
        self.wk = nn.Linear(config.dim, kv_dim, bias=config.bias)
        self.wv = nn.Linear(config.dim, kv_dim, bias=config.bias)
        self.wo = nn.Linear(config.dim, config.dim, bias=config.bias)

    def init_weights(self, *, out_std: float) -> None:
        """Initialise in place; ``out_std`` is for the output projection."""
        for linear in (self.wq, self.wk, self.wv):
            init_linear(linear, std=INIT_STD)
        init_linear(self.wo, std=out_std)

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        """``x`` ``[b, s, dim]`` → ``[b, s, dim]``."""
        b, s, _ = x.shape
        # -1, not a head count: under tensor parallelism this rank holds a slice of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if rope is not None:
            q, k = rotate_pairs(q, rope), rotate_pairs(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, head_dim]
        out = self._explicit(q, k, v) if self.explicit else self._sdpa(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal,
            enable_gqa=q.size(1) != k.size(1),
        )

    def _explicit(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        repeats = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if self.causal:
            s = q.size(2)
            future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
        # in the scores' dtype, as Megatron's fused softmax reads and writes them (CUDA's autocast
        # would run a softmax without a dtype in float32)
        probs = F.dropout(scores.softmax(dim=-1, dtype=scores.dtype), p=self.dropout, training=self.training)
        return probs @ v


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attention(norm(x))``, then ``h + feed_forward(norm(h))``.

    Dropout (``config.dropout``) applies to the attention probabilities and to both branch
    outputs before the residual add, as in GPT-2 and Megatron.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention = Attention(config)
        self.ffn_norm = make_norm(config)
        self.feed_forward = _make_feed_forward(config)
        self.dropout = nn.Dropout(config.dropout)

    def init_weights(self, *, out_std: float) -> None:
        """Initialise in place; ``out_std`` is for the projections that feed the residual."""
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(out_std=out_std)
        self.feed_forward.init_weights(out_std=out_std)

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        """``x`` ``[b, s, dim]`` → ``[b, s, dim]``; ``rope`` from :func:`rope_tables` or None."""
        h = x + self.dropout(self.attention(self.attention_norm(x), rope))
        return h + self.dropout(self.feed_forward(self.ffn_norm(h)))


def _make_feed_forward(config: TransformerConfig) -> FeedForward | MoEFeedForward:
    return MoEFeedForward(config) if config.n_experts else FeedForward(config)


class Transformer(nn.Module):
    """Decoder-only language model: ``tokens [b, s]`` → ``logits [b, s, vocab_size]``.

    Built on the ambient default device and dtype (``with torch.device("meta")`` allocates
    nothing). After ``to_empty`` call :meth:`init_weights`; it also re-ties the output layer to
    the embedding, which ``to_empty`` unties.

    A pipeline stage keeps a slice of ``layers`` and sets the modules it doesn't own to None:
    without ``tok_embeddings`` (and ``pos_embeddings``) its input is hidden states
    ``[b, s, dim]``; without ``norm`` and ``output`` it returns hidden states.
    """

    pipeline_removal = RemovalConvention(embed=("tok_embeddings", "pos_embeddings"), head=("norm", "output"))

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        learned = config.pos == "learned"
        self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim) if learned else None
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm: nn.Module | None = make_norm(config)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one parameter, counted once
        if not next(self.parameters()).is_meta:  # meta tensors hold no values to initialise
            self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter in place, deterministically given the torch seed.

        Linear and embedding weights are N(0, 0.02); projections into the residual stream are
        scaled by 1/√(2·n_layers) as in GPT-2; norms are ones (and zero bias).
        """
        out_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=INIT_STD)
        if self.pos_embeddings is not None:
            nn.init.normal_(self.pos_embeddings.weight, std=INIT_STD)
        for layer in self.layers:
            layer.init_weights(out_std=out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            self._init_output()

    def _init_output(self) -> None:
        if self.config.tie_embeddings and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty unties them
        else:
            init_linear(self.output, std=INIT_STD)

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens`` ``[b, s]`` (int64) → logits ``[b, s, vocab_size]``."""
        seq_len = tokens.size(1)
        h = self._embed(tokens)
        rope = None
        if self.config.pos == "rope":
            rope = rope_tables(seq_len, self.config.head_dim, theta=self.config.rope_theta, device=h.device)
        for layer in self.layers:
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def _embed(self, tokens: Tensor) -> Tensor:
        if self.tok_embeddings is None:
            return tokens
        seq_len = tokens.size(1)
        if seq_len > self.config.max_seq_len and self.pos_embeddings is not None:
            raise UsageError(
                f"sequence length {seq_len} exceeds max_seq_len ({self.config.max_seq_len}) of "
                "the learned position embeddings.\nHINT: use a shorter sequence."
            )
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(torch.arange(seq_len, device=tokens.device))
        return h
