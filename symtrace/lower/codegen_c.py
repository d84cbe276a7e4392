"""The C target: C99 + OpenMP code for :class:`~symtrace.lower.ir.Kernel`.

One translation unit per lowered graph: the math prelude (``prelude.h``, inlined vectorisable
exp/tanh/erf/... with IEEE NaN/Inf behaviour) followed by one ``void kN(void *p0, ..., int nt)``
per kernel. The walk and the kernel outlines are :class:`~symtrace.lower.render.KernelRenderer`'s;
this module holds C's tables and idioms. Outer loops run under ``#pragma omp parallel for``
(serial, with no OpenMP region at all, at or below :data:`PARALLEL_THRESHOLD` elements of work),
inner loops under ``#pragma omp simd``; a region's thread count is the ``nt`` argument
(``torch.get_num_threads()``). fp16/bf16 are loaded as raw bits, computed in float and rounded
once at the store.
Reductions over a row happen inside one thread (so they do not depend on the thread count); a
row kernel's :class:`~symtrace.lower.ir.RowCache` values live in row-long arrays declared in the
parallel loop's body (thread-private, on the stack); full reductions sum fixed blocks of
:data:`BLOCK` elements in the compute type and combine the block results in double, in order.

The generated C has no undefined behaviour: float -> integer casts go through the prelude's
range-checked ``st_f2i32f``/``st_f2u8``/... (eager's x86-64 results for NaN, +-Inf and
out-of-range values), integer add/sub/mul/neg/abs and integer sums wrap modulo 2^64 through
unsigned arithmetic (``st_addi``, ...) and narrow integer results wrap to their dtype
(``st_wrap_i32``, ...), as torch's do; integer division is never emitted (the lowering divides
in floating point).
"""
from __future__ import annotations

import math
import re
from typing import Dict, List, NamedTuple, Optional

import torch

from ..graph.symbols import SizeExpr, bounds, c_text
from .ir import Affine, Buffer, Expr, Kernel, Phase, Var, ctype_of, to_f32, walk, wrap_int
from .render import COMPUTE_TYPES, KernelRenderer, Reduction, expand, templates
from .toolchain import UNIT_BREAK

__all__ = ["kernel_source", "translation_unit", "entry_point", "CCall", "PARALLEL_THRESHOLD", "BLOCK"]

PARALLEL_THRESHOLD = 32768
BLOCK = 4096

_CT = {"f32": "float", "f64": "double", "i64": "int64_t", "b": "int"}
_FLOATS = (torch.float32, torch.float64)
_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _lit(value, ty: str) -> str:
    if ty in ("f32", "f64"):
        suffix = "f" if ty == "f32" else ""
        value = to_f32(value) if ty == "f32" else float(value)
        if math.isnan(value):
            return "NAN" if ty == "f32" else "((double)NAN)"
        if math.isinf(value):
            s = "INFINITY" if ty == "f32" else "((double)INFINITY)"
            return s if value > 0 else f"(-{s})"
        return f"{value.hex()}{suffix}"
    if ty == "i64":
        v = wrap_int(int(value))
        return "INT64_MIN" if v == -2 ** 63 else f"INT64_C({v})"
    return "1" if value else "0"


# --------------------------------------------------------------------------- tables

