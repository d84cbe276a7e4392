"""Forming kernels: store one lazy value into a buffer with as much fused into it as is legal.

:func:`build_kernel` reads the value at symbolic loop indices; producers inline themselves
(pointwise chains, prologues). A :class:`~symtrace.lower.values.RowReduce` read at the
kernel's own outer indices becomes a reduction *phase* of the same kernel (row epilogues:
softmax, layernorm); read anywhere else it raises
:class:`~symtrace.lower.values.NeedsMaterialize` and the caller stores it first. A kernel is
tried with its last dimension as the inner (row) loop, then, if a reduction result is stored
per row, with all dimensions as outer loops.

:func:`collapse` then drops size-1 loops and merges adjacent loops that every access walks
contiguously (as TensorIterator does), so a contiguous pointwise kernel is one flat loop.

:func:`plan_row_cache` finds, in a row kernel, costly per-element values that an earlier loop
computes and a later loop needs again (softmax: ``exp(x - max)`` in the sum phase and in the
store loop) and records them as :class:`~symtrace.lower.ir.RowCache` entries: computed once,
kept in a row-long scratch array, read back by the later loops.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .ir import (Affine, Expr, ExprBuilder, Kernel, Phase, RowCache, Store, Var, _payload_key, compute_type,
                 op_cost, walk)
from .values import BufferValue, FullReduce, LValue, NeedsMaterialize, RowReduce

__all__ = ["KernelBuild", "build_kernel", "collapse", "plan_row_cache", "ROW_CACHE_BYTES", "ROW_CACHE_MIN_COST"]

#: most scratch bytes one row kernel keeps per thread for :class:`~symtrace.lower.ir.RowCache`
#: values (the C backend keeps them on the stack; longer rows recompute)
ROW_CACHE_BYTES = 64 * 1024
#: least cost (ir.op_cost units: 4 per transcendental or pow, 1 per arithmetic op, counting only the
#: ops that vary along the row) of a value worth a scratch store and load instead of recomputing
ROW_CACHE_MIN_COST = 4


class _WrongMode(Exception):
    pass


def acc_type(op: str, ty: str) -> str:
    """Accumulator type of a reduction of values of compute type ``ty``."""
    if ty == "b":
        return "i64" if op == "sum" else "b"
    return ty


class KernelBuild:
    """State while one kernel's expressions are built: the expression builder, a memo of
    (value, index) reads, the reduction phases found so far and the graph nodes fused in."""

    def __init__(self, materialized: Dict[int, BufferValue], row_outer: Optional[List[Var]],
                 store_vars: Optional[List[Var]] = None):
        self.eb = ExprBuilder()
        self.materialized = materialized
        self.row_outer = row_outer
        self.store_vars = store_vars
        self.phases: List[Phase] = []
        self._phase_of: Dict[int, Phase] = {}
        self._memo: Dict[tuple, Expr] = {}
        self.nodes: Dict[str, None] = {}

    def read(self, value: LValue, idx: Tuple[Affine, ...]) -> Expr:
        bv = self.materialized.get(id(value))
        if bv is not None:
            value = bv
        key = (id(value), idx)
        e = self._memo.get(key)
        if e is None:
            e = value.read(self, idx)
            if not isinstance(value, BufferValue):
                if value.held_in_dtype and e.op not in ("load", "round") and e.ty in ("f32", "f64", "i64"):
                    # a node's computed fp16/bf16 result is held in its dtype by eager: round
                    # (and overflow to Inf) where it is read (a rule's internal values are not);
                    # an int8/uint8/int16/int32 result (computed in int64) wraps to its dtype
                    e = self.eb.round_to(e, value.dtype)
                for n in value.nodes:
                    self.nodes[n] = None
            self._memo[key] = e
        return e

    def row_ref(self, r: RowReduce, outer_idx: Tuple[Affine, ...]) -> Expr:
        ro = self.row_outer
        if ro is None or len(outer_idx) != len(ro) or not all(a.is_var(v) for a, v in zip(outer_idx, ro)):
            sv = self.store_vars
            if sv is not None and len(outer_idx) == len(sv) and all(a.is_var(v) for a, v in zip(outer_idx, sv)):
                raise _WrongMode()
            raise NeedsMaterialize(r)
        ph = self._phase_of.get(id(r))
        if ph is None:
            var = Var(f"r{len(self.phases)}", r.length)
            body = self.read(r.src, tuple(outer_idx) + (Affine.of(var),))
            ty = acc_type(r.op, body.ty)
            ph = Phase(f"acc{len(self.phases)}", r.op, var, self.eb.cast(body, ty), ty)
            self.phases.append(ph)
            self._phase_of[id(r)] = ph
            for n in r.nodes:
                self.nodes[n] = None
        e = self.eb.acc(ph)
        out_ty = compute_type(r.dtype)
        if r.divisor is not None:
            fty = out_ty if out_ty in ("f32", "f64") else "f64"
            e = self.eb.binary("div", self.eb.cast(e, fty), self.eb.const(r.divisor, fty))
        return self.eb.cast(e, out_ty)


def _store_index(target: BufferValue, vars_: List[Var]) -> Affine:
    index = Affine(target.offset)
    for v, s in zip(vars_, target.strides):
        if s:
            index = index + Affine.of(v).scale(s)
    return index


def build_kernel(value: LValue, target: BufferValue, name: str,
                 materialized: Dict[int, BufferValue]) -> Kernel:
    """The kernel storing ``value`` into ``target``. Raises ``NeedsMaterialize`` when a value
    it reads must be stored by another kernel first."""
    if isinstance(value, FullReduce):
        return _build_full(value, target, name, materialized)
    vars_ = [Var(f"i{k}", s) for k, s in enumerate(value.shape)]
    idx = tuple(Affine.of(v) for v in vars_)
    out_ty = compute_type(target.dtype)
    modes = ("inner", "outer") if vars_ else ("outer",)
    for mode in modes:
        if mode == "inner":
            kb = KernelBuild(materialized, vars_[:-1], store_vars=vars_)
        else:
            kb = KernelBuild(materialized, vars_)
        try:
            e = kb.read(value, idx)
        except _WrongMode:
            continue
        store = Store(target.buffer, _store_index(target, vars_), kb.eb.cast(e, out_ty))
        outer, inner = (vars_[:-1], vars_[-1]) if mode == "inner" else (vars_, None)
        kind = "row" if kb.phases else "pointwise"
        if kind == "pointwise" and inner is None and outer:
            outer, inner = outer[:-1], outer[-1]
        return plan_row_cache(Kernel(name, kind, list(outer), inner, kb.phases, [store], list(kb.nodes)))
    raise AssertionError("unreachable: the 'outer' mode never raises _WrongMode")


def _build_full(value: FullReduce, target: BufferValue, name: str, materialized) -> Kernel:
    src = value.src
    vars_ = [Var(f"i{k}", s) for k, s in enumerate(src.shape)]
    kb = KernelBuild(materialized, None)
    body = kb.read(src, tuple(Affine.of(v) for v in vars_))
    for n in value.nodes:
        kb.nodes[n] = None
    ty = acc_type(value.op, body.ty)
    total_ty = "f64" if (ty == "f32" and value.op == "sum") else ty
    ph = Phase("acc0", value.op, vars_[-1] if vars_ else Var("i0", 1), kb.eb.cast(body, ty), total_ty)
    e = kb.eb.acc(ph)
    out_ty = compute_type(value.dtype)
    if value.divisor is not None:
        fty = "f64"
        e = kb.eb.binary("div", kb.eb.cast(e, fty), kb.eb.const(value.divisor, fty))
    store = Store(target.buffer, Affine(target.offset), kb.eb.cast(e, out_ty))
    outer = vars_[:-1]
    return Kernel(name, "full", outer, vars_[-1] if vars_ else None, [ph], [store], list(kb.nodes))


# --------------------------------------------------------------------------- row caches

_WIDTH = {"f32": 4, "f64": 8, "i64": 8}


def _index_key(a: Affine, var: Var) -> tuple:
    """An index with the loop variable ``var`` written as a placeholder."""
    return (a.const, tuple((("row",) if v is var else ("var", id(v)), c) for v, c in a.terms))


def _row_keys(roots: List[Expr], var: Var) -> Tuple[Dict[int, object], set]:
    """Structural keys of the nodes under ``roots`` with the loop variable ``var`` written as a
    placeholder (so the same element-wise expression gets the same key in two loops), and the
    ids of the nodes that vary along ``var``."""
    keys: Dict[int, object] = {}
    dep: set = set()
    for root in roots:
        for e in walk(root):
            if e.id in keys:
                continue
            if e.op == "load":   # (a masked load: its mask, other value and safe index are part of it)
                buf, *indices = e.payload
                keys[e.id] = ("load", id(buf), tuple(_index_key(a, var) for a in indices),
                              tuple(keys[a.id] for a in e.args))
                if any(a.coeff(var) for a in indices) or any(a.id in dep for a in e.args):
                    dep.add(e.id)
            elif e.op == "inrange":
                idx, lo, hi = e.payload
                keys[e.id] = ("inrange", _index_key(idx, var), lo, hi)
                if idx.coeff(var):
                    dep.add(e.id)
            elif e.op == "acc":
                keys[e.id] = ("acc", id(e.payload))
            else:
                keys[e.id] = (e.op, e.ty, _payload_key(e.payload), tuple(keys[a.id] for a in e.args))
                if any(a.id in dep for a in e.args):
                    dep.add(e.id)
    return keys, dep


def plan_row_cache(kernel: Kernel) -> Kernel:
    """Fill ``kernel.row_cache`` (row kernels; others are returned unchanged).

    Loops are the phases in order, then the store loop. Searching each loop's expressions from
    the top, a node that varies along the row, costs at least :data:`ROW_CACHE_MIN_COST` and is
    computed (as the same element-wise expression) by an earlier loop of the same length is read
    from that loop's scratch instead; the earliest such loop produces it. Scratch is limited to
    :data:`ROW_CACHE_BYTES` per kernel. Results are bit-identical to recomputing."""
    if kernel.kind != "row" or not kernel.phases:
        return kernel
    loops: List[Tuple[Optional[Phase], Var, List[Expr]]] = [(p, p.var, [p.value]) for p in kernel.phases]
    if kernel.inner is not None:
        loops.append((None, kernel.inner, [s.value for s in kernel.stores]))
    computed: List[Dict[object, Expr]] = []   # per loop: key -> node that loop really computes
    caches: Dict[Tuple[int, object], RowCache] = {}
    budget = ROW_CACHE_BYTES
    for j, (loop, var, roots) in enumerate(loops):
        keys, dep = _row_keys(roots, var)
        reads: set = set()
        stack = list(roots)
        seen: set = set()
        while stack:
            e = stack.pop()
            if e.id in seen or e.id not in dep:
                continue
            seen.add(e.id)
            src = next((i for i in range(j) if loops[i][1].size == var.size and keys[e.id] in computed[i]), None)
            # (a row of symbolic length recomputes: its scratch size is not known when compiling)
            if src is not None and isinstance(var.size, int) and var.size > 0 and e.ty in _WIDTH and op_cost(e, only=dep) >= ROW_CACHE_MIN_COST:
                rc = caches.get((src, keys[e.id]))
                nbytes = var.size * _WIDTH[e.ty]
                if rc is None and nbytes <= budget:
                    budget -= nbytes
                    rc = RowCache(f"sc{len(caches)}", loops[src][0], computed[src][keys[e.id]], [])
                    caches[(src, keys[e.id])] = rc
                if rc is not None:
                    rc.uses.append((loop, e))
                    reads.add(e.id)
                    continue
            stack.extend(e.args)
        table: Dict[object, Expr] = {}
        for root in roots:
            for e in walk(root, stop=reads):
                if e.id in dep and e.id not in reads:
                    table.setdefault(keys[e.id], e)
        computed.append(table)
    kernel.row_cache = list(caches.values())
    return kernel


# --------------------------------------------------------------------------- loop collapsing


def _indices(kernel: Kernel) -> List[Affine]:
    out = [s.index for s in kernel.stores]
    for root in [p.value for p in kernel.phases] + [s.value for s in kernel.stores]:
        for e in walk(root):
            if e.op == "load":
                out.extend(e.payload[1:])   # (a masked load's safe index is an access too)
            elif e.op == "inrange":   # (a bound on one loop's index keeps that loop apart)
                out.append(e.payload[0])
    return out


def collapse(kernel: Kernel) -> Kernel:
    """Drop size-1 loops and merge adjacent loops that all accesses walk contiguously."""
    if kernel.kind == "row":
        dims = list(kernel.outer)
    else:
        dims = list(kernel.outer) + ([kernel.inner] if kernel.inner is not None else [])
    if not dims:
        return kernel
    indices = _indices(kernel)
    keep = [v for v in dims if v.size != 1]
    groups: List[List[Var]] = []
    for v in keep:
        if groups:
            prev = groups[-1][-1]
            if all(a.coeff(prev) == a.coeff(v) * v.size for a in indices):
                groups[-1].append(v)
                continue
        groups.append([v])
    if len(groups) == len(dims):
        return kernel  # nothing to do
    new_vars: List[Var] = []
    plan: Dict[Var, Optional[Tuple[Var, bool]]] = {v: None for v in dims if v.size == 1}
    for k, g in enumerate(groups):
        size = 1
        for v in g:
            size *= v.size
        u = Var(f"i{k}", size)
        new_vars.append(u)
        for v in g:
            plan[v] = (u, v is g[-1])

    def remap(a: Affine) -> Affine:
        terms = []
        for v, c in a.terms:
            if v in plan:
                p = plan[v]
                if p is not None and p[1]:
                    terms.append((p[0], c))
            else:
                terms.append((v, c))
        return Affine(a.const, terms)

    phases, stores, caches = _rebuild(kernel, remap)
    if kernel.kind == "row":
        outer, inner = new_vars, kernel.inner
    else:
        outer, inner = new_vars[:-1], new_vars[-1] if new_vars else None
    return Kernel(kernel.name, kernel.kind, outer, inner, phases, stores, kernel.nodes, caches, kernel.symbols)


def _rebuild(kernel: Kernel, remap) -> Tuple[List[Phase], List[Store], List[RowCache]]:
    eb = ExprBuilder()
    new_of: Dict[int, Expr] = {}
    phase_map: Dict[int, Phase] = {}

    def conv(root: Expr) -> Expr:
        for e in walk(root):
            if e.id in new_of:
                continue
            if e.op == "load":
                buf, idx = e.payload[:2]
                n = eb.load(buf, remap(idx), *(new_of[a.id] for a in e.args), *(remap(a) for a in e.payload[2:]))
            elif e.op == "inrange":
                a, lo, hi = e.payload
                n = eb.in_range(remap(a), lo, hi)
            elif e.op == "const":
                n = eb.const(e.payload, e.ty)
            elif e.op == "acc":
                n = eb.acc(phase_map[id(e.payload)])
            else:
                n = eb._make(e.op, e.ty, tuple(new_of[a.id] for a in e.args), e.payload)
            new_of[e.id] = n
        return new_of[root.id]

    phases = []
    for p in kernel.phases:
        np_ = Phase(p.name, p.op, p.var, conv(p.value), p.ty, p.scale)
        phase_map[id(p)] = np_
        phases.append(np_)
    stores = [Store(s.buffer, remap(s.index), conv(s.value)) for s in kernel.stores]
    caches = [RowCache(rc.name, phase_map[id(rc.phase)], conv(rc.value),
                       [(None if lp is None else phase_map[id(lp)], conv(e)) for lp, e in rc.uses])
              for rc in kernel.row_cache]
    return phases, stores, caches
