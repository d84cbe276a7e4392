"""The loop-level IR shared by the C and Triton code generators.

Everything here is backend-neutral and concrete: shapes, strides and offsets are Python ints
(lowering specialises on the example inputs' metadata), and every index is *affine* in the
loop variables (``Affine``: ``const + sum(coeff * var)``), which covers contiguous, permuted,
sliced, expanded (stride 0) and offset tensors.

* ``Expr``: a scalar expression DAG in a *compute type* (``f32``, ``f64``, ``i64``, ``b``).
  Expressions are hash-consed by an :class:`ExprBuilder`, so a value used twice is one node.
* ``Buffer``: a tensor the kernels read or write (graph input, parameter, extern result, a
  fused kernel's output, or an intermediate kept in the per-graph arena).
* ``Kernel``: one fused loop nest of one of three kinds: ``pointwise`` (a store loop over a
  domain), ``row`` (per outer index: reduction *phases* over a row, then a store, all in one
  pass over rows so they stay in cache: softmax, layernorm, RMSNorm) and ``full`` (a whole-tensor
  reduction with fixed blocks, so its result never depends on the thread count).
"""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..graph.symbols import SizeExpr, at_least_1

__all__ = ["Var", "Affine", "Expr", "ExprBuilder", "Buffer", "Phase", "Store", "RowCache", "Kernel",
           "compute_type", "ctype_of", "wrap_int", "to_f32", "UNARY_OPS", "BINARY_OPS", "REDUCE_OPS"]

# --------------------------------------------------------------------------- dtypes

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


_INT_BITS = {torch.int8: (8, True), torch.uint8: (8, False), torch.int16: (16, True), torch.int32: (32, True),
             torch.int64: (64, True)}


def to_f32(value: float) -> float:
    """``value`` rounded to float32 (+-Inf beyond its range), as torch rounds a Python scalar
    for a float32 op (a C float literal out of float's range is a constraint violation)."""
    value = float(value)
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def wrap_int(v: int, dtype: torch.dtype = torch.int64) -> int:
    """``v`` reduced modulo 2^N into the range of the N-bit integer ``dtype`` (torch's
    two's-complement wrap-around)."""
    bits, signed = _INT_BITS[dtype]
    v &= (1 << bits) - 1
    return v - (1 << bits) if signed and v >> (bits - 1) else v


def compute_type(dtype: torch.dtype) -> str:
    """The type a kernel computes values of storage ``dtype`` in: fp16/bf16/fp32 -> ``f32``,
    fp64 -> ``f64``, integers -> ``i64``, bool -> ``b``."""
    if dtype in _FLOATS:
        return "f32"
    if dtype == torch.float64:
        return "f64"
    if dtype in _INTS:
        return "i64"
    if dtype == torch.bool:
        return "b"
    raise TypeError(f"no kernel compute type for {dtype}")


def ctype_of(dtype: torch.dtype) -> str:
    """The C storage type of ``dtype`` (fp16/bf16 are raw ``uint16_t`` bits)."""
    return _STORAGE_C[dtype]


_STORAGE_C = {torch.float32: "float", torch.float64: "double", torch.float16: "uint16_t",
              torch.bfloat16: "uint16_t", torch.int8: "int8_t", torch.uint8: "uint8_t",
              torch.int16: "int16_t", torch.int32: "int32_t", torch.int64: "int64_t",
              torch.bool: "uint8_t"}

SUPPORTED_DTYPES = frozenset(_STORAGE_C)
#: computed in fp32, held (rounded) in their own dtype where eager holds them
HALF_DTYPES = (torch.float16, torch.bfloat16)

# --------------------------------------------------------------------------- indices


class Var:
    """A loop variable. ``size`` is its trip count."""

    __slots__ = ("name", "size")

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size

    def __repr__(self) -> str:
        return self.name


