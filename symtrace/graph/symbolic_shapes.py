"""Symbolic tensor metadata: every node's ``TensorMeta`` with sizes as expressions over the
graph's size symbols (``float32[seq, 8, 256]``).

How: the graph runs once under torch's ``FakeTensorMode`` with a ``ShapeEnv`` and torch's Python
dispatcher (as Dynamo runs it: see :meth:`SymbolicShapes.running`); each symbolic
input dimension becomes a torch symbol with the example size as its hint and the declared range,
so torch's own meta kernels compute exact output sizes (an example size of 0 or 1 is
hinted as 2 where the Dim allows it: torch's kernels would treat those sizes specially) (floor divisions of convolutions and
``view(-1)`` included) and :meth:`SymbolicShapes.size_of` turns torch's sympy expressions into
:class:`~symtrace.graph.symbols.SizeExpr`. This is exact where fitting sizes seen at a few hints
would guess, and it needs no second trace. It costs one fake run (tens of microseconds per op),
paid only by graphs with symbolic inputs: static graphs never come here.

A callable object whose op has no fake-tensor kernel may define ``fake_call`` (same arguments)
computing its result with ops that have one; it is used instead (the lowering's packed oneDNN
layers do). A node that cannot run on fake tensors (data-dependent ops such as ``nonzero``, ``.item()``)
has no ``tensor_meta`` afterwards, nor has anything computed from it; :func:`symbolic_metadata`
returns one note per such node. When torch's kernels pin a symbol to its example value (an
example size of 1 broadcasting), the metadata would hold only there: :func:`symbolic_metadata`
raises :class:`~symtrace.graph.symbols.SymbolicSizeError` instead. A node computing a symbolic size (``x.shape[1] * 2``) gets
``meta["size"]``: its :class:`~symtrace.graph.symbols.SizeExpr` (a tuple of them for a shape). Python
state writes (replayed writes into a caller's object or a closure, setitem on a list), data
guards and prints are not run.
What torch assumed about the sizes while running (e.g. ``s0*8 % 3 == 0`` for a view) is returned
too, as text over the symbols; eager torch raises when those break, so the graph stays right and
the assumptions only qualify the metadata.
"""
from __future__ import annotations

import contextlib
import operator
import random
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from .guards import check_data_guard
from .interpreter import Interpreter
from .node import Node, TensorMeta
from .replay import STATE_WRITES, read_state
from .tree import tree_map
from .symbols import INF, SizeExpr, SizeLike, Sym, SymbolicSizeError, as_expr, bounds

__all__ = ["SymbolicShapes", "symbolic_metadata", "input_symbols", "contiguous_strides", "symbolic_input_meta"]


def contiguous_strides(shape) -> Tuple[SizeLike, ...]:
    """The strides of a contiguous tensor of ``shape`` (sizes may be symbolic)."""
    out: List[SizeLike] = []
    acc: SizeLike = 1
    for d in reversed(tuple(shape)):
        out.append(acc)
        acc = acc * d
    return tuple(reversed(out))


def symbolic_input_meta(t: torch.Tensor, dims: Mapping[int, Sym], where: str) -> TensorMeta:
    """The metadata of input ``t`` with the dimensions in ``dims`` symbolic. Strides are
    written for the layout ``t`` has (contiguous, or dense in another dimension order)."""
    shape = list(t.shape)
    for i, s in dims.items():
        shape[i] = SizeExpr([(((s, 1),), 1)])
    order = _dense_order(t)
    if order is None:
        raise ValueError(f"{where} has symbolic dimensions but is not dense (strides {tuple(t.stride())}); "
                         "symtrace writes strides of symbolic inputs for dense layouts only: pass a "
                         "contiguous (or permuted-contiguous) tensor")
    strides: List[SizeLike] = [0] * len(shape)
    acc: SizeLike = 1
    for i in reversed(order):
        strides[i] = acc
        acc = acc * shape[i]
    return TensorMeta(tuple(shape), t.dtype, t.device, tuple(strides), t.requires_grad)


