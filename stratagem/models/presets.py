"""Named reference models: published shapes (parameter counts exact), tiny ones that train on a CPU
in moments, and small ones whose tensors outweigh the framework's own memory (benchmarks).

A :class:`Preset` builds its model lazily (honouring the ambient default device and dtype, so
``with torch.device("meta"): get_preset("llama-2-70b").build()`` allocates nothing), makes a
random batch for it and computes its training loss.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stratagem.errors import UsageError
from stratagem.models.config import TransformerConfig
from stratagem.models.resnet import ResNet
from stratagem.models.transformer import Transformer
from stratagem.models.vit import ViT

__all__ = ["PRESETS", "Preset", "get_preset"]

Batch = tuple[tuple[Tensor, ...], Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    """A reference model by name, with what it takes to feed and train it.

    ``input_kind="tokens"``: a language model; inputs are token ids ``[b, s]``, the output is
    logits ``[b, s, vocab_size]``, targets are the next tokens. ``"image"``: a classifier;
    inputs are images ``[b, 3, image_size, image_size]``, targets class ids ``[b]``.
    ``config`` is the transformer's configuration (None for convolutional networks); ``notes``
    are caveats a report should repeat.
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    input_kind: Literal["tokens", "image"]
    default_seq_len: int | None = None
    vocab_size: int | None = None
    image_size: int | None = None
    num_classes: int | None = None
    config: TransformerConfig | None = None
    notes: tuple[str, ...] = ()

    def make_batch(
        self,
        batch_size: int,
        seq_len: int | None = None,
        *,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> Batch:
        """Random ``(inputs, targets)``: ``inputs`` is the tuple of positional model arguments.

        Token ids are uniform over the vocabulary and the targets are the same sequence shifted
        by one; images are standard normal (in the default dtype) with uniform class targets.
        ``seq_len`` defaults to ``default_seq_len``; image presets ignore it, with a warning.
        Inside ``FakeTensorMode`` the tensors are fake.
        """
        if batch_size < 1:
            raise UsageError(f"batch_size must be at least 1, got {batch_size}.")
        draw = {"device": device, "generator": generator}
        if self.input_kind == "tokens":
            return self._token_batch(batch_size, self.default_seq_len if seq_len is None else seq_len, **draw)
        if seq_len is not None:
            warnings.warn(f"preset {self.name!r} takes images; seq_len={seq_len} is ignored", stacklevel=2)
        return self._image_batch(batch_size, **draw)

    def loss(self, output: Tensor, targets: Tensor) -> Tensor:
        """Mean cross entropy in fp32: over every position for language models (``targets``
        ``[b, s]``, already shifted), over the batch for classifiers (``targets`` ``[b]``)."""
        return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())

    def _token_batch(self, batch_size: int, seq_len: int, **draw: Any) -> Batch:
        if seq_len < 1:
            raise UsageError(f"seq_len must be at least 1, got {seq_len}.")
        ids = torch.randint(0, self.vocab_size, (batch_size, seq_len + 1), **draw)
        return (ids[:, :-1],), ids[:, 1:]

    def _image_batch(self, batch_size: int, **draw: Any) -> Batch:
        size = self.image_size
        images = torch.randn(batch_size, 3, size, size, **draw)
        return (images,), torch.randint(0, self.num_classes, (batch_size,), **draw)