#: op -> operand compute type -> C (``{f}``: the float32 suffix of the libm/prelude name)
_OPS = expand({
    "not": {"all": "(!{0})"},
    "isnan": {"all": "({0} != {0})"},
    "neg": {"all": "(-{0})", "i64": "st_negi({0})"},
    "reciprocal": {"f32": f"({_lit(1.0, 'f32')} / {{0}})", "f64": f"({_lit(1.0, 'f64')} / {{0}})"},
    "sin": {"float": "sin{f}({0})"},
    "cos": {"float": "cos{f}({0})"},
    "abs": {"float": "st_abs{f}({0})", "i64": "st_absi({0})", "b": "{0}"},
    "relu": {"float": "st_relu{f}({0})", "int": "({0} > 0 ? {0} : 0)"},
    "sign": {"float": "st_sign{f}({0})", "int": "(({0} > 0) - ({0} < 0))"},
    **{op: {"float": f"st_{op}{{f}}({{0}})", "int": "{0}"} for op in ("floor", "ceil", "round", "trunc")},
    **{op: {"float": f"st_{op}{{f}}({{0}})"} for op in ("exp", "log", "log1p", "expm1", "tanh", "sigmoid", "erf",
                                                       "sqrt", "rsqrt", "gelu_erf", "gelu_tanh", "silu")},
    # integer add/sub/mul wrap like torch's (no signed overflow); no integer division
    "add": {"float": "({0} + {1})", "i64": "st_addi({0}, {1})", "b": "({0} || {1})"},
    "sub": {"float": "({0} - {1})", "i64": "st_subi({0}, {1})", "b": "({0} != {1})"},
    "mul": {"float": "({0} * {1})", "i64": "st_muli({0}, {1})", "b": "({0} && {1})"},
    "div": {"float": "({0} / {1})"},
    "pow": {"float": "st_pow{f}({0}, {1})"},
    "max": {"float": "st_max{f}({0}, {1})", "int": "({0} > {1} ? {0} : {1})"},
    "min": {"float": "st_min{f}({0}, {1})", "int": "({0} < {1} ? {0} : {1})"},
    **{op: {"all": f"({{0}} {sym} {{1}})"} for op, sym in (
        ("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="),
        ("and", "&&"), ("or", "||"), ("xor", "!="))},
    "where": {"all": "({0} ? {1} : {2})"},
}, f32="f")

#: storage dtype -> its load (``{0}``: the element) in its compute type
_LOAD = {torch.float16: "st_h2f({0})", torch.bfloat16: "st_bf2f({0})", torch.bool: "({0} != 0)",
         torch.float32: "{0}", torch.float64: "{0}", **{dt: "(int64_t){0}" for dt in _INTS}}

#: compute type -> the prelude's select of an argument read unconditionally (masked loads)
_PICK = {"f32": "st_pickf", "f64": "st_pick", "i64": "st_pick_i64", "b": "st_pick_b"}

#: prelude helpers: float -> integer storage dtype (eager's results for NaN/Inf/out of range)
_F2I = {torch.int8: "st_f2i8", torch.uint8: "st_f2u8", torch.int16: "st_f2i16", torch.int32: "st_f2i32",
        torch.int64: "st_f2i64"}
#: prelude helpers: an int64 reduced modulo 2^N into an N-bit integer dtype
_WRAP = {torch.int8: "st_wrap_i8", torch.uint8: "st_wrap_u8", torch.int16: "st_wrap_i16", torch.int32: "st_wrap_i32"}


def _f2int(x: str, src_ty: str, dtype: Optional[torch.dtype]) -> str:
    """C for the float (``src_ty`` f32/f64) value ``x`` converted to integer ``dtype`` (an int64_t)."""
    return f"{_F2I[dtype or torch.int64]}{'f' if src_ty == 'f32' else ''}({x})"


def _wrap(x: str, dtype: torch.dtype, e: Optional[Expr] = None) -> str:
    """``x`` (an int64) wrapped into integer ``dtype``; unchanged when the expression ``e`` is
    known to be in its range already (a load of, a conversion or a wrap to ``dtype``)."""
    if e is not None and (e.op in ("round", "cast") and e.payload == dtype or
                          e.op == "load" and not e.args and e.payload[0].dtype == dtype):
        return x
    return f"{_WRAP[dtype]}({x})" if dtype in _WRAP else x


#: (from, to, integer dtype of a float -> integer cast) -> C of the cast
_CASTS = {(src, dst, None): "({0} != 0)" if dst == "b" else "{0}" if src == dst else f"(({_CT[dst]}){{0}})"
          for src in COMPUTE_TYPES for dst in COMPUTE_TYPES}
_CASTS.update({(src, "i64", dt): _f2int("{0}", src, dt) for src in ("f32", "f64") for dt in (None,) + _INTS})

