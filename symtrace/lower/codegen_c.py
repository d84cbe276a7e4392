"""C99 + OpenMP code generation for :class:`~symtrace.lower.ir.Kernel`.

One translation unit per lowered graph: the math prelude (``prelude.h``, inlined vectorisable
exp/tanh/erf/... with IEEE NaN/Inf behaviour) followed by one ``void kN(void *p0, ..., int nt)``
per kernel. Outer loops run under ``#pragma omp parallel for`` (serial below
:data:`PARALLEL_THRESHOLD` elements of work), inner loops under ``#pragma omp simd``.
fp16/bf16 are loaded as raw bits, computed in float and rounded once at the store. Reductions
over a row happen inside one thread (so they do not depend on the thread count); a row
kernel's :class:`~symtrace.lower.ir.RowCache` values live in row-long arrays declared in the
parallel loop's body (thread-private, on the stack); full
reductions sum fixed blocks of :data:`BLOCK` elements in the compute type and combine the
block results in double, in order.

The generated C has no undefined behaviour: float -> integer casts go through the prelude's
range-checked ``st_f2i32f``/``st_f2u8``/... (eager's x86-64 results for NaN, +-Inf and
out-of-range values), integer add/sub/mul/neg/abs and integer sums wrap modulo 2^64 through
unsigned arithmetic (``st_addi``, ...) and narrow integer results wrap to their dtype
(``st_wrap_i32``, ...), as torch's do; integer division is never emitted (the lowering divides
in floating point).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from .ir import Affine, Expr, Kernel, Phase, Var, ctype_of, walk, wrap_int, to_f32

__all__ = ["kernel_source", "translation_unit", "PARALLEL_THRESHOLD", "BLOCK"]

PARALLEL_THRESHOLD = 32768
BLOCK = 4096

_CT = {"f32": "float", "f64": "double", "i64": "int64_t", "b": "int"}

_FLOAT_FN = {  # op -> prelude function stem (f32 adds 'f')
    "exp": "st_exp", "log": "st_log", "log1p": "st_log1p", "expm1": "st_expm1", "tanh": "st_tanh",
    "sigmoid": "st_sigmoid", "erf": "st_erf", "sqrt": "st_sqrt", "rsqrt": "st_rsqrt", "relu": "st_relu",
    "gelu_erf": "st_gelu_erf", "gelu_tanh": "st_gelu_tanh", "silu": "st_silu", "floor": "st_floor",
    "ceil": "st_ceil", "round": "st_round", "trunc": "st_trunc", "abs": "st_abs", "sign": "st_sign",
}


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
                          e.op == "load" and e.payload[0].dtype == dtype):
        return x
    return f"{_WRAP[dtype]}({x})" if dtype in _WRAP else x


def _index(a: Affine, names: Dict[int, str]) -> str:
    parts = []
    for v, c in a.terms:
        n = names[id(v)]
        parts.append(n if c == 1 else f"{c}*{n}")
    if a.const or not parts:
        parts.append(str(a.const))
    return "(" + " + ".join(parts) + ")"


class _Emitter:
    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.bufs = kernel.buffers()
        self.bufname = {id(b): f"b{i}" for i, b in enumerate(self.bufs)}
        self.var_names: Dict[int, str] = {}
        self.lines: List[str] = []

    def name_var(self, v: Var, name: str) -> str:
        self.var_names[id(v)] = name
        return name

    def w(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    # -- expressions
    def expr(self, e: Expr, t: Dict[int, str]) -> str:
        a = [t[x.id] for x in e.args]
        op, ty = e.op, e.ty
        if op == "load":
            buf, idx = e.payload
            ref = f"{self.bufname[id(buf)]}[{_index(idx, self.var_names)}]"
            if buf.dtype == torch.float16:
                return f"st_h2f({ref})"
            if buf.dtype == torch.bfloat16:
                return f"st_bf2f({ref})"
            if buf.dtype == torch.bool:
                return f"({ref} != 0)"
            if ty == "i64":
                return f"(int64_t){ref}"
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
                return _f2int(a[0], src, e.payload)
            if src == "b" or ty != src:
                return f"(({_CT[ty]}){a[0]})"
            return a[0]
        if op == "round" and e.payload is not None:  # round to a storage dtype (explicit casts)
            dt = e.payload
            if dt == torch.float16:
                return f"st_h2f(st_f2h((float){a[0]}))" if ty == "f32" else f"(double)st_h2f(st_f2h((float){a[0]}))"
            if dt == torch.bfloat16:
                return f"st_bf2f(st_f2bf((float){a[0]}))" if ty == "f32" else f"(double)st_bf2f(st_f2bf((float){a[0]}))"
            if dt == torch.float32:
                return f"(({_CT[ty]})(float){a[0]})"
            if dt == torch.bool:
                return f"(({_CT[ty]})({a[0]} != 0))"
            if dt in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
                if ty == "i64":
                    return _wrap(a[0], dt, e.args[0])
                if ty in ("f32", "f64"):
                    return f"(({_CT[ty]}){_wrap(_f2int(a[0], ty, dt), dt)})"
                return f"(({_CT[ty]}){a[0]})"
            return a[0]
        if op == "where":
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if len(e.args) == 1:
            return self._unary(op, ty, e.args[0].ty, a[0])
        return self._binary(op, e.args[0].ty, a[0], a[1])

    def _unary(self, op: str, ty: str, src_ty: str, x: str) -> str:
        if op == "not":
            return f"(!{x})"
        if op == "isnan":
            return f"({x} != {x})"
        if op == "neg":
            return f"st_negi({x})" if ty == "i64" else f"(-{x})"
        if op == "reciprocal":
            if ty not in ("f32", "f64"):
                raise TypeError(f"reciprocal on {ty} has no C form")
            return f"({_lit(1.0, ty)} / {x})"
        if ty in ("f32", "f64"):
            if op in ("sin", "cos"):
                return f"{op}{'f' if ty == 'f32' else ''}({x})"
            return f"{_FLOAT_FN[op]}{'f' if ty == 'f32' else ''}({x})"
        # integers / bools
        if op == "abs":
            return f"st_absi({x})" if ty == "i64" else x
        if op == "relu":
            return f"({x} > 0 ? {x} : 0)"
        if op == "sign":
            return f"(({x} > 0) - ({x} < 0))"
        if op in ("floor", "ceil", "round", "trunc"):
            return x
        raise TypeError(f"unary {op} on {ty} has no C form")

    def _binary(self, op: str, ty: str, x: str, y: str) -> str:
        sym = {"add": "+", "sub": "-", "mul": "*", "div": "/", "eq": "==", "ne": "!=", "lt": "<",
               "le": "<=", "gt": ">", "ge": ">=", "and": "&&", "or": "||", "xor": "!="}.get(op)
        if sym is not None:
            if op == "sub" and ty == "b":
                return f"({x} != {y})"
            if op == "add" and ty == "b":
                return f"({x} || {y})"
            if op == "mul" and ty == "b":
                return f"({x} && {y})"
            if ty == "i64" and op in ("add", "sub", "mul"):   # wraps like torch: no signed overflow
                return f"st_{op}i({x}, {y})"
            if op == "div" and ty not in ("f32", "f64"):
                raise TypeError(f"integer division has no C form (the lowering divides in floating point)")
            return f"({x} {sym} {y})"
        if op in ("max", "min"):
            if ty in ("f32", "f64"):
                return f"st_{op}{'f' if ty == 'f32' else ''}({x}, {y})"
            cmp = ">" if op == "max" else "<"
            return f"({x} {cmp} {y} ? {x} : {y})"
        if op == "pow":
            if ty in ("f32", "f64"):
                return f"st_pow{'f' if ty == 'f32' else ''}({x}, {y})"
        raise TypeError(f"binary {op} on {ty} has no C form")

    def dag(self, depth: int, roots: List[Expr], known: Optional[Dict[int, str]] = None) -> Dict[int, str]:
        """Emit every node under ``roots`` as a local constant; return id -> C name. ``known``:
        nodes already available (row-cache reads), not recomputed."""
        t: Dict[int, str] = dict(known or {})
        stop = frozenset(t)
        for root in roots:
            for e in walk(root, stop):
                if e.id in t:
                    continue
                code = self.expr(e, t)
                if e.op in ("const", "acc") or (e.op == "load" and e.payload[0].dtype in (torch.float32, torch.float64)):
                    t[e.id] = code
                else:
                    name = f"t{e.id}"
                    self.w(depth, f"const {_CT[e.ty]} {name} = {code};")
                    t[e.id] = name
        return t

    # -- stores and reductions
    def store(self, depth: int, t: Dict[int, str], kernel: Kernel) -> None:
        for s in kernel.stores:
            v = t[s.value.id]
            dt = s.buffer.dtype
            if dt == torch.float16:
                v = f"st_f2h({v})"
            elif dt == torch.bfloat16:
                v = f"st_f2bf({v})"
            elif dt == torch.bool:
                v = f"(uint8_t)({v} != 0)"
            elif dt not in (torch.float32, torch.float64):   # integers: every conversion defined
                if s.value.ty in ("f32", "f64"):
                    v = _wrap(_f2int(v, s.value.ty, dt), dt)
                elif s.value.ty == "i64":
                    v = _wrap(v, dt, s.value)
                v = f"({ctype_of(dt)}){v}"
            elif s.value.ty not in ("f32", "f64") or (dt == torch.float32) != (s.value.ty == "f32"):
                v = f"({ctype_of(dt)}){v}"
            self.w(depth, f"{self.bufname[id(s.buffer)]}[{_index(s.index, self.var_names)}] = {v};")

    def init_value(self, p: Phase, ty: str) -> str:
        if p.op == "sum":
            return _lit(0, ty)
        big = {"f32": "INFINITY", "f64": "((double)INFINITY)", "i64": "INT64_MAX", "b": "1"}[ty]
        small = {"f32": "(-INFINITY)", "f64": "(-(double)INFINITY)", "i64": "INT64_MIN", "b": "0"}[ty]
        return small if p.op == "max" else big

    def reduction_loop(self, depth: int, p: Phase, acc: str, ty: str, lo: str, hi: str, var: Var) -> None:
        """``acc`` (declared, initialised) op= p.value over var in [lo, hi)."""
        is_float = ty in ("f32", "f64")
        nan = f"{acc}_nan"
        if p.op == "sum":
            clause = f"reduction(+:{acc})"
        else:
            clause = f"reduction({p.op}:{acc})"
            if is_float:
                self.w(depth, f"int {nan} = 0;")
                clause += f" reduction(|:{nan})"
        wrap_sum = p.op == "sum" and ty == "i64"   # int64 sums wrap like torch's: accumulate unsigned
        if wrap_sum:
            self.w(depth, f"uint64_t {acc}_u = 0;")
            clause = f"reduction(+:{acc}_u)"
        self.w(depth, f"#pragma omp simd {clause}")
        name = self.name_var(var, var.name)
        self.w(depth, f"for (int64_t {name} = {lo}; {name} < {hi}; {name}++) {{")
        t = self.dag(depth + 1, [p.value], self.cache_reads(p, name))
        self.cache_writes(depth + 1, p, name, t)
        v = t[p.value.id]
        if wrap_sum:
            self.w(depth + 1, f"{acc}_u += (uint64_t){v};")
        elif p.op == "sum":
            self.w(depth + 1, f"{acc} += {v};")
        else:
            cmp = ">" if p.op == "max" else "<"
            self.w(depth + 1, f"{acc} = {acc} {cmp} {v} ? {acc} : {v};")
            if is_float:
                self.w(depth + 1, f"{nan} |= ({v} != {v});")
        self.w(depth, "}")
        if wrap_sum:
            self.w(depth, f"{acc} = st_addi({acc}, st__u2i64({acc}_u));")
        if p.op != "sum" and is_float:
            self.w(depth, f"if ({nan}) {acc} = NAN;")

    def open_outer(self, outer: List[Var], work: int, parallel: bool = True) -> int:
        names = [self.name_var(v, f"o{k}") for k, v in enumerate(outer)]
        if outer and parallel:
            coll = f" collapse({len(outer)})" if len(outer) > 1 else ""
            self.w(1, f"#pragma omp parallel for{coll} schedule(static) num_threads(nt) if({work} > {PARALLEL_THRESHOLD})")
        for k, (v, n) in enumerate(zip(outer, names)):
            self.w(1 + k, f"for (int64_t {n} = 0; {n} < {v.size}; {n}++) {{")
        return 1 + len(outer)

    def close(self, depth: int, upto: int = 1) -> None:
        for d in range(depth - 1, upto - 1, -1):
            self.w(d, "}")

    # -- kernels
    def emit(self) -> str:
        k = self.kernel
        params = ", ".join([f"void *p{i}" for i in range(len(self.bufs))] + ["int nt"])
        self.w(0, f"/* {k.kind} kernel; nodes: {', '.join(k.nodes) or '-'} */")
        self.w(0, f"void {k.name}({params}) {{")
        written = {id(s.buffer) for s in k.stores}
        for i, b in enumerate(self.bufs):
            const = "" if id(b) in written else "const "
            self.w(1, f"{const}{ctype_of(b.dtype)} *restrict b{i} = ({const}{ctype_of(b.dtype)} *)p{i};")
        self.w(1, "(void)nt;")
        if k.kind == "pointwise":
            self.pointwise()
        elif k.kind == "row":
            self.row()
        else:
            self.full()
        self.w(0, "}")
        return "\n".join(self.lines)

    def pointwise(self) -> None:
        k = self.kernel
        work = k.work
        if k.inner is None:
            depth = self.open_outer(k.outer, work)
            t = self.dag(depth, [s.value for s in k.stores])
            self.store(depth, t, k)
            self.close(depth)
            return
        if not k.outer:
            n = self.name_var(k.inner, "i0")
            self.w(1, f"#pragma omp parallel for simd schedule(static) num_threads(nt) if({work} > {PARALLEL_THRESHOLD})")
            self.w(1, f"for (int64_t {n} = 0; {n} < {k.inner.size}; {n}++) {{")
            t = self.dag(2, [s.value for s in k.stores])
            self.store(2, t, k)
            self.w(1, "}")
            return
        depth = self.open_outer(k.outer, work)
        self.store_loop(depth)
        self.close(depth)

    def store_loop(self, depth: int) -> None:
        """The SIMD inner loop computing and storing the kernel's values."""
        k = self.kernel
        n = self.name_var(k.inner, "i0")
        self.w(depth, "#pragma omp simd")
        self.w(depth, f"for (int64_t {n} = 0; {n} < {k.inner.size}; {n}++) {{")
        t = self.dag(depth + 1, [s.value for s in k.stores], self.cache_reads(None, n))
        self.store(depth + 1, t, k)
        self.w(depth, "}")

    def cache_reads(self, loop: Optional[Phase], var: str) -> Dict[int, str]:
        """Row-cache values the loop of ``loop`` (None: the store loop) reads from scratch."""
        return {e.id: f"{rc.name}[{var}]" for rc in self.kernel.row_cache for lp, e in rc.uses if lp is loop}

    def cache_writes(self, depth: int, p: Phase, var: str, t: Dict[int, str]) -> None:
        for rc in self.kernel.row_cache:
            if rc.phase is p:
                self.w(depth, f"{rc.name}[{var}] = {t[rc.value.id]};")

    def row(self) -> None:
        k = self.kernel
        depth = self.open_outer(k.outer, k.work)
        for rc in k.row_cache:  # thread-private (declared in the parallel loop's body)
            self.w(depth, f"{_CT[rc.value.ty]} {rc.name}[{rc.phase.var.size}];")
        for p in k.phases:
            self.w(depth, f"{_CT[p.ty]} {p.name} = {self.init_value(p, p.ty)};")
            self.reduction_loop(depth, p, p.name, p.ty, "0", str(p.var.size), p.var)
        if k.inner is None:
            t = self.dag(depth, [s.value for s in k.stores])
            self.store(depth, t, k)
        else:
            self.store_loop(depth)
        self.close(depth)

    def full(self) -> None:
        k = self.kernel
        p = k.phases[0]
        block_ty = p.value.ty
        total_ty = p.ty
        outer = k.outer
        n_outer = 1
        for v in outer:
            n_outer *= v.size
        inner = k.inner
        R = inner.size if inner is not None else 1
        nb = (R + BLOCK - 1) // BLOCK
        nparts = n_outer * nb
        self.w(1, f"{_CT[total_ty]} {p.name} = {self.init_value(p, total_ty)};")
        if nparts == 0:
            pass
        elif inner is None:  # 0-d source
            t = self.dag(1, [p.value])
            self.w(1, f"{p.name} = ({_CT[total_ty]}){t[p.value.id]};")
        else:
            self.w(1, "{")
            self.w(2, f"{_CT[total_ty]} *part = ({_CT[total_ty]} *)malloc(sizeof({_CT[total_ty]}) * {nparts});")
            self.w(2, f"#pragma omp parallel for schedule(static) num_threads(nt) if({k.work} > {PARALLEL_THRESHOLD})")
            self.w(2, f"for (int64_t blk = 0; blk < {nparts}; blk++) {{")
            self.w(3, f"int64_t rest = blk / {nb};")
            for j in range(len(outer) - 1, -1, -1):
                name = self.name_var(outer[j], f"o{j}")
                if j:
                    self.w(3, f"const int64_t {name} = rest % {outer[j].size}; rest /= {outer[j].size};")
                else:
                    self.w(3, f"const int64_t {name} = rest;")
            self.w(3, f"const int64_t lo = (blk % {nb}) * {BLOCK};")
            self.w(3, f"const int64_t hi = lo + {BLOCK} < {R} ? lo + {BLOCK} : {R};")
            self.w(3, f"{_CT[block_ty]} bacc = {self.init_value(p, block_ty)};")
            self.reduction_loop(3, p, "bacc", block_ty, "lo", "hi", inner)
            self.w(3, f"part[blk] = ({_CT[total_ty]})bacc;")
            self.w(2, "}")
            self.w(2, f"for (int64_t blk = 0; blk < {nparts}; blk++) {{")
            if p.op == "sum" and total_ty == "i64":
                self.w(3, f"{p.name} = st_addi({p.name}, part[blk]);")
            elif p.op == "sum":
                self.w(3, f"{p.name} += part[blk];")
            else:
                cmp = ">" if p.op == "max" else "<"
                if total_ty in ("f32", "f64"):
                    self.w(3, f"if (part[blk] != part[blk] || {p.name} != {p.name}) {p.name} = NAN;")
                    self.w(3, f"else {p.name} = {p.name} {cmp} part[blk] ? {p.name} : part[blk];")
                else:
                    self.w(3, f"{p.name} = {p.name} {cmp} part[blk] ? {p.name} : part[blk];")
            self.w(2, "}")
            self.w(2, "free(part);")
            self.w(1, "}")
        t = self.dag(1, [s.value for s in k.stores])
        self.store(1, t, k)


def kernel_source(kernel: Kernel) -> str:
    """The C function of one kernel."""
    return _Emitter(kernel).emit()


_HEADER = """/* generated by symtrace.lower (C backend) */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
"""


def translation_unit(kernels: List[Kernel], prelude: str) -> str:
    """The C source of a whole lowered graph: headers, the math prelude, every kernel."""
    return "\n\n".join([_HEADER, prelude] + [kernel_source(k) for k in kernels]) + "\n"
