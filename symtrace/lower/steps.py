"""What a lowering produces: the steps the wrapper runs (:class:`KernelStep`, :class:`ExternStep`,
:class:`WoqCallStep`), :class:`Runtime` placeholders for values known only when the graph runs,
and :class:`NodeReport`."""
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


@dataclasses.dataclass(eq=False)
class WoqCallStep:
    """A weight-only linear (``woq_linear``) that a C entry point calls between the kernels
    around it, where ``extern`` (the torch call it replaces) would have gone through Python:
    ``function(address, x + offset, m, ldx, out, level, nt)``, the weight's plan bound once
    (:func:`~symtrace.lower.woq_calls.bind_woq_calls`). When the C call refuses (integer
    activations meeting NaN or an infinity, no memory), the wrapper runs ``extern`` in torch
    into ``out`` and the entry point goes on after it."""

    extern: ExternStep
    x: Any            # the input: a BufferValue, m rows of ldx elements from offset
    out: Buffer       # m rows of n, dense
    function: int     # the C function's address (st_woq_linear or st_woq_linear_a8)
    address: int      # the plan's struct address
    level: int        # the isa argument
    m: int
    ldx: int
    offset: int
    plan: Any         # what ``address`` points into (kept alive)

    @property
    def name(self) -> str:
        return f"woq_{self.extern.result}"

    kind = "woq"

    @property
    def nodes(self) -> List[str]:
        return [self.extern.node.name]

    def buffers(self) -> List[Buffer]:
        """The buffer read, then the one written."""
        return [self.x.buffer, self.out]


@dataclasses.dataclass
class NodeReport:
    node: str
    op: str
    target: str
    where: str   # "kernel k0", "torch", "view", "constant", "input", "output"
    reason: str = ""
