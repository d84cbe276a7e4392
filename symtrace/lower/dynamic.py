"""Size-generic lowering: which dimensions are symbolic, and the graph's metadata over them.

A *generic* variant is lowered once for a *shape class*: the same ranks, dtypes, devices,
layouts and Python-valued inputs, with some input dimensions symbolic (``s0``, ``s1``: a
:class:`~symtrace.graph.symbols.Sym` each, sizes seen equal at every observation share one
symbol). Its kernels take the symbols' values as arguments and its wrapper binds them from the
inputs' shapes (see :mod:`.wrapper`).

:func:`symbolic_record` gives every node's metadata as expressions over the symbols. It runs
the graph (as :func:`~symtrace.lower.lowering.record` does) at the observed sizes and at a few
*probe* sizes, and fits each size, stride and Python int to a polynomial of degree <= 2 in the
symbols (exact rational solve; integer coefficients required), verified on the samples not
used to solve. A value that is not such a polynomial (a strided convolution's
``(s - 1)//2 + 1``) takes the expression the IR's symbolic run derived for that node
(:func:`~symtrace.graph.symbolic_shapes.symbolic_metadata`: torch's ShapeEnv over fake tensors,
run once, on a copy of the graph, only when needed) that equals the recorded value at every
sample. Anything else refuses (:class:`NotGeneric`) and the caller compiles per shape:

* graphs whose result metadata is not a function of the inputs' metadata (record-uncacheable:
  data-dependent shapes, ``.item()``, user functions);
* a size that is neither (the IR's run failed, or derived another expression);
* a non-integer Python value computed from a symbolic size (a float scale ``T ** -0.5``), or
  any Python value that differs between samples and is not an int;
* an input whose layout the probes cannot reproduce (a slice with gaps).

Sizes 0 and 1 are never symbolic by default (``Sym`` ranges start at 2): broadcasting, empty
tensors and squeezes behave differently there, so such a call gets a static variant.
"""
from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..graph.node import Node, TensorMeta
from ..graph.symbols import INF, SizeExpr, Sym, sym

__all__ = ["NotGeneric", "symbolic_record", "changed_dims", "all_dims", "shape_class", "PROBES"]

#: probe sizes (small, distinct primes: cheap to run, unlikely to coincide with real sizes)
PROBES = (7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47)


class NotGeneric(Exception):
    """The graph cannot get a size-generic variant for these dimensions (the message says why)."""


