"""What a saved file may name: call targets, classes and method names, by dotted name.

Loading never imports or evaluates anything a file names. A name resolves only through
this allow-list:

* ``torch.*`` operators (C builtins, minus thread/autocast/file/JIT setters) and the Python
  functions of ``torch.functional`` and ``torch.random``; ``torch.nn.functional``,
  ``torch.fft``, ``torch.linalg``, ``torch.special``; ``torch.Tensor`` methods;
  ``torch.ops.<ns>.<op>[.<overload>]`` operator overloads;
* ``operator`` (minus ``attrgetter``/``methodcaller``/``call``), ``math``, a few builtins
  (``getattr``, ``len``, ``int``, ``tuple``...);
* the helpers symtrace's tracer puts into graphs (``check_data_guard``, ...);
* module classes defined under ``torch.nn.modules`` / ``torch.ao.nn`` (and ``nn.Module``);
* whatever the user registers with :func:`register_target`.
"""
from __future__ import annotations

import builtins
import collections
import math
import operator
import re
import sys
import types
from typing import Any, Dict, Optional

import torch
from torch import nn

from ..graph.graph_module import GraphModule
from .errors import SerializationError

__all__ = ["register_target", "name_of", "resolve", "resolve_module_class", "module_class_name",
           "METHOD_NAMES", "is_allowed_method", "how_to_register"]

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

SAFE_BUILTINS = ("abs", "all", "any", "bool", "complex", "dict", "divmod", "enumerate", "float",
                 "frozenset", "getattr", "hasattr", "int", "isinstance", "issubclass", "len", "list",
                 "max", "min", "pow", "print", "range", "reversed", "round", "set", "slice",
                 "sorted", "str", "sum", "tuple", "zip")
_OPERATOR_DENY = frozenset({"attrgetter", "methodcaller", "call"})
# C builtins in the torch namespace that touch files, threads, the JIT or global modes
_TORCH_DENY = frozenset({"fork", "wait", "from_file", "import_ir_module", "import_ir_module_from_buffer",
                         "init_num_threads", "clear_autocast_cache", "autocast_increment_nesting",
                         "autocast_decrement_nesting"})
_TORCH_PY_MODULES = frozenset({"torch.functional", "torch.random", "torch._lowrank"})
_TORCH_PY_OK = frozenset({"_assert", "is_tensor", "is_storage", "typename", "sym_int", "sym_float",
                          "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_sum", "sym_ite"})
_TORCH_C_OK = ("_set_grad_enabled", "is_grad_enabled")
_OPERATOR_DUNDERS = frozenset(
    f"__{p}{n}__" for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lshift",
                            "rshift", "and", "or", "xor") for p in ("", "r", "i")
) | frozenset(f"__{n}__" for n in ("neg", "pos", "invert", "abs", "eq", "ne", "lt", "le", "gt", "ge",
                                   "getitem", "setitem", "delitem", "len", "contains", "bool", "int",
                                   "float", "index", "round", "floor", "ceil", "trunc", "iter"))
_CONTAINER_METHODS = frozenset({"keys", "values", "items", "get", "index", "count", "copy", "bit_length",
                                "numel", "conjugate", "is_integer"})
_MODULE_PREFIXES = ("torch.nn.modules.", "torch.ao.nn.")
_HELPERS = {  # the functions symtrace's tracer records into graphs
    "symtrace.graph.guards.check_data_guard": ("symtrace.graph.guards", "check_data_guard"),
    "symtrace.proxy._call_value": ("symtrace.proxy", "_call_value"),
    "symtrace.tracer.apply_autograd_function": ("symtrace.tracer", "apply_autograd_function"),
}
GRAPH_MODULE_CLASS = "symtrace.GraphModule"

_REGISTERED: Dict[str, Any] = {}
_REGISTERED_IDS: Dict[int, str] = {}
_REGISTERED_METHODS: set = set()
_TABLE: Optional[Dict[str, Any]] = None
_TABLE_IDS: Optional[Dict[int, str]] = None


def how_to_register(obj: Any = None, name: str = "") -> str:
    what = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or name or "it"
    return (f"if you trust it, call symtrace.serialize.register_target({what}) before saving and before "
            "loading (the same name must be registered on both sides)")


