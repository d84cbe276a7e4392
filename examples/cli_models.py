"""Small model factories for the ``symtrace`` command line (each builds a seeded model).

``examples.models:SmallResNet`` and ``examples.models:TransformerBlock`` work as factories too;
the ones here cover what those two do not: a pair that differs in one op (for ``diff``), a
data-dependent branch (for ``explain``), integer inputs, and two inputs::

    python -m symtrace diff examples.cli_models:mlp_relu examples.cli_models:mlp_gelu -i 2x16
    python -m symtrace explain examples.cli_models:branchy -i 4x8
    python -m symtrace show examples.cli_models:bag_of_words -i 2x6:int64 --as histogram
    python -m symtrace show examples.cli_models:two_inputs -i 2x8 -i 2x8
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["mlp_relu", "mlp_gelu", "branchy", "bag_of_words", "two_inputs", "tiny_resnet"]


class MLP(nn.Module):
    """``Linear(16, 32) -> act -> Linear(32, 4)``."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = act
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Branchy(nn.Module):
    """Takes a Python branch on the input's data: traced with example inputs this becomes a
    data-dependent guard; traced symbolically it is a TraceError naming the ``if`` line."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            return torch.relu(y)
        return -y


class BagOfWords(nn.Module):
    """Token ids ``(B, T)`` of a 10-word vocabulary -> mean embedding -> 3 logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(dim=1))


class TwoInputs(nn.Module):
    """``relu(x @ W + y)`` for two ``(B, 8)`` inputs."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x, y):
        return torch.relu(self.proj(x) + y)


def _seeded(cls, *args):
    torch.manual_seed(0)
    return cls(*args)


def mlp_relu() -> nn.Module:
    """MLP with ReLU; its graph differs from :func:`mlp_gelu` in one node."""
    return _seeded(MLP, nn.ReLU())


def mlp_gelu() -> nn.Module:
    """MLP with GELU."""
    return _seeded(MLP, nn.GELU())


def branchy() -> nn.Module:
    """A model with a data-dependent ``if`` (input ``(B, 8)``)."""
    return _seeded(Branchy)


def bag_of_words() -> nn.Module:
    """An embedding model on int64 token ids (input ``B x T:int64``, ids below 10)."""
    return _seeded(BagOfWords)


def two_inputs() -> nn.Module:
    """A model of two ``(B, 8)`` inputs."""
    return _seeded(TwoInputs)


def tiny_resnet() -> nn.Module:
    """:class:`examples.models.SmallResNet` with width 4: quick to trace (input ``Bx3x32x32``)."""
    from examples.models import SmallResNet
    return _seeded(SmallResNet, 10, 4)