def shape_class(args) -> Optional[tuple]:
    """What a call must share with another to be served by one generic variant: per tensor its
    rank, dtype, device and stride order (with broadcast dims), per other input its value.
    None for inputs that cannot be compared (unhashable)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(("t", a.dim(), a.dtype, a.device.type, _layout_key(a)))
        else:
            try:
                hash(a)
            except TypeError:
                return None
            out.append(("py", type(a), a))
    return tuple(out)


def _layout_key(t: torch.Tensor) -> tuple:
    st = t.stride()
    return tuple(sorted(range(t.dim()), key=lambda d: (-st[d], d))) + tuple(s == 0 for s in st)


def changed_dims(old_shapes: Sequence[Optional[tuple]], args) -> Dict[Tuple[int, int], str]:
    """``{(input position, dim): symbol name}`` for the dims of ``args`` whose size differs from
    ``old_shapes`` (the compiled variant's input shapes), except where the new size is 0 or 1;
    dims whose sizes are equal in both calls share a symbol (duck sizing)."""
    out: Dict[Tuple[int, int], str] = {}
    names: Dict[Tuple[int, int], str] = {}
    for pos, (old, a) in enumerate(zip(old_shapes, args)):
        if old is None or not isinstance(a, torch.Tensor):
            continue
        for d, (o, n) in enumerate(zip(old, a.shape)):
            if o != n and n >= 2:
                key = (o, n)
                if key not in names:
                    names[key] = f"s{len(names)}"
                out[(pos, d)] = names[key]
    return out


# --------------------------------------------------------------------------- probing


def _like(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Zeros of ``shape`` laid out as ``t`` is (contiguous, a permutation of it, expanded)."""
    st = t.stride()
    if any(s == 0 and n > 1 for s, n in zip(st, t.shape)):
        base_shape = [1 if s == 0 and n > 1 else m for s, n, m in zip(st, t.shape, shape)]
        base = t.as_strided([1 if s == 0 and n > 1 else n for s, n in zip(st, t.shape)],
                            [0 if s == 0 and n > 1 else s for s, n in zip(st, t.shape)])
        return _like(base, base_shape).expand(*shape)
    order = sorted(range(t.dim()), key=lambda d: (-st[d], d))
    expect = 1
    for d in reversed(order):
        if t.shape[d] != 1 and st[d] != expect:
            raise NotGeneric("an input's layout (a slice with gaps, overlapping strides) cannot be reproduced "
                             "at other sizes")
        expect *= max(t.shape[d], 1)
    dense = torch.zeros([shape[d] for d in order], dtype=t.dtype, device=t.device)
    inv = [order.index(d) for d in range(t.dim())]
    return dense.permute(inv)


def _probe_envs(syms: Sequence[Sym], taken: Sequence[Dict[str, int]], count: int,
                attempt: int = 0) -> List[Dict[str, int]]:
    """``count`` assignments of the symbols, each within its range, differing from the
    ``taken`` ones; several symbols get unrelated values (``attempt`` > 0: a reshuffled choice,
    for when the first design does not determine the fit)."""
    pools = []
    for k, s in enumerate(syms):
        hi = s.hi if s.hi != INF else 10 ** 9
        used = {env[s.name] for env in taken}
        pool = [p for p in PROBES if s.lo <= p <= hi and p not in used]
        pool += [v for v in range(s.lo, int(min(hi, s.lo + 64)) + 1) if v not in pool and v not in used]
        if len(pool) < count:
            raise NotGeneric(f"the range of {s.name} ({s.lo}..{s.hi}) is too small to probe")
        pools.append(pool)
    if attempt:
        import random
        rng = random.Random(attempt)
        pools = [rng.sample(pool, len(pool)) for pool in pools]
    return [{s.name: pools[k][(i * (k + 1) + k) % len(pools[k])] for k, s in enumerate(syms)}
            for i in range(count)]


def _monomials(names: Sequence[str]) -> List[Tuple[str, ...]]:
    out: List[Tuple[str, ...]] = [()]
    out += [(n,) for n in names]
    out += list(itertools.combinations_with_replacement(names, 2))
    return out


def _solve(rows: List[List[Fraction]], rhs: List[Fraction]) -> Optional[List[Fraction]]:
    """Gaussian elimination over the rationals; None if singular."""
    n = len(rows)
    a = [r[:] + [b] for r, b in zip(rows, rhs)]
    for c in range(n):
        p = next((r for r in range(c, n) if a[r][c] != 0), None)
        if p is None:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(n):
            if r != c and a[r][c] != 0:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c])]
    return [a[i][n] / a[i][i] for i in range(n)]


