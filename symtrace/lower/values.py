"""Lazy tensor values: what a graph node lowers to before kernels are formed.

A lowered node is not computed where it stands. It becomes a *value* that knows how to give
the scalar expression of any of its elements (``read(kb, index)``), so a consumer inlines its
producers: that is how pointwise chains, prologues and row epilogues fuse. A value is
*materialised* (stored into a :class:`~symtrace.lower.ir.Buffer` by a kernel of its own) only
where it must be: graph outputs, inputs of torch ops, expensive values with several users,
reductions read outside their row, and before an in-place torch op would change what it reads.

* :class:`BufferValue` — a strided view of a buffer (inputs, parameters, extern results,
  materialised values); views of it stay buffer views.
* :class:`Pointwise` — ``fn(kb, index) -> Expr`` over a shape.
* :class:`IndexView` — permute/expand/slice/select/unsqueeze/... of a lazy value: an affine map
  from its index to its base's index.
* :class:`RowReduce` — a reduction over the last dimension; read inside a kernel whose outer
  loops are its rows, it becomes a reduction *phase* of that kernel.
* :class:`FullReduce` — a reduction of all elements to a 0-d value (its own kernel).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..graph.node import TensorMeta

from ..graph.symbols import at_least_1
from .ir import Affine, Buffer, Expr, Var

__all__ = ["LValue", "BufferValue", "Pointwise", "IndexView", "RowReduce", "FullReduce",
           "NeedsMaterialize", "contiguous_strides", "broadcast_shapes"]


class NeedsMaterialize(Exception):
    """Raised while building a kernel when ``value`` must first be stored by a kernel of its own."""

    def __init__(self, value: "LValue"):
        super().__init__(f"materialise {value!r}")
        self.value = value


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= at_least_1(s)
    return tuple(reversed(strides))


def strided_probe(meta) -> Optional[torch.Tensor]:
    """A meta tensor with ``meta``'s recorded shape, strides and dtype (to ask torch whether a
    call on it returns a view), or None where they are unknown or symbolic."""
    if not isinstance(meta, TensorMeta):
        return None
    shape, stride = tuple(meta.shape), tuple(meta.stride)
    if len(stride) != len(shape) or not all(type(d) is int for d in shape + stride):
        return None
    return torch.empty_strided(shape, stride, dtype=meta.dtype, device="meta")


def dense_in_order(shape: Sequence[int], strides: Sequence[int], order: Sequence[int]) -> bool:
    """Whether ``strides`` lay ``shape`` out densely with dimensions ``order`` from the
    innermost (``range(n)[::-1]``: contiguous; ``(1, 3, 2, 0)``: channels-last); size-1
    dimensions' strides do not matter (torch's own rule)."""
    expect = 1
    for d in order:
        if shape[d] != 1 and strides[d] != expect:
            return False
        expect *= shape[d]
    return True


def broadcast_shapes(*shapes: Sequence[int]) -> Tuple[int, ...]:
    """numpy broadcasting of ``shapes`` (torch.broadcast_shapes imports torch._refs: seconds)."""
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        for k, d in enumerate(s, start=n - len(s)):
            if d != 1:
                if out[k] not in (1, d):
                    raise ValueError(f"shapes {shapes} do not broadcast")
                out[k] = d
    return tuple(out)


class LValue:
    """A lazily lowered tensor value of ``shape`` and storage ``dtype``."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    #: graph node names that built this value (reports: which nodes went into which kernel)
    nodes: Tuple[str, ...] = ()
    #: values this one reads (for hazard analysis before in-place torch ops)
    inputs: Tuple["LValue", ...] = ()
    #: True for pure index remappings of another value (they see later writes to the base)
    is_view = False
    cost = 0
    #: set on a graph node's own fp16/bf16 result (not on a rule's internal values): eager holds
    #: it in its dtype, so kernels round it to that dtype where they read it
    held_in_dtype = False

    def read(self, kb, idx: Tuple[Affine, ...]) -> Expr:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class BufferValue(LValue):
    """``buffer`` seen with ``strides`` and element ``offset`` (a view of real memory)."""

    is_view = True

    def __init__(self, buffer: Buffer, shape=None, strides=None, offset: int = 0, nodes=()):
        self.buffer = buffer
        self.shape = tuple(buffer.shape if shape is None else shape)
        self.strides = tuple(buffer.strides if strides is None else strides)
        self.offset = offset
        self.dtype = buffer.dtype
        self.nodes = tuple(nodes)

    def read(self, kb, idx):
        index = Affine(self.offset)
        for i, s in zip(idx, self.strides):
            if s:
                index = index + i.scale(s)
        return kb.eb.load(self.buffer, index)

    def is_whole(self) -> bool:
        """Whether this is exactly the buffer (not a view of part of it)."""
        return self.offset == 0 and self.shape == self.buffer.shape and self.strides == self.buffer.strides

    def __repr__(self):
        return f"BufferValue({self.buffer.name}, {list(self.shape)}, strides={self.strides}, offset={self.offset})"