class Affine:
    """``const + sum(coeff * var)``: an integer index, immutable and hashable."""

    __slots__ = ("const", "terms", "_hash")

    def __init__(self, const: int = 0, terms: Sequence[Tuple[Var, int]] = ()):
        merged: Dict[Var, int] = {}
        for v, c in terms:
            if c:
                merged[v] = merged.get(v, 0) + c
        self.const = const if isinstance(const, SizeExpr) else int(const)
        self.terms = tuple((v, c) for v, c in merged.items() if c)
        self._hash = hash((self.const, tuple((id(v), c) for v, c in self.terms)))

    @staticmethod
    def of(v: Var) -> "Affine":
        return Affine(0, ((v, 1),))

    def __add__(self, other: "Affine | int") -> "Affine":
        if isinstance(other, (int, SizeExpr)):
            return Affine(self.const + other, self.terms)
        return Affine(self.const + other.const, self.terms + other.terms)

    def scale(self, k: int) -> "Affine":
        return Affine(self.const * k, tuple((v, c * k) for v, c in self.terms))

    def coeff(self, v: Var) -> int:
        for w, c in self.terms:
            if w is v:
                return c
        return 0

    def is_var(self, v: Var) -> bool:
        return self.const == 0 and len(self.terms) == 1 and self.terms[0][0] is v and self.terms[0][1] == 1

    def substitute(self, mapping: Dict[Var, "Affine"]) -> "Affine":
        out = Affine(self.const)
        for v, c in self.terms:
            out = out + (mapping[v].scale(c) if v in mapping else Affine(0, ((v, c),)))
        return out

    def __eq__(self, other) -> bool:
        return isinstance(other, Affine) and self.const == other.const and \
            len(self.terms) == len(other.terms) and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(self.terms, other.terms))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        parts = [f"{c}*{v.name}" if c != 1 else v.name for v, c in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts)


# --------------------------------------------------------------------------- expressions

#: unary ops and whether they are transcendental (costly to recompute)
UNARY_OPS = {
    "neg": False, "abs": False, "relu": False, "floor": False, "ceil": False, "round": False,
    "trunc": False, "sign": False, "reciprocal": False, "sqrt": False, "rsqrt": False,
    "not": False, "isnan": False,
    "exp": True, "log": True, "log1p": True, "expm1": True, "sigmoid": True, "tanh": True,
    "erf": True, "gelu_erf": True, "gelu_tanh": True, "silu": True, "sin": True, "cos": True,
}
BINARY_OPS = ("add", "sub", "mul", "div", "pow", "max", "min", "eq", "ne", "lt", "le", "gt", "ge",
              "and", "or", "xor")
COMPARISONS = frozenset(("eq", "ne", "lt", "le", "gt", "ge"))
REDUCE_OPS = ("sum", "max", "min")


class Expr:
    """One node of a scalar expression DAG. ``op`` is ``load``, ``const``, ``cast``, ``round``
    (round to a storage dtype and back, for explicit ``.to(float16)``), ``where``, ``acc``
    (a reduction result of the current row, see :class:`Phase`), ``inrange`` (an index bound
    test, see :meth:`ExprBuilder.in_range`), a unary op or a binary op. A ``load`` with
    ``args`` ``(mask, other)`` is a masked load. ``ty`` is the compute type of the result."""

    __slots__ = ("op", "ty", "args", "payload", "id")

    def __init__(self, op: str, ty: str, args: Tuple["Expr", ...], payload, ident: int):
        self.op = op
        self.ty = ty
        self.args = args
        self.payload = payload
        self.id = ident

    def __repr__(self) -> str:
        if self.op == "load":
            buf, idx = self.payload[:2]
            return f"{buf.name}[{idx}]" + (f" if {self.args[0]!r} else {self.args[1]!r}" if self.args else "")
        if self.op == "inrange":
            a, lo, hi = self.payload
            return f"({lo} <= {a} < {hi})"
        if self.op == "const":
            return repr(self.payload)
        if self.op == "acc":
            return f"acc({self.payload.name})"
        inner = ", ".join(map(repr, self.args))
        extra = f"{self.payload}, " if self.payload is not None else ""
        return f"{self.op}:{self.ty}({extra}{inner})"