def register_target(obj: Any, name: Optional[str] = None) -> Any:
    """Allow ``obj`` (a function, a class, or a method name given as a string) in saved files.

    Graphs that call a function of your own (a :func:`~symtrace.leaf_function`, an autograd
    ``Function``), hold a namedtuple/dataclass/enum of your own, or contain a module class of
    your own can only be saved and loaded once it is registered, under the same ``name`` on both
    sides (default: ``module.qualname``). Registered classes of modules are rebuilt without
    calling their ``__init__``; instances of other registered classes from their ``__dict__``.
    Returns ``obj``, so it can be used as a decorator.
    """
    if isinstance(obj, str):
        if not obj.isidentifier() or (obj.startswith("__") and obj not in _OPERATOR_DUNDERS):
            raise ValueError(f"register_target({obj!r}): a method name must be an identifier, not a dunder")
        _REGISTERED_METHODS.add(obj)
        return obj
    if not callable(obj):
        raise TypeError(f"register_target expects a function, a class or a method name, got {type(obj).__name__}")
    inner = getattr(obj, "__symtrace_leaf__", None)  # a leaf_function wrapper: graphs record the inner function
    target = inner if inner is not None else obj
    if name is None:
        mod = getattr(target, "__module__", None) or ""
        qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", "")
        name = f"{mod}.{qual}" if mod else qual
    if not isinstance(name, str) or not _DOTTED.match(name) or any(p.startswith("__") for p in name.split(".")):
        raise ValueError(f"register_target: {name!r} is not a dotted name of identifiers (no dunders); "
                         "pass name='mypackage.my_fn'")
    known = _builtin_resolve(name)
    if known is not None and known is not target:
        raise ValueError(f"register_target: {name!r} already names {known!r} on the built-in allow-list")
    old = _REGISTERED.get(name)
    if old is not None and old is not target:
        raise ValueError(f"register_target: {name!r} is already registered for {old!r}")
    _REGISTERED[name] = target
    _REGISTERED_IDS[id(target)] = name
    if inner is not None:
        _REGISTERED_IDS[id(obj)] = name
    return obj


# --- the built-in table ------------------------------------------------------------------------
def _is_function(obj: Any) -> bool:
    return isinstance(obj, (types.BuiltinFunctionType, types.FunctionType, types.BuiltinMethodType)) \
        or type(obj).__name__ in ("method_descriptor", "wrapper_descriptor", "_lru_cache_wrapper")


def _torch_ok(name: str, obj: Any) -> bool:
    if isinstance(obj, (type, types.ModuleType)) or not callable(obj):
        return False
    if name in _TORCH_DENY or name.startswith("set_") or (name.startswith("_") and name not in _TORCH_PY_OK):
        return False
    if isinstance(obj, types.BuiltinFunctionType):
        return True
    if isinstance(obj, types.FunctionType):
        mod = obj.__module__
        return mod in _TORCH_PY_MODULES or (mod == "torch" and name in _TORCH_PY_OK)
    return False


def _torch_sub_ok(name: str, obj: Any) -> bool:
    if name.startswith("__") or isinstance(obj, (type, types.ModuleType)) or not _is_function(obj):
        return False
    mod = getattr(obj, "__module__", None)
    return mod is None or mod.startswith("torch")


def _build_table() -> None:
    global _TABLE, _TABLE_IDS
    table: Dict[str, Any] = {}

    def add(name: str, obj: Any) -> None:
        table.setdefault(name, obj)

    for n in SAFE_BUILTINS:
        add(n, getattr(builtins, n))
    for n, obj in vars(torch).items():
        if _torch_ok(n, obj):
            add(f"torch.{n}", obj)
    for n in _TORCH_C_OK:
        add(f"torch._C.{n}", getattr(torch._C, n))
    for prefix, mod in (("torch.nn.functional", torch.nn.functional), ("torch.fft", torch.fft),
                        ("torch.linalg", torch.linalg), ("torch.special", torch.special)):
        for n, obj in vars(mod).items():
            if _torch_sub_ok(n, obj):
                add(f"{prefix}.{n}", obj)
    for n in dir(torch.Tensor):
        if n.startswith("_") and n not in _OPERATOR_DUNDERS:
            continue
        obj = getattr(torch.Tensor, n, None)
        if callable(obj) and not isinstance(obj, type):
            add(f"torch.Tensor.{n}", obj)
    for n, obj in vars(operator).items():
        if not n.startswith("_") and n not in _OPERATOR_DENY and callable(obj) and not isinstance(obj, type):
            add(f"operator.{n}", obj)
    for n, obj in vars(math).items():
        if not n.startswith("_") and callable(obj):
            add(f"math.{n}", obj)
    for n, cls in (("torch.Tensor", torch.Tensor), ("torch.Size", torch.Size), ("torch.device", torch.device),
                   ("torch.nn.Parameter", nn.Parameter), ("collections.OrderedDict", collections.OrderedDict),
                   ("NoneType", type(None)), ("torch.no_grad", torch.no_grad),
                   ("torch.enable_grad", torch.enable_grad), ("torch.set_grad_enabled", torch.set_grad_enabled)):
        add(n, cls)
    ids: Dict[int, str] = {}
    for name, obj in table.items():
        ids.setdefault(id(obj), name)
    _TABLE, _TABLE_IDS = table, ids


def _table() -> Dict[str, Any]:
    if _TABLE is None:
        _build_table()
    return _TABLE


def _helper(name: str) -> Any:
    spec = _HELPERS.get(name)
    if spec is None:
        return None
    mod = sys.modules.get(spec[0])
    return getattr(mod, spec[1], None) if mod is not None else None