def get_preset(name: str) -> Preset:
    """The preset called ``name``; :class:`~stratagem.errors.UsageError` listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(
            f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}.\n"
            "HINT: pick one of these names, or pass your own nn.Module."
        ) from None


def _language_model(name: str, description: str, config: TransformerConfig, *, seq_len: int) -> Preset:
    return Preset(
        name=name, description=description, build=partial(Transformer, config), input_kind="tokens",
        default_seq_len=seq_len, vocab_size=config.vocab_size, config=config,
        notes=(_BALANCED_ROUTING,) if config.n_experts else (),
    )


def _gpt2(name: str, description: str, *, dim: int, n_layers: int, n_heads: int, vocab_size: int = 50257,
          seq_len: int = 1024) -> Preset:
    config = TransformerConfig(
        vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=4 * dim,
        max_seq_len=seq_len, tie_embeddings=True,
    )
    return _language_model(name, description, config, seq_len=seq_len)


def _llama(name: str, description: str, *, seq_len: int, max_seq_len: int | None = None, **shape: Any) -> Preset:
    config = TransformerConfig(
        **shape, max_seq_len=max_seq_len or seq_len, norm="rmsnorm", mlp="swiglu", pos="rope", bias=False,
    )
    return _language_model(name, description, config, seq_len=seq_len)


def _vit(name: str, description: str, *, dim: int, n_layers: int, n_heads: int, ffn_dim: int,
         image_size: int = 224, patch_size: int = 16, num_classes: int = 1000) -> Preset:
    config = TransformerConfig(
        vocab_size=num_classes, dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=ffn_dim,
        max_seq_len=(image_size // patch_size) ** 2 + 1, causal=False, norm_eps=1e-6,
    )
    return Preset(
        name=name, description=description, input_kind="image", image_size=image_size,
        num_classes=num_classes, config=config,
        build=partial(ViT, config, image_size=image_size, patch_size=patch_size),
    )


def _resnet(name: str, description: str, blocks_per_stage: tuple[int, ...], *, width: int = 64,
            image_size: int = 224, num_classes: int = 1000) -> Preset:
    return Preset(
        name=name, description=description, input_kind="image", image_size=image_size,
        num_classes=num_classes, build=partial(ResNet, blocks_per_stage, width=width, num_classes=num_classes),
    )


_BALANCED_ROUTING = (
    "mixture of experts: on fake/meta tensors every expert is assumed to get an equal share of the "
    "tokens (balanced routing); real routing is data-dependent"
)
_LLAMA_2 = {"vocab_size": 32000, "rope_theta": 10_000.0}
_LLAMA_3 = {"vocab_size": 128256, "rope_theta": 500_000.0}

_ALL = (
    _gpt2("gpt2", "GPT-2 small, 124M: 12 layers × 768, learned positions, tied embeddings",
          dim=768, n_layers=12, n_heads=12),
    _gpt2("gpt2-medium", "GPT-2 medium, 355M: 24 layers × 1024", dim=1024, n_layers=24, n_heads=16),
    _gpt2("gpt2-large", "GPT-2 large, 774M: 36 layers × 1280", dim=1280, n_layers=36, n_heads=20),
    _gpt2("gpt2-xl", "GPT-2 XL, 1.5B: 48 layers × 1600", dim=1600, n_layers=48, n_heads=25),
    _llama("llama-2-7b", "Llama 2 7B: 32 layers × 4096, RoPE, SwiGLU, RMSNorm", **_LLAMA_2,
           dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, seq_len=4096),
    _llama("llama-2-13b", "Llama 2 13B: 40 layers × 5120", **_LLAMA_2,
           dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, seq_len=4096),
    _llama("llama-2-70b", "Llama 2 70B: 80 layers × 8192, GQA with 8 key/value heads", **_LLAMA_2,
           dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, seq_len=4096),
    _llama("llama-3-8b", "Llama 3 8B: 32 layers × 4096, GQA 8 kv heads, 128K vocabulary", **_LLAMA_3,
           dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, seq_len=8192),
    _llama("llama-3-70b", "Llama 3 70B: 80 layers × 8192, GQA 8 kv heads, 128K vocabulary", **_LLAMA_3,
           dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, seq_len=8192),
    _llama("mixtral-8x7b", "Mixtral 8x7B: 32 layers × 4096, 8 SwiGLU experts, top-2 routing (32K context)",
           vocab_size=32000, rope_theta=1_000_000.0, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
           ffn_dim=14336, n_experts=8, experts_per_token=2, seq_len=4096, max_seq_len=32768),
    _vit("vit-b-16", "ViT-B/16 (torchvision vit_b_16), 224×224 images, 1000 classes",
         dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    _vit("vit-l-16", "ViT-L/16 (torchvision vit_l_16), 224×224 images, 1000 classes",
         dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    _resnet("resnet-50", "ResNet-50 (torchvision resnet50), 224×224 images, 1000 classes", (3, 4, 6, 3)),
    _resnet("resnet-101", "ResNet-101 (torchvision resnet101), 224×224 images, 1000 classes", (3, 4, 23, 3)),
    _gpt2("gpt2-tiny", "tiny GPT-2 for CPU training: 2 layers × 64, 256 tokens",
          dim=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=64),
    _llama("llama-tiny", "tiny Llama for CPU training: 4 layers × 64, GQA 4/2 heads, RoPE, SwiGLU",
           vocab_size=256, rope_theta=10_000.0, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176,
           seq_len=64),
    _llama("mixtral-tiny", "tiny Mixtral for CPU training: 2 layers × 64, 4 experts, top-2",
           vocab_size=256, rope_theta=10_000.0, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
           n_experts=4, experts_per_token=2, seq_len=64),
    _vit("vit-tiny", "tiny ViT for CPU training: 32×32 images, 8×8 patches, 2 layers × 64, 10 classes",
         dim=64, n_layers=2, n_heads=4, ffn_dim=128, image_size=32, patch_size=8, num_classes=10),
    _resnet("resnet-tiny", "tiny ResNet for CPU training: 4 bottlenecks, width 8, 64×64 images, 10 classes",
            (1, 1, 1, 1), width=8, image_size=64, num_classes=10),
    _llama("llama-small", "small Llama for CPU benchmarks, 5.0M: 4 layers × 256, GQA 8/4 heads, 4096 tokens",
           vocab_size=4096, rope_theta=10_000.0, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704,
           seq_len=128),
    _llama("mixtral-small", "small Mixtral for CPU benchmarks, 5.6M: 2 layers × 256, 4 experts, top-2",
           vocab_size=4096, rope_theta=10_000.0, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=512,
           n_experts=4, experts_per_token=2, seq_len=128),
    _vit("vit-small", "small ViT for CPU benchmarks, 3.2M: 64×64 images, 8×8 patches, 4 layers × 256",
         dim=256, n_layers=4, n_heads=8, ffn_dim=1024, image_size=64, patch_size=8, num_classes=100),
)

PRESETS: dict[str, Preset] = {preset.name: preset for preset in _ALL}
"""Every preset by name: published shapes first, then the tiny ones, then the small ones."""
