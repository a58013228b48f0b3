"""Factories that tests name as 'model_factories:NAME' (pytest puts this folder on sys.path)."""

from collections.abc import Callable

import torch
from torch import nn


def mlp(batch_size: int = 1):
    """A module and its example inputs; takes the batch size the CLI passes."""
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)), (torch.randn(batch_size, 16),)


def mlp_with_loss():
    model, inputs = mlp(2)
    target = torch.randn(2, 16)  # a tensor the loss closes over
    return model, inputs, lambda out: (out - target).pow(2).mean()


def module_only():
    return nn.Linear(4, 4)


def not_a_module():
    return 42


def raises():
    """A factory whose own code fails."""
    raise RuntimeError("a factory's own error")


def exits():
    """A factory that ends the program: a UsageError, not an exit."""
    raise SystemExit(1)


def tokens(batch_size: int = 1, seq_len: int = 8):
    """A token model with its own sequence-length default."""
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    return model, (torch.randint(0, 32, (batch_size, seq_len)),)


def needs_seq_len(seq_len):
    """Requires a sequence length: a UsageError without one."""
    return tokens(1, seq_len)


def mlp_with_targets(batch_size: int = 2):
    """A module, its example inputs and a loss closing over targets of the same batch size (verify
    calls it for real with each rank's batch size)."""
    model, inputs = mlp(batch_size)
    target = torch.randn(batch_size, 16)
    return model, inputs, lambda out: (out - target).pow(2).mean()


def mlp_keyword_inputs(batch_size: int = 2):
    """Example inputs given as keyword arguments (nn.Sequential's forward takes ``input``)."""
    model, (x,) = mlp(batch_size)
    return model, {"input": x}


def mlp_four_samples():
    """Four samples of its own choosing: no batch_size parameter."""
    return mlp(4)


def sequence_first(batch_size: int = 2, seq_len: int = 8):
    """Tokens laid out (sequence, batch), torch's default for its transformer layers."""
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    return model, (torch.randint(0, 32, (seq_len, batch_size)),)


class _WithUnused(nn.Module):
    """An MLP with a layer its forward never calls (an auxiliary head left in the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))
        self.aux = nn.Linear(16, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def mlp_with_unused(batch_size: int = 2):
    return _WithUnused(), (torch.randn(batch_size, 16),)


def frozen(batch_size: int = 2):
    """No parameter requires grad: nothing to train."""
    model, inputs = mlp(batch_size)
    return model.requires_grad_(False), inputs


def sparse_embedding(batch_size: int = 2):
    """Sparse gradients, which fake tensors cannot hold."""
    return nn.Sequential(nn.Embedding(32, 8, sparse=True), nn.Linear(8, 2)), (torch.randint(0, 32, (batch_size, 4)),)


class _StemAndBlocks(nn.Module):
    """Blocks that are nn.Sequential, and a stem that is one too."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


def stem_and_blocks(batch_size: int = 2):
    return _StemAndBlocks(), (torch.randn(batch_size, 16),)


def encoder(batch_size: int = 2, seq_len: int = 8):
    """nn.TransformerEncoder deep-copies its layer: torch warns of a fake tensor's data pointer."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (torch.randn(batch_size, seq_len, 16),)


class _FeedForwards(nn.Module):
    """Residual feed-forward blocks on 2-D activations: tensor parallelism splits them, sequence
    parallelism has no sequence to split."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def feed_forwards(batch_size: int = 2):
    return _FeedForwards(), (torch.randn(batch_size, 16),)


class Embedded(nn.Module):
    """A Linear of ``width`` before two blocks made by ``block``: the blocks' input takes a gradient."""

    def __init__(self, block: Callable[[], nn.Module], width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x
