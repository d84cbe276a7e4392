"""The kernel renderer shared by the C and Triton targets.

:class:`KernelRenderer` writes what every target writes the same way: the walk over a kernel's
expression DAG (one temporary per node, in dependency order), the outline of the three kernel
kinds (which loops exist, where the reduction phases, the row-cache arrays and the stores go)
and the outline of a reduction (initialise, loop, accumulate, finish). A target subclass
(:mod:`~symtrace.lower.codegen_c`, :mod:`~symtrace.lower.codegen_triton`) supplies tables and
idioms, in the spirit of tinygrad's ``code_for_op``:

* ``ops``: IR op -> compute type of its operands -> template (``"({0} + {1})"``), built with
  :func:`expand`; an op or type missing there raises :class:`NoKernelForm`;
* ``loads``/``casts``/``rounds`` (tables) and ``element``/``literal``/``store_value``/``store``
  (methods): how values enter, change type and leave;
* ``begin``/``end``: the function's prologue (signature, buffer declarations) and epilogue;
* the parallel idiom: how the rows, the pointwise domain, a reduction's span, the store loop and
  the blocks of a full reduction are opened (``#pragma omp`` loops in C, program ids, blocks and
  masks in Triton) and how accumulators are initialised, updated and finished.

Outline of the three kinds (``open_*`` hooks return the depth their body is written at)::

    pointwise:  begin; open_pointwise; stores; close_loops; end
    row:        begin; open_rows; per phase: reduce; stores (per row, or in the store loop);
                close_loops; end
    full:       open_full; [open_partials; reduce the inner loop of one block; close_partials];
                open_total; total = value (0-d source) or combine(partials); stores; end
    reduce:     reduce_init; open_reduction; values (row-cache reads and writes); accumulate;
                close_reduction; reduce_finish
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import SymtraceError
from .ir import Affine, Buffer, Expr, Kernel, Phase, Var, walk

__all__ = ["KernelRenderer", "Reduction", "NoKernelForm", "expand", "template", "templates", "COMPUTE_TYPES"]

COMPUTE_TYPES = ("f32", "f64", "i64", "b")
#: the type groups a table row may name (besides the compute types themselves)
_GROUPS = {"float": ("f32", "f64"), "int": ("i64", "b"), "all": COMPUTE_TYPES}


class NoKernelForm(SymtraceError, TypeError):
    """A kernel holds an operation that a target's renderer has no form for (an IR op, or an op
    on operands of a compute type the target's table does not list).

    Example: integer division reaching the C renderer (the lowering divides in floating point).
    This is a bug in a lowering rule or in the target's table; please report it with the program.
    """

    def __init__(self, op: str, ty: str, target: str):
        super().__init__(f"the {target} kernel renderer has no form for {op!r} on {ty} operands "
                         f"(add it to the {target} op table, or lower the op differently)")
        self.op, self.ty, self.target = op, ty, target


def template(form: str) -> Callable[..., str]:
    """The template ``form`` (``{0}``, ``{1}``, ...: the operands' code) as a function of the
    operands. ``str.format`` would parse the template again for every node; this parses it once."""
    order = tuple(int(i) for i in re.findall(r"\{(\d)\}", form))
    text = re.sub(r"\{\d\}", "%s", form.replace("%", "%%"))
    if order == tuple(range(len(order))):
        return lambda *a: text % a
    return lambda *a: text % tuple(a[i] for i in order)


def templates(table: Dict) -> Dict:
    """``table`` with each template replaced by its :func:`template` function."""
    return {key: template(form) for key, form in table.items()}


def expand(table: Dict[str, Dict[str, str]], f32: str = "", f64: str = "") -> Dict[str, Dict[str, Callable]]:
    """An op table with its type groups (``float``, ``int``, ``all``) spelled out per compute
    type, each template made a :func:`template` function; ``{f}`` in a float template becomes
    ``f32``/``f64`` (C's ``expf``/``exp``). A row may name a group and override single types
    (``{"all": "(-{0})", "i64": "st_negi({0})"}``)."""
    out: Dict[str, Dict[str, Callable]] = {}
    for op, row in table.items():
        forms: Dict[str, str] = {}
        for key in sorted(row, key=lambda k: k not in _GROUPS):   # groups first, single types override
            for ty in _GROUPS.get(key, (key,)):
                forms[ty] = row[key].replace("{f}", f32 if ty == "f32" else f64)
        out[op] = templates(forms)
    return out


@dataclasses.dataclass
class Reduction:
    """``acc`` (of compute type ``ty``) = ``phase.op`` of ``phase.value`` over ``var``, in the
    target-defined ``span`` (C: ``(lo, hi)``; Triton: ``(lo, size, block, looped)``). ``index``:
    the loop variable's name in the code, once :meth:`KernelRenderer.open_reduction` named it."""

    phase: Phase
    acc: str
    ty: str
    var: Var
    span: Tuple
    index: str = ""

    @property
    def op(self) -> str:
        return self.phase.op

    @property
    def nan_flag(self) -> bool:
        """Whether NaNs are tracked on the side (float max/min: they must win)."""
        return self.phase.op != "sum" and self.ty in ("f32", "f64")


class KernelRenderer:
    """Renders one :class:`~symtrace.lower.ir.Kernel`; subclasses are the targets.

    Besides the tables below, a target defines these methods (``open_*`` return the depth of
    the body they open):

    =================================  ============================================================
    ``element(buf, index, mask=None)`` the element as stored (a C lvalue, a Triton ``tl.load``);
                                       ``mask``: the code of a masked load's mask
    ``in_range(a, lo, hi)``            the test ``lo <= a < hi`` of an index (``inrange``)
    ``masked_load(e, mask, other)``    a masked load (see :meth:`~symtrace.lower.ir.ExprBuilder.load`)
    ``literal(value, ty)``             a constant of compute type ``ty``
    ``convert(x, ty)``                 ``x`` to compute type ``ty`` (block sums to totals)
    ``store_value(x, value, dt)``      ``x`` (the code of ``value``) converted for a ``dt`` buffer
    ``store(buf, index, x)``           the statement storing ``x``
    ``cache_ref(name, index)``         an element of a row-cache array (if ``keeps_row_cache``)
    ``begin()``, ``end()``             the function's signature and prologue; its epilogue
    ``open_pointwise()``               the whole domain of a pointwise kernel
    ``open_rows()``                    a row kernel's outer variables: one row per iteration
    ``close_loops(depth)``             closes what ``open_pointwise``/``open_rows`` opened
    ``row_span(var)``                  the :attr:`Reduction.span` of a phase over all of ``var``
    ``open_store_loop(depth)``         a row kernel's loop over its inner variable: (depth, name)
    ``close_store_loop(depth)``        closes it
    ``reduce_init(depth, r)``          declares and initialises the accumulator(s) of ``r``
    ``open_reduction(depth, r)``       the loop over ``r.var`` in ``r.span``; sets ``r.index``
    ``accumulate(depth, r, x)``        folds the value ``x`` into the accumulator(s)
    ``close_reduction(depth)``         closes the loop
    ``reduce_finish(depth, r)``        the result (NaNs of max/min, wrapped integer sums, ...)
    ``open_full(p)``                   what a full kernel writes before its partials
    ``open_partials(p, nb, n)``        one partial of ``nb`` blocks of :attr:`full_block` per outer
                                       index, ``n`` in all: (depth, span of the block's loop)
    ``close_partials(depth, acc, p)``  writes the partial ``acc``, closes ``open_partials``
    ``open_total(p)``                  what a full kernel writes between partials and total
    ``combine(p, n)``                  ``p.name`` = ``p.op`` of the ``n`` partials, in order
    =================================  ============================================================
    """

    target = "?"
    #: IR op -> operand compute type -> template over the operands' code (see :func:`expand`)
    ops: Dict[str, Dict[str, Callable]] = {}
    #: the number of elements one partial of a full reduction covers
    full_block = 1
    #: whether the target keeps row-cache values (:class:`~symtrace.lower.ir.RowCache`) in arrays
    keeps_row_cache = False
    #: compute type -> how a temporary's definition starts (C: ``const float ``)
    declare: Dict[str, str] = {ty: "" for ty in COMPUTE_TYPES}
    #: how a statement ends (C: ``;``)
    end_of_statement = ""
    #: storage dtypes whose loads are used in place rather than held in a temporary
    inline_loads: frozenset = frozenset()
    #: storage dtype -> template of a load (``{0}``: :meth:`element`) in its compute type
    loads: Dict = {}
    #: (from, to, integer dtype of a float -> integer cast, else None) -> template of a cast
    casts: Dict[Tuple, Callable] = {}
    #: (storage dtype, compute type) -> template of a value rounded to the dtype (default: none)
    rounds: Dict[Tuple, Callable] = {}

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.bufs = kernel.buffers()
        self.bufname = {id(b): f"b{i}" for i, b in enumerate(self.bufs)}
        self.var_names: Dict[int, str] = {}
        self.lines: List[str] = []

    def w(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    def name_var(self, v: Var, name: str) -> str:
        self.var_names[id(v)] = name
        return name

    # ------------------------------------------------------------------ expressions
    def expr(self, e: Expr, t: Dict[int, str]) -> str:
        """The code of ``e`` given the code ``t`` of the nodes below it."""
        op = e.op
        if op == "load":
            if e.args:
                return self.masked_load(e, *(t[a.id] for a in e.args))
            buf, index = e.payload
            return self.loads[buf.dtype](self.element(buf, index))
        if op == "inrange":
            return self.in_range(*e.payload)
        if op == "const":
            return self.literal(e.payload, e.ty)
        if op == "size":   # a size expression over the kernel's symbol arguments
            return self.size_value(e.payload, e.ty)
        if op == "acc":
            return e.payload.name
        args = [t[a.id] for a in e.args]
        if op == "cast":
            return self.cast(e, args[0])
        if op == "round" and e.payload is not None:   # to a storage dtype (payload None: torch.round)
            return self.round(e, args[0])
        ty = e.args[-1].ty   # the operands' type (for where: the branches')
        try:
            form = self.ops[op][ty]
        except KeyError:
            raise NoKernelForm(op, ty, self.target) from None
        return form(*args)

    def cast(self, e: Expr, x: str) -> str:
        form = self.casts.get((e.args[0].ty, e.ty, e.payload))
        if form is None:
            raise NoKernelForm(f"cast to {e.payload or e.ty}", e.args[0].ty, self.target)
        return form(x)

    def round(self, e: Expr, x: str) -> str:
        form = self.rounds.get((e.payload, e.ty))
        return form(x) if form is not None else x

    def assign(self, target: str, value: str) -> str:
        return f"{target} = {value}{self.end_of_statement}"

    def dag(self, depth: int, roots: List[Expr], known: Optional[Dict[int, str]] = None) -> Dict[int, str]:
        """Write every node under ``roots`` as a temporary ``tN``, except constants,
        accumulators and :attr:`inline_loads`, which are used in place; return node id -> code.
        ``known``: nodes already available (row-cache reads)."""
        t: Dict[int, str] = dict(known) if known else {}
        stop = frozenset(t)
        expr, lines, indent, declare, end = self.expr, self.lines, "    " * depth, self.declare, self.end_of_statement
        inline_loads = self.inline_loads
        for root in roots:
            for e in walk(root, stop):
                if e.id in t:
                    continue
                code = expr(e, t)
                op = e.op
                if op == "const" or op == "acc" or (op == "load" and e.payload[0].dtype in inline_loads):
                    t[e.id] = code
                else:
                    name = t[e.id] = f"t{e.id}"
                    lines.append(f"{indent}{declare[e.ty]}{name} = {code}{end}")
        return t

    def compute_and_store(self, depth: int, known: Optional[Dict[int, str]] = None) -> None:
        """The kernel's stored values and their stores."""
        stores = self.kernel.stores
        t = self.dag(depth, [s.value for s in stores], known)
        for s in stores:
            self.w(depth, self.store(s.buffer, s.index, self.store_value(t[s.value.id], s.value, s.buffer.dtype)))

    # ------------------------------------------------------------------ row caches
    def cache_reads(self, loop: Optional[Phase], index: str) -> Dict[int, str]:
        """Row-cache values the loop of phase ``loop`` (None: the store loop) reads, by node id."""
        if not self.keeps_row_cache:
            return {}
        return {e.id: self.cache_ref(rc.name, index) for rc in self.kernel.row_cache for lp, e in rc.uses
                if lp is loop}

    def cache_writes(self, depth: int, p: Phase, index: str, t: Dict[int, str]) -> None:
        if self.keeps_row_cache:
            for rc in self.kernel.row_cache:
                if rc.phase is p:
                    self.w(depth, self.assign(self.cache_ref(rc.name, index), t[rc.value.id]))

    # ------------------------------------------------------------------ kernels
    def render(self) -> str:
        {"pointwise": self.pointwise, "row": self.row}.get(self.kernel.kind, self.full)()
        return "\n".join(self.lines)

    def pointwise(self) -> None:
        self.begin()
        depth = self.open_pointwise()
        self.compute_and_store(depth)
        self.close_loops(depth)
        self.end()

    def row(self) -> None:
        k = self.kernel
        self.begin()
        depth = self.open_rows()
        for p in k.phases:
            self.reduce(depth, Reduction(p, p.name, p.ty, p.var, self.row_span(p.var)))
        if k.inner is None:
            self.compute_and_store(depth)
        else:
            d, index = self.open_store_loop(depth)
            self.compute_and_store(d, self.cache_reads(None, index))
            self.close_store_loop(d)
        self.close_loops(depth)
        self.end()

    def full(self) -> None:
        k = self.kernel
        p = k.phases[0]
        n_outer = 1
        for v in k.outer:
            n_outer *= v.size
        nb = ((k.inner.size if k.inner is not None else 1) + self.full_block - 1) // self.full_block
        nparts = n_outer * nb
        self.open_full(p)
        if k.inner is not None and nparts:
            depth, span = self.open_partials(p, nb, nparts)
            self.reduce(depth, Reduction(p, "bacc", p.value.ty, k.inner, span))
            self.close_partials(depth, "bacc", p)
        self.open_total(p)
        if k.inner is None:   # 0-d source
            t = self.dag(1, [p.value])
            self.w(1, self.assign(p.name, self.convert(t[p.value.id], p.ty)))
        else:
            self.combine(p, nparts)
        self.compute_and_store(1)
        self.end()

    def reduce(self, depth: int, r: Reduction) -> None:
        self.reduce_init(depth, r)
        d = self.open_reduction(depth, r)
        t = self.dag(d, [r.phase.value], self.cache_reads(r.phase, r.index))
        self.cache_writes(d, r.phase, r.index, t)
        self.accumulate(d, r, t[r.phase.value.id])
        self.close_reduction(d)
        self.reduce_finish(depth, r)
