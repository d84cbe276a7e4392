"""What a lowering produces: the steps the wrapper runs (:class:`KernelStep`, :class:`ExternStep`,
:class:`CCallStep`), :class:`Runtime` placeholders for values known only when the graph runs,
and :class:`NodeReport`."""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

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
    #: the position in ``args`` where the call takes a bias (past the end, or an argument now
    #: None) that the lowering may pass it instead of adding it in a kernel; None: it takes none
    bias_arg: Optional[int] = None


@dataclasses.dataclass(eq=False)
class CCallStep:
    """A call into one of symtrace's own compiled kernels (a weight-only linear, decode
    attention: :mod:`~symtrace.lower.c_calls`) that a C entry point makes between the kernels
    around it, where ``extern`` (the torch call it replaces) would have gone through Python.
    Its result goes to ``out``. :meth:`c_call` is the C expression making the call: 0, or
    non-zero where the kernel refused; the wrapper then runs ``extern`` in torch into ``out``
    and the entry point goes on after it."""

    extern: ExternStep
    out: Buffer
    function: int     # the kernel entry's address
    keep: Any         # what the call's constant addresses point into (kept alive)

    kind = "c_call"
    #: whether the call may refuse (then ``c_call`` is an int expression; else a statement)
    refuses = True
    #: whether the call makes ``out`` (else it writes into a buffer made before it)
    makes_out = True

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.extern.result}"   # (the kind and a name the lowering made: an identifier)

    @property
    def nodes(self) -> List[str]:
        return [self.extern.node.name]

    def reads(self) -> List[Buffer]:
        raise NotImplementedError

    def buffers(self) -> List[Buffer]:
        """The buffers read, then the one written."""
        return [b for b in dict.fromkeys(self.reads()) if b is not self.out] + [self.out]

    def c_call(self, p) -> str:
        """The call as a C expression of type int (a statement where it cannot refuse), where
        ``p(buffer)`` / ``p(address)`` name the entry point's parameters holding them
        (``void *``), and ``nt`` the thread count."""
        raise NotImplementedError


@dataclasses.dataclass
class NodeReport:
    node: str
    op: str
    target: str
    where: str   # "kernel k0", "torch", "view", "constant", "input", "output"
    reason: str = ""
