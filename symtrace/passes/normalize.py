"""Bind a call's arguments to parameter names, defaults filled: ``normalize_call``.

``torch.add(x, y)``, ``torch.add(x, y, alpha=1)`` and ``torch.add(input=x, other=y)`` all
normalise to ``{"input": x, "other": y, "alpha": 1}``, so matchers can compare calls written
differently. Where a signature comes from, by kind of target:

- Python functions (``F.softmax``, user functions): :func:`inspect.signature`;
- torch builtins (``torch.add``, ``torch.relu``), ``torch.Tensor`` methods and ``call_method``
  names: torch's operator schemas (``aten::add``), the first overload the arguments fit; the
  tensor argument is ``input`` for functions and ``self`` for methods, as in Python;
- ``operator.*`` and other builtins without a signature: positional names ``arg0``, ``arg1``...;
- ``call_module``: the module type's ``forward`` (pass the module or its type as ``module``).

Binders are cached per target (per module type), so a call costs one dict lookup plus the
binding itself: O(number of parameters).
"""
from __future__ import annotations

import inspect
import operator
import types
from typing import Any, Dict, FrozenSet, NamedTuple, Optional, Tuple

import torch

from ..graph.node import Node

__all__ = ["normalize_call", "bind_call", "Binding"]

_MISSING = object()
_CACHE: Dict[Any, Any] = {}
_CACHE_MAX = 4096

# Tensor dunder methods whose aten operator has another name.
_DUNDER_OPS = {"truediv": "div", "floordiv": "floor_divide", "and": "bitwise_and", "or": "bitwise_or",
               "xor": "bitwise_xor", "invert": "bitwise_not", "lshift": "bitwise_left_shift",
               "rshift": "bitwise_right_shift", "mod": "remainder", "matmul": "matmul"}


class Binding(NamedTuple):
    """A bound call: ``values`` has every parameter (in signature order, defaults filled),
    ``explicit`` the names the call gave, ``defaults`` each defaulted parameter's default."""

    values: Dict[str, Any]
    explicit: FrozenSet[str]
    defaults: Dict[str, Any]


def normalize_call(call: Any, args: Optional[tuple] = None, kwargs: Optional[dict] = None, *,
                   module: Any = None) -> Optional[Dict[str, Any]]:
    """Bind ``args``/``kwargs`` of a call to parameter names, with defaults filled.

    ``call`` is a :class:`~symtrace.graph.Node` (its own args/kwargs are used unless given) or
    an ``(op, target)`` pair. For ``call_module`` pass the called module (or its type) as
    ``module``. Returns ``{name: value}`` in signature order, or None when the target has no
    known signature or the arguments do not fit it (compare positionally then).
    """
    b = bind_call(call, args, kwargs, module=module)
    return None if b is None else b.values


def bind_call(call: Any, args: Optional[tuple] = None, kwargs: Optional[dict] = None, *,
              module: Any = None) -> Optional[Binding]:
    """Like :func:`normalize_call`, but also says which names were explicit and their defaults."""
    if type(call) is Node:
        op, target = call.op, call.target
        args = call.args if args is None else args
        kwargs = call.kwargs if kwargs is None else kwargs
    else:
        op, target = call
    binder = binder_for(op, target, module)
    if binder is None:
        return None
    return binder.bind(tuple(args or ()), dict(kwargs or {}))


def binder_for(op: str, target: Any, module: Any = None):
    """The cached binder of a target (an object with ``bind(args, kwargs) -> Binding|None``),
    or None when its signature is unknown."""
    if op == "call_module":
        if module is None:
            return None
        key = (op, module if isinstance(module, type) else type(module))
    else:
        key = (op, target)
    try:
        return _CACHE[key]
    except KeyError:
        pass
    except TypeError:  # unhashable target: no caching
        return _make_binder(op, target, module)
    binder = _make_binder(op, target, module)
    if len(_CACHE) >= _CACHE_MAX:  # targets may be user functions: do not keep them forever
        _CACHE.clear()
    _CACHE[key] = binder
    return binder


def _make_binder(op: str, target: Any, module: Any):
    if op == "call_module":
        cls = module if isinstance(module, type) else type(module)
        try:
            sig = inspect.signature(cls.forward)
        except (TypeError, ValueError):
            return None
        params = list(sig.parameters.values())[1:]  # drop self
        return _PyBinder(sig.replace(parameters=params))
    if op == "call_method":
        return _schema_binder(target, method=True) if isinstance(target, str) else None
    if op != "call_function":
        return None
    schema = getattr(target, "_schema", None)
    if isinstance(schema, torch._C.FunctionSchema):  # an OpOverload (torch.ops.aten.add.Tensor)
        return _SchemaBinder([schema], "self")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _SchemaBinder(torch._C._jit_get_schemas_for_operator(target._qualified_op_name), "self")
    if isinstance(target, (types.MethodDescriptorType, types.WrapperDescriptorType)) and \
            getattr(target, "__objclass__", None) in (torch._C.TensorBase, torch.Tensor):
        return _schema_binder(target.__name__, method=True)
    if getattr(operator, getattr(target, "__name__", ""), None) is target:
        return _POSITIONAL
    builtin = isinstance(target, types.BuiltinFunctionType)
    if builtin and _is_torch_builtin(target):
        b = _schema_binder(target.__name__, method=False)
        if b is not None:
            return b
    try:
        return _PyBinder(inspect.signature(target))
    except (TypeError, ValueError):
        pass
    if builtin:
        return _POSITIONAL
    return None