class _Fitter:
    def __init__(self, syms: Sequence[Sym], envs: Sequence[Dict[str, int]]):
        self.syms = {s.name: s for s in syms}
        self.envs = envs
        self.monos = _monomials([s.name for s in syms])
        m = len(self.monos)
        self.rows = [[Fraction(_mono_value(mono, env)) for mono in self.monos] for env in envs]
        self.m = m
        self._inverse_cache: Dict[tuple, Any] = {}
        if _solve(self.rows[:m], [Fraction(0)] * m) is None:
            raise NotGeneric("the probe sizes do not determine the size expressions")

    def fit(self, values: Sequence[int], node: Optional[Node] = None):
        """The int or SizeExpr taking ``values`` at the sample assignments: a polynomial of
        degree <= 2, else one of the expressions torch's symbolic run derived for ``node``
        (:attr:`hints`: floor divisions of strided convolutions and pooling) that takes
        exactly ``values`` at every sample."""
        try:
            return self._fit_polynomial(values)
        except NotGeneric:
            for cand in (self.hints(node) if node is not None and self.hints is not None else ()):
                if all((cand.evaluate(env) if isinstance(cand, SizeExpr) else cand) == v
                       for env, v in zip(self.envs, values)):
                    return cand
            raise

    def fit_where(self, values: Sequence[int], keep: Sequence[bool], node: Node):
        """:meth:`fit` where only the samples marked in ``keep`` must agree: a constant, or
        one of the IR's expressions for ``node``."""
        kept = [v for v, k in zip(values, keep) if k]
        if all(v == kept[0] for v in kept):
            return kept[0]
        for cand in (self.hints(node) if self.hints is not None else ()):
            if all((cand.evaluate(env) if isinstance(cand, SizeExpr) else cand) == v
                   for env, v, k in zip(self.envs, values, keep) if k):
                return cand
        raise NotGeneric(f"a stride taking the values {list(values)} (any value where its size is 1) is not "
                         "an expression of the symbols")

    #: ``hints(node)``: candidate SizeExprs for ``node`` (set by :func:`symbolic_record`)
    hints: Optional[Callable[[Node], List[Any]]] = None

    def _fit_polynomial(self, values: Sequence[int]):
        if all(v == values[0] for v in values):
            return values[0]
        coefs = _solve(self.rows[:self.m], [Fraction(v) for v in values[:self.m]])
        if coefs is None or any(c.denominator != 1 for c in coefs):
            raise NotGeneric(f"a size taking the values {list(values)} is not a polynomial of the symbols")
        expr: Any = 0
        for mono, c in zip(self.monos, coefs):
            if c:
                term: Any = int(c)
                for name in mono:
                    s = self.syms[name]
                    term = term * sym(s.name, s.lo, s.hi)
                expr = expr + term
        for env, v in zip(self.envs[self.m:], values[self.m:]):
            got = expr.evaluate(env) if isinstance(expr, SizeExpr) else expr
            if got != v:
                raise NotGeneric(f"a size taking the values {list(values)} is not a polynomial of degree <= 2 "
                                 "of the symbols")
        return expr


def _mono_value(mono: Tuple[str, ...], env: Mapping[str, int]) -> int:
    v = 1
    for n in mono:
        v *= env[n]
    return v