class ExprBuilder:
    """Creates hash-consed expressions with light constant folding and type checks."""

    def __init__(self):
        self._table: Dict[tuple, Expr] = {}

    def _make(self, op: str, ty: str, args: Tuple[Expr, ...] = (), payload=None) -> Expr:
        key = (op, ty, tuple(a.id for a in args), _payload_key(payload))
        e = self._table.get(key)
        if e is None:
            e = Expr(op, ty, args, payload, len(self._table))
            self._table[key] = e
        return e

    def load(self, buf: "Buffer", index: Affine, mask: Optional[Expr] = None, other: Optional[Expr] = None,
             safe: Optional[Affine] = None) -> Expr:
        """Element ``index`` of ``buf``. With ``mask`` (a ``b`` expression, see :meth:`in_range`)
        a *masked* load: the element where ``mask`` holds, else ``other`` (same compute type).
        ``safe`` is an index inside ``buf`` wherever ``mask`` does not hold (``index`` need not
        be): backends read ``buf[mask ? index : safe]`` unconditionally and then select, which
        vectorises where a conditional read would not (windows that reach past an edge)."""
        ty = compute_type(buf.dtype)
        if mask is None or (mask.op == "const" and mask.payload):
            return self._make("load", ty, (), (buf, index))
        if other is None or other.ty != ty or mask.ty != "b" or safe is None:
            raise TypeError("a masked load needs a bool mask, an 'other' value of the load's type and a safe index")
        if mask.op == "const":   # never in range
            return other
        return self._make("load", ty, (mask, other), (buf, index, safe))

    def in_range(self, a: Affine, lo, hi) -> Expr:
        """``lo <= a < hi`` (a ``b`` expression) for an integer index ``a`` of the loop variables."""
        if not a.terms and not isinstance(a.const, SizeExpr):
            return self.const(lo <= a.const < hi, "b")
        return self._make("inrange", "b", (), (a, lo, hi))

    def const(self, value, ty: str) -> Expr:
        if isinstance(value, SizeExpr):   # a size known per call (size-generic kernels)
            return self._make("size", ty, (), value)
        if ty in ("f32", "f64"):
            value = float(value)
        elif ty == "i64":
            value = wrap_int(int(value))
        else:
            value = bool(value)
        return self._make("const", ty, (), value)

    def cast(self, e: Expr, ty: str, dtype: Optional[torch.dtype] = None) -> Expr:
        """``e`` converted to compute type ``ty``. A floating -> ``i64`` cast carries the integer
        storage ``dtype`` it converts to (default int64) as its payload: what NaN, +-Inf and
        out-of-range values give depends on it (on x86, 3e9 -> int32 is INT32_MIN, not the int64
        3000000000 wrapped), so backends convert per target (see prelude.h, "float -> integer
        casts"). Constants are folded only where every backend agrees (finite, |v| < 2^31)."""
        if e.ty == ty:
            return e
        if ty == "i64" and e.ty in ("f32", "f64"):
            dtype = torch.int64 if dtype is None else dtype
            if dtype not in _INTS:
                raise TypeError(f"float -> integer cast to {dtype}")
            v = e.payload
            if e.op == "const" and math.isfinite(v) and -2.0 ** 31 < v < 2.0 ** 31:
                return self.const(wrap_int(int(v), dtype), ty)
            return self._make("cast", ty, (e,), dtype)
        if e.op == "const":
            v = e.payload
            return self.const(int(v) if ty == "i64" else v, ty)
        return self._make("cast", ty, (e,))

    def round_to(self, e: Expr, dtype: torch.dtype) -> Expr:
        """Round ``e`` to ``dtype``'s precision (explicit casts to fp16/bf16 in the program)."""
        return self._make("round", e.ty, (e,), dtype)

    def unary(self, op: str, e: Expr) -> Expr:
        if op not in UNARY_OPS:
            raise ValueError(f"unknown unary op {op}")
        ty = "b" if op in ("not", "isnan") else e.ty
        return self._make(op, ty, (e,))

    def binary(self, op: str, a: Expr, b: Expr) -> Expr:
        if op not in BINARY_OPS:
            raise ValueError(f"unknown binary op {op}")
        if a.ty != b.ty:
            raise TypeError(f"binary {op} of {a.ty} and {b.ty}: cast first")
        if op in ("add", "sub") and b.op == "const" and b.payload == 0 and a.ty != "b":
            # x + (-0.0) and x - (+0.0) are x; x + (+0.0) turns -0.0 into +0.0 (IEEE), so it stays
            if a.ty not in ("f32", "f64") or math.copysign(1.0, b.payload) == (-1.0 if op == "add" else 1.0):
                return a
        if op == "mul" and b.op == "const" and b.payload == 1 and a.ty != "b":
            return a
        ty = "b" if op in COMPARISONS or op in ("and", "or", "xor") else a.ty
        return self._make(op, ty, (a, b))

    def where(self, c: Expr, a: Expr, b: Expr) -> Expr:
        if a.ty != b.ty or c.ty != "b":
            raise TypeError("where(cond: b, a, b) needs a bool condition and equal branch types")
        return self._make("where", a.ty, (c, a, b))

    def acc(self, phase: "Phase") -> Expr:
        return self._make("acc", phase.ty, (), phase)


def _payload_key(p):
    if p is None or isinstance(p, (bool, int, str, torch.dtype)):
        return (type(p).__name__, p)
    if isinstance(p, float):
        return ("float", repr(p))  # distinguishes -0.0 and nan
    if isinstance(p, SizeExpr):
        return ("size", str(p))
    if isinstance(p, tuple) and p and isinstance(p[0], Affine):   # inrange: (index, lo, hi)
        return ("inrange",) + p
    if isinstance(p, tuple):  # (buffer, index) or a masked load's (buffer, index, safe index)
        return (id(p[0]),) + p[1:]
    return id(p)


# --------------------------------------------------------------------------- buffers & kernels


