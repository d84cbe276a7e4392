"""The Triton target: code for :class:`~symtrace.lower.ir.Kernel` (the ``cuda`` target).

One Python module per lowered graph: a small math prelude of ``@triton.jit`` helpers
(:mod:`~symtrace.lower.triton_prelude`) followed by one ``@triton.jit`` function per kernel (two
for ``full`` kernels). The walk and the kernel outlines are
:class:`~symtrace.lower.render.KernelRenderer`'s; this module holds Triton's tables and idioms
and the launch table. Shapes are specialised, so every size and block is a literal in the source.

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
from typing import List, Optional, Set

import torch

from ..graph.symbols import SizeExpr, bounds, c_text
from .ir import Affine, Buffer, Expr, Kernel, Phase, Var, to_f32, wrap_int
from .render import COMPUTE_TYPES, KernelRenderer, Reduction, expand, templates
from .triton_prelude import interpreting, prelude

__all__ = ["kernel_source", "module_source", "launch_plan", "LaunchPlan", "interpreting", "prelude",
           "PERSISTENT_MAX", "LOOP_BLOCK", "FULL_BLOCK", "POINTWISE_BLOCK"]

PERSISTENT_MAX = 8192   # a row up to this (next power of two) is held in one block
LOOP_BLOCK = 2048       # block of a looped row / of the second stage of a full reduction
FULL_BLOCK = 1024       # elements per program in the first stage of a full reduction
POINTWISE_BLOCK = 1024  # elements per program of a pointwise kernel (smaller for small kernels)

_TL = {"f32": "tl.float32", "f64": "tl.float64", "i64": "tl.int64", "b": "tl.int1"}
_STORE_TL = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
             torch.bfloat16: "tl.bfloat16", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
             torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.bool: "tl.int1"}
_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _lit(value, ty: str) -> str:
    if ty in ("f32", "f64"):
        value = to_f32(value) if ty == "f32" else float(value)
        if math.isnan(value):
            return "st_nan()" if ty == "f32" else "st_nan().to(tl.float64)"
        elif math.isinf(value):
            v = "_INF" if value > 0 else "-_INF"
        else:
            v = repr(float(value))
        return f"tl.full([], {v}, {_TL[ty]})"
    if ty == "i64":
        return f"tl.full([], {wrap_int(int(value))}, tl.int64)"
    return f"tl.full([], {1 if value else 0}, tl.int1)"


# --------------------------------------------------------------------------- tables

#: binary op -> its operator on numbers, and on bools (on bools, add is or, sub is xor, mul is and)
_OPERATORS = {"add": ("+", "|"), "sub": ("-", "!="), "mul": ("*", "&"), "eq": ("==", "=="), "ne": ("!=", "!="),
              "lt": ("<", "<"), "le": ("<=", "<="), "gt": (">", ">"), "ge": (">=", ">=")}

#: op -> operand compute type -> Triton
_OPS = expand({
    "not": {"all": "({0} == 0)"},
    "isnan": {"all": "({0} != {0})"},
    "neg": {"all": "(-{0})"},
    "reciprocal": {"all": "(1 / {0})"},
    **{op: {"float": f"{fn}({{0}})"} for op, fn in (
        ("exp", "tl.exp"), ("log", "tl.log"), ("sigmoid", "tl.sigmoid"), ("erf", "tl.math.erf"), ("sqrt", "tl.sqrt"),
        ("sin", "tl.sin"), ("cos", "tl.cos"))},
    **{op: {"float": f"st_{op}({{0}})"} for op in ("log1p", "expm1", "tanh", "rsqrt", "gelu_erf", "gelu_tanh",
                                                   "silu")},
    **{op: {"float": f"tl.{op}({{0}})", "int": "{0}"} for op in ("floor", "ceil")},
    **{op: {"float": f"st_{op}({{0}})", "int": "{0}"} for op in ("round", "trunc")},
    "abs": {"all": "tl.abs({0})"},
    "relu": {"float": "st_relu({0})", "int": "tl.where({0} > 0, {0}, 0)"},
    "sign": {"all": "st_sign({0})"},
    **{op: {"float": f"({{0}} {sym} {{1}})", "i64": f"({{0}} {sym} {{1}})", "b": f"({{0}} {bsym} {{1}})"}
       for op, (sym, bsym) in _OPERATORS.items()},
    **{op: {"b": f"({{0}} {sym} {{1}})"} for op, sym in (("and", "&"), ("or", "|"), ("xor", "!="))},
    "div": {"float": "({0} / {1})", "i64": "({0} // {1})"},
    "max": {"float": "st_max({0}, {1})", "i64": "tl.maximum({0}, {1})", "b": "({0} | {1})"},
    "min": {"float": "st_min({0}, {1})", "i64": "tl.minimum({0}, {1})", "b": "({0} & {1})"},
    "pow": {"float": "st_pow({0}, {1})"},
    "where": {"all": "tl.where({0}, {1}, {2})"},
})

#: storage dtype -> its load (``{0}``: the ``tl.load``) in its compute type
_LOAD = {torch.bool: "({0} != 0)", torch.float16: "{0}.to(tl.float32)", torch.bfloat16: "{0}.to(tl.float32)",
         torch.float32: "{0}", torch.float64: "{0}", torch.int64: "{0}",
         **{dt: "{0}.to(tl.int64)" for dt in _INTS if dt != torch.int64}}

#: float -> integer storage dtype: the prelude helper's stem (st_f2* from float32, st_d2* from float64)
_F2I = {torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


def _f2int(src_ty: str, dtype: torch.dtype) -> str:
    return f"st_{'f' if src_ty == 'f32' else 'd'}2{_F2I[dtype]}"


#: (from, to, integer dtype of a float -> integer cast) -> Triton of the cast
_CASTS = {(src, dst, None): "({0} != 0)" if dst == "b" else f"{{0}}.to({_TL[dst]})"
          for src in COMPUTE_TYPES for dst in COMPUTE_TYPES}
_CASTS.update({(src, "i64", dt): f"{_f2int(src, dt or torch.int64)}({{0}})" for src in ("f32", "f64")
               for dt in (None,) + _INTS})

#: (storage dtype, compute type) -> Triton of a value rounded to the dtype's precision and range
_ROUNDS = {(dt, ty): f"({{0}} != 0).to({_TL[ty]})" if dt == torch.bool else f"{{0}}.to({store}).to({_TL[ty]})"
           for dt, store in _STORE_TL.items() if dt != torch.float64 for ty in COMPUTE_TYPES}

_REDUCE_FN = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}


#: reduction op -> compute type -> its identity, a plain literal (``tl.full`` and ``tl.where`` type it)
_IDENTITY = {"sum": {"f32": "0.0", "f64": "0.0", "i64": "0", "b": "0"},
             "max": {"f32": "-_INF", "f64": "-_INF", "i64": str(-2 ** 63), "b": "0"},
             "min": {"f32": "_INF", "f64": "_INF", "i64": str(2 ** 63 - 1), "b": "1"}}


# --------------------------------------------------------------------------- launch table

def _t(x) -> str:
    """A size in Triton code: an int, or an expression over the kernel's symbol arguments."""
    return c_text(x, cast="", div="//") if isinstance(x, SizeExpr) else str(x)