def symbolic_record(gm, inputs: tuple, dims: Mapping[Tuple[int, int], Sym], cache: bool = True,
                    known: Sequence[Tuple[Sequence[Optional[tuple]], Dict[Node, Any]]] = (),
                    record=None) -> Dict[Node, Any]:
    """Every node's value description (as :func:`~symtrace.lower.lowering.record` gives it)
    with sizes, strides and Python ints as expressions over the symbols of ``dims``
    (``{(input position, dim): Sym}``); ``inputs`` are real inputs of the class (their sizes
    are one sample). ``known``: records made already for inputs of the same class (input
    shapes, record), e.g. a static variant's, used as samples instead of running the graph
    again. ``record(gm, inputs, cache)``: the recorder (:func:`~symtrace.lower.lowering.record`;
    default: run the graph). Raises :class:`NotGeneric` (see the module doc)."""
    from .record_cache import shape_deterministic
    if record is None:
        from .recorder import _record_real
        record = (lambda gm_, inputs_, cache_: _record_real(gm_, inputs_))
    why = shape_deterministic(gm, inputs)
    if why is not None:
        raise NotGeneric(f"the graph's shapes may not be a function of its inputs' shapes ({why}: data-dependent "
                         "ops, .item(), user functions, hooks or modules without lowering rules)")
    syms: Dict[str, Sym] = {}
    observed: Dict[str, int] = {}
    for (pos, d), s in dims.items():
        x = inputs[pos]
        if not isinstance(x, torch.Tensor) or not 0 <= d < x.dim():
            raise NotGeneric(f"input {pos} has no dimension {d}")
        n = int(x.shape[d])
        if observed.setdefault(s.name, n) != n:
            raise NotGeneric(f"dimensions declared equal ({s.name}) have different sizes")
        if not s.lo <= n <= s.hi:
            hint = (" (a declared minimum of 0 is served from 1 up by the generic variant and size 0 by a static "
                    "one: pass example inputs with a size of at least 1 there)" if n == 0 else "")
            raise NotGeneric(f"size {n} is outside the range of {s.name} ({s.lo}..{s.hi}){hint}")
        syms[s.name] = s
    order = list(syms.values())
    m = len(_monomials([s.name for s in order]))
    known_envs, known_recs = [], []
    for shapes, rec in known:
        env = _env_of(shapes, dims)
        if env is not None and env != observed and env not in known_envs:
            known_envs.append(env)
            known_recs.append(rec)
    # m samples to solve with and one to check: the known records, this call, probes
    for attempt in range(8):
        envs = _probe_envs(order, known_envs + [observed], max(m - len(known_envs), 1), attempt)
        all_envs = known_envs + envs + [observed]
        try:
            fitter = _Fitter(order, all_envs)
            break
        except NotGeneric:
            if attempt == 7:
                raise
    samples = [_probe_inputs(inputs, dims, env) for env in envs] + [inputs]
    recs = list(known_recs)
    for s, env in zip(samples, envs + [observed]):
        try:
            recs.append(record(gm, s, cache))
        except Exception as e:   # e.g. a weight fixes a dim the probe changed
            sizes = ", ".join(f"{k}={v}" for k, v in env.items())
            raise NotGeneric(f"the graph fails at other sizes ({sizes}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    # (the IR's run with each symbol at its largest sample: a size that becomes 1 inside the
    # graph would make torch pin the symbol there)
    big = {s.name: max(env[s.name] for env in all_envs) for s in order}
    fitter.hints = _ir_hints(gm, _probe_inputs(inputs, dims, big), dims)
    return _merge(gm, recs, fitter)


def _ir_hints(gm, inputs: tuple, dims: Mapping[Tuple[int, int], Sym]) -> Callable[[Node], List[Any]]:
    """``hints(node)``: the symbolic sizes, strides and Python ints the IR's symbolic run
    (:func:`~symtrace.graph.symbolic_shapes.symbolic_metadata`, torch's ShapeEnv over fake
    tensors: exact floor divisions) gives ``node``, computed once, on a copy of the graph, the
    first time a size is not a polynomial. Nothing when that run fails."""
    cache: Optional[Dict[str, List[Any]]] = None

    def run() -> Dict[str, List[Any]]:
        import copy
        from ..graph.symbolic_shapes import symbolic_input_meta, symbolic_metadata
        try:
            graph = copy.deepcopy(gm.graph)
            per_input: Dict[int, Dict[int, Sym]] = {}
            for (pos, d), s in dims.items():
                per_input.setdefault(pos, {})[d] = s
            for pos, n in enumerate(n for n in graph.nodes if n.op == "placeholder"):
                t = inputs[pos] if pos < len(inputs) else None
                if isinstance(t, torch.Tensor):
                    n.meta["tensor_meta"] = (symbolic_input_meta(t, per_input[pos], f"input {n.name!r}")
                                             if pos in per_input else TensorMeta.of(t))
            symbolic_metadata(gm, graph, tuple(inputs))
        except Exception:   # (data-dependent ops, a pinned symbol, ...): polynomials only
            return {}
        found: Dict[str, List[Any]] = {}
        for n in graph.nodes:
            metas = n.meta.get("tensor_meta")
            size = n.meta.get("size")
            exprs = [x for m in (metas if isinstance(metas, tuple) else (metas,)) if isinstance(m, TensorMeta)
                     for x in tuple(m.shape) + tuple(m.stride)]
            exprs += list(size) if isinstance(size, tuple) else [size]
            exprs = [x for x in exprs if isinstance(x, SizeExpr)]
            if exprs:
                found[n.name] = exprs
        return found

    def hints(node: Node) -> List[Any]:
        nonlocal cache
        if cache is None:
            cache = run()
        return cache.get(node.name, [])
    return hints


def _env_of(shapes, dims) -> Optional[Dict[str, int]]:
    env: Dict[str, int] = {}
    for (pos, d), s in dims.items():
        shape = shapes[pos] if pos < len(shapes) else None
        if shape is None or d >= len(shape) or env.setdefault(s.name, shape[d]) != shape[d]:
            return None
        if not s.lo <= shape[d] <= s.hi:
            return None
    return env


def _probe_inputs(inputs, dims, env) -> tuple:
    out = []
    for pos, x in enumerate(inputs):
        mine = {d: env[s.name] for (p, d), s in dims.items() if p == pos}
        if not mine or not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        shape = [mine.get(d, n) for d, n in enumerate(x.shape)]
        out.append(_like(x, shape))
    return tuple(out)


def _merge(gm, recs: List[Dict[Node, Any]], fitter: _Fitter) -> Dict[Node, Any]:
    out: Dict[Node, Any] = {}
    varying: set = set()
    for node in gm.graph.nodes:
        descs = [r.get(node) for r in recs]
        first = descs[0]
        if isinstance(first, tuple) and len(first) == 2 and first[0] == "py" and \
                not isinstance(first[1], (int, tuple, list, torch.Size)) or isinstance(first, tuple) and \
                len(first) == 2 and first[0] == "py" and isinstance(first[1], bool):
            if any(i in varying for i in node.all_input_nodes):
                # a decision (bool, float, ...) computed from a symbolic size: the samples cannot
                # show that it holds for every size
                raise NotGeneric(f"{node.name}: a Python value ({first[1]!r}) is computed from a symbolic size")
        out[node] = _merge_desc(node, descs, fitter)
        if any(d != first for d in descs):
            varying.add(node)
    return out


def _merge_desc(node, descs, fitter):
    first = descs[0]
    if isinstance(first, TensorMeta):
        return _merge_meta(node, descs, fitter)
    if isinstance(first, tuple) and first and isinstance(first[0], TensorMeta):
        if not all(isinstance(d, tuple) and len(d) == len(first) for d in descs):
            raise NotGeneric(f"{node.name}: its result's structure depends on the sizes")
        return tuple(_merge_meta(node, [d[i] for d in descs], fitter) for i in range(len(first)))
    if isinstance(first, tuple) and len(first) == 2 and first[0] == "py":
        return ("py", _merge_py(node, [d[1] for d in descs], fitter))
    if all(d == first for d in descs):
        return first
    raise NotGeneric(f"{node.name}: its value depends on the sizes")


def _merge_meta(node, metas, fitter) -> TensorMeta:
    first = metas[0]
    if not all(isinstance(m, TensorMeta) and len(m.shape) == len(first.shape) and m.dtype == first.dtype
               and m.device == first.device and len(m.stride) == len(first.stride) for m in metas):
        raise NotGeneric(f"{node.name}: its rank, dtype or device depends on the sizes")
    shape = tuple(fitter.fit([m.shape[i] for m in metas], node) for i in range(len(first.shape)))
    stride = tuple(_fit_stride(fitter, node, metas, i) for i in range(len(first.stride)))
    import dataclasses
    return dataclasses.replace(first, shape=shape, stride=stride)


def _fit_stride(fitter, node, metas, i):
    """Stride ``i`` over the samples. Where dimension ``i`` has size 1 at a sample its stride
    never moves an index (torch may give it any value there), so only the other samples must
    agree: with a polynomial fitted without them, or with one of the IR's expressions."""
    values = [m.stride[i] for m in metas]
    try:
        return fitter.fit(values, node)
    except NotGeneric:
        keep = [m.shape[i] != 1 for m in metas]
        if all(keep) or not any(keep):
            raise
    return fitter.fit_where(values, keep, node)


def _merge_py(node, values, fitter):
    first = values[0]
    if isinstance(first, bool) or not isinstance(first, (int, tuple, list, torch.Size)):
        if all(type(v) is type(first) and _same(v, first) for v in values):
            return first
        raise NotGeneric(f"{node.name}: the value {first!r} depends on the sizes and is not an int")
    if isinstance(first, int):
        if not all(type(v) is int for v in values):
            raise NotGeneric(f"{node.name}: its type depends on the sizes")
        return fitter.fit(values, node)
    if not all(type(v) is type(first) and len(v) == len(first) for v in values):
        raise NotGeneric(f"{node.name}: its structure depends on the sizes")
    items = [_merge_py(node, [v[i] for v in values], fitter) for i in range(len(first))]
    if isinstance(first, torch.Size):
        return tuple(items)
    return type(first)(items)


def _same(a, b) -> bool:
    try:
        return bool(a == b) and repr(a) == repr(b)
    except Exception:
        return a is b


def all_dims(args) -> Dict[Tuple[int, int], Sym]:
    """``dynamic=True``: every dim of every tensor input whose size is not 0 or 1 symbolic;
    dims of equal size share a symbol (duck sizing: an elementwise op between them stays legal)."""
    names: Dict[int, str] = {}
    out: Dict[Tuple[int, int], Sym] = {}
    for pos, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            for d, n in enumerate(a.shape):
                if n >= 2:
                    name = names.setdefault(n, f"s{len(names)}")
                    out[(pos, d)] = Sym(name)
    return out
