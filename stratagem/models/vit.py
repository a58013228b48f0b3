"""A Vision Transformer (Dosovitskiy et al., 2021) built from the same ``Block`` as the language models."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from stratagem.errors import UsageError
from stratagem.models.config import TransformerConfig
from stratagem.models.feed_forward import INIT_STD, init_linear
from stratagem.models.transformer import Block, make_norm

__all__ = ["ViT"]


class ViT(nn.Module):
    """Image classifier: ``images [b, channels, H, W]`` → ``logits [b, num_classes]``.

    The image is cut into ``patch_size``² patches (a strided ``Conv2d``, ``patch_embed``), a
    learned class token is prepended and learned position embeddings added, then the encoder
    ``layers`` (non-causal pre-norm blocks) run, and ``head`` classifies the final class token.

    ``config`` describes the encoder: ``config.vocab_size`` is the number of classes and
    ``config.max_seq_len`` must be the number of patches plus one. Built on the ambient default
    device and dtype; call :meth:`init_weights` after ``to_empty``.
    """

    def __init__(
        self, config: TransformerConfig, *, image_size: int, patch_size: int, in_channels: int = 3
    ) -> None:
        super().__init__()
        _check_vit_config(config, image_size=image_size, patch_size=patch_size)
        self.config = config
        self.image_size = image_size
        self.patch_embed = nn.Conv2d(in_channels, config.dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.empty(1, 1, config.dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, config.max_seq_len, config.dim))
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = make_norm(config)
        self.head = nn.Linear(config.dim, config.vocab_size)
        if not next(self.parameters()).is_meta:  # meta tensors hold no values to initialise
            self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter in place, deterministically given the torch seed.

        Patch embedding N(0, 1/fan_in) as torchvision does; class token zero; everything else
        as in :class:`~stratagem.models.transformer.Transformer`.
        """
        fan_in = self.patch_embed.in_channels * math.prod(self.patch_embed.kernel_size)
        nn.init.normal_(self.patch_embed.weight, std=math.sqrt(1.0 / fan_in))
        nn.init.zeros_(self.patch_embed.bias)
        nn.init.zeros_(self.cls_token)
        nn.init.normal_(self.pos_embedding, std=INIT_STD)
        out_std = INIT_STD / math.sqrt(2 * self.config.n_layers)
        for layer in self.layers:
            layer.init_weights(out_std=out_std)
        self.norm.reset_parameters()
        init_linear(self.head, std=INIT_STD)

    def forward(self, images: Tensor) -> Tensor:
        """``images`` ``[b, channels, image_size, image_size]`` → logits ``[b, num_classes]``."""
        patches = self.patch_embed(images).flatten(2).transpose(1, 2)  # [b, patches, dim]
        cls = self.cls_token.expand(patches.size(0), -1, -1)
        h = torch.cat((cls, patches), dim=1) + self.pos_embedding
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h)[:, 0])


def _check_vit_config(config: TransformerConfig, *, image_size: int, patch_size: int) -> None:
    if image_size % patch_size:
        raise UsageError(
            f"ViT image_size ({image_size}) must be a multiple of patch_size ({patch_size})."
        )
    tokens = (image_size // patch_size) ** 2 + 1
    if config.max_seq_len != tokens:
        raise UsageError(
            f"ViT config.max_seq_len must be patches + 1 = {tokens}, got {config.max_seq_len}.\n"
            f"HINT: set max_seq_len={tokens}."
        )
    if config.pos != "learned" or config.causal:
        raise UsageError(
            "ViT encoder blocks need pos='learned' and causal=False (the class token must see "
            f"every patch); got pos={config.pos!r}, causal={config.causal}."
        )
