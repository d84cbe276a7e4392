"""``Proxy``: the stand-in for a traced value while a program runs under the tracer.

A proxy wraps the graph node that computes its value. It takes part in ``__torch_function__``
(``torch.*``, ``torch.nn.functional.*``) and the Python data model (operators, reflected and
in-place forms, indexing and item assignment, attributes, method calls), and every use is
recorded as a new node by its :class:`~symtrace.trace.Tracer`.

With example inputs a proxy also carries the real value it stands for, so Python-level
decisions (``bool()``, ``int()``, ``len()``, iteration, ``isinstance``) resolve — and each one
is recorded as a guard. Without a value, such a decision raises a :class:`TraceError` naming
the user's line.
"""
from __future__ import annotations

import dis
import operator
import sys
from typing import Any

from torch import Tensor as _TENSOR

from .errors import TraceError
from .graph.tree import tree_iter

__all__ = ["Proxy", "Attribute", "NO_VALUE", "claimed_class"]


class _NoValue:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<no value>"


#: The ``value`` of a proxy traced without example inputs.
NO_VALUE = _NoValue()


class Proxy:
    """A traced value: ``node`` computes it, ``tracer`` records its uses.

    ``value`` is the example value it stands for (or :data:`NO_VALUE`); ``expr`` is a guard
    expression (:mod:`symtrace.graph.guard_expr`) reading it from the graph's inputs and module
    state when it depends only on their metadata (e.g. ``x.shape[0]``) — guards on such values
    are checked at entry.
    """

    __slots__ = ("node", "tracer", "value", "expr", "guess")

    def __init__(self, node, tracer=None, value: Any = NO_VALUE, expr=None, guess=None):
        if tracer is None:  # type(x)(...) in the program: type() of a traced value is Proxy
            raise _type_call_error()
        osa = object.__setattr__
        osa(self, "node", node)
        osa(self, "tracer", tracer)
        osa(self, "value", value)
        osa(self, "expr", expr)
        osa(self, "guess", guess)

    # isinstance(proxy, int) answers for the value the proxy stands for. Tensors are the
    # exception: C code (torch's argument parser) asks the same question and would then read
    # the proxy as a C tensor, so for them the tracer answers Python's isinstance instead
    # (symtrace.trace.proxies_pass_isinstance), and ``x.__class__`` written in Python code
    # (an attribute load in the calling frame, not a C call) names the tensor's class.
    @property
    def __class__(self):
        cls = claimed_class(self)
        if cls is None:
            return Proxy
        if issubclass(cls, _TENSOR):
            if not python_reads_attribute(sys._getframe(1)):
                return Proxy
            object.__getattribute__(self, "tracer").class_read(self, cls)
        return cls

    def __repr__(self) -> str:
        return f"Proxy({self.node.name})"

    def __str__(self) -> str:
        return self.tracer.proxy_text(self, str)

    def __format__(self, spec: str) -> str:
        return self.tracer.proxy_text(self, lambda v: format(v, spec))

    def __hash__(self) -> int:
        return self.tracer.proxy_hash(self)

    # --- torch ---------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = _find_tracer(args, kwargs)
        return tracer.torch_function(func, args, kwargs or {})

    # --- attributes ----------------------------------------------------------------------
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name == "node":  # only a lazy attribute has no node yet
            return self._materialize()
        return self.tracer.proxy_getattr(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.tracer.proxy_setattr(self, name, value)

    # --- decisions: these need a concrete answer -------------------------------------------
    def __bool__(self) -> bool:
        return self.tracer.force(self, "bool")

    def __int__(self) -> int:
        return self.tracer.force(self, "int")

    def __index__(self) -> int:
        return self.tracer.force(self, "int")

    def __float__(self) -> float:
        return self.tracer.force(self, "float")

    def __len__(self) -> int:
        return self.tracer.proxy_len(self)

    def __iter__(self):
        return self.tracer.proxy_iter(self)

    def __contains__(self, item) -> bool:
        return self.tracer.force(self.tracer.call_function(operator.contains, (self, item)), "bool")

    def __getitem__(self, idx):
        return self.tracer.call_function(operator.getitem, (self, idx))

    def __setitem__(self, idx, value) -> None:
        self.tracer.call_function(operator.setitem, (self, idx, value))

    def __call__(self, *args, **kwargs):
        return self.tracer.call_function(_call_value, (self,) + args, kwargs)

    # --- NumPy: its dispatch protocols record ufuncs and functions on traced values -------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = ufunc if method == "__call__" else getattr(ufunc, method)
        return self.tracer.call_function(fn, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return self.tracer.call_function(func, args, kwargs)

    def __deepcopy__(self, memo):
        raise TraceError(f"cannot deep-copy the traced value {self.node.name!r} while tracing; "
                         "use .clone() for tensors")

    def __reduce_ex__(self, protocol):
        raise TraceError(f"cannot pickle the traced value {self.node.name!r} while tracing")


class Attribute(Proxy):
    """``x.name`` on a proxy without a value: a method if called (``call_method``), else an
    attribute read (a ``getattr`` node, created when first used)."""

    __slots__ = ("owner", "attr")

    def __init__(self, owner: Proxy, attr: str):
        osa = object.__setattr__
        osa(self, "tracer", owner.tracer)
        osa(self, "value", NO_VALUE)
        osa(self, "expr", None)
        osa(self, "guess", None)
        osa(self, "owner", owner)
        osa(self, "attr", attr)

    def _materialize(self):
        node = self.tracer.create_node("call_function", getattr, (self.owner.node, self.attr))
        object.__setattr__(self, "node", node)
        return node

    def __call__(self, *args, **kwargs):
        return self.tracer.call_method(self.attr, self.owner, args, kwargs)

    def __repr__(self) -> str:
        return f"Attribute({self.owner!r}.{self.attr})"


_LOAD_ATTR_OPS = frozenset(op for name, op in dis.opmap.items() if name.startswith("LOAD_ATTR"))
_ATTR_LOADS: dict = {}  # code object -> offsets of its attribute loads


def python_reads_attribute(frame) -> bool:
    """Whether ``frame`` is executing an attribute load (``obj.__class__`` in Python source)
    rather than a call into C code that asks for ``__class__`` itself."""
    code = frame.f_code
    offsets = _ATTR_LOADS.get(code)
    if offsets is None:
        raw = code.co_code
        offsets = _ATTR_LOADS[code] = frozenset(i for i in range(0, len(raw), 2) if raw[i] in _LOAD_ATTR_OPS)
    return frame.f_lasti in offsets


def claimed_class(p: Proxy):
    """The class of the value proxy ``p`` stands for (its example value's, else the tracer's
    guess), or None when unknown."""
    v = object.__getattribute__(p, "value")
    if v is not NO_VALUE:
        return type(v)
    return object.__getattribute__(p, "guess")


def _type_call_error() -> TraceError:
    from .graph.source import user_location
    loc = user_location(3)
    return TraceError(
        f"the program calls type(x)(...) of a traced value at {loc.describe() if loc else 'an unknown line'}: "
        "type() of a traced value is symtrace's Proxy class, not the class of the value it stands for "
        "(only x.__class__ and isinstance answer for that value). Build the container directly "
        "(list(...), tuple(...)), or pass the value through concrete_args.")


def _call_value(fn, *args, **kwargs):
    """Call a traced callable value (e.g. a function returned by a traced op)."""
    return fn(*args, **kwargs)


def _find_tracer(args, kwargs):
    for a in tree_iter((args, kwargs), subclasses=True):  # (torch also finds proxies in list subclasses)
        if type(a) is Proxy:
            return a.tracer
    raise RuntimeError("no Proxy among the arguments")


def _binary(fn):
    def forward(self, other):
        return self.tracer.call_function(fn, (self, other))

    def reflected(self, other):
        return self.tracer.call_function(fn, (other, self))

    return forward, reflected


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lshift",
              "rshift", "and", "or", "xor"):
    _op = getattr(operator, _name + "_" if _name in ("and", "or") else _name)
    _f, _r = _binary(_op)
    setattr(Proxy, f"__{_name}__", _f)
    setattr(Proxy, f"__r{_name}__", _r)
    _iop = getattr(operator, f"i{_name}")

    def _inplace(self, other, _iop=_iop):
        return self.tracer.call_function(_iop, (self, other))

    setattr(Proxy, f"__i{_name}__", _inplace)

for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(Proxy, f"__{_name}__", _binary(getattr(operator, _name))[0])

for _name, _op in (("neg", operator.neg), ("pos", operator.pos), ("invert", operator.invert),
                   ("abs", operator.abs)):
    def _unary(self, _op=_op):
        return self.tracer.call_function(_op, (self,))

    setattr(Proxy, f"__{_name}__", _unary)

for _name in ("floor", "ceil", "trunc"):
    import math as _math
    _fn = getattr(_math, _name)

    def _rounding(self, _fn=_fn):
        return self.tracer.call_function(_fn, (self,))

    setattr(Proxy, f"__{_name}__", _rounding)


def _round(self, ndigits=None):
    return self.tracer.call_function(round, (self,) if ndigits is None else (self, ndigits))


Proxy.__round__ = _round
