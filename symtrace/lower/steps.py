"""What a lowering produces: the steps the wrapper runs (:class:`KernelStep`, :class:`ExternStep`),
:class:`Runtime` placeholders for values known only when the graph runs, and :class:`NodeReport`."""
from __future__ import annotations

import dataclasses
from typing import Any, List, Tuple

from ..graph.node import Node
from .ir import Buffer, Kernel


class Runtime:
    """A non-tensor value known only when the graph runs (e.g. ``x.sum().item()``)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"Runtime({self.name})"


@dataclasses.dataclass(eq=False)
class KernelStep:
    kernel: Kernel


@dataclasses.dataclass(eq=False)
class ExternStep:
    """Run ``kind`` (``function``/``method``/``module``) ``target`` on ``args``/``kwargs``
    (values, materialised) and bind the result to ``result`` (a python name)."""

    node: Node
    kind: str
    target: Any
    args: tuple
    kwargs: dict
    result: str
    out_buffers: List[Tuple[str, Buffer]]  # (python expression, buffer) for tensor results read later
    label: str = ""


@dataclasses.dataclass
class NodeReport:
    node: str
    op: str
    target: str
    where: str   # "kernel k0", "torch", "view", "constant", "input", "output"
    reason: str = ""