class Pointwise(LValue):
    """Elementwise ``fn(kb, idx) -> Expr`` (in the compute type of ``dtype``)."""

    def __init__(self, shape, dtype, fn: Callable, inputs: Sequence[LValue] = (), nodes=(), cost: int = 1):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.fn = fn
        self.inputs = tuple(inputs)
        self.nodes = tuple(nodes)
        self.cost = cost + sum(getattr(i, "cost", 0) for i in self.inputs if not isinstance(i, BufferValue))

    def read(self, kb, idx):
        return self.fn(kb, idx)

    def __repr__(self):
        return f"Pointwise({'/'.join(self.nodes) or '?'}, {list(self.shape)})"


class IndexView(LValue):
    """``base`` read through ``index_map(idx) -> base idx`` (affine), with a new shape."""

    is_view = True

    def __init__(self, base: LValue, shape, index_map: Callable, nodes=()):
        self.base = base
        self.shape = tuple(shape)
        self.dtype = base.dtype
        self.index_map = index_map
        self.inputs = (base,)
        self.nodes = tuple(nodes)
        self.cost = base.cost

    def read(self, kb, idx):
        return kb.read(self.base, tuple(self.index_map(idx)))

    def __repr__(self):
        return f"IndexView({self.base!r} -> {list(self.shape)})"


class RowReduce(LValue):
    """``op`` (sum/max/min) of ``src`` over its last dimension, optionally divided by
    ``divisor`` (means); shape ``src.shape[:-1]`` (+ ``(1,)`` with ``keepdim``)."""

    def __init__(self, src: LValue, op: str, dtype, keepdim: bool, divisor: Optional[float] = None, nodes=()):
        self.src = src
        self.op = op
        self.dtype = dtype
        self.keepdim = keepdim
        self.divisor = divisor
        self.outer_shape = tuple(src.shape[:-1])
        self.length = src.shape[-1]
        self.shape = self.outer_shape + ((1,) if keepdim else ())
        self.inputs = (src,)
        self.nodes = tuple(nodes)
        self.cost = 4 + src.cost

    def read(self, kb, idx):
        outer = tuple(idx[:-1]) if self.keepdim else tuple(idx)
        return kb.row_ref(self, outer)

    def __repr__(self):
        return f"RowReduce({self.op}, {'/'.join(self.nodes) or '?'}, {list(self.src.shape)})"


class FullReduce(LValue):
    """``op`` of every element of ``src`` (divided by ``divisor`` for means): a 0-d value,
    computed by a kernel of its own in fixed blocks (the result does not depend on threads)."""

    def __init__(self, src: LValue, op: str, dtype, divisor: Optional[float] = None, nodes=(), keep_shape=None):
        self.src = src
        self.op = op
        self.dtype = dtype
        self.divisor = divisor
        self.shape = ()
        self.inputs = (src,)
        self.nodes = tuple(nodes)
        self.cost = 1000

    def read(self, kb, idx):
        raise NeedsMaterialize(self)

    def __repr__(self):
        return f"FullReduce({self.op}, {'/'.join(self.nodes) or '?'})"


def view_strides(value: BufferValue, shape, index_map: Callable) -> BufferValue:
    """Compose an affine ``index_map`` with a buffer view: the result is again a buffer view."""
    probes = [Var(f"_p{i}", s) for i, s in enumerate(shape)]
    base_idx = index_map(tuple(Affine.of(v) for v in probes))
    offset = value.offset
    strides = [0] * len(shape)
    for a, s in zip(base_idx, value.strides):
        offset += a.const * s
        for j, v in enumerate(probes):
            strides[j] += a.coeff(v) * s
    return BufferValue(value.buffer, shape, tuple(strides), offset, value.nodes)


def make_view(value: LValue, shape, index_map: Callable, nodes=()) -> LValue:
    if isinstance(value, BufferValue):
        out = view_strides(value, shape, index_map)
        out.nodes = tuple(nodes)
        return out
    return IndexView(value, shape, index_map, nodes)


def expand_index_map(src_shape, dst_shape) -> Callable:
    """The index map of broadcasting ``src_shape`` to ``dst_shape`` (numpy rules)."""
    lead = len(dst_shape) - len(src_shape)
    zero = Affine(0)

    def index_map(idx):
        return tuple(zero if s == 1 and dst_shape[lead + k] != 1 else idx[lead + k] for k, s in enumerate(src_shape))
    return index_map


def broadcast_to(value: LValue, shape, nodes=()) -> LValue:
    if tuple(value.shape) == tuple(shape):
        return value
    return make_view(value, shape, expand_index_map(value.shape, shape), nodes or value.nodes)
