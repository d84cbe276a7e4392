"""Small example models bundled with symtrace.

Both models are written from scratch in plain PyTorch and are small enough to
trace, print and draw quickly on a CPU:

* :class:`SmallResNet` -- a ResNet-style CNN for 3x32x32 images.
* :class:`TransformerBlock` -- a pre-norm transformer block with hand-written
  multi-head self-attention.

Use :func:`build` to get a seeded model in eval mode and
:func:`example_inputs` for matching example tensors.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "BasicBlock",
    "SmallResNet",
    "TransformerBlock",
    "build",
    "example_inputs",
    "MODELS",
]


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn, residual add, relu.

    When the stride or the number of channels changes, the shortcut is a
    1x1 convolution followed by batch norm (``downsample``); otherwise it is
    the identity.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.downsample = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu2(out)


class SmallResNet(nn.Module):
    """A small ResNet-style CNN for 3x32x32 images (CIFAR-sized).

    Layout: stem (conv3x3-BN-ReLU), three stages of two :class:`BasicBlock`
    each (strides 1, 2, 2; widths ``width``, ``2*width``, ``4*width``),
    adaptive average pooling, flatten and a linear classifier head.

    Args:
        num_classes: number of output logits.
        width: channel count of the stem and first stage.
    """

    def __init__(self, num_classes: int = 10, width: int = 16):
        super().__init__()
        w = width
        self.stem = nn.Sequential(
            nn.Conv2d(3, w, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(),
        )
        self.layer1 = self._make_stage(w, w, stride=1)
        self.layer2 = self._make_stage(w, 2 * w, stride=2)
        self.layer3 = self._make_stage(2 * w, 4 * w, stride=2)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(4 * w, num_classes)

    @staticmethod
    def _make_stage(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
        return nn.Sequential(
            BasicBlock(in_channels, out_channels, stride=stride),
            BasicBlock(out_channels, out_channels, stride=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.pool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


class TransformerBlock(nn.Module):
    """A pre-norm transformer block with hand-written self-attention.

    ``x -> x + Attn(LN(x)) -> x + MLP(LN(x))``, where the attention is
    written out explicitly (qkv projection, reshape, scaled dot product,
    optional additive mask, softmax, dropout, output projection) rather than
    using ``nn.MultiheadAttention``, so that every step shows up in a traced
    graph.

    Args:
        dim: embedding dimension (must be divisible by ``heads``).
        heads: number of attention heads.
        mlp_ratio: hidden size of the MLP as a multiple of ``dim``.
        dropout: dropout probability on the attention weights and outputs.
    """

    def __init__(self, dim: int = 64, heads: int = 4, mlp_ratio: int = 4, dropout: float = 0.0):
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_drop = nn.Dropout(dropout)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(B, T, C)``.

        ``mask``, if given, is added to the attention scores before the
        softmax (e.g. ``-inf`` above the diagonal for causal attention); it
        must broadcast to ``(B, heads, T, T)``.
        """
        # --- multi-head self-attention (pre-norm) ---
        B, T, C = x.shape
        h = self.norm1(x)
        qkv = self.qkv(h).view(B, T, 3, self.heads, C // self.heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, heads, T, head_dim)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = q @ k.transpose(-2, -1) * self.scale
        if mask is not None:
            att = att + mask
        att = att.softmax(dim=-1)
        att = self.attn_drop(att)
        out = att @ v  # (B, heads, T, head_dim)
        out = out.transpose(1, 2).reshape(B, T, C)
        x = x + self.proj_drop(self.proj(out))
        # --- MLP (pre-norm) ---
        x = x + self.mlp(self.norm2(x))
        return x


MODELS = {
    "resnet": SmallResNet,
    "transformer": TransformerBlock,
}


def example_inputs(name: str) -> tuple[torch.Tensor, ...]:
    """Return a tuple of example input tensors for the model called ``name``.

    ``"resnet"``: one ``2x3x32x32`` image batch; ``"transformer"``: one
    ``2x8x64`` token batch. Inputs are seeded with ``torch.manual_seed(0)``.
    """
    torch.manual_seed(0)
    if name == "resnet":
        return (torch.randn(2, 3, 32, 32),)
    if name == "transformer":
        return (torch.randn(2, 8, 64),)
    raise KeyError(f"unknown example model {name!r}; choose from {sorted(MODELS)}")


def build(name: str) -> nn.Module:
    """Build the example model called ``name`` (seeded, in eval mode)."""
    if name not in MODELS:
        raise KeyError(f"unknown example model {name!r}; choose from {sorted(MODELS)}")
    torch.manual_seed(0)
    return MODELS[name]().eval()
