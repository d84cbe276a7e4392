"""Layout-keeping ops the inference pipeline (:mod:`.pipeline`) puts in its graphs.

``ChannelShuffle`` stands for ShuffleNet's ``view, transpose, contiguous, view``: it keeps the
channels-last layout of the convolutions around it (see :func:`.pipeline.channel_shuffles`).
"""
from __future__ import annotations

import torch

__all__ = ["ChannelShuffle"]


class ChannelShuffle:
    """``torch.channel_shuffle(x, groups)``; its result keeps ``x``'s memory format (channels-last
    in, channels-last out), which :meth:`fake_call` says for symbolic metadata too."""

    __module__ = "symtrace.lower.layout_ops"

    def __init__(self, groups: int):
        self.groups = groups
        self.__name__ = "channel_shuffle"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.channel_shuffle(x, self.groups)

    def fake_call(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)   # (preserve_format: the strides torch's CPU kernel gives)

    def __repr__(self):
        return f"<channel_shuffle groups={self.groups}>"
