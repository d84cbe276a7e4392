"""Triton code generation for :class:`~symtrace.lower.ir.Kernel` (the ``cuda`` target).

One Python module per lowered graph: a small math prelude of ``@triton.jit`` helpers followed
by one ``@triton.jit`` function per kernel (two for ``full`` kernels). Shapes are specialised,
so every size and block is a literal in the source.

* ``pointwise``: a flat ``offs = pid * BLOCK + tl.arange(0, BLOCK)`` over the product of the
  kernel's (collapsed) loop variables, masked; each variable is recovered with ``//`` and ``%``.
* ``row``: one program per row. Each reduction phase is a ``tl.sum``/``tl.max``/``tl.min`` over
  the masked row, held in one block when ``next_pow2(R) <= PERSISTENT_MAX`` and looped over
  blocks otherwise; max/min propagate NaN like the C kernels. Then the stores.
* ``full``: two stages: ``kN_part`` writes one partial per program (``FULL_BLOCK`` elements each)
  and ``kN`` (one program) combines the partials in a fixed order. No atomics: deterministic.

fp16/bf16 are loaded and computed in fp32 and converted once at the store. Under the Triton
interpreter (``TRITON_INTERPRET=1``) libdevice is unavailable, so the prelude then uses
formulas built from ``tl`` primitives (see :func:`prelude`).

Float -> integer casts (``st_f2i32`` ...) are defined for NaN, +-Inf and out-of-range values
(a bare ``.to(tl.int32)`` is LLVM ``fptosi``, poison there; the interpreter's numpy cast is
platform-defined). Their semantics follow eager torch where the kernel runs: under the
interpreter (CPU tensors) eager CPU on x86-64, as the C kernels (INT_MIN for every bad value);
compiled for a GPU, eager CUDA as reported upstream (saturation to the int32/int64 range, NaN
-> 0 for float32 -> int32 but INT_MIN for float64 -> int32 and INT64_MIN for -> int64; not
measured by this project). int8/int16 take the low bits of the int32 result, uint8 those of the
int64 result, on both. Integer arithmetic wraps (two's complement) in Triton and numpy alike.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Set

import torch

from .ir import Affine, Expr, Kernel, Phase, Var, walk, wrap_int, to_f32

__all__ = ["kernel_source", "module_source", "launch_plan", "LaunchPlan", "interpreting",
           "PERSISTENT_MAX", "LOOP_BLOCK", "FULL_BLOCK", "POINTWISE_BLOCK"]

PERSISTENT_MAX = 8192   # a row up to this (next power of two) is held in one block
LOOP_BLOCK = 2048       # block of a looped row / of the second stage of a full reduction
FULL_BLOCK = 1024       # elements per program in the first stage of a full reduction
POINTWISE_BLOCK = 1024  # elements per program of a pointwise kernel (smaller for small kernels)

_TL = {"f32": "tl.float32", "f64": "tl.float64", "i64": "tl.int64", "b": "tl.int1"}
#: float -> integer storage dtype: the prelude helper's stem (st_f2* from float32, st_d2* from float64)
_F2I = {torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}
_STORE_TL = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
             torch.bfloat16: "tl.bfloat16", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
             torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.bool: "tl.int1"}

_PRELUDE_COMMON = '''
_NAN = tl.constexpr(float("nan"))
_INF = tl.constexpr(float("inf"))


@triton.jit
def st_max(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def st_min(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.minimum(a, b)))


@triton.jit
def st_relu(x):
    return tl.where(x < 0, 0, x).to(x.dtype)


@triton.jit
def st_sign(x):
    return ((x > 0).to(tl.int32) - (x < 0).to(tl.int32)).to(x.dtype)


@triton.jit
def st_gelu_erf(x):
    return 0.5 * x * (1 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def st_gelu_tanh(x):
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u), as in the C prelude
    return tl.where(x != x, x, x * tl.sigmoid(x * (1.5957691216057308 + 0.07135481627159719 * x * x)))


@triton.jit
def st_silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def st_wrap_i8(x):
    return x.to(tl.int8).to(tl.int64)


@triton.jit
def st_wrap_u8(x):
    return x.to(tl.uint8).to(tl.int64)


@triton.jit
def st_wrap_i16(x):
    return x.to(tl.int16).to(tl.int64)


@triton.jit
def st_wrap_i32(x):
    return x.to(tl.int32).to(tl.int64)
'''

# float -> integer casts, defined for every input (fptosi of NaN/Inf/out-of-range values is poison
# in LLVM and numpy's astype warns): only in-range values are converted, the rest selected. The
# narrow targets go through int32 (int8, int16) or int64 (uint8), as torch's kernels do.
_PRELUDE_F2I = '''
@triton.jit
def st_f2i8(x):
    return st_wrap_i8(st_f2i32(x))


@triton.jit
def st_d2i8(x):
    return st_wrap_i8(st_d2i32(x))


@triton.jit
def st_f2i16(x):
    return st_wrap_i16(st_f2i32(x))


@triton.jit
def st_d2i16(x):
    return st_wrap_i16(st_d2i32(x))


@triton.jit
def st_f2u8(x):
    return st_wrap_u8(st_f2i64(x))


@triton.jit
def st_d2u8(x):
    return st_wrap_u8(st_d2i64(x))
'''

# eager CPU (x86-64) semantics, for the interpreter (CPU tensors, checked against eager CPU):
# trunc(x) when it fits, else the "integer indefinite" INT_MIN (NaN, +-Inf, out of range)
_PRELUDE_F2I_CPU = '''
@triton.jit
def st_f2i32(x):
    ok = (x >= -2147483648.0) & (x < 2147483648.0)
    r = tl.where(ok, x, 0.0).to(tl.int32).to(tl.int64)
    return tl.where(ok, r, -2147483648)


@triton.jit
def st_d2i32(x):
    return st_f2i32(x)


@triton.jit
def st_f2i64(x):
    ok = (x >= -9.223372036854775808e18) & (x < 9.223372036854775808e18)
    r = tl.where(ok, x, 0.0).to(tl.int64)
    return tl.where(ok, r, tl.full([], -9223372036854775808, tl.int64))


@triton.jit
def st_d2i64(x):
    return st_f2i64(x)
'''

# eager CUDA semantics (cvt.rzi saturates), as reported by pytorch/pytorch#140347, #154311,
# #154724, #154726, #180159 (not measured by this project): out-of-range values clamp to the
# int32 / int64 range; NaN -> 0 from float32 (fp16/bf16 convert via float32) to int32, but
# INT32_MIN from float64 and INT64_MIN to int64
_PRELUDE_F2I_CUDA = '''
@triton.jit
def st__sat32(x, r, ok, nan):
    bad = tl.where(x > 0, 2147483647, -2147483648)
    return tl.where(ok, r, tl.where(x != x, nan, bad)).to(tl.int64)


@triton.jit
def st_f2i32(x):
    ok = (x >= -2147483648.0) & (x < 2147483648.0)
    return st__sat32(x, tl.where(ok, x, 0.0).to(tl.int32), ok, 0)


@triton.jit
def st_d2i32(x):
    ok = (x >= -2147483648.0) & (x < 2147483648.0)
    return st__sat32(x, tl.where(ok, x, 0.0).to(tl.int32), ok, -2147483648)


@triton.jit
def st_f2i64(x):
    ok = (x >= -9.223372036854775808e18) & (x < 9.223372036854775808e18)
    r = tl.where(ok, x, 0.0).to(tl.int64)
    hi = tl.full([], 9223372036854775807, tl.int64)
    lo = tl.full([], -9223372036854775808, tl.int64)
    return tl.where(ok, r, tl.where(x > 0, hi, lo))


@triton.jit
def st_d2i64(x):
    return st_f2i64(x)
'''

_PRELUDE_LIBDEVICE = '''
@triton.jit
def st_tanh(x):
    return libdevice.tanh(x)


@triton.jit
def st_log1p(x):
    return libdevice.log1p(x)


@triton.jit
def st_expm1(x):
    return libdevice.expm1(x)


@triton.jit
def st_round(x):
    return libdevice.rint(x)


@triton.jit
def st_trunc(x):
    return libdevice.trunc(x)


@triton.jit
def st_pow(x, y):
    return libdevice.pow(x, y)
'''

# the interpreter has no libdevice: the same functions from tl primitives
_PRELUDE_PORTABLE = '''
@triton.jit
def st_tanh(x):
    e = tl.exp(-2 * tl.abs(x))
    small = x * (1 - x * x * (0.3333333333333333 - 0.13333333333333333 * x * x))
    r = tl.where(tl.abs(x) < 0.004, small, (1 - e) / (1 + e))
    return tl.where(x < 0, -tl.abs(r), tl.where(x != x, x, tl.abs(r)))


@triton.jit
def st_log1p(x):
    u = 1 + x
    r = tl.where(u == 1, x, tl.log(u) * (x / (u - 1)))
    return tl.where(u == _INF, u, r)


@triton.jit
def st_expm1(x):
    u = tl.exp(x)
    r = tl.where(u == 1, x, (u - 1) * (x / tl.log(u)))
    return tl.where(u == _INF, u, tl.where(u - 1 == -1, u - 1, r))


@triton.jit
def st_round(x):
    f = tl.floor(x)
    d = x - f
    odd = (f - 2 * tl.floor(f * 0.5)) != 0
    return tl.where(d > 0.5, f + 1, tl.where(d < 0.5, f, tl.where(odd, f + 1, f)))


@triton.jit
def st_trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def st_pow(x, y):
    ax = tl.abs(x)
    r = tl.exp(y * tl.log(ax))
    yint = tl.floor(y) == y
    yodd = yint & ((y - 2 * tl.floor(y * 0.5)) != 0)
    r = tl.where((x < 0) & yodd, -r, r)
    r = tl.where((x < 0) & (~yint), _NAN, r)
    r = tl.where((ax == 1) & (tl.abs(y) == _INF), 1, r).to(r.dtype)
    return tl.where(y == 0, 1, tl.where(x == 1, 1, r)).to(r.dtype)
'''


def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def prelude(portable: Optional[bool] = None) -> str:
    """Imports and math helpers; ``portable`` (default: :func:`interpreting`) avoids libdevice."""
    portable = interpreting() if portable is None else portable
    head = "# generated by symtrace.lower (Triton backend)\nimport triton\nimport triton.language as tl\n"
    if not portable:
        head += "from triton.language.extra import libdevice\n"
    return head + _PRELUDE_COMMON + (_PRELUDE_PORTABLE + _PRELUDE_F2I_CPU if portable else
                                     _PRELUDE_LIBDEVICE + _PRELUDE_F2I_CUDA) + _PRELUDE_F2I


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_warps(block: int) -> int:
    """Launch-config table: warps per program for a block of ``block`` elements."""
    for limit, w in ((256, 2), (1024, 4), (4096, 8)):
        if block <= limit:
            return w
    return 16


def _lit(value, ty: str) -> str:
    if ty in ("f32", "f64"):
        value = to_f32(value) if ty == "f32" else float(value)
        if math.isnan(value):
            v = "_NAN"
        elif math.isinf(value):
            v = "_INF" if value > 0 else "-_INF"
        else:
            v = repr(float(value))
        return f"tl.full([], {v}, {_TL[ty]})"
    if ty == "i64":
        return f"tl.full([], {wrap_int(int(value))}, tl.int64)"
    return f"tl.full([], {1 if value else 0}, tl.int1)"


class LaunchPlan:
    """How to launch one kernel: ``grid`` (programs), ``warps``; for ``full`` kernels also the
    number of partials (``parts``) and their torch dtype (``part_dtype``)."""

    def __init__(self, grid: int, warps: int, parts: int = 0, part_dtype: Optional[torch.dtype] = None):
        self.grid = grid
        self.warps = warps
        self.parts = parts
        self.part_dtype = part_dtype


def _prod(vs: List[Var]) -> int:
    n = 1
    for v in vs:
        n *= v.size
    return n


def _pointwise_block(n: int) -> int:
    return max(16, min(POINTWISE_BLOCK, next_pow2(n)))


def launch_plan(kernel: Kernel) -> LaunchPlan:
    """Grid and warps of ``kernel`` (a grid of 0 means: nothing to launch)."""
    k = kernel
    if k.kind == "pointwise":
        vars_ = list(k.outer) + ([k.inner] if k.inner is not None else [])
        n = _prod(vars_)
        b = _pointwise_block(n)
        return LaunchPlan((n + b - 1) // b, num_warps(b))
    if k.kind == "row":
        r = max([p.var.size for p in k.phases] + [k.inner.size if k.inner is not None else 1])
        return LaunchPlan(_prod(k.outer), num_warps(min(next_pow2(r), PERSISTENT_MAX)))
    p = k.phases[0]
    R = k.inner.size if k.inner is not None else 1
    nb = (R + FULL_BLOCK - 1) // FULL_BLOCK
    part_dtype = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64, "b": torch.bool}[p.ty]
    return LaunchPlan(_prod(k.outer) * nb if k.inner is not None else 0, num_warps(FULL_BLOCK),
                      _prod(k.outer) * nb if k.inner is not None else 0, part_dtype)


class _Emitter:
    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.bufs = kernel.buffers()
        self.bufname = {id(b): f"b{i}" for i, b in enumerate(self.bufs)}
        self.var_names: Dict[int, str] = {}
        self.block_vars: Set[int] = set()   # vars that are blocks (tl.arange) in the current scope
        self.zero = "0"                     # a block of zeros of the current scope's shape
        self.mask: Optional[str] = None
        self.lines: List[str] = []
        self.wide = self._needs_int64()

    def _needs_int64(self) -> bool:
        k = self.kernel
        limit = 2 ** 31 - 1
        extents = [sum((s - 1) * abs(st) for s, st in zip(b.shape, b.strides)) + 1 for b in self.bufs]
        total = _prod(list(k.outer) + ([k.inner] if k.inner is not None else []))
        return max(extents + [total, FULL_BLOCK * (total // FULL_BLOCK + 1)]) >= limit

    def w(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    def index(self, a: Affine) -> str:
        parts = []
        blocky = False
        for v, c in a.terms:
            n = self.var_names[id(v)]
            blocky = blocky or id(v) in self.block_vars
            parts.append(n if c == 1 else f"{c} * {n}")
        if a.const or not parts:
            parts.append(str(a.const))
        if not blocky and self.mask is not None:
            parts.append(self.zero)
        return " + ".join(parts)

    # -- expressions
    def expr(self, e: Expr, t: Dict[int, str]) -> str:
        a = [t[x.id] for x in e.args]
        op, ty = e.op, e.ty
        if op == "load":
            buf, idx = e.payload
            mask = f", mask={self.mask}, other=0" if self.mask is not None else ""
            ref = f"tl.load({self.bufname[id(buf)]} + ({self.index(idx)}){mask})"
            if buf.dtype == torch.bool:
                return f"({ref} != 0)"
            if buf.dtype in (torch.float16, torch.bfloat16) or (ty == "i64" and buf.dtype != torch.int64):
                return f"{ref}.to({_TL[ty]})"
            return ref
        if op == "const":
            return _lit(e.payload, ty)
        if op == "acc":
            return e.payload.name
        if op == "cast":
            src = e.args[0].ty
            if ty == "b":
                return f"({a[0]} != 0)"
            if ty == "i64" and src in ("f32", "f64"):   # defined for NaN/Inf/out of range
                return f"st_{'f' if src == 'f32' else 'd'}2{_F2I[e.payload or torch.int64]}({a[0]})"
            return f"{a[0]}.to({_TL[ty]})"
        if op == "round" and e.payload is not None:  # rounding to a dtype (payload None: torch.round)
            dt = e.payload
            if dt == torch.bool:
                return f"({a[0]} != 0).to({_TL[ty]})"
            if dt in _STORE_TL and dt != torch.float64:
                return f"{a[0]}.to({_STORE_TL[dt]}).to({_TL[ty]})"
            return a[0]
        if op == "where":
            return f"tl.where({a[0]}, {a[1]}, {a[2]})"
        if len(e.args) == 1:
            return self._unary(op, ty, a[0])
        return self._binary(op, e.args[0].ty, a[0], a[1])

    def _unary(self, op: str, ty: str, x: str) -> str:
        if op == "not":
            return f"({x} == 0)"
        if op == "isnan":
            return f"({x} != {x})"
        if op == "neg":
            return f"(-{x})"
        if op == "reciprocal":
            return f"(1 / {x})"
        if ty in ("f32", "f64"):
            direct = {"exp": "tl.exp", "log": "tl.log", "sigmoid": "tl.sigmoid", "erf": "tl.math.erf",
                      "sqrt": "tl.sqrt", "floor": "tl.floor", "ceil": "tl.ceil", "abs": "tl.abs",
                      "sin": "tl.sin", "cos": "tl.cos"}
            if op in direct:
                return f"{direct[op]}({x})"
            if op == "rsqrt":
                return f"(1 / tl.sqrt({x}))"
            return f"st_{op}({x})"
        if op == "abs":
            return f"tl.abs({x})"
        if op == "relu":
            return f"tl.where({x} > 0, {x}, 0)"
        if op == "sign":
            return f"st_sign({x})"
        if op in ("floor", "ceil", "round", "trunc"):
            return x
        raise TypeError(f"unary {op} on {ty} has no Triton form")

    def _binary(self, op: str, ty: str, x: str, y: str) -> str:
        if ty == "b":
            sym = {"add": "|", "sub": "!=", "mul": "&", "and": "&", "or": "|", "xor": "!=", "eq": "==",
                   "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "max": "|", "min": "&"}.get(op)
            if sym is None:
                raise TypeError(f"binary {op} on bool has no Triton form")
            return f"({x} {sym} {y})"
        sym = {"add": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">",
               "ge": ">="}.get(op)
        if sym is not None:
            return f"({x} {sym} {y})"
        if op == "div":
            return f"({x} / {y})" if ty in ("f32", "f64") else f"({x} // {y})"
        if op in ("max", "min"):
            if ty in ("f32", "f64"):
                return f"st_{op}({x}, {y})"
            return f"tl.{op}imum({x}, {y})"
        if op == "pow" and ty in ("f32", "f64"):
            return f"st_pow({x}, {y})"
        raise TypeError(f"binary {op} on {ty} has no Triton form")

    def dag(self, depth: int, roots: List[Expr]) -> Dict[int, str]:
        t: Dict[int, str] = {}
        for root in roots:
            for e in walk(root):
                if e.id in t:
                    continue
                code = self.expr(e, t)
                if e.op in ("const", "acc"):
                    t[e.id] = code
                else:
                    name = f"t{e.id}"
                    self.w(depth, f"{name} = {code}")
                    t[e.id] = name
        return t

    def store(self, depth: int, t: Dict[int, str]) -> None:
        for s in self.kernel.stores:
            v = t[s.value.id]
            dt = s.buffer.dtype
            if dt == torch.bool and s.value.ty != "b":
                v = f"({v} != 0)"
            elif dt in _F2I and s.value.ty in ("f32", "f64"):
                v = f"st_{'f' if s.value.ty == 'f32' else 'd'}2{_F2I[dt]}({v}).to({_STORE_TL[dt]})"
            else:
                v = f"{v}.to({_STORE_TL[dt]})"
            mask = f", mask={self.mask}" if self.mask is not None else ""
            self.w(depth, f"tl.store({self.bufname[id(s.buffer)]} + ({self.index(s.index)}), {v}{mask})")

    # -- helpers
    def split(self, depth: int, flat: str, vars_: List[Var], names: List[str]) -> None:
        """Recover ``vars_`` (row-major) from the flat index ``flat``."""
        rest = flat
        for j in range(len(vars_) - 1, -1, -1):
            name = names[j]
            self.var_names[id(vars_[j])] = name
            if j == 0:
                self.w(depth, f"{name} = {rest}")
            else:
                self.w(depth, f"{name} = {rest} % {vars_[j].size}")
                if j == 1:
                    self.w(depth, f"{'rest'} = {rest} // {vars_[j].size}")
                    rest = "rest"
                else:
                    self.w(depth, f"rest = {rest} // {vars_[j].size}")
                    rest = "rest"

    def pid(self, depth: int) -> None:
        self.w(depth, "pid = tl.program_id(0).to(tl.int64)" if self.wide else "pid = tl.program_id(0)")

    def init_value(self, op: str, ty: str) -> str:
        """The identity of ``op`` as a plain literal (``tl.full`` and ``tl.where`` type it)."""
        if op == "sum":
            return "0.0" if ty in ("f32", "f64") else "0"
        if ty in ("f32", "f64"):
            return "-_INF" if op == "max" else "_INF"
        if ty == "i64":
            return str(-2 ** 63) if op == "max" else str(2 ** 63 - 1)
        return "0" if op == "max" else "1"

    def reduce_block(self, depth: int, p: Phase, acc: str, ty: str, lo: str, size: int, block: int,
                     loop: bool) -> None:
        """``acc`` (a scalar of ``ty``) = op of ``p.value`` over ``p.var``/inner in [lo, lo+size)
        (``size``: the total count when ``loop``, else the valid count of one block)."""
        var = p.var if p.var is not None else self.kernel.inner
        name = f"r_{acc}"
        red_ty = "i64" if ty == "b" else ty
        self.w(depth, f"{acc}_blk = tl.full([{block}], {self.init_value(p.op, red_ty)}, {_TL[red_ty]})")
        is_float = ty in ("f32", "f64")
        if is_float and p.op != "sum":
            self.w(depth, f"{acc}_nan = tl.zeros([{block}], tl.int32)")
        d = depth
        if loop:
            self.w(depth, f"for start in range(0, {size}, {block}):")
            d = depth + 1
            self.w(d, f"{name} = {lo} + start + tl.arange(0, {block})")
        else:
            self.w(d, f"{name} = {lo} + tl.arange(0, {block})")
        self.w(d, f"{name}_m = {name} < {lo} + {size}" if lo != "0" else f"{name}_m = {name} < {size}")
        self.var_names[id(var)] = name
        self.block_vars = {id(var)}
        self.mask, self.zero = f"{name}_m", f"{name} * 0"
        t = self.dag(d, [p.value])
        v = t[p.value.id]
        if red_ty != ty:
            v = f"{v}.to(tl.int64)"
        if p.op == "sum":
            self.w(d, f"{acc}_blk += tl.where({name}_m, {v}, 0)")
        else:
            fn = "st_max" if p.op == "max" else "st_min"
            if not is_float:
                fn = f"tl.{p.op}imum"
            ident = self.init_value(p.op, red_ty)
            self.w(d, f"{acc}_blk = {fn}({acc}_blk, tl.where({name}_m, {v}, {ident}))")
            if is_float:
                self.w(d, f"{acc}_nan += tl.where({name}_m & ({v} != {v}), 1, 0)")
        self.mask, self.block_vars, self.zero = None, set(), "0"
        op = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}[p.op]
        self.w(depth, f"{acc} = {op}({acc}_blk, axis=0)")
        if is_float and p.op != "sum":
            self.w(depth, f"{acc} = tl.where(tl.sum({acc}_nan, axis=0) > 0, _NAN, {acc})")
        if red_ty != ty:
            self.w(depth, f"{acc} = {acc} != 0")

    # -- kernels
    def emit(self) -> str:
        k = self.kernel
        params = [f"b{i}" for i in range(len(self.bufs))]
        if k.kind == "full":
            return self.full(params)
        self.w(0, f"# {k.kind} kernel; nodes: {', '.join(k.nodes) or '-'}")
        self.w(0, "@triton.jit")
        self.w(0, f"def {k.name}({', '.join(params)}):")
        if k.kind == "pointwise":
            self.pointwise()
        else:
            self.row()
        return "\n".join(self.lines)

    def pointwise(self) -> None:
        k = self.kernel
        vars_ = list(k.outer) + ([k.inner] if k.inner is not None else [])
        n = _prod(vars_)
        b = _pointwise_block(n)
        self.pid(1)
        self.w(1, f"offs = pid * {b} + tl.arange(0, {b})")
        self.w(1, f"mask = offs < {n}")
        names = [f"o{j}" for j in range(len(k.outer))] + (["i0"] if k.inner is not None else [])
        self.split(1, "offs", vars_, names)
        self.block_vars = {id(v) for v in vars_}
        self.mask, self.zero = "mask", "offs * 0"
        t = self.dag(1, [s.value for s in k.stores])
        self.store(1, t)

    def row(self) -> None:
        k = self.kernel
        self.pid(1)
        self.split(1, "pid", list(k.outer), [f"o{j}" for j in range(len(k.outer))])
        for p in k.phases:
            R = p.var.size
            persistent = next_pow2(R) <= PERSISTENT_MAX
            block = next_pow2(R) if persistent else LOOP_BLOCK
            self.reduce_block(1, p, p.name, p.ty, "0", R, block, not persistent)
        if k.inner is None:
            t = self.dag(1, [s.value for s in k.stores])
            self.store(1, t)
            return
        n = k.inner.size
        persistent = next_pow2(n) <= PERSISTENT_MAX
        block = next_pow2(n) if persistent else LOOP_BLOCK
        d = 1
        if persistent:
            self.w(1, f"i0 = tl.arange(0, {block})")
        else:
            self.w(1, f"for start in range(0, {n}, {block}):")
            d = 2
            self.w(d, f"i0 = start + tl.arange(0, {block})")
        self.w(d, f"i0_m = i0 < {n}")
        self.var_names[id(k.inner)] = "i0"
        self.block_vars = {id(k.inner)}
        self.mask, self.zero = "i0_m", "i0 * 0"
        t = self.dag(d, [s.value for s in k.stores])
        self.store(d, t)
        self.mask, self.block_vars, self.zero = None, set(), "0"

    def full(self, params: List[str]) -> str:
        k = self.kernel
        p = k.phases[0]
        R = k.inner.size if k.inner is not None else 1
        nb = (R + FULL_BLOCK - 1) // FULL_BLOCK
        nparts = _prod(list(k.outer)) * nb if k.inner is not None else 0
        block_ty, total_ty = p.value.ty, p.ty
        if nparts:
            self.w(0, f"# full reduction, stage 1: one partial per {FULL_BLOCK} elements; nodes: {', '.join(k.nodes) or '-'}")
            self.w(0, "@triton.jit")
            self.w(0, f"def {k.name}_part({', '.join(params)}, part):")
            self.pid(1)
            self.w(1, f"rest = pid // {nb}")
            self.split(1, "rest", list(k.outer), [f"o{j}" for j in range(len(k.outer))])
            self.w(1, f"lo = (pid % {nb}) * {FULL_BLOCK}")
            self.w(1, f"n = tl.minimum({R} - lo, {FULL_BLOCK})")
            ph = Phase("bacc", p.op, k.inner, p.value, block_ty)
            self.reduce_block(1, ph, "bacc", block_ty, "lo", "n", FULL_BLOCK, False)
            cast = "(bacc != 0)" if total_ty == "b" else f"bacc.to({_TL[total_ty]})"
            self.w(1, f"tl.store(part + pid, {cast})")
            self.w(0, "")
            self.w(0, "")
        self.w(0, f"# full reduction, stage 2: combine the partials in a fixed order; nodes: {', '.join(k.nodes) or '-'}")
        self.w(0, "@triton.jit")
        self.w(0, f"def {k.name}({', '.join(params)}, part):")
        if k.inner is None:  # 0-d source
            t = self.dag(1, [p.value])
            v = t[p.value.id]
            self.w(1, f"{p.name} = {'(' + v + ' != 0)' if total_ty == 'b' else v + '.to(' + _TL[total_ty] + ')'}")
        else:
            stage = Phase(p.name, p.op, Var("part", nparts), None, total_ty)  # value: the partials
            self._combine(stage, nparts)
        t = self.dag(1, [s.value for s in k.stores])
        self.store(1, t)
        return "\n".join(self.lines)

    def _combine(self, p: Phase, nparts: int) -> None:
        ty = p.ty
        red_ty = "i64" if ty == "b" else ty
        self.w(1, f"{p.name}_blk = tl.full([{LOOP_BLOCK}], {self.init_value(p.op, red_ty)}, {_TL[red_ty]})")
        float_minmax = ty in ("f32", "f64") and p.op != "sum"
        if float_minmax:
            self.w(1, f"{p.name}_nan = tl.zeros([{LOOP_BLOCK}], tl.int32)")
        if nparts:
            self.w(1, f"for start in range(0, {nparts}, {LOOP_BLOCK}):")
            self.w(2, f"j = start + tl.arange(0, {LOOP_BLOCK})")
            self.w(2, f"v = tl.load(part + j, mask=j < {nparts}, other=0)" + (".to(tl.int64)" if red_ty != ty else ""))
            ident = self.init_value(p.op, red_ty)
            if p.op == "sum":
                self.w(2, f"{p.name}_blk += tl.where(j < {nparts}, v, 0)")
            else:
                fn = f"st_{p.op}" if ty in ("f32", "f64") else f"tl.{p.op}imum"
                self.w(2, f"{p.name}_blk = {fn}({p.name}_blk, tl.where(j < {nparts}, v, {ident}))")
                if float_minmax:
                    self.w(2, f"{p.name}_nan += tl.where((j < {nparts}) & (v != v), 1, 0)")
        op = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}[p.op]
        self.w(1, f"{p.name} = {op}({p.name}_blk, axis=0)")
        if float_minmax:
            self.w(1, f"{p.name} = tl.where(tl.sum({p.name}_nan, axis=0) > 0, _NAN, {p.name})")
        if red_ty != ty:
            self.w(1, f"{p.name} = {p.name} != 0")


def kernel_source(kernel: Kernel) -> str:
    """The ``@triton.jit`` function(s) of one kernel."""
    return _Emitter(kernel).emit()


def module_source(kernels: List[Kernel], portable: Optional[bool] = None) -> str:
    """The Python source of a whole lowered graph: imports, the math prelude, every kernel."""
    return "\n\n\n".join([prelude(portable)] + [kernel_source(k) for k in kernels]) + "\n"