#: (storage dtype, compute type) -> C of a value rounded to the dtype's precision and range
#: (integer results are wrapped by :func:`_wrap`, which knows values already in range)
_ROUNDS = {}
for _ty in COMPUTE_TYPES:
    _cast = f"({_CT[_ty]})"
    _ROUNDS[(torch.float16, _ty)] = ("" if _ty == "f32" else "(double)") + "st_h2f(st_f2h((float){0}))"
    _ROUNDS[(torch.bfloat16, _ty)] = ("" if _ty == "f32" else "(double)") + "st_bf2f(st_f2bf((float){0}))"
    _ROUNDS[(torch.float32, _ty)] = f"({_cast}(float){{0}})"
    _ROUNDS[(torch.bool, _ty)] = f"({_cast}({{0}} != 0))"
    for _dt in _INTS if _ty != "i64" else ():
        _ROUNDS[(_dt, _ty)] = f"({_cast}{{0}})" if _ty == "b" else f"({_cast}{_wrap(_f2int('{0}', _ty, _dt), _dt)})"

#: reduction op -> compute type -> its identity
_IDENTITY = {"sum": {ty: _lit(0, ty) for ty in COMPUTE_TYPES},
             "max": {"f32": "(-INFINITY)", "f64": "(-(double)INFINITY)", "i64": "INT64_MIN", "b": "0"},
             "min": {"f32": "INFINITY", "f64": "((double)INFINITY)", "i64": "INT64_MAX", "b": "1"}}


def _index(a: Affine, names: Dict[int, str]) -> str:
    parts = []
    for v, c in a.terms:
        n = names[id(v)]
        parts.append(n if c == 1 else f"{c_text(c)}*{n}")
    if a.const or not parts:
        parts.append(c_text(a.const))
    return "(" + " + ".join(parts) + ")"


def _for(name: str, lo, hi) -> str:
    return f"for (int64_t {name} = {_c(lo)}; {name} < {_c(hi)}; {name}++) {{"


def _c(x) -> str:
    """A loop bound or size in C: an int, a size expression over the kernel's symbols, or code."""
    return x if isinstance(x, str) else c_text(x)


def _straddles(work) -> bool:
    """Whether a size-generic kernel's work may fall on either side of the threshold."""
    if not isinstance(work, SizeExpr):
        return False
    lo, hi = bounds(work)
    return lo <= PARALLEL_THRESHOLD < hi


def _parallel_for(clause: str, work, parallel: Optional[bool] = None) -> Optional[str]:
    """The parallel idiom: OpenMP threads when there is more ``work`` than
    :data:`PARALLEL_THRESHOLD`; below it the loop stays serial (a ``simd`` clause becomes
    ``#pragma omp simd``, else no pragma). ``work`` is known when the kernel is generated, and
    an ``if(0)`` clause would still enter the OpenMP runtime: a team of one thread set up
    and torn down, about as costly as the ctypes call of a small kernel."""
    if parallel is None and isinstance(work, SizeExpr):   # (a range on one side of the threshold)
        lo, hi = bounds(work)
        parallel = lo > PARALLEL_THRESHOLD
    if parallel if parallel is not None else work > PARALLEL_THRESHOLD:
        return f"#pragma omp parallel for{clause} schedule(static) num_threads(nt)"
    return "#pragma omp simd" if clause.strip() == "simd" else None


# --------------------------------------------------------------------------- the renderer