def _torch_op(name: str) -> Any:
    parts = name.split(".")
    if len(parts) not in (4, 5) or any(p.startswith("_") for p in parts[2:]):
        return None
    ns = getattr(torch.ops, parts[2], None)
    if not isinstance(ns, torch._ops._OpNamespace):
        return None
    try:
        packet = getattr(ns, parts[3])
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    if len(parts) == 4:
        return packet
    try:
        op = getattr(packet, parts[4])
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, torch._ops.OpOverload) else None


def _builtin_resolve(name: str) -> Any:
    obj = _table().get(name)
    if obj is not None:
        return obj
    if name in _HELPERS:
        return _helper(name)
    if name.startswith("torch.ops."):
        return _torch_op(name)
    cls = resolve_module_class(name, quiet=True)
    return cls


# --- public look-ups -------------------------------------------------------------------------
def resolve(name: Any, what: str = "target") -> Any:
    """The object a saved dotted ``name`` stands for; SerializationError if it is not allowed."""
    if not isinstance(name, str) or not _DOTTED.match(name):
        raise SerializationError(f"the file names the {what} {name!r}, which is not a dotted name")
    obj = _REGISTERED.get(name)
    if obj is None:
        obj = _builtin_resolve(name)
    if obj is None:
        raise SerializationError(
            f"the file names the {what} {name!r}, which is not on symtrace's allow-list of loadable "
            f"targets (torch, operator, math, safe builtins and registered objects); {how_to_register(name=name)}")
    return obj


def name_of(obj: Any) -> Optional[str]:
    """The dotted name under which ``obj`` resolves on load, or None when it is not allowed."""
    try:
        hit = _REGISTERED_IDS.get(id(obj))
        if hit is not None and _REGISTERED.get(hit) is not None:
            return hit
        _table()
        hit = _TABLE_IDS.get(id(obj))
        if hit is not None:
            return hit
        for name in _HELPERS:
            if _helper(name) is obj:
                return name
        if isinstance(obj, torch._ops.OpOverload):
            name = f"torch.ops.{obj.namespace}.{obj._opname}.{obj._overloadname}"
            return name if _torch_op(name) is obj else None
        if isinstance(obj, torch._ops.OpOverloadPacket):
            name = f"torch.ops.{obj._qualified_op_name.replace('::', '.')}"
            return name if _torch_op(name) is obj else None
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            return module_class_name(obj)
    except Exception:  # an object whose attributes misbehave is simply not allowed
        return None
    return None


def module_class_name(cls: type) -> Optional[str]:
    """The saved name of a module class, or None when it is not loadable."""
    if cls is GraphModule:
        return GRAPH_MODULE_CLASS
    hit = _REGISTERED_IDS.get(id(cls))
    if hit is not None:
        return hit
    if cls is nn.Module:
        return "torch.nn.Module"
    short = f"torch.nn.{cls.__name__}"
    if resolve_module_class(short, quiet=True) is cls:
        return short
    full = f"{cls.__module__}.{cls.__qualname__}"
    return full if resolve_module_class(full, quiet=True) is cls else None


def resolve_module_class(name: str, quiet: bool = False) -> Optional[type]:
    """A module class by saved name: torch.nn's own layers, GraphModule, or registered classes."""
    cls = None
    if name == GRAPH_MODULE_CLASS:
        cls = GraphModule
    elif name in _REGISTERED:
        cls = _REGISTERED[name]
    elif name == "torch.nn.Module":
        cls = nn.Module
    elif _DOTTED.match(name) and not any(p.startswith("__") for p in name.split(".")):
        parts = name.split(".")
        if len(parts) == 3 and name.startswith("torch.nn."):
            cls = vars(torch.nn).get(parts[2])
        elif name.startswith(_MODULE_PREFIXES):
            cls = _class_by_path(parts)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)
                and (cls.__module__ or "").startswith(_MODULE_PREFIXES)):
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        cls = None
    if cls is None and not quiet:
        raise SerializationError(
            f"the file holds a module of class {name!r}, which is not a torch.nn layer nor a registered "
            f"class; {how_to_register(name=name)}")
    return cls


def _class_by_path(parts) -> Any:
    for i in range(len(parts) - 1, 2, -1):
        modname = ".".join(parts[:i])
        mod = sys.modules.get(modname)  # already imported by torch: nothing is imported here
        if mod is not None:
            obj = mod
            for p in parts[i:]:
                obj = vars(obj).get(p) if isinstance(obj, (type, types.ModuleType)) else None
            return obj
    return None


def _method_names() -> frozenset:
    names = set(_OPERATOR_DUNDERS) | _CONTAINER_METHODS
    for n in dir(torch.Tensor):
        if not n.startswith("_") and callable(getattr(torch.Tensor, n, None)):
            names.add(n)
    for n in dir(str):
        if not n.startswith("_") and n not in ("format", "format_map"):
            names.add(n)
    return frozenset(names)


METHOD_NAMES = _method_names()


def is_allowed_method(name: Any) -> bool:
    """Whether ``call_method`` nodes may call a method of this name."""
    return isinstance(name, str) and (name in METHOD_NAMES or name in _REGISTERED_METHODS)
