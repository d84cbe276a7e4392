"""Data and models for the quantization example: scikit-learn's digits, a small CNN and an MLP.

The data set is the 1,797 8x8 handwritten digits bundled with scikit-learn
(``sklearn.datasets.load_digits``, BSD-3-Clause), committed here as
``data/digits.csv.gz`` (one image per line: 64 pixel values 0..16, then the label) so the
example needs neither scikit-learn nor numpy, and nothing is unpickled.

* :func:`load_digits` -- the images as a float tensor (N, 1, size, size) and labels, split into a
  seeded train/test partition (1437 / 360 images).
* :func:`augmented` -- a seeded, harder copy of a set (rotation, scale, shift, noise; pixels kept
  in range): accuracy on the clean test split saturates, this set shows where int8 and fp32
  disagree. :func:`random_affine` is the transform (also used, milder, for training).
* :class:`DigitsCNN` -- conv-bn-relu blocks, a max-pool, a residual block with an add, a stride-2
  block, global average pooling and a Linear head.
* :class:`DigitsMLP` -- a plain ReLU MLP, for static vs dynamic int8 Linear.
* :func:`train` -- a short AdamW + one-cycle training loop, seeded.
"""
from __future__ import annotations

import gzip
import math
import os
import time
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")

__all__ = ["load_digits", "augmented", "random_affine", "DigitsCNN", "DigitsMLP", "train", "accuracy"]


def _read_csv(path: str = DATA) -> Tuple[torch.Tensor, torch.Tensor]:
    rows = []
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            rows.append([int(v) for v in line.split(",")])
    t = torch.tensor(rows, dtype=torch.int64)
    if t.shape != (1797, 65):
        raise ValueError(f"{path}: expected 1797 rows of 65 integers, got {tuple(t.shape)}")
    return t[:, :64].to(torch.uint8), t[:, 64]


def load_digits(size: int = 16, seed: int = 0, test_fraction: float = 0.2):
    """``(x_train, y_train, x_test, y_test)``: images upsampled (bilinear) to ``size`` x ``size``,
    scaled to [-1, 1]; a seeded random split with ``test_fraction`` of the images for testing."""
    pix, labels = _read_csv()
    x = pix.reshape(-1, 1, 8, 8).float() / 16.0
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = x * 2.0 - 1.0
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    n_test = int(round(len(x) * test_fraction))
    test, tr = perm[:n_test], perm[n_test:]
    return x[tr].contiguous(), labels[tr], x[test].contiguous(), labels[test]


def random_affine(x: torch.Tensor, g: torch.Generator, rotate: float = 20.0, scale: float = 0.12,
                  shift: float = 0.12, noise: float = 0.15) -> torch.Tensor:
    """One random variant of each image of ``x``: rotation within +-``rotate`` degrees, zoom
    within +-``scale``, shift within +-``shift`` of the width, Gaussian noise of std
    ``noise``; pixels stay in the valid range [-1, 1] (as a camera's would)."""
    n = len(x)
    ang = (torch.rand(n, generator=g) * 2 - 1) * math.radians(rotate)
    zoom = 1.0 + (torch.rand(n, generator=g) * 2 - 1) * scale
    t = (torch.rand(n, 2, generator=g) * 2 - 1) * shift * 2  # grid units: the width spans 2
    cos, sin = torch.cos(ang) / zoom, torch.sin(ang) / zoom
    theta = torch.stack([torch.stack([cos, -sin, t[:, 0]], 1), torch.stack([sin, cos, t[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    # background is -1 (a blank pixel); grid_sample pads with zeros, so shift to 0 and back
    out = F.grid_sample(x + 1.0, grid, mode="bilinear", padding_mode="zeros", align_corners=False) - 1.0
    if noise:
        out = out + noise * torch.randn(out.shape, generator=g)
    return out.clamp_(-1.0, 1.0)


def augmented(x: torch.Tensor, copies: int = 10, seed: int = 1, **kw) -> torch.Tensor:
    """``copies`` seeded :func:`random_affine` variants of every image in ``x`` (N*copies
    images: image 0 copies 0..k-1, then image 1, ...): a harder, fixed evaluation set."""
    g = torch.Generator().manual_seed(seed)
    return random_affine(x.repeat_interleave(copies, dim=0), g, **kw)


class ConvBNReLU(nn.Module):
    """conv 3x3 (no bias) -> batch norm -> ReLU (in place, as many model zoos write it)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class Residual(nn.Module):
    """conv-bn-relu, conv-bn, ``out += x``, relu: a ResNet basic block without downsampling."""

    def __init__(self, c: int):
        super().__init__()
        self.cbr = ConvBNReLU(c, c)
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.bn(self.conv(self.cbr(x)))
        out += x                      # in place, as torchvision's ResNet does
        return F.relu(out)


class DigitsCNN(nn.Module):
    """A small residual CNN for 1-channel digit images (any size divisible by 4).

    stem(1->w) -> block(w) -> max-pool 2 -> block(w->2w) -> residual(2w) -> block(2w->4w, stride 2)
    -> block(4w) -> global average pool -> flatten -> Linear(4w -> 10).
    """

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        w = width
        self.stem = ConvBNReLU(1, w)
        self.block1 = ConvBNReLU(w, w)
        self.pool = nn.MaxPool2d(2)
        self.block2 = ConvBNReLU(w, 2 * w)
        self.res = Residual(2 * w)
        self.down = ConvBNReLU(2 * w, 4 * w, stride=2)
        self.block3 = ConvBNReLU(4 * w, 4 * w)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * w, classes)

    def forward(self, x):
        x = self.pool(self.block1(self.stem(x)))
        x = self.res(self.block2(x))
        x = self.block3(self.down(x))
        x = self.gap(x)
        return self.fc(x.view(x.size(0), -1))


class DigitsMLP(nn.Module):
    """flatten -> Linear/ReLU stack -> Linear (static vs dynamic int8 Linear)."""

    def __init__(self, inputs: int = 256, hidden: Tuple[int, ...] = (1024, 1024, 512), classes: int = 10):
        super().__init__()
        dims = (inputs,) + tuple(hidden)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x):
        x = torch.flatten(x, 1)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int = 4, batch: int = 64,
          lr: float = 3e-3, seed: int = 0, augment: bool = True,
          log: Optional[Callable[[str], None]] = print) -> nn.Module:
    """Train ``model`` on ``(x, y)`` with AdamW and a one-cycle schedule; with ``augment``,
    every batch is a fresh milder :func:`random_affine` variant (rotation 15 degrees, zoom and
    shift 10%, noise 0.1). Seeded; returns the model in eval mode."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    steps = epochs * math.ceil(len(x) / batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    model.train()
    t0 = time.perf_counter()
    for epoch in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        total = 0.0
        for i in range(0, len(x), batch):
            idx = perm[i:i + batch]
            xb = x[idx]
            if augment:
                xb = random_affine(xb, g, rotate=15.0, scale=0.1, shift=0.1, noise=0.1)
            loss = F.cross_entropy(model(xb), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        if log is not None:
            log(f"  epoch {epoch + 1}/{epochs}: loss {total / len(x):.4f} ({time.perf_counter() - t0:.1f} s)")
    return model.eval()


@torch.no_grad()
def accuracy(model: Callable, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    """Top-1 accuracy (a fraction) of ``model`` on ``(x, y)``."""
    correct = 0
    for i in range(0, len(x), batch):
        correct += (model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item()
    return correct / len(x)
