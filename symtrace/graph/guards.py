"""Guards: the assumptions a traced graph was specialised on, and their run-time checks.

Every Python-level decision taken from a traced value while tracing (``if x.shape[0] > 2``,
``int(n)``, ``self.training``, ``isinstance(mask, Tensor)``...) becomes a :class:`Guard`.

* **Entry guards** (``Graph.guards``) are Python expressions over the graph's inputs, the
  module (``root``) and module globals. Code generation turns them into one short-circuit
  boolean test at the top of ``forward``: a passing call costs a few attribute reads.
* **Data guards** depend on computed values (``x.sum() > 0``, ``.item()``). They are
  ``call_function`` nodes of :func:`check_data_guard` placed right after the value they test.

A failing guard raises :class:`~symtrace.errors.GuardError` naming the guard, the value seen now
and the user's line where the decision was taken.
"""
from __future__ import annotations

import math
import types
from typing import Any, Dict, List, Optional, Sequence

from ..errors import GuardError
from .effects import register_side_effect
from .guard_expr import BinOp, GExpr, as_attributes, render_sharing
from .op_schema import OpSchemaInfo, register_schema
from .pytree_bridge import GUARD_FUNCTIONS
from .source import SourceLocation

__all__ = ["Guard", "LIVE_GUARD_KINDS", "needs_live_root", "check_data_guard", "entry_guard_test", "raise_entry_guard_failure",
           "attribute_form"]

_CHECK_FORMS = {
    "eq": "{pexpr} == {e}",
    "is": "{pexpr} is {e}",
    "isinstance": "isinstance({expr}, {e})",
    "type": "type({expr}) is {e}",
    "bool": "bool({expr}) is {e}",
}


class Guard:
    """One assumption of a traced graph.

    ``kind``: what is assumed — ``type``, ``dtype``, ``device``, ``ndim``, ``shape``, ``value``
    (a Python value passed in), ``module`` (a module attribute), ``global``, ``data`` (a
    computed value). ``expr``: for entry guards what is read, a
    :class:`~symtrace.graph.guard_expr.GExpr` over the inputs, ``root``, module globals and
    torch's state (``str(expr)`` is its Python text); for data guards a description of the
    tested value (a string, never code). ``check``: how the value is
    compared with ``expected`` (``eq``, ``is``, ``isinstance``, ``type``, ``bool``, and for
    data guards also ``int``, ``float``, ``tolist``). ``source``: where in the user's code the
    decision was taken. ``reason``: the Python operation that forced it.
    """

    __slots__ = ("kind", "expr", "expected", "check", "source", "reason")

    def __init__(self, kind: str, expr: str, expected: Any, check: str = "eq",
                 source: Optional[SourceLocation] = None, reason: str = ""):
        self.kind = kind
        self.expr = expr
        self.expected = expected
        self.check = check
        self.source = source
        self.reason = reason

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)

    def __repr__(self) -> str:
        return f"Guard({self.describe()})"

    def expected_text(self) -> str:
        e = self.expected
        if isinstance(e, type):
            return e.__module__ + "." + e.__qualname__ if e.__module__ != "builtins" else e.__qualname__
        if isinstance(e, tuple) and all(isinstance(t, type) for t in e):
            return " or ".join(t.__qualname__ for t in e)
        return repr(e)

    def reads_root(self) -> bool:
        """Whether this entry guard reads the module (``root``)."""
        return isinstance(self.expr, GExpr) and self.expr.reads_root()

    def describe(self) -> str:
        """The assumption as text, e.g. ``x.shape[0] > 2 is True``."""
        expr = self.expr.shown() if isinstance(self.expr, GExpr) else str(self.expr)
        if self.check == "isinstance" or self.check == "type":
            return f"{expr} is a {self.expected_text()}"
        if self.check in ("is", "bool"):
            return f"{expr} is {self.expected_text()}"
        if self.check in ("int", "float", "tolist"):
            return f"{self.check}({expr}) == {self.expected_text()}"
        return f"{expr} == {self.expected_text()}"

    def where(self) -> str:
        if self.source is not None:
            return self.source.describe()
        return "the call's inputs (checked on entry)" if self.kind in ("type", "dtype", "device", "ndim", "value", "shape") \
            else "<unknown location>"

    def test_source(self, ename: str, text: Optional[str] = None) -> str:
        """This entry guard as a Python boolean expression (``ename`` names ``expected``),
        written from its checked expression tree (``text``: that tree's text as
        :func:`~symtrace.graph.guard_expr.render_sharing` wrote it)."""
        if not isinstance(self.expr, GExpr):
            raise TypeError(f"an entry guard reads a GExpr, not {type(self.expr).__name__} ({self.expr!r})")
        if self.check not in _CHECK_FORMS or not ename.isidentifier():
            raise ValueError(f"unknown guard check {self.check!r}")
        shared = text is not None and text != self.expr.render()   # (else written as usual)
        expr = text if shared else self.expr.render()
        pexpr = expr if " " not in expr or (type(self.expr) is BinOp and not shared) else f"({expr})"
        if self.check == "bool" and not shared:
            expr = self.expr.bare()
        return _CHECK_FORMS[self.check].format(expr=expr, pexpr=pexpr, e=ename)

    def holds_for(self, seen: Any) -> bool:
        """Whether a data guard's converted value matches what tracing saw."""
        e = self.expected
        if seen is e:
            return True
        try:
            if seen == e:
                return True
        except Exception:
            return False
        return isinstance(seen, float) and isinstance(e, float) and math.isnan(seen) and math.isnan(e)

    def failure(self, seen: Any) -> GuardError:
        if self.check in ("isinstance", "type"):
            now = f"got {type(seen).__qualname__}" if seen is not _UNKNOWN else "it is not"
        elif seen is _UNKNOWN:
            now = "it cannot be evaluated for these inputs"
        else:
            now = f"it is {_short(seen)} now"
        return GuardError(
            f"guard failed: the graph assumes {self.describe()} ({self.kind} guard, "
            f"from {self.reason or 'a decision'} at {self.where()}), but {now}. "
            "Re-trace with these inputs, or use symtrace.capture(model), which re-captures "
            "when a guard fails.", guard=self, seen=seen)