class CRenderer(KernelRenderer):
    target = "C"
    ops = _OPS
    full_block = BLOCK
    keeps_row_cache = True

    def __init__(self, kernel: Kernel, parallel: Optional[bool] = None, name: Optional[str] = None):
        super().__init__(kernel)
        self.parallel = parallel          # a size-generic kernel's serial or parallel form (see kernel_source)
        self.fn_name = name or kernel.name
    loads, casts, rounds = templates(_LOAD), templates(_CASTS), templates(_ROUNDS)
    literal = staticmethod(_lit)
    declare = {ty: f"const {ct} " for ty, ct in _CT.items()}
    end_of_statement = ";"
    inline_loads = frozenset(_FLOATS)

    # -- values
    def element(self, buf: Buffer, index: Affine) -> str:
        return f"{self.bufname[id(buf)]}[{_index(index, self.var_names)}]"

    def masked_load(self, e: Expr, mask: str, other: str) -> str:
        # the read happens either way (at the safe index where the mask fails), as an argument:
        # gcc vectorises a select of two values, not a read under a condition
        # (the terms both indices share stay outside the select, so a read contiguous along the
        # inner loop stays a vector read; the index is chosen with bit masks for the same reason)
        buf, index, safe = e.payload
        names = self.var_names
        common = Affine(0, [(v, c) for v, c in index.terms if safe.coeff(v) == c])
        rest_i, rest_s = index + common.scale(-1), safe + common.scale(-1)
        shared = f"{_index(common, names)} + " if common.terms else ""
        element = (f"{self.bufname[id(buf)]}[{shared}"
                   f"st__pick_index({mask}, {_index(rest_i, names)}, {_index(rest_s, names)})]")
        return f"{_PICK[e.ty]}({mask}, {self.loads[buf.dtype](element)}, {other})"

    def in_range(self, a: Affine, lo, hi) -> str:
        i = _index(a, self.var_names)
        return f"({c_text(lo)} <= {i} && {i} < {c_text(hi)})"

    def round(self, e: Expr, x: str) -> str:
        if e.ty == "i64" and e.payload in _F2I:   # wrapped, unless known to be in range
            return _wrap(x, e.payload, e.args[0])
        return super().round(e, x)

    def convert(self, x: str, ty: str) -> str:
        return f"({_CT[ty]}){x}"

    def size_value(self, size, ty: str) -> str:
        return f"(({_CT[ty]}){c_text(size)})"

    def cache_ref(self, name: str, index: str) -> str:
        return f"{name}[{index}]"

    def store_value(self, x: str, value: Expr, dtype) -> str:
        vty = value.ty
        if dtype == torch.float16:
            return f"st_f2h({x})"
        if dtype == torch.bfloat16:
            return f"st_f2bf({x})"
        if dtype == torch.bool:
            return f"(uint8_t)({x} != 0)"
        if dtype not in _FLOATS:   # integers: every conversion defined
            if vty in ("f32", "f64"):
                x = _wrap(_f2int(x, vty, dtype), dtype)
            elif vty == "i64":
                x = _wrap(x, dtype, value)
            return f"({ctype_of(dtype)}){x}"
        if vty not in ("f32", "f64") or (dtype == torch.float32) != (vty == "f32"):
            return f"({ctype_of(dtype)}){x}"
        return x

    def store(self, buf: Buffer, index: Affine, value: str) -> str:
        return self.assign(self.element(buf, index), value)

    # -- the function
    def begin(self) -> None:
        k = self.kernel
        self.w(0, f"/* {k.kind} kernel; nodes: {', '.join(k.nodes) or '-'} */")
        self.w(0, f"void {self.fn_name}({_signature(k)[0]}) {{")
        written = {id(s.buffer) for s in k.stores}
        for i, b in enumerate(self.bufs):
            const = "" if id(b) in written else "const "
            self.w(1, f"{const}{ctype_of(b.dtype)} *restrict b{i} = ({const}{ctype_of(b.dtype)} *)p{i};")
        self.w(1, "(void)nt;" + "".join(f" (void){s};" for s in k.symbols))

    def end(self) -> None:
        self.w(0, "}")

    # -- loops
    def pragma(self, depth: int, line: Optional[str]) -> None:
        if line is not None:
            self.w(depth, line)

    def open_outer(self, outer: List[Var], work: int) -> int:
        """The outer loops, run in parallel (collapsed); returns the depth of their body."""
        names = [self.name_var(v, f"o{k}") for k, v in enumerate(outer)]
        if outer:
            self.pragma(1, _parallel_for(f" collapse({len(outer)})" if len(outer) > 1 else "", work, self.parallel))
        for k, (v, n) in enumerate(zip(outer, names)):
            self.w(1 + k, _for(n, 0, v.size))
        return 1 + len(outer)

    def close_loops(self, depth: int) -> None:
        for d in range(depth - 1, 0, -1):
            self.w(d, "}")

    def open_pointwise(self) -> int:
        k = self.kernel
        if k.inner is None:
            return self.open_outer(k.outer, k.work)
        if not k.outer:   # one loop: threads and SIMD lanes
            n = self.name_var(k.inner, "i0")
            self.pragma(1, _parallel_for(" simd", k.work, self.parallel))
            self.w(1, _for(n, 0, k.inner.size))
            return 2
        return self.open_store_loop(self.open_outer(k.outer, k.work))[0]

    def open_rows(self) -> int:
        k = self.kernel
        depth = self.open_outer(k.outer, k.work)
        for rc in k.row_cache:  # thread-private (declared in the parallel loop's body)
            self.w(depth, f"{_CT[rc.value.ty]} {rc.name}[{rc.phase.var.size}];")
        return depth

    def row_span(self, var: Var):
        return "0", _c(var.size)

    def open_store_loop(self, depth: int):
        n = self.name_var(self.kernel.inner, "i0")
        self.w(depth, "#pragma omp simd")
        self.w(depth, _for(n, 0, self.kernel.inner.size))
        return depth + 1, n

    def close_store_loop(self, depth: int) -> None:
        self.w(depth - 1, "}")

    # -- reductions
    def reduce_init(self, depth: int, r: Reduction) -> None:
        self.w(depth, f"{_CT[r.ty]} {r.acc} = {_IDENTITY[r.op][r.ty]};")
        if r.nan_flag:
            self.w(depth, f"int {r.acc}_nan = 0;")
        if r.op == "sum" and r.ty == "i64":   # int64 sums wrap like torch's: accumulate unsigned
            self.w(depth, f"uint64_t {r.acc}_u = 0;")

    def open_reduction(self, depth: int, r: Reduction) -> int:
        acc = r.acc
        if r.op == "sum":
            clause = f"reduction(+:{acc}_u)" if r.ty == "i64" else f"reduction(+:{acc})"
        else:
            clause = f"reduction({r.op}:{acc})" + (f" reduction(|:{acc}_nan)" if r.nan_flag else "")
        self.w(depth, f"#pragma omp simd {clause}")
        r.index = self.name_var(r.var, r.var.name)
        self.w(depth, _for(r.index, *r.span))
        return depth + 1

    def accumulate(self, depth: int, r: Reduction, v: str) -> None:
        acc = r.acc
        if r.op == "sum":
            self.w(depth, f"{acc}_u += (uint64_t){v};" if r.ty == "i64" else f"{acc} += {v};")
            return
        cmp = ">" if r.op == "max" else "<"
        self.w(depth, f"{acc} = {acc} {cmp} {v} ? {acc} : {v};")
        if r.nan_flag:
            self.w(depth, f"{acc}_nan |= ({v} != {v});")

    def close_reduction(self, depth: int) -> None:
        self.w(depth - 1, "}")

    def reduce_finish(self, depth: int, r: Reduction) -> None:
        if r.op == "sum" and r.ty == "i64":
            self.w(depth, f"{r.acc} = st_addi({r.acc}, st__u2i64({r.acc}_u));")
        if r.nan_flag:
            self.w(depth, f"if ({r.acc}_nan) {r.acc} = NAN;")

    # -- row kernels over strided rows: column blocks
    def row(self) -> None:
        c = _column_var(self.kernel)
        if c is None:
            return super().row()
        self._column_row(c)

    def expr(self, e: Expr, t: Dict[int, str]) -> str:
        if e.op == "acc" and self._columns:
            return f"{e.payload.name}[cj]"
        return super().expr(e, t)

    _columns = False

    def _column_row(self, c: Var) -> None:
        """A row kernel whose rows are the columns of its reads (a mean over H, W of a
        channels-last tensor: each row reads with the channel stride, neighbouring rows are
        neighbours in memory): blocks of :data:`COLUMN_BLOCK` rows (or half that, when it divides
        the number of rows and the whole block does not) are reduced together, the
        reduction loop outside and the rows inside, vectorised, with an accumulator array
        per phase. Each row's values are folded in the same order as in the row form."""
        k = self.kernel
        self._columns = True
        self.begin()
        outer = k.outer[:-1]
        names = [self.name_var(v, f"o{j}") for j, v in enumerate(outer)]
        cname = self.name_var(c, f"o{len(outer)}")
        # (a constant trip count vectorises: 2.5-10x faster than a variable one in column blocks)
        fixed = next((b for b in (COLUMN_BLOCK, COLUMN_BLOCK // 2) if type(c.size) is int and c.size % b == 0), None)
        block = fixed or COLUMN_BLOCK
        nblocks = f"(({_c(c.size)} + {block - 1}) / {block})"
        self.pragma(1, _parallel_for(f" collapse({len(outer) + 1})" if outer else "", k.work, self.parallel))
        for j, (v, n) in enumerate(zip(outer, names)):
            self.w(1 + j, _for(n, 0, v.size))
        depth = 1 + len(outer)
        self.w(depth, _for("cb", 0, nblocks))
        depth += 1
        self.w(depth, f"const int64_t c_lo = cb * {block};")
        if fixed:
            self.w(depth, f"enum {{ c_n = {block} }};")
        else:
            self.w(depth, f"const int64_t c_n = {_c(c.size)} - c_lo < {block} ? {_c(c.size)} - c_lo : {block};")
        for p in k.phases:
            r = Reduction(p, p.name, p.ty, p.var, self.row_span(p.var))
            self.w(depth, f"{_CT[r.ty]} {r.acc}[{block}];")
            if r.nan_flag:
                self.w(depth, f"int {r.acc}_nan[{block}];")
            self.w(depth, f"for (int64_t cj = 0; cj < c_n; cj++) {{ {r.acc}[cj] = {_IDENTITY[r.op][r.ty]};"
                          + (f" {r.acc}_nan[cj] = 0;" if r.nan_flag else "") + " }")
            r.index = self.name_var(r.var, r.var.name)
            self.w(depth, _for(r.index, *r.span))
            self.w(depth + 1, "#pragma omp simd")
            self.w(depth + 1, _for("cj", 0, "c_n"))
            self.w(depth + 2, f"const int64_t {cname} = c_lo + cj;")
            t = self.dag(depth + 2, [p.value])
            v = t[p.value.id]
            acc = f"{r.acc}[cj]"
            if r.op == "sum":
                self.w(depth + 2, f"{acc} += {v};")
            else:
                cmp = ">" if r.op == "max" else "<"
                self.w(depth + 2, f"{acc} = {acc} {cmp} {v} ? {acc} : {v};")
                if r.nan_flag:
                    self.w(depth + 2, f"{r.acc}_nan[cj] |= ({v} != {v});")
            self.w(depth + 1, "}")
            self.w(depth, "}")
            if r.nan_flag:
                self.w(depth, f"for (int64_t cj = 0; cj < c_n; cj++) if ({r.acc}_nan[cj]) {r.acc}[cj] = NAN;")
        self.w(depth, "#pragma omp simd")
        self.w(depth, _for("cj", 0, "c_n"))
        self.w(depth + 1, f"const int64_t {cname} = c_lo + cj;")
        if k.inner is not None:   # (of size 1)
            self.w(depth + 1, f"const int64_t {self.name_var(k.inner, 'i0')} = 0;")
        self.compute_and_store(depth + 1)
        self.w(depth, "}")
        self.close_loops(depth)
        self.end()
        self._columns = False

    # -- full reductions: partials of BLOCK elements in parallel, combined in order
    def open_full(self, p: Phase) -> None:
        self.begin()
        self.w(1, f"{_CT[p.ty]} {p.name} = {_IDENTITY[p.op][p.ty]};")

    def open_partials(self, p: Phase, nb: int, nparts: int):
        k = self.kernel
        T, R = _CT[p.ty], k.inner.size
        self.w(1, "{")
        nparts, nb, R = _c(nparts), _c(nb), _c(R)
        self.w(2, f"{T} *part = ({T} *)malloc(sizeof({T}) * {nparts});")
        self.pragma(2, _parallel_for("", k.work, self.parallel))
        self.w(2, _for("blk", 0, nparts))
        self.w(3, f"int64_t rest = blk / {nb};")
        for j in range(len(k.outer) - 1, -1, -1):
            name = self.name_var(k.outer[j], f"o{j}")
            size = _c(k.outer[j].size)
            self.w(3, f"const int64_t {name} = rest % {size}; rest /= {size};" if j else
                   f"const int64_t {name} = rest;")
        self.w(3, f"const int64_t lo = (blk % {nb}) * {BLOCK};")
        self.w(3, f"const int64_t hi = lo + {BLOCK} < {R} ? lo + {BLOCK} : {R};")
        return 3, ("lo", "hi")

    def close_partials(self, depth: int, acc: str, p: Phase) -> None:
        self.w(depth, self.assign("part[blk]", self.convert(acc, p.ty)))
        self.w(depth - 1, "}")

    def open_total(self, p: Phase) -> None:
        pass

    def combine(self, p: Phase, nparts: int) -> None:
        if not nparts:
            return
        acc = p.name
        self.w(2, _for("blk", 0, _c(nparts)))
        if p.op == "sum":
            self.w(3, f"{acc} = st_addi({acc}, part[blk]);" if p.ty == "i64" else f"{acc} += part[blk];")
        else:
            cmp = ">" if p.op == "max" else "<"
            if p.ty in ("f32", "f64"):
                self.w(3, f"if (part[blk] != part[blk] || {acc} != {acc}) {acc} = NAN;")
                self.w(3, f"else {acc} = {acc} {cmp} part[blk] ? {acc} : part[blk];")
            else:
                self.w(3, f"{acc} = {acc} {cmp} part[blk] ? {acc} : part[blk];")
        self.w(2, "}")
        self.w(2, "free(part);")
        self.w(1, "}")


#: rows reduced together by a row kernel in column form (see ``CRenderer._column_row``)
COLUMN_BLOCK = 16


def _column_var(k: Kernel) -> Optional[Var]:
    """The last outer variable of row kernel ``k`` when its rows are better reduced as columns:
    every phase is a float sum/max/min over a variable its reads stride over, while neighbouring
    rows read neighbouring elements (coefficient 1 of the last outer variable), and each row
    stores one value (no store loop, or one of size 1); no row caches. Else None."""
    if k.kind != "row" or not k.outer or k.row_cache or not k.phases:
        return None
    if k.inner is not None and not (type(k.inner.size) is int and k.inner.size == 1):
        return None
    c = k.outer[-1]
    if type(c.size) is int and c.size < COLUMN_BLOCK // 2:
        return None
    strided = False
    for p in k.phases:
        if p.op not in ("sum", "max", "min") or p.ty not in ("f32", "f64"):
            return None
        for e in walk(p.value):
            if e.op != "load":
                continue
            index = e.payload[1]
            if index.coeff(c) not in (0, 1):
                return None
            if index.coeff(c) == 1 and abs(index.coeff(p.var)) not in (0, 1):
                strided = True
            elif index.coeff(p.var) in (1, -1):
                return None   # (a contiguous row: the row form reads it better)
    return c if strided else None


def kernel_source(kernel: Kernel) -> str:
    """The C function of one kernel. A size-generic kernel whose work may be on either side of
    :data:`PARALLEL_THRESHOLD` is written twice, with and without OpenMP threads, behind a
    function that picks one by the work of the call (an OpenMP ``if`` clause would still
    enter the OpenMP runtime for small calls)."""
    if not _straddles(kernel.work):
        return CRenderer(kernel).render()
    par = CRenderer(kernel, True, f"{kernel.name}_par").render()
    ser = CRenderer(kernel, False, f"{kernel.name}_ser").render()
    params, args = _signature(kernel)
    pick = (f"void {kernel.name}({params}) {{\n"
            f"    if ({c_text(kernel.work)} > {PARALLEL_THRESHOLD}) {kernel.name}_par({args});\n"
            f"    else {kernel.name}_ser({args});\n}}")
    return "\n".join([par, ser, pick])


_HEADER = """/* generated by symtrace.lower (C backend) */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
"""


class CCall(NamedTuple):
    """A call an entry point makes into another of symtrace's C libraries, or code of its own
    (:class:`~symtrace.lower.steps.CCallStep`): ``text``, over the entry's parameters, is a C
    expression of type int (0: done; else it refused) or, where it cannot refuse, a statement;
    ``label`` names it in the comment."""

    label: str
    text: str
    refuses: bool = True


def entry_point(name: str, calls, nargs: int, symbols=()) -> str:
    """A C function ``name(void *p0, ..., [int64_t s0, ...,] int nt)`` that calls the kernels
    ``calls`` (pairs of a kernel name and the indices of the parameters it passes on), in order:
    one call from Python runs them all (see :mod:`.wrapper`). ``symbols``: the size symbols of a
    size-generic variant, passed on to every kernel.

    With calls into other libraries among ``calls`` (:class:`CCall`) it returns an int and takes
    ``int start`` last: it makes the calls from index ``start`` on and returns 0, or ``i + 1``
    when the call at index ``i`` refused (the caller runs that one in torch, then calls again
    with ``start = i + 1``)."""
    woq = any(isinstance(c, CCall) for c in calls)
    params = ", ".join([f"void *p{i}" for i in range(nargs)] + [f"int64_t {s}" for s in symbols] + ["int nt"]
                       + (["int start"] if woq else []))
    syms = "".join(f"{s}, " for s in symbols)
    lines, names = [], []
    for i, c in enumerate(calls):
        if isinstance(c, CCall):
            names.append(c.label)
            lines.append(f"    if (start <= {i} && ({c.text}) != 0) return {i + 1};\n" if c.refuses
                         else f"    if (start <= {i}) {{ {c.text} }}\n")
            continue
        k, idx = c
        names.append(k)
        call = f"{k}({''.join(f'p{j}, ' for j in idx)}{syms}nt);"
        lines.append(f"    if (start <= {i}) {call}\n" if woq else f"    {call}\n")
    body = "".join(lines) + ("    return 0;\n" if woq else "")
    return f"/* {', '.join(names)}, in this order */\n{'int' if woq else 'void'} {name}({params}) {{\n{body}}}\n"


def translation_unit(kernels: List[Kernel], prelude: str, entries=()) -> str:
    """The C source of a whole lowered graph: headers, the math prelude, every kernel, then the
    ``entries`` (:class:`~symtrace.lower.wrapper.Entry`: name, calls, number of parameters).

    Kernels take their buffers as pointer arguments, so the layers of a deep model give many
    kernels with the same code (GPT-2: 88 kernels, a few distinct): each distinct body is
    written once and the others forward to it, which keeps the C compiler's time (most of a
    cold compile) proportional to the distinct kernels, not to the depth."""
    units = []
    first_of: Dict[str, str] = {}
    for k in kernels:
        src = kernel_source(k)
        key = _body_key(src, k.name)
        first = first_of.setdefault(key, k.name)
        units.append(src if first == k.name else _forwarder(k, first))
    head = "\n\n".join([_HEADER, prelude, "\n".join(_prototype(k) for k in kernels)])
    # units apart: a large source is compiled in parallel parts (toolchain.UNIT_BREAK; the
    # prototypes let entries and forwarders call kernels of another part)
    return UNIT_BREAK.join([head] + units + [entry_point(*e) for e in entries]) + "\n"


def _signature(kernel: Kernel):
    """A kernel's C parameter list and the argument list that passes them on."""
    nbuf = len(kernel.buffers())
    params = [f"void *p{i}" for i in range(nbuf)] + [f"int64_t {s}" for s in kernel.symbols] + ["int nt"]
    return ", ".join(params), ", ".join([f"p{i}" for i in range(nbuf)] + list(kernel.symbols) + ["nt"])


def _prototype(kernel: Kernel) -> str:
    return f"void {kernel.name}({_signature(kernel)[0]});"


_COMMENT_LINE = re.compile(r"^\s*/\*.*\*/\s*$", re.M)


def _body_key(src: str, name: str) -> str:
    """``src`` without its comment lines (they name the graph's nodes) and with the kernel's own
    name replaced: equal keys, equal code."""
    return re.sub(rf"\b{re.escape(name)}(_par|_ser)?\b", r"KERNEL\1", _COMMENT_LINE.sub("", src))


def _forwarder(kernel: Kernel, to: str) -> str:
    """A kernel whose code equals kernel ``to``'s: a call of it (same parameters)."""
    params, args = _signature(kernel)
    return f"/* {kernel.name}: the code of {to} */\nvoid {kernel.name}({params}) {{ {to}({args}); }}"
