"""Dynamic dimensions while tracing (``dynamic_shapes=``): which input sizes are symbols, the
entry guards their declarations add, and the check that no Python decision pinned one of them
to its example value.

The tracer keeps running on the example values, so Python sees concrete sizes; sizes that feed
tensor ops are already graph nodes (``x.shape[1]`` is a ``getitem`` node), so the graph computes
them for every input. What must not happen silently is a decision that holds only for the example
size: an entry guard that compares a symbolic size for equality with a number (from ``int()``,
``range()``, ``str()``, hashing, ``len()`` or ``x.shape == ...``). :func:`pinned_dims` finds those;
``symbolic_trace`` refuses them with the user's line, ``capture`` keeps such dimensions static.
Comparisons that steer branches (``if x.shape[1] % 8 == 0``) stay guards over the symbols.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

from ..graph.guard_expr import Attr, BinOp, Call, Const, GExpr, Input, Item, Method
from ..graph.guards import Guard
from ..graph.symbols import INF, Dim, Sym

__all__ = ["DynamicInput", "declare", "pinned_dims", "symbolic_text", "dim_expr", "size_guards", "reads_symbols", "describe_symbolic"]


class DynamicInput:
    """The symbolic dimensions of one tensor input: ``{dim: Sym}`` and its rank. ``name`` is
    its placeholder's (what guards read), ``param`` the parameter's (what the user declared;
    they differ when the parameter's name is taken, as ``input`` is)."""

    __slots__ = ("name", "dims", "rank", "param")

    def __init__(self, name: str, dims: Dict[int, Sym], rank: int, param: Optional[str] = None):
        self.name, self.dims, self.rank = name, dims, rank
        self.param = param or name

    def __repr__(self) -> str:
        return f"DynamicInput({self.name}: {{{', '.join(f'{d}: {s.name}' for d, s in sorted(self.dims.items()))}}})"


def declare(spec: Mapping[int, Mapping[int, Dim]], names: List[str]) -> Dict[str, Dict[int, Sym]]:
    """``{input name: {dim: Sym}}`` from a normalised spec (one Sym per Dim name)."""
    syms: Dict[str, Sym] = {}
    out: Dict[str, Dict[int, Sym]] = {}
    for pos, dims in spec.items():
        out[names[pos]] = {i: syms.setdefault(d.name, Sym(d.name, d.min, d.max)) for i, d in dims.items()}
    return out


def dim_expr(name: str, dim: int) -> GExpr:
    """``x.shape[dim]`` as a guard expression."""
    return Item(Attr(Input(name), "shape"), Const(dim))


def declaration_guards(inputs: Iterable[DynamicInput]) -> List[Tuple[GExpr, str]]:
    """Entry guards (boolean expressions, expected True) a declaration implies: each symbolic
    size within its Dim's range; sizes sharing a Dim equal."""
    out: List[Tuple[GExpr, str]] = []
    first: Dict[str, GExpr] = {}
    for inp in inputs:
        for i, s in sorted(inp.dims.items()):
            e = dim_expr(inp.name, i)
            if s.name in first:
                out.append((BinOp("==", e, first[s.name]), f"the inputs' sizes declared equal (Dim {s.name!r})"))
                continue
            first[s.name] = e
            out.append((BinOp(">=", e, Const(s.lo)), f"the declared range of Dim {s.name!r}"))
            if s.hi != INF:
                out.append((BinOp("<=", e, Const(s.hi)), f"the declared range of Dim {s.name!r}"))
    return out


def _size_reads(e: GExpr, dyn: Mapping[str, DynamicInput], out: Set[Tuple[str, int]]) -> None:
    """Add the symbolic ``(input, dim)`` sizes ``e`` reads (a whole-shape read reads them all)."""
    if type(e) is Call and e.fn == "len" and e.args and _tensor_of(e.args[0]) is not None:
        return  # len(x.shape): the rank
    x = _tensor_of(e)
    if x is not None:
        inp = dyn.get(x)
        if inp is not None:
            out.update((x, i) for i in _dims_of(e, inp) if i in inp.dims)
        return
    for c in e.children():
        _size_reads(c, dyn, out)


def _input_name(e: GExpr) -> Optional[str]:
    return e.name if type(e) is Input else None


def _tensor_of(e: GExpr) -> Optional[str]:
    """The input whose sizes ``e`` reads directly (``x.shape``, ``x.shape[i]``, ``x.size(i)``,
    ``x.numel()``, ``len(x)``, ``x.stride()``), else None."""
    t = type(e)
    if t is Attr and e.name == "shape":
        return _input_name(e.obj)
    if t is Item and type(e.obj) in (Attr, Method):
        return _tensor_of(e.obj)
    if t is Method and e.name in ("size", "numel", "nelement", "stride"):
        return _input_name(e.obj)
    if t is Call and e.fn == "len" and len(e.args) == 1:
        return _input_name(e.args[0])
    return None


def _dims_of(e: GExpr, inp: DynamicInput) -> Iterable[int]:
    every = range(inp.rank)
    t = type(e)
    if t is Call:  # len(x)
        return [0]
    if t is Item:
        base, key = e.obj, e.key
        if type(key) is Const and type(key.value) is int and -inp.rank <= key.value < inp.rank:
            d = key.value % inp.rank
            return range(d + 1, inp.rank) if _is_stride(base) else [d]
        return range(1, inp.rank) if _is_stride(base) else every
    if t is Method and e.args and type(e.args[0]) is Const and type(e.args[0].value) is int \
            and -inp.rank <= e.args[0].value < inp.rank:
        d = e.args[0].value % inp.rank
        return range(d + 1, inp.rank) if e.name == "stride" else [d]
    if t is Method and e.name == "stride":
        return range(1, inp.rank)
    return every


def _is_stride(e: GExpr) -> bool:
    return type(e) is Method and e.name == "stride"


def pinned_dims(guard: Guard, dyn: Mapping[str, DynamicInput]) -> Set[Tuple[str, int]]:
    """The symbolic sizes ``guard`` holds only at their example values: an equality with a
    number (``int(x.shape[1])``, ``x.shape == ...``), or a branch taken on ``size == number``."""
    e = guard.expr
    if not isinstance(e, GExpr) or guard.check in ("isinstance", "type"):
        return set()
    if guard.check == "bool" or isinstance(guard.expected, bool):
        # a branch: pins only when it tests a size for equality (``if n == 4``) and held
        if type(e) is BinOp and e.op in ("==", "!=") and guard.expected is (e.op == "=="):
            reads: Set[Tuple[str, int]] = set()
            for side, other in ((e.a, e.b), (e.b, e.a)):
                if type(other) is Const and _polynomial(side):
                    _size_reads(side, dyn, reads)
            return reads
        return set()
    reads = set()
    _size_reads(e, dyn, reads)
    return reads


def _polynomial(e: GExpr) -> bool:
    """Whether ``e`` is sizes and numbers under ``+ - *`` only (so ``e == c`` holds at few
    sizes; ``n % 8 == 0`` holds at many and is a guard, not a pin)."""
    if type(e) is BinOp:
        return e.op in ("+", "-", "*") and _polynomial(e.a) and _polynomial(e.b)
    return True


def symbolic_text(e: GExpr, dyn: Mapping[str, DynamicInput]) -> str:
    """``e`` as text with each symbolic size written as its symbol (``x.shape[1] % 8`` ->
    ``seq % 8``); for display only."""
    t = type(e)
    if t is Item and type(e.key) is Const and type(e.key.value) is int:
        x = _tensor_of(e)
        inp = dyn.get(x) if x is not None and not _is_stride(e.obj) else None
        if inp is not None and -inp.rank <= e.key.value < inp.rank:
            s = inp.dims.get(e.key.value % inp.rank)
            if s is not None:
                return s.name
    if t is Method and e.name == "size" and len(e.args) == 1:
        inp = dyn.get(_input_name(e.obj) or "")
        if inp is not None and type(e.args[0].value if type(e.args[0]) is Const else None) is int:
            s = inp.dims.get(e.args[0].value % inp.rank)
            if s is not None:
                return s.name
    if t is BinOp:
        a, b = symbolic_text(e.a, dyn), symbolic_text(e.b, dyn)
        if e.op in _COMPARISONS:  # arithmetic binds tighter: no parentheses needed around it
            a, b = (_bare(x) if type(y) is BinOp and y.op not in _COMPARISONS else x for x, y in ((a, e.a), (b, e.b)))
        return f"({a} {e.op} {b})"
    if t is Call:
        return f"{e.fn}({', '.join(symbolic_text(a, dyn) for a in e.args)})"
    return e.render()


_COMPARISONS = frozenset({"==", "!=", "<", "<=", ">", ">=", "is"})


def _bare(text: str) -> str:
    return text[1:-1] if text.startswith("(") and text.endswith(")") else text


def describe_symbolic(guard: Guard, dyn: Mapping[str, DynamicInput]) -> str:
    """A size guard as a relation over symbols: ``seq % 8 == 0``, ``seq >= 2``."""
    text = symbolic_text(guard.expr, dyn)
    if type(guard.expr) is BinOp and text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    if guard.check == "bool" and guard.expected is True:
        return text
    if guard.check == "bool" and guard.expected is False:
        return f"not ({text})"
    return f"{text} == {guard.expected!r}"


def reads_symbols(guard: Guard, dyn: Mapping[str, DynamicInput]) -> bool:
    """Whether an entry guard reads a symbolic size."""
    if not isinstance(guard.expr, GExpr):
        return False
    reads: Set[Tuple[str, int]] = set()
    _size_reads(guard.expr, dyn, reads)
    return bool(reads)


def size_guards(gm) -> List[str]:
    """The entry guards of a graph traced with ``dynamic_shapes`` that involve its size symbols,
    as relations over the symbols (``["seq >= 2", "seq % 8 == 0"]``)."""
    dyn = gm.meta.get("dynamic_inputs") or {}
    return [describe_symbolic(g, dyn) for g in gm.graph.guards if reads_symbols(g, dyn)]