def _hi(n):
    """The largest value of a size (inf for an unbounded symbolic one)."""
    return bounds(n)[1] if isinstance(n, SizeExpr) else n


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_warps(block: int) -> int:
    """Launch-config table: warps per program for a block of ``block`` elements."""
    for limit, w in ((256, 2), (1024, 4), (4096, 8)):
        if block <= limit:
            return w
    return 16


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


def _pointwise_block(n) -> int:
    hi = _hi(n)   # (a symbolic size: the block its largest value would get)
    return POINTWISE_BLOCK if hi > POINTWISE_BLOCK else max(16, next_pow2(int(hi)))


def _row_block(n):
    """(block, looped) for a row of ``n`` elements: one block if it fits, else a loop. A
    symbolic row is held in one block only when its whole range fits (else looped for all)."""
    hi = _hi(n)
    if hi > PERSISTENT_MAX:
        return (LOOP_BLOCK, True)
    return (next_pow2(int(hi)), False)


def launch_plan(kernel: Kernel) -> LaunchPlan:
    """Grid and warps of ``kernel`` (a grid of 0 means: nothing to launch)."""
    k = kernel
    if k.kind == "pointwise":
        vars_ = list(k.outer) + ([k.inner] if k.inner is not None else [])
        n = _prod(vars_)
        b = _pointwise_block(n)
        return LaunchPlan((n + b - 1) // b, num_warps(b))
    if k.kind == "row":
        r = max(_hi(n) for n in [p.var.size for p in k.phases] + [k.inner.size if k.inner is not None else 1])
        return LaunchPlan(_prod(k.outer), num_warps(PERSISTENT_MAX if r > PERSISTENT_MAX else next_pow2(int(r))))
    p = k.phases[0]
    R = k.inner.size if k.inner is not None else 1
    nb = (R + FULL_BLOCK - 1) // FULL_BLOCK
    part_dtype = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64, "b": torch.bool}[p.ty]
    return LaunchPlan(_prod(k.outer) * nb if k.inner is not None else 0, num_warps(FULL_BLOCK),
                      _prod(k.outer) * nb if k.inner is not None else 0, part_dtype)


