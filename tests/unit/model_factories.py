"""Factories that tests name as 'model_factories:NAME' (pytest puts this folder on sys.path)."""

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