def _is_torch_builtin(fn: Any) -> bool:
    mod = getattr(fn, "__module__", None) or ""
    if mod.startswith("torch"):
        return True
    owner = getattr(fn, "__self__", None)  # torch.add is a method of torch._C._VariableFunctions
    return isinstance(owner, type) and owner.__module__.startswith("torch") or \
        (isinstance(owner, types.ModuleType) and owner.__name__.startswith("torch"))


def _schema_binder(name: str, method: bool):
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        if core.startswith(("r", "i")) and core[1:] in ("add", "sub", "mul", "truediv", "floordiv", "pow",
                                                         "matmul", "mod", "and", "or", "xor"):
            core = core[1:]  # __radd__ / __iadd__: same parameters (self, other)
        name = _DUNDER_OPS.get(core, core)
    schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    if not schemas:
        return None
    return _SchemaBinder(schemas, "self" if method else "input")


class _PyBinder:
    """Binds with an :class:`inspect.Signature`."""

    __slots__ = ("sig", "defaults")

    def __init__(self, sig: inspect.Signature):
        self.sig = sig
        self.defaults = {p.name: p.default for p in sig.parameters.values()
                         if p.default is not inspect.Parameter.empty}

    def bind(self, args: tuple, kwargs: dict) -> Optional[Binding]:
        try:
            ba = self.sig.bind(*args, **kwargs)
        except TypeError:
            return None
        explicit = frozenset(ba.arguments)
        ba.apply_defaults()
        return Binding(dict(ba.arguments), explicit, self.defaults)


class _PositionalBinder:
    """Positional-only calls without a signature (builtins): names ``arg0``, ``arg1``..."""

    __slots__ = ()

    def bind(self, args: tuple, kwargs: dict) -> Optional[Binding]:
        if kwargs:
            return None
        values = {f"arg{i}": a for i, a in enumerate(args)}
        return Binding(values, frozenset(values), {})


_POSITIONAL = _PositionalBinder()


class _Overload:
    __slots__ = ("names", "nameset", "npos", "kwonly", "defaults", "pack", "rank")

    def __init__(self, schema, first_name: str):
        args = list(schema.arguments)
        self.names = []
        self.defaults: Dict[str, Any] = {}
        self.kwonly = set()
        positional = []
        for i, a in enumerate(args):
            name = first_name if (i == 0 and a.name == "self") else a.name
            self.names.append(name)
            if a.has_default_value():
                self.defaults[name] = a.default_value
            if a.kwarg_only:
                self.kwonly.add(name)
            else:
                positional.append((name, a))
        self.nameset = frozenset(self.names)
        self.npos = len(positional)
        # ``x.view(2, 3)``: trailing int-list parameter may be given as varargs
        self.pack = bool(positional) and isinstance(positional[-1][1].type, torch.ListType)
        has_out = any(a.name == "out" for a in args)
        first_self = bool(args) and args[0].name == "self"
        self.rank = (has_out, not first_self)

    def bind(self, args: tuple, kwargs: dict, first_name: str) -> Optional[Binding]:
        names = self.names
        if len(args) > self.npos:
            if not self.pack:
                return None
            k = self.npos - 1
            args = args[:k] + (tuple(args[k:]),)
        values: Dict[str, Any] = {}
        for name, a in zip(names, args):
            values[name] = a
        for k, v in kwargs.items():
            if k == "self" or k == "input":
                k = first_name
            if k not in self.nameset or k in values:
                return None
            values[k] = v
        explicit = frozenset(values)
        out: Dict[str, Any] = {}
        for name in names:
            if name in values:
                out[name] = values[name]
            elif name in self.defaults:
                out[name] = self.defaults[name]
            else:
                return None
        return Binding(out, explicit, self.defaults)


class _SchemaBinder:
    """Binds with torch operator schemas: the first overload the arguments fit, preferring
    overloads without ``out=`` whose first argument is the tensor."""

    __slots__ = ("overloads", "first_name")

    def __init__(self, schemas, first_name: str):
        self.first_name = first_name
        overloads = [_Overload(s, first_name) for s in schemas]
        overloads.sort(key=lambda o: o.rank)  # stable: keeps torch's order otherwise
        self.overloads: Tuple[_Overload, ...] = tuple(overloads)

    def bind(self, args: tuple, kwargs: dict) -> Optional[Binding]:
        for ov in self.overloads:
            b = ov.bind(args, kwargs, self.first_name)
            if b is not None:
                return b
        return None