# --------------------------------------------------------------------------- the renderer

class TritonRenderer(KernelRenderer):
    target = "Triton"
    ops = _OPS
    full_block = FULL_BLOCK
    loads, casts, rounds = templates(_LOAD), templates(_CASTS), templates(_ROUNDS)
    literal = staticmethod(_lit)

    def __init__(self, kernel: Kernel):
        super().__init__(kernel)
        self.block_vars: Set[int] = set()   # vars that are blocks (tl.arange) in the current scope
        self.zero = "0"                     # a block of zeros of the current scope's shape
        self.mask: Optional[str] = None
        self.wide = self._needs_int64()

    def _needs_int64(self) -> bool:
        k = self.kernel
        limit = 2 ** 31 - 1
        extents = [sum((s - 1) * (st if isinstance(st, SizeExpr) else abs(st)) for s, st in zip(b.shape, b.strides)) + 1
                   for b in self.bufs]
        total = _prod(list(k.outer) + ([k.inner] if k.inner is not None else []))
        return max(_hi(n) for n in extents + [total, FULL_BLOCK * (total // FULL_BLOCK + 1)]) >= limit

    def index(self, a: Affine) -> str:
        parts = []
        blocky = False
        for v, c in a.terms:
            n = self.var_names[id(v)]
            blocky = blocky or id(v) in self.block_vars
            parts.append(n if c == 1 else f"{_t(c)} * {n}")
        if a.const or not parts:
            parts.append(_t(a.const))
        if not blocky and self.mask is not None:
            parts.append(self.zero)
        return " + ".join(parts)

    # -- values
    def element(self, buf: Buffer, index: Affine, mask: Optional[str] = None) -> str:
        masks = [m for m in (self.mask, mask) if m is not None]
        mask = f", mask={' & '.join(masks)}, other=0" if masks else ""
        return f"tl.load({self.bufname[id(buf)]} + ({self.index(index)}){mask})"

    def masked_load(self, e: Expr, mask: str, other: str) -> str:
        buf, index = e.payload[:2]
        return f"tl.where({mask}, {self.loads[buf.dtype](self.element(buf, index, mask))}, {other})"

    def in_range(self, a: Affine, lo, hi) -> str:
        i = self.index(a)
        return f"(({i}) >= {_t(lo)}) & (({i}) < {_t(hi)})"

    def convert(self, x: str, ty: str) -> str:
        return f"({x} != 0)" if ty == "b" else f"{x}.to({_TL[ty]})"

    def size_value(self, size, ty: str) -> str:
        return f"(tl.zeros([], {_TL[ty]}) + {_t(size)})"

    def store_value(self, x: str, value: Expr, dtype) -> str:
        if dtype == torch.bool and value.ty != "b":
            return f"({x} != 0)"
        if dtype in _F2I and value.ty in ("f32", "f64"):
            return f"{_f2int(value.ty, dtype)}({x}).to({_STORE_TL[dtype]})"
        return f"{x}.to({_STORE_TL[dtype]})"

    def store(self, buf: Buffer, index: Affine, value: str) -> str:
        mask = f", mask={self.mask}" if self.mask is not None else ""
        return f"tl.store({self.bufname[id(buf)]} + ({self.index(index)}), {value}{mask})"

    # -- functions and programs
    def function(self, comment: str, name: str, extra: List[str]) -> None:
        params = [f"b{i}" for i in range(len(self.bufs))] + list(self.kernel.symbols) + extra
        self.w(0, f"# {comment}; nodes: {', '.join(self.kernel.nodes) or '-'}")
        self.w(0, "@triton.jit")
        self.w(0, f"def {name}({', '.join(params)}):")

    def begin(self) -> None:
        self.function(f"{self.kernel.kind} kernel", self.kernel.name, [])

    def end(self) -> None:
        pass

    def pid(self, depth: int) -> None:
        self.w(depth, "pid = tl.program_id(0).to(tl.int64)" if self.wide else "pid = tl.program_id(0)")

    def split(self, depth: int, flat: str, vars_: List[Var], names: List[str]) -> None:
        """Recover ``vars_`` (row-major) from the flat index ``flat``."""
        rest = flat
        for j in range(len(vars_) - 1, -1, -1):
            name = self.name_var(vars_[j], names[j])
            if j == 0:
                self.w(depth, f"{name} = {rest}")
            else:
                self.w(depth, f"{name} = {rest} % {_t(vars_[j].size)}")
                self.w(depth, f"rest = {rest} // {_t(vars_[j].size)}")
                rest = "rest"

    def outer_names(self) -> List[str]:
        return [f"o{j}" for j in range(len(self.kernel.outer))]

    def close_loops(self, depth: int) -> None:
        pass

    def open_pointwise(self) -> int:
        k = self.kernel
        vars_ = list(k.outer) + ([k.inner] if k.inner is not None else [])
        n = _prod(vars_)
        b = _pointwise_block(n)
        self.pid(1)
        self.w(1, f"offs = pid * {b} + tl.arange(0, {b})")
        self.w(1, f"mask = offs < {_t(n)}")
        self.split(1, "offs", vars_, self.outer_names() + (["i0"] if k.inner is not None else []))
        self.block_vars = {id(v) for v in vars_}
        self.mask, self.zero = "mask", "offs * 0"
        return 1

    def open_rows(self) -> int:
        self.pid(1)
        self.split(1, "pid", list(self.kernel.outer), self.outer_names())
        return 1

    def row_span(self, var: Var):
        return ("0", var.size) + _row_block(var.size)

    def open_block(self, depth: int, var: Var, name: str, lo: Optional[str], size, block: int, looped: bool) -> int:
        """``var`` as the block ``name`` of ``block`` lanes over [lo, lo + size) (``lo`` None: 0),
        masked by ``name_m``; ``looped``: in a loop over blocks. Returns the body's depth."""
        start = f"{lo} + " if lo is not None else ""
        if looped:
            self.w(depth, f"for start in range(0, {_t(size)}, {block}):")
            depth += 1
            self.w(depth, f"{name} = {start}start + tl.arange(0, {block})")
        else:
            self.w(depth, f"{name} = {start}tl.arange(0, {block})")
        self.w(depth, f"{name}_m = {name} < {_t(size)}" if lo in (None, "0") else f"{name}_m = {name} < {lo} + {_t(size)}")
        self.var_names[id(var)] = name
        self.block_vars = {id(var)}
        self.mask, self.zero = f"{name}_m", f"{name} * 0"
        return depth

    def leave_block(self) -> None:
        self.mask, self.block_vars, self.zero = None, set(), "0"

    def open_store_loop(self, depth: int):
        n = self.kernel.inner.size
        return self.open_block(depth, self.kernel.inner, "i0", None, n, *_row_block(n)), "i0"

    def close_store_loop(self, depth: int) -> None:
        self.leave_block()

    # -- reductions: a block of partial results, reduced with tl.sum/max/min at the end
    def reduce_init(self, depth: int, r: Reduction) -> None:
        block = r.span[2]
        red_ty = "i64" if r.ty == "b" else r.ty
        self.w(depth, f"{r.acc}_blk = tl.full([{block}], {_IDENTITY[r.op][red_ty]}, {_TL[red_ty]})")
        if r.nan_flag:
            self.w(depth, f"{r.acc}_nan = tl.zeros([{block}], tl.int32)")

    def open_reduction(self, depth: int, r: Reduction) -> int:
        r.index = f"r_{r.acc}"
        return self.open_block(depth, r.var, r.index, *r.span)

    def accumulate(self, depth: int, r: Reduction, v: str) -> None:
        mask = f"{r.index}_m"
        self.update_block(depth, r, f"{v}.to(tl.int64)" if r.ty == "b" else v, mask, mask)

    def update_block(self, depth: int, r: Reduction, v: str, mask: str, mask_term: str) -> None:
        """Fold the block ``v`` (valid where ``mask``; ``mask_term``: the same as an operand of
        ``&``) into ``r``'s block of partial results."""
        acc = r.acc
        if r.op == "sum":
            self.w(depth, f"{acc}_blk += tl.where({mask}, {v}, 0)")
            return
        fn = f"st_{r.op}" if r.ty in ("f32", "f64") else f"tl.{r.op}imum"
        ident = _IDENTITY[r.op]["i64" if r.ty == "b" else r.ty]
        self.w(depth, f"{acc}_blk = {fn}({acc}_blk, tl.where({mask}, {v}, {ident}))")
        if r.nan_flag:
            self.w(depth, f"{acc}_nan += tl.where({mask_term} & ({v} != {v}), 1, 0)")

    def close_reduction(self, depth: int) -> None:
        self.leave_block()

    def reduce_finish(self, depth: int, r: Reduction) -> None:
        acc = r.acc
        self.w(depth, f"{acc} = {_REDUCE_FN[r.op]}({acc}_blk, axis=0)")
        if r.nan_flag:
            self.w(depth, f"{acc} = tl.where(tl.sum({acc}_nan, axis=0) > 0, st_nan(), {acc})")
        if r.ty == "b":
            self.w(depth, f"{acc} = {acc} != 0")

    # -- full reductions: kN_part writes one partial per program, kN combines them in order
    def open_full(self, p: Phase) -> None:
        pass

    def open_partials(self, p: Phase, nb: int, nparts: int):
        k = self.kernel
        self.function(f"full reduction, stage 1: one partial per {FULL_BLOCK} elements", f"{k.name}_part", ["part"])
        self.pid(1)
        self.w(1, f"rest = pid // {_t(nb)}")
        self.split(1, "rest", list(k.outer), self.outer_names())
        self.w(1, f"lo = (pid % {_t(nb)}) * {FULL_BLOCK}")
        self.w(1, f"n = tl.minimum({_t(k.inner.size)} - lo, {FULL_BLOCK})")
        return 1, ("lo", "n", FULL_BLOCK, False)

    def close_partials(self, depth: int, acc: str, p: Phase) -> None:
        self.w(depth, f"tl.store(part + pid, {self.convert(acc, p.ty)})")
        self.w(0, "")
        self.w(0, "")

    def open_total(self, p: Phase) -> None:
        self.function("full reduction, stage 2: combine the partials in a fixed order", self.kernel.name, ["part"])

    def combine(self, p: Phase, nparts: int) -> None:
        r = Reduction(p, p.name, p.ty, Var("part", nparts), ("0", nparts, LOOP_BLOCK, True))
        self.reduce_init(1, r)
        if nparts:
            n = _t(nparts)
            self.w(1, f"for start in range(0, {n}, {LOOP_BLOCK}):")
            self.w(2, f"j = start + tl.arange(0, {LOOP_BLOCK})")
            self.w(2, f"v = tl.load(part + j, mask=j < {n}, other=0)" + (".to(tl.int64)" if p.ty == "b" else ""))
            self.update_block(2, r, "v", f"j < {n}", f"(j < {n})")
        self.reduce_finish(1, r)


def kernel_source(kernel: Kernel) -> str:
    """The ``@triton.jit`` function(s) of one kernel."""
    return TritonRenderer(kernel).render()


def module_source(kernels: List[Kernel], portable: Optional[bool] = None) -> str:
    """The Python source of a whole lowered graph: imports, the math prelude, every kernel."""
    return "\n\n\n".join([prelude(portable)] + [kernel_source(k) for k in kernels]) + "\n"
