"""Helpers the model-level test files share."""
import torch
from torch import nn


def randomize_bn(model: nn.Module, seed: int = 1) -> nn.Module:
    """Non-trivial running statistics and affine parameters for every batch norm of ``model``
    (in place; returns it), so that folding or merging them is really tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.rand(m.num_features, generator=g) * 2 - 1)
                    m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                    m.bias.copy_(torch.rand(m.num_features, generator=g) - 0.5)
    return model