def _short(v: Any) -> str:
    try:
        import torch
        if isinstance(v, torch.Tensor):
            return f"a {str(v.dtype).replace('torch.', '')} tensor of shape {tuple(v.shape)}"
    except ImportError:
        pass
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


class _Unknown:
    def __repr__(self):
        return "<unknown>"


_UNKNOWN = _Unknown()

_CONVERT = {"bool": bool, "int": int, "float": float, "tolist": lambda v: v.tolist(), "eq": lambda v: v,
            "is": lambda v: v}


@register_side_effect
def check_data_guard(value: Any, guard: Guard) -> None:
    """Run-time check of a data-dependent guard: raise GuardError if ``value`` differs from
    what tracing saw. Recorded as a ``call_function`` node right after ``value``."""
    seen = _CONVERT[guard.check](value)
    if not guard.holds_for(seen):
        raise guard.failure(seen)


# it only reads its value (a side effect all the same: never removed or moved); without this,
# alias analysis took it to write the value's whole alias group, a model's weights included
register_schema(check_data_guard, OpSchemaInfo("check_data_guard", arg_names=("value", "guard")))


#: Guard kinds about the identity of model state; checked only when a graph runs against the
#: live model (``GraphModule.guard_root`` set, as ``symtrace.capture`` does).
LIVE_GUARD_KINDS = frozenset({"identity", "structure"})


def needs_live_root(g: "Guard") -> bool:
    """Whether ``g`` is checked only against a live model: a live kind that reads the module.
    (Live guards are made only by a live trace; those on globals and inputs, as in a captured
    function's graph, which has no module, are checked on every call.)"""
    return g.kind in LIVE_GUARD_KINDS and g.reads_root()


def method_function(obj: Any, name: str) -> Any:
    """What ``obj.name`` runs: the function of a method bound to ``obj`` (from its class, or
    assigned on the instance), else the attribute itself. Entry guards compare it by identity,
    so replacing a method of a module, on its class or on the instance, re-captures."""
    v = getattr(obj, name)
    return v.__func__ if isinstance(v, types.MethodType) and v.__self__ is obj else v


def slot_names(cls: type) -> List[str]:
    """The attributes the ``__slots__`` of ``cls`` and its bases declare (not ``__dict__``/
    ``__weakref__``), as stored: a private ``__x`` of class ``C`` is ``_C__x``."""
    names = []
    for klass in cls.__mro__[:-1]:
        slots = vars(klass).get("__slots__", ())
        for n in [slots] if isinstance(slots, str) else slots:
            if n in ("__dict__", "__weakref__"):
                continue
            if n.startswith("__") and not n.endswith("__") and klass.__name__.lstrip("_"):
                n = f"_{klass.__name__.lstrip('_')}{n}"
            names.append(n)
    return names


def attr_names(obj: Any) -> Optional[tuple]:
    """The names of ``obj``'s instance attributes (its ``__dict__``'s string keys and the
    ``__slots__`` it has set), sorted; None for an object with neither. Entry guards compare
    it, so an object that gains or loses an attribute (one the program read as missing, or
    found on the class) re-captures."""
    d = getattr(obj, "__dict__", None)
    names = set(k for k in d if type(k) is str) if isinstance(d, dict) else set()
    for n in slot_names(type(obj)):
        try:
            object.__getattribute__(obj, n)
            names.add(n)
        except AttributeError:
            pass
    if not names and not isinstance(d, dict) and not slot_names(type(obj)):
        return None
    return tuple(sorted(names))


