"""A Mixtral-style sparse mixture-of-experts feed-forward."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch._guards import detect_fake_mode

from stratagem.models.config import TransformerConfig
from stratagem.models.feed_forward import INIT_STD, FeedForward, init_linear

__all__ = ["MoEFeedForward", "balanced_counts"]


class MoEFeedForward(nn.Module):
    """Routes each token to its top ``experts_per_token`` experts and sums their weighted outputs.

    A bias-free linear ``gate`` scores the ``n_experts`` experts (feed-forwards shaped by the
    config, SwiGLU for Mixtral). A token's weights are the softmax over its top-k logits, which
    equals Mixtral's softmax over all logits renormalised over the top k.

    Dispatch has static shapes: the (token, expert) assignments are sorted by expert, gathered
    with ``index_select``, run through each expert as one contiguous slice, and scattered back
    with ``index_add``. Only the number of assignments per expert depends on the data:

    * real tensors: the exact counts; dropless (no capacity limit, no token dropped) and exact;
    * fake or meta tensors (profiling), where counts cannot be read: **balanced routing is
      assumed** — each expert processes ``tokens·k // n_experts`` assignments and the first
      ``tokens·k mod n_experts`` experts one more — so FLOPs and memory are those of a
      perfectly balanced router.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.top_k = config.experts_per_token
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(config) for _ in range(config.n_experts))

    def init_weights(self, *, out_std: float) -> None:
        """Initialise in place; ``out_std`` is for the experts' down projections."""
        init_linear(self.gate, std=INIT_STD)
        for expert in self.experts:
            expert.init_weights(out_std=out_std)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``[..., dim]`` → ``[..., dim]``."""
        tokens = x.reshape(-1, x.size(-1))
        top_logits, top_experts = self.gate(tokens).topk(self.top_k, dim=-1)  # [T, k]
        weights = top_logits.softmax(dim=-1)
        flat_experts = top_experts.flatten()  # assignment i is token i // k
        order = flat_experts.argsort(stable=True)
        token_of = order // self.top_k
        routed = tokens.index_select(0, token_of)
        outputs = [
            expert(chunk) for expert, chunk in zip(self.experts, routed.split(self._counts(flat_experts)))
        ]
        weighted = torch.cat(outputs) * weights.flatten()[order].unsqueeze(-1)
        return tokens.new_zeros(tokens.shape).index_add(0, token_of, weighted).view_as(x)

    def _counts(self, flat_experts: Tensor) -> list[int]:
        """Assignments per expert: exact on real tensors, balanced where values are unknown."""
        if flat_experts.device.type == "meta" or detect_fake_mode(flat_experts) is not None:
            return balanced_counts(flat_experts.numel(), len(self.experts))
        return torch.bincount(flat_experts, minlength=len(self.experts)).tolist()


def balanced_counts(assignments: int, n_experts: int) -> list[int]:
    """``assignments`` spread as evenly as possible: the first ``assignments mod n_experts`` get one more."""
    base, extra = divmod(assignments, n_experts)
    return [base + (i < extra) for i in range(n_experts)]