@dataclasses.dataclass(eq=False)
class Buffer:
    """A tensor kernels read or write. ``role``: ``input`` (graph placeholder), ``param``
    (a get_attr tensor), ``extern`` (a torch op's result), ``output`` (fresh each call),
    ``temp`` (kept in the per-graph arena and reused across calls)."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    role: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"Buffer({self.name}, {str(self.dtype).replace('torch.', '')}{list(self.shape)}, {self.role})"


@dataclasses.dataclass(eq=False)
class Phase:
    """One reduction over a row: ``op`` of ``value`` over ``var`` (trip count ``var.size``),
    accumulated in ``ty``; ``scale``: divide the result by it (means)."""

    name: str
    op: str
    var: Var
    value: Expr
    ty: str
    scale: Optional[float] = None


@dataclasses.dataclass(eq=False)
class Store:
    """``buffer[index] = value`` (converted to the buffer's dtype)."""

    buffer: Buffer
    index: Affine
    value: Expr


@dataclasses.dataclass(eq=False)
class RowCache:
    """A per-element value of a row kernel that several of its loops need (e.g. softmax's
    ``exp(x - max)``: the sum phase and the store loop). ``phase`` computes ``value`` (indexed by
    ``phase.var``) and keeps it in a row-long, thread-private scratch array; each ``(loop, expr)``
    of ``uses`` (``loop``: a later phase, or None for the store loop) reads it there instead of
    recomputing ``expr``, which is the same element-wise expression over that loop's variable.
    An optimisation only: a backend may ignore it and recompute."""

    name: str
    phase: Phase
    value: Expr
    uses: List[Tuple[Optional[Phase], Expr]]


@dataclasses.dataclass(eq=False)
class Kernel:
    """One fused loop nest.

    * ``pointwise``: ``for outer...: for inner: stores`` (``inner`` may be None for 0-d).
    * ``row``: ``for outer...: phases (each a loop over its own var), then for inner: stores``
      (``inner`` None: the stores are per row).
    * ``full``: one reduction ``phases[0]`` over the variables ``outer + [inner]`` into the
      0-d buffer of ``stores[0]``; computed in fixed blocks and summed in a fixed order.
    ``nodes``: names of the graph nodes fused into it (for reports and pictures).
    ``row_cache``: values of a row kernel computed once and reused by later loops (:class:`RowCache`).
    """

    name: str
    kind: str
    outer: List[Var]
    inner: Optional[Var]
    phases: List[Phase]
    stores: List[Store]
    nodes: List[str] = dataclasses.field(default_factory=list)
    row_cache: List[RowCache] = dataclasses.field(default_factory=list)
    #: names of the size symbols the kernel takes as arguments (size-generic variants; see
    #: :mod:`~symtrace.lower.dynamic`): loop bounds and index coefficients may use them
    symbols: Tuple[str, ...] = ()

    def loaded(self) -> List[Buffer]:
        """The buffers the kernel loads from, in first-use order (written ones included)."""
        seen: Dict[int, Buffer] = {}
        for root in [p.value for p in self.phases] + [s.value for s in self.stores]:
            for e in walk(root):
                if e.op == "load":
                    seen.setdefault(id(e.payload[0]), e.payload[0])
        return list(seen.values())

    def buffers(self) -> List[Buffer]:
        """Buffers read (in first-use order), then buffers written."""
        reads = [b for b in self.loaded() if all(b is not s.buffer for s in self.stores)]
        writes = []
        for s in self.stores:
            if all(s.buffer is not w for w in writes):
                writes.append(s.buffer)
        return reads + writes

    @property
    def work(self) -> int:
        n = 1
        for v in self.outer:
            n *= v.size
        inner = (self.inner.size if self.inner is not None else 1) + sum(p.var.size for p in self.phases)
        return n * at_least_1(inner)


def walk(root: Expr, stop=frozenset()) -> List[Expr]:
    """The DAG under ``root`` in dependency order (each node once). Nodes whose id is in
    ``stop`` are listed but not descended into."""
    out: List[Expr] = []
    seen = set()
    stack = [(root, False)]
    while stack:
        e, done = stack.pop()
        if done:
            out.append(e)
            continue
        if e.id in seen:
            continue
        seen.add(e.id)
        stack.append((e, True))
        if e.id in stop:
            continue
        for a in reversed(e.args):
            if a.id not in seen:
                stack.append((a, False))
    return out


def op_cost(root: Expr, only: Optional[set] = None) -> int:
    """A rough cost of computing ``root``: 4 per transcendental op or ``pow``, 1 per other
    arithmetic op, 0 for loads, constants and accumulators; ``only``: count just the nodes
    with these ids."""
    cost = 0
    for e in walk(root):
        if e.op in ("load", "const", "acc") or (only is not None and e.id not in only):
            continue
        cost += 4 if UNARY_OPS.get(e.op) or e.op == "pow" else 1
    return cost