def _dense_order(t: torch.Tensor) -> Optional[List[int]]:
    """Dimensions from outermost to innermost if ``t`` is dense and non-overlapping."""
    st = t.stride()
    order = sorted(range(t.ndim), key=lambda i: (-st[i], -i))
    acc = 1
    for i in reversed(order):
        if t.shape[i] != 1 and st[i] != acc:
            return None
        acc *= t.shape[i]
    return order


def input_symbols(meta: Any) -> Dict[int, Sym]:
    """``{dim: Sym}`` for the dimensions of an input's metadata that are one bare symbol."""
    out: Dict[int, Sym] = {}
    if not isinstance(meta, TensorMeta):
        return out
    for i, d in enumerate(meta.shape):
        if isinstance(d, SizeExpr) and d.constant is None:
            syms = d.free_symbols()
            (s,) = syms if len(syms) == 1 else (None,)
            if s is not None and d == SizeExpr([(((s, 1),), 1)]):
                out[i] = s
    return out


class SymbolicShapes:
    """One ``ShapeEnv`` and ``FakeTensorMode``; maps torch's symbols to ours."""

    def __init__(self):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        # duck_shape=False: equal example sizes must not become one symbol
        self.env = ShapeEnv(duck_shape=False)
        self.mode = FakeTensorMode(shape_env=self.env, allow_non_fake_inputs=True)
        self._ours: Dict[Any, Sym] = {}      # sympy symbol -> Sym
        self._theirs: Dict[str, Any] = {}    # Sym name -> SymInt

    @contextlib.contextmanager
    def running(self):
        """Run torch ops on this fake mode as Dynamo does: with the Python dispatcher, so
        composite ops (``matmul``, ``linear`` on 3-D inputs) take torch's Python
        decompositions, written for symbolic sizes. Their C++ kernels may read concrete sizes
        (torch 2.11's ``matmul`` calls ``numel()``, which symbolic tensors refuse)."""
        from torch._dispatch.python import enable_python_dispatcher
        with self.mode, enable_python_dispatcher():
            yield

    def symint(self, s: Sym, hint: int):
        """torch's SymInt for our symbol ``s`` (one per name), hinted by ``hint``."""
        si = self._theirs.get(s.name)
        if si is None:
            from torch._dynamo.source import ConstantSource
            from torch.fx.experimental.symbolic_shapes import DimDynamic
            source = ConstantSource(f"symtrace_{s.name}")
            try:  # a hint of 0 or 1 must stay a symbol when the Dim allows those sizes
                expr = self.env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC,
                                              do_not_specialize_zero_one=True)
            except TypeError:  # an older ShapeEnv without the switch
                expr = self.env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
            if not getattr(expr, "is_Symbol", False):
                raise SymbolicSizeError(f"torch made the size {s.name} (example {hint}) a constant; trace "
                                        "with an example size of at least 2")
            hi = s.hi if s.hi != INF else max(hint, s.lo, 2 ** 62)
            self.env.constrain_symbol_range(expr, compiler_min=s.lo, compiler_max=hi)
            si = self.env.create_symintnode(expr, hint=hint)
            self._ours[expr] = s
            self._theirs[s.name] = si
        return si

    def fake_input(self, t: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
        """A fake tensor like ``t`` whose sizes and strides are ``meta``'s (symbols bound to
        torch symbols hinted by ``t``'s sizes)."""
        hints = {}
        for d, real in zip(meta.shape, t.shape):
            for s in (d.free_symbols() if isinstance(d, SizeExpr) else ()):
                # hinted at >= 2 where the range allows: torch treats 0 and 1 specially
                # (broadcasting, contiguity) and would pin the symbol to the example's 0 or 1
                hints.setdefault(s, int(real) if int(real) >= 2 or s.hi < 2 else max(2, s.lo))
        env = {s.name: self.symint(s, h) for s, h in hints.items()}
        size = [d.subs(env) if isinstance(d, SizeExpr) else d for d in meta.shape]
        stride = [d.subs(env) if isinstance(d, SizeExpr) else d for d in meta.stride] or None
        with self.mode:
            if stride is None:
                out = torch.empty(size, dtype=t.dtype, device=t.device)
            else:
                out = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
        return out.requires_grad_(True) if t.requires_grad else out

    def size_of(self, v: Any) -> SizeLike:
        """An int or SymInt as an int or :class:`SizeExpr`."""
        if isinstance(v, int):
            return v
        node = getattr(v, "node", None)
        expr = getattr(node, "expr", None)
        if expr is None:
            raise SymbolicSizeError(f"not a size: {v!r}")
        expr = self.env.simplify(expr) if hasattr(self.env, "simplify") else expr
        try:
            return self._convert(expr)
        except SymbolicSizeError:
            known = self._guarded_value(expr)  # e.g. view(-1)'s size torch guarded to one value
            if known is None:
                raise
            return known

    def _guarded_value(self, expr: Any) -> Optional[int]:
        """The int that torch's guards or value ranges pin ``expr`` to, if any."""
        try:
            v = self.env._maybe_evaluate_static(expr)  # private, but in every torch 2.x
            if v is not None and v.is_Integer:
                return int(v)
        except Exception:
            pass
        text = str(expr)
        for g in getattr(self.env, "guards", ()):
            e = g.expr
            if type(e).__name__ == "Equality" and len(e.args) == 2:
                for a, b in (e.args, e.args[::-1]):  # (equal sympy trees may differ in construction)
                    if b.is_Integer and (a == expr or str(a) == text):
                        return int(b)
        return None

    def _convert(self, e: Any) -> SizeLike:
        import sympy
        if e.is_Integer:
            return int(e)
        if e.is_Symbol:
            s = self._ours.get(e)
            if s is None:
                raise SymbolicSizeError(f"torch made the size symbol {e}, which no input declares "
                                        "(a size that depends on data)")
            return SizeExpr([(((s, 1),), 1)])
        if isinstance(e, sympy.Add):
            total: SizeLike = 0
            for a in e.args:
                total = total + self._convert(a)
            return total
        if isinstance(e, sympy.Mul):
            prod: SizeLike = 1
            for a in e.args:
                prod = prod * self._convert(a)
            return prod
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
            base, out = self._convert(e.base), 1
            for _ in range(int(e.exp)):
                out = out * base
            return out
        name = type(e).__name__
        if name in ("FloorDiv", "CleanDiv", "IntTrueDiv", "Mod", "PythonMod", "CeilDiv") and len(e.args) == 2 \
                and not isinstance(self._convert(e.args[1]), int):
            known = self._guarded_value(e)  # a symbolic divisor: only a value torch pinned helps
            if known is not None:
                return known
        if name in ("FloorDiv", "CleanDiv", "IntTrueDiv") and len(e.args) == 2:
            return as_expr(self._convert(e.args[0])) // int(self._convert(e.args[1]))
        if name in ("Mod", "PythonMod") and len(e.args) == 2:
            return as_expr(self._convert(e.args[0])) % int(self._convert(e.args[1]))
        if name in ("Max", "Min") and len(e.args) == 2:  # kept when the ranges decide it
            a, b = (self._convert(x) for x in e.args)
            (alo, ahi), (blo, bhi) = bounds(a), bounds(b)
            if alo >= bhi:
                return a if name == "Max" else b
            if blo >= ahi:
                return b if name == "Max" else a
        if name == "CeilDiv" and len(e.args) == 2:
            return -((-as_expr(self._convert(e.args[0]))) // int(self._convert(e.args[1])))
        raise SymbolicSizeError(f"the size {e} ({name}) has no symtrace form (sums, products, floor "
                                "division and modulo by constants)")

    def meta_of(self, t: torch.Tensor) -> TensorMeta:
        try:
            stride = tuple(self.size_of(s) for s in t.stride())
        except RuntimeError:
            stride = ()
        return TensorMeta(tuple(self.size_of(d) for d in t.shape), t.dtype, t.device, stride, t.requires_grad)

    def specialised(self) -> Dict[str, int]:
        """Our symbols that torch's kernels pinned to one value while running (broadcasting
        against a size-1 example, say): the metadata holds only at that value."""
        out = {}
        for theirs, ours in self._ours.items():
            to = self.env.replacements.get(theirs) if hasattr(self.env, "replacements") else None
            if to is not None and getattr(to, "is_Integer", False):
                out[ours.name] = int(to)
        return out

    def assumptions(self) -> List[str]:
        """What torch assumed about the symbols while running, as Python text over their names."""
        out = []
        for g in getattr(self.env, "guards", ()):
            text = self._relation_text(g.expr)
            if text is not None and text not in out:
                out.append(text)
        for a, b in getattr(self.env, "replacements", {}).items():
            if a in self._ours:
                out.append(f"{self._ours[a].name} == {self._text(b)}")
        return out

    def _text(self, e: Any) -> str:
        try:
            return str(self._convert(e))
        except SymbolicSizeError:  # torch's own text, with our symbols' names
            import sympy
            return str(e.xreplace({k: sympy.Symbol(v.name) for k, v in self._ours.items()}))

    def _relation_text(self, e: Any) -> Optional[str]:
        ops = {"Equality": "==", "Unequality": "!=", "StrictLessThan": "<", "LessThan": "<=",
               "StrictGreaterThan": ">", "GreaterThan": ">="}
        op = ops.get(type(e).__name__)
        if op is None or len(e.args) != 2:
            return self._text(e)
        a, b = self._text(e.args[0]), self._text(e.args[1])
        if a.lstrip("-").isdigit() and b.lstrip("-").isdigit():
            return None  # settled once the sizes torch pinned are put in
        return f"{a} {op} {b}"


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


class _Unknown:
    """The value of a node the fake run could not compute."""

    def __repr__(self) -> str:
        return "<unknown>"


_UNKNOWN = _Unknown()


class _SymbolicRunner(Interpreter):
    _verb = "computing symbolic shapes of"

    def __init__(self, module, graph, shapes: SymbolicShapes):
        super().__init__(module, graph, garbage_collect_values=True, check_guards=False)
        self.shapes = shapes
        self.notes: List[Tuple[str, str]] = []
        self._fakes: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def placeholder(self, target, args, kwargs):
        value = super().placeholder(target, args, kwargs)
        meta = self.current_node.meta.get("tensor_meta")
        if isinstance(value, torch.Tensor) and isinstance(meta, TensorMeta) and input_symbols(meta):
            return self.shapes.fake_input(value, meta)
        return tree_map(self._static_fake, value)

    def fetch_attr(self, qualified: str) -> Any:
        value = super().fetch_attr(qualified)
        return self._static_fake(value) if isinstance(value, torch.Tensor) else value

    def _static_fake(self, t: Any) -> Any:
        """A fake copy of a real tensor input or attribute, so in-place ops in the graph write
        the copy (under the fake mode a real tensor's own storage would be written)."""
        if not isinstance(t, torch.Tensor) or _is_fake(t):
            return t
        hit = self._fakes.get(id(t))
        if hit is None or hit[0] is not t:
            fake = self.shapes.mode.from_tensor(t, static_shapes=True)
            if isinstance(t, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            hit = self._fakes[id(t)] = (t, fake)
        return hit[1]

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        # a callable object whose own op has no fake-tensor kernel may say what it computes
        # with ops that have (``fake_call``, same arguments; e.g. a packed oneDNN layer)
        fake_call = getattr(target, "fake_call", None)
        if callable(fake_call) and not isinstance(target, type):
            return fake_call(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: Node) -> Any:
        if n.op == "call_function" and n.target is read_state:
            return _UNKNOWN   # live Python state (read when the graph runs): no symbolic value
        if n.op == "call_function" and _writes_python_state(n, self.env):
            # guard checks and Python state writes (replayed writes into a caller's object or a
            # closure, print, setitem on a list) must not run here: they would put fake tensors
            # into the caller's objects (they return None)
            n.meta.pop("tensor_meta", None)
            return None
        if n.op not in ("placeholder", "output") and any(
                self.env.get(i) is _UNKNOWN for i in n.all_input_nodes):
            n.meta.pop("tensor_meta", None)
            return _UNKNOWN
        try:
            with self.shapes.running():
                value = super().run_node(n)
            meta = self._meta(value)
        except Exception as e:
            if n.op in ("placeholder", "output"):
                raise
            n.meta.pop("tensor_meta", None)
            first = str(e).splitlines()[0] if str(e) else ""
            self.notes.append((n.name, f"{type(e).__name__}: {first}"[:300]))
            return _UNKNOWN
        if meta is None:
            n.meta.pop("tensor_meta", None)
        else:
            n.meta["tensor_meta"] = meta
        if isinstance(value, torch.SymInt) or (type(value) is torch.Size and any(
                isinstance(d, torch.SymInt) for d in value)):
            n.meta["size"] = self.shapes.size_of(value) if isinstance(value, torch.SymInt) else \
                tuple(self.shapes.size_of(d) for d in value)
        return value

    def _meta(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return self.shapes.meta_of(v)
        if type(v) in (tuple, list) or isinstance(v, tuple):
            metas = tuple(self._meta(x) for x in v)
            return metas if any(m is not None for m in metas) else None
        return None


#: Python state writes the graph replays, and checks: never run on fake values
_PYTHON_WRITES = STATE_WRITES | {check_data_guard, print}


def _writes_python_state(n: Node, env: dict) -> bool:
    """A replayed write, a check or a print; or ``setitem``/``delitem`` on something that is
    not a tensor (a list or dict the caller may hold)."""
    try:
        if n.target in _PYTHON_WRITES:
            return True
    except TypeError:   # an unhashable callable
        return False
    if n.target in (operator.setitem, operator.delitem) and n.args:
        first = n.args[0]
        return not isinstance(env.get(first) if isinstance(first, Node) else first, torch.Tensor)
    return False


def symbolic_metadata(module: Any, graph: Any, args: tuple = (), kwargs: Optional[dict] = None
                      ) -> Tuple[List[Tuple[str, str]], List[str]]:
    """Fill every node's ``tensor_meta`` with symbolic sizes, by running ``graph`` (of
    ``module``) under fake tensors. ``args``/``kwargs`` are example inputs; each placeholder whose
    ``tensor_meta`` has symbolic dimensions gets a fake input with those symbols (hinted by the
    example's sizes). Returns ``(notes, assumptions)``: ``(node name, why)`` for nodes left
    without metadata, and what torch assumed about the symbols (see the module doc)."""
    shapes = SymbolicShapes()
    runner = _SymbolicRunner(module, graph, shapes)
    rng, py_rng = torch.get_rng_state(), random.getstate()
    try:
        runner.run(*args, **(kwargs or {}))
    finally:
        torch.set_rng_state(rng)
        random.setstate(py_rng)
    pinned = shapes.specialised()
    if pinned:
        for n in graph.nodes:  # sizes computed at one value of a symbol would pass for general ones
            if n.op != "placeholder":
                n.meta.pop("tensor_meta", None)
                n.meta.pop("size", None)
        name, value = sorted(pinned.items())[0]
        raise SymbolicSizeError(
            f"torch's kernels treat the size {name} as exactly {value} at its example size (e.g. "
            f"broadcasting against a size-1 example), so no metadata holds for other sizes; trace with "
            f"an example whose size there is at least 2")
    return runner.notes, shapes.assumptions()