def distinct(*objs: Any) -> bool:
    """Whether ``objs`` are all different objects (entry guards on mutable inputs that were
    distinct when traced: one passed for two of them is then re-captured)."""
    return len({id(o) for o in objs}) == len(objs)


#: the helpers entry guards may call, under their names in ``guard_expr.GUARD_CALLS``
GUARD_HELPERS = dict(GUARD_FUNCTIONS, _st_method_function=method_function, _st_attr_names=attr_names,
                     _st_distinct=distinct)


def entry_guard_test(guards: Sequence[Guard], globals_: Dict[str, Any], prefix: str = "_guard_e",
                     share: Optional[str] = None) -> str:
    """One Python boolean expression testing all entry guards, in order (short-circuit).

    Binds each guard's expected value in ``globals_`` as ``<prefix><i>``. ``share`` (a name
    prefix; only for a test inside a function body, whose locals these become): what several
    guards read is read once (``root.layers`` for every layer's guards; see
    :func:`~symtrace.graph.guard_expr.render_sharing`)."""
    parts = []
    globals_.update(GUARD_HELPERS)
    texts = render_sharing([g.expr for g in guards], share) if share else [None] * len(guards)
    for i, (g, text) in enumerate(zip(guards, texts)):
        ename = f"{prefix}{i}"
        globals_[ename] = g.expected
        parts.append(g.test_source(ename, text))
    return " and ".join(parts) if parts else "True"


def raise_entry_guard_failure(guards: Sequence[Guard], env: Dict[str, Any],
                              globals_: Dict[str, Any], prefix: str = "_guard_e") -> None:
    """Find the first failing entry guard for the inputs in ``env`` and raise its GuardError.

    A guard reading a module's members from its tables (:class:`~symtrace.graph.guard_expr.
    Member`) that fails there is checked again reading them as attributes, which is what the
    program did. Where every guard holds that way (a member moved to another table or into
    the module's ``__dict__``, as a pass turning a parameter into a buffer does), a graph that
    owns its modules runs on, on this slower path; against a live model (a ``root`` that is not
    a GraphModule: the graph's ``guard_root``) a GuardError names the moved member, so that
    ``capture`` re-captures a graph reading it where it now is."""
    moved = None
    for i, g in enumerate(guards):
        ename = f"{prefix}{i}"
        if _holds(g, ename, globals_, env):
            continue
        plain = attribute_form(g)
        if plain is not g and _holds(plain, ename, globals_, env):
            moved = moved or g
            continue
        try:
            seen = eval(g.expr.render(), globals_, env)
        except Exception:
            raise g.failure(_UNKNOWN) from None
        if g.check == "bool":
            seen = bool(seen)
        raise g.failure(seen) from None
    if moved is not None:
        if hasattr(env.get("root"), "guard_root"):   # (a GraphModule: its own modules)
            return
        raise GuardError(f"guard failed: the graph reads {moved.expr.shown()} from the tables of the modules on "
                         "that path (their _modules, _parameters and _buffers), and it is no longer found there "
                         "(the module changed since the graph was captured); symtrace.capture re-captures.",
                         guard=moved, seen=_UNKNOWN)
    raise GuardError("guard check failed, but every guard holds when re-checked one by one; "
                     "please report this as a symtrace bug")


def attribute_form(g: Guard) -> Guard:
    """``g`` reading each module member as the attribute it stands for
    (:func:`~symtrace.graph.guard_expr.as_attributes`); ``g`` itself where it reads none."""
    expr = as_attributes(g.expr) if isinstance(g.expr, GExpr) else g.expr
    return g if expr == g.expr else Guard(g.kind, expr, g.expected, g.check, g.source, g.reason)


def _holds(g: Guard, ename: str, globals_: Dict[str, Any], env: Dict[str, Any]) -> bool:
    try:
        return bool(eval(g.test_source(ename), globals_, env))
    except Exception:
        return False


def format_guards(guards: List[Guard]) -> List[List[str]]:
    """Rows (kind, assumption, where) for tables and reports."""
    return [[g.kind, g.describe(), g.where()] for g in guards]


def check_entry_guards(guards: Sequence[Guard], env: Dict[str, Any], cache: Dict[str, Any]) -> None:
    """Test ``guards`` on the inputs in ``env`` (names -> values, plus ``root``) as a generated
    ``forward`` does, raising the first failing guard's GuardError. ``cache`` (any dict owned by
    the caller) keeps the compiled test between calls."""
    if not guards:
        return
    entry = cache.get("entry_guards")
    if entry is None or entry[0] != guards:
        import operator
        import sys
        import torch
        globals_ = {"torch": torch, "operator": operator, "math": math, "sys": sys}
        test = compile(entry_guard_test(guards, globals_), "<symtrace-entry-guards>", "eval")
        entry = cache["entry_guards"] = (list(guards), test, globals_)
    _, test, globals_ = entry
    try:
        ok = eval(test, globals_, env)
    except Exception:
        ok = False
    if not ok:
        raise_entry_guard_failure(guards, env, globals_)
