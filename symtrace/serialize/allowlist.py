"""What a saved file may name: call targets, classes and method names, by dotted name.

Loading never imports or evaluates anything a file names. A name resolves only through
this allow-list:

* ``torch.*`` operators (C builtins, minus thread/autocast/file/JIT functions) and the Python
  functions of ``torch.functional`` and ``torch.random``; the public functions of
  ``torch.nn.functional``, ``torch.fft``, ``torch.linalg``, ``torch.special`` (not the helpers
  they import); ``torch.Tensor`` methods minus the escape hatches (``_ESCAPES``: storages,
  shared memory, numpy, callables, hooks...); ``torch.ops`` overloads admitted by schema
  (value-typed arguments and returns; aten ops with a Python form, an export tag or on a short
  list; prims);
* ``operator`` (minus ``attrgetter``/``methodcaller``/``call``), ``math``, a few builtins
  (``getattr``, ``len``, ``int``, ``tuple``...);
* the helpers symtrace puts into graphs (``_HELPERS``): the tracer's (``check_data_guard``,
  ...) and the quantization passes' pure tensor functions (``quantize_per_tensor``,
  ``int8_conv2d``, ...), whose modules are imported from that fixed list when loading;
* module classes defined under ``torch.nn.modules`` / ``torch.ao.nn`` (and ``nn.Module``);
* whatever the user registers with :func:`register_target`.

The set is closed over what it admits: no admitted name, method or attribute (``METHOD_NAMES``,
``ATTRIBUTE_NAMES``) returns a storage, a file, a Python module, a frame, code, a function's
globals or class internals, and callables that read attributes by a runtime name or call what
they are given are call targets only, never stored values (``is_value_name``).
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
           "METHOD_NAMES", "ATTRIBUTE_NAMES", "is_allowed_method", "is_allowed_attribute", "is_value_name",
           "how_to_register"]

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

SAFE_BUILTINS = ("abs", "all", "any", "bool", "complex", "dict", "divmod", "enumerate", "float",
                 "frozenset", "getattr", "hasattr", "int", "isinstance", "issubclass", "len", "list",
                 "max", "min", "pow", "print", "range", "reversed", "round", "set", "slice",
                 "sorted", "str", "sum", "tuple", "zip")
_OPERATOR_DENY = frozenset({"attrgetter", "methodcaller", "call"})
# C builtins in the torch namespace that touch files, threads, the JIT or global modes
_TORCH_DENY = frozenset({"fork", "wait", "from_file", "import_ir_module", "import_ir_module_from_buffer",
                         "init_num_threads", "clear_autocast_cache", "autocast_increment_nesting",
                         "autocast_decrement_nesting",
                         # the TorchScript compiler's parsers (they return JIT graphs, schemas and types)
                         "parse_ir", "parse_schema", "parse_type_comment", "merge_type_from_type_comment",
                         "unify_type_list",
                         # an opaque capsule that owns a tensor's memory
                         "to_dlpack"})
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
# Escape hatches: names that lead out of the world of tensors and plain values (to storages and
# shared-memory files, numpy arrays and their file methods, callables run on data, autograd hooks
# and graph nodes, other classes, streams, str.format's attribute lookups, frames and code). They
# are never call targets (``torch.Tensor.<name>``), call_method names, getattr/hasattr names or
# registrable names, whatever else admits them.
_ESCAPES = frozenset({
    "storage", "untyped_storage", "storage_type", "set_", "share_memory_", "numpy", "apply_", "map_", "map2_",
    "register_hook", "register_post_accumulate_grad_hook", "grad_fn", "as_subclass", "record_stream",
    "format", "format_map", "mro", "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await",
    "ag_frame", "ag_code", "ag_await", "f_globals", "f_locals", "f_builtins", "f_back", "f_code", "tb_frame",
    "tb_next", "func_globals", "func_code", "im_func", "im_self"})
# attributes of the plain values a graph computes, besides tensors' (torch.Size and containers
# have theirs among the method names): dtypes, devices, numbers, slices, enum members, finfo
_VALUE_ATTRS = frozenset({
    "abbr", "is_complex", "is_floating_point", "is_signed", "itemsize", "to_complex", "to_real",  # torch.dtype
    "type", "index",  # torch.device
    "real", "imag", "numerator", "denominator", "conjugate", "is_integer", "bit_length",  # numbers
    "start", "stop", "step",  # slice
    "name", "value",  # enum members
    "bits", "eps", "max", "min", "tiny", "smallest_normal", "resolution", "dtype"})  # torch.finfo / iinfo
# call targets that take an attribute name or a callable to call: a graph may call them, a stored
# value ($ref) may not be them
_NOT_VALUES = frozenset({"getattr", "hasattr", "symtrace.proxy._call_value",
                         "symtrace.tracer.apply_autograd_function"})
_MODULE_PREFIXES = ("torch.nn.modules.", "torch.ao.nn.")
_HELPERS = {  # the functions symtrace's tracer records into graphs
    "symtrace.graph.guards.check_data_guard": ("symtrace.graph.guards", "check_data_guard"),
    "symtrace.proxy._call_value": ("symtrace.proxy", "_call_value"),
    "symtrace.tracer.apply_autograd_function": ("symtrace.trace.patches", "apply_autograd_function"),
    "symtrace.rollback.record_write": ("symtrace.rollback", "record_write"),  # a no-op outside capture
    # symtrace.passes.quant: the q/dq primitives of reference graphs and the int8 calls of lowered
    # and dynamic graphs; tensor computations only (fused calls pick a registered backend by name)
    **{f"symtrace.passes.quant.qparams.{n}": ("symtrace.passes.quant.qparams", n)
       for n in ("quantize_per_tensor", "dequantize_per_tensor", "dequantize_per_channel", "requantize_per_tensor",
                 "reference_conv2d", "reference_linear")},
    **{f"symtrace.passes.quant.kernels.{n}": ("symtrace.passes.quant.kernels", n)
       for n in ("int8_conv2d", "int8_linear", "int8_dynamic_linear", "int8_add", "int8_cat", "int8_avg_pool2d",
                 "int8_adaptive_avg_pool2d", "int8_max_pool2d", "int8_relu", "int8_lut", "woq_linear")},
}


def import_helper_modules() -> None:
    """Import the symtrace modules that define the ``_HELPERS`` above (a fixed list: nothing a
    file names), so that they resolve in a process that has not imported them yet."""
    import importlib
    for modname in sorted({spec[0] for spec in _HELPERS.values()}):
        if modname not in sys.modules:
            importlib.import_module(modname)
GRAPH_MODULE_CLASS = "symtrace.GraphModule"

_REGISTERED: Dict[str, Any] = {}
_REGISTERED_IDS: Dict[int, str] = {}
_REGISTERED_METHODS: set = set()
_REGISTERED_ATTRS: set = set()  # field names of registered classes: getattr/hasattr may read them
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
    A registered class's field names (namedtuple fields, dataclass fields, annotated attributes,
    properties) become names that loaded graphs may read with ``getattr``; a registered method
    name may be called (``call_method``) and read. Operators of ``torch.ops`` namespaces other
    than ``aten`` / ``prims`` are registered as ``torch.ops.<ns>.<op>.<overload>``.
    Returns ``obj``, so it can be used as a decorator.
    """
    if isinstance(obj, str):
        if not obj.isidentifier() or (obj.startswith("__") and obj not in _OPERATOR_DUNDERS):
            raise ValueError(f"register_target({obj!r}): a method name must be an identifier, not a dunder")
        if obj in _ESCAPES:
            raise ValueError(f"register_target({obj!r}): {obj!r} leads out of the tensor world (storages, files, "
                             "callables, hooks, frames) and cannot be allowed")
        _REGISTERED_METHODS.add(obj)
        return obj
    if not callable(obj):
        raise TypeError(f"register_target expects a function, a class or a method name, got {type(obj).__name__}")
    from ..graph.replay import ROOT_HELPERS
    if obj in ROOT_HELPERS:
        raise ValueError(f"register_target({obj.__name__}): graphs replaying Python side effects write to the "
                         "loading program's objects; they are never loadable")
    inner = getattr(obj, "__symtrace_leaf__", None)  # a leaf_function wrapper: graphs record the inner function
    target = inner if inner is not None else obj
    if name is None and isinstance(target, torch._ops.OpOverload):
        name = f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    elif name is None and isinstance(target, torch._ops.OpOverloadPacket):
        name = f"torch.ops.{target._qualified_op_name.replace('::', '.')}"
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
    if isinstance(target, type):
        _REGISTERED_ATTRS.update(_field_names(target))
    return obj


def _field_names(cls: type) -> set:
    """The data attributes a registered class declares: namedtuple and dataclass fields,
    annotations, ``__slots__`` and properties (not dunders, not escape hatches)."""
    if issubclass(cls, (nn.Module, torch.autograd.Function)):
        return set()
    names = set(getattr(cls, "_fields", ()) if issubclass(cls, tuple) else ())
    for klass in cls.__mro__[:-1]:
        d = vars(klass)
        names.update(d.get("__annotations__", {}) if isinstance(d.get("__annotations__"), dict) else ())
        names.update(d.get("__dataclass_fields__", {}))
        slots = d.get("__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
        names.update(k for k, v in d.items() if isinstance(v, property))
    return {n for n in names if isinstance(n, str) and n.isidentifier() and not n.startswith("__")
            and n not in _ESCAPES}


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


# where the public functions of torch.nn.functional / fft / linalg / special are defined: the
# namespace itself or torch's operator bindings, not the helpers it imports (torch.overrides'
# handle_torch_function calls any function, torch._jit_internal.boolean_dispatch builds one,
# torch._C._add_docstr rewrites docstrings)
_TORCH_SUB_HOMES = frozenset({"torch", "torch._C._nn", "torch._C._fft", "torch._C._linalg", "torch._C._special"})


def _torch_sub_ok(name: str, obj: Any, prefix: str) -> bool:
    if name.startswith("_") or isinstance(obj, (type, types.ModuleType)) or not _is_function(obj):
        return False
    mod = getattr(obj, "__module__", None)
    return mod is None or mod == prefix or mod in _TORCH_SUB_HOMES


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
            if _torch_sub_ok(n, obj, prefix):
                add(f"{prefix}.{n}", obj)
    for n in dir(torch.Tensor):
        if (n.startswith("_") and n not in _OPERATOR_DUNDERS) or n in _ESCAPES:
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


# --- torch.ops operators: admitted by schema ------------------------------------------------
# Namespaces admitted without registration: aten (with a Python form or an export tag, below),
# prims (torch's primitive tensor ops) and symtrace's own. Others (quantized, onednn, prim,
# profiler, c10d...) only when registered.
_OP_NAMESPACES = frozenset({"aten", "prims", "symtrace"})
# the value types (FunctionSchema real_type kinds) an admitted overload takes and returns, also
# inside Optional / List / Tuple: tensors, numbers, strings, dtypes, layouts, devices, memory
# formats, qschemes (SymInt/SymBool in symbolic graphs); Generator only as an optional argument.
# Storage, Stream, Any, type variables, Dict, Future/RRef/Await, capsules and custom classes are not.
_OP_VALUE_KINDS = frozenset({"TensorType", "IntType", "SymIntType", "BoolType", "SymBoolType", "FloatType",
                             "NumberType", "ComplexType", "StringType", "DeviceObjType", "ScalarTypeType",
                             "LayoutType", "MemoryFormatType", "QSchemeType", "NoneType"})
# aten ops without a Python name or export tag that ATen-level torch.fx / torch.export / AOT graphs
# emit (views, asserts, size constraints, attention and norm kernels): all tensor computations
_ATEN_GRAPH_OPS = frozenset({
    "_unsafe_view", "_reshape_alias", "lift_fresh_copy", "lift_fresh", "_assert_async", "_assert_scalar",
    "_functional_assert_async", "_functional_assert_scalar", "_assert_tensor_metadata", "sym_constrain_range",
    "sym_constrain_range_for_size", "_native_batch_norm_legit_functional", "_unsafe_index", "_unsafe_index_put",
    "_safe_softmax", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_softmax_backward_data", "_log_softmax_backward_data"})
_OP_TAGS = ("core", "pointwise")  # torch.Tag: the Core ATen opset torch.export decomposes to
_OP_CACHE: Dict[str, Any] = {}
_ATEN_OP_OK: Dict[str, bool] = {}


def _op_type_ok(t: Any) -> bool:
    kind = t.kind()
    if kind in _OP_VALUE_KINDS:
        return True
    if kind == "OptionalType":
        inner = t.getElementType()
        return inner.kind() == "GeneratorType" or _op_type_ok(inner)
    if kind == "ListType":
        return _op_type_ok(t.getElementType())
    if kind == "TupleType":
        return all(_op_type_ok(c) for c in t.containedTypes())
    return False


def _schema_ok(op: Any) -> bool:
    """Every argument and return of the overload is a plain value type (see _OP_VALUE_KINDS)."""
    try:
        schema = op._schema
        return all(_op_type_ok(getattr(a, "real_type", a.type)) for a in (*schema.arguments, *schema.returns))
    except Exception:  # no schema we can read: not admitted
        return False


def _python_forms(opname: str) -> tuple:
    forms = [f"torch.{opname}", f"torch.Tensor.{opname}", f"torch.nn.functional.{opname}"]
    for prefix, module in (("special_", "torch.special."), ("linalg_", "torch.linalg."), ("fft_", "torch.fft.")):
        if opname.startswith(prefix):
            forms.append(module + opname[len(prefix):])
    return tuple(forms)


def _aten_op_ok(packet: Any, opname: str) -> bool:
    """An aten op is admitted when the allow-list admits it in its Python form (``torch.X``,
    ``torch.Tensor.X``, ``torch.nn.functional.X``, ``torch.special/linalg/fft``), when torch tags
    one of its overloads ``core`` or ``pointwise``, or when it is one of _ATEN_GRAPH_OPS."""
    hit = _ATEN_OP_OK.get(opname)
    if hit is None:
        table = _table()
        hit = any(f in table for f in _python_forms(opname)) or opname in _ATEN_GRAPH_OPS
        if not hit:
            tags = {getattr(torch.Tag, t) for t in _OP_TAGS if hasattr(torch.Tag, t)}
            try:
                hit = any(tags & set(getattr(packet, o).tags) for o in packet.overloads())
            except Exception:
                hit = False
        _ATEN_OP_OK[opname] = hit
    return hit


def _torch_op(name: str) -> Any:
    """``torch.ops.<ns>.<op>[.<overload>]``, admitted by schema: a namespace of _OP_NAMESPACES, an
    admitted op (aten: see _aten_op_ok), and only value-typed arguments and returns (a packet:
    every overload's). Nothing is imported or loaded: only operators already registered resolve."""
    if name in _OP_CACHE:
        return _OP_CACHE[name]
    op = _find_torch_op(name)
    if len(_OP_CACHE) < 100_000:
        _OP_CACHE[name] = op
    return op


def _find_torch_op(name: str) -> Any:
    parts = name.split(".")
    if len(parts) not in (4, 5) or parts[2] not in _OP_NAMESPACES or any(p.startswith("__") for p in parts[3:]):
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
    if parts[2] == "aten" and not _aten_op_ok(packet, parts[3]):
        return None
    try:
        if len(parts) == 4:
            ok = all(_schema_ok(getattr(packet, o)) for o in packet.overloads())
            return packet if ok else None
        op = getattr(packet, parts[4])
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, torch._ops.OpOverload) and _schema_ok(op) else None


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
    """The saved name of a module class, or None when it is not loadable. A GraphModule
    subclass that names ``saved_without`` (a class attribute: the attributes it adds) is saved
    as a plain GraphModule of its current graph."""
    if cls is GraphModule or (isinstance(cls, type) and issubclass(cls, GraphModule)
                              and "saved_without" in vars(cls)):
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
        if not n.startswith("_"):
            names.add(n)
    return frozenset(names - _ESCAPES)


METHOD_NAMES = _method_names()


def _attribute_names() -> frozenset:
    names = {n for n in METHOD_NAMES if not n.startswith("_")} | _VALUE_ATTRS
    for n in dir(torch.Tensor):  # tensor properties: shape, dtype, device, T, mT, real, grad, is_cuda...
        if not n.startswith("_") and not callable(getattr(torch.Tensor, n, None)):
            names.add(n)
    for cls in vars(torch.return_types).values():  # fields of torch's structseq results (values, indices...)
        if isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "n_fields"):
            names.update(n for n in dir(cls) if not n.startswith("_") and not callable(getattr(cls, n, None)))
    return frozenset(names - _ESCAPES)


#: The attribute names ``getattr`` / ``hasattr`` nodes of a loaded graph may read: the method
#: names above (a bound method can only be called as call_method could), tensor properties,
#: the attributes of dtypes, devices, numbers, slices, enum members and torch's structseq
#: results -- plus the field names of registered classes and registered names.
ATTRIBUTE_NAMES = _attribute_names()


def is_allowed_method(name: Any) -> bool:
    """Whether ``call_method`` nodes may call a method of this name."""
    return isinstance(name, str) and (name in METHOD_NAMES or name in _REGISTERED_METHODS)


def is_allowed_attribute(name: Any) -> bool:
    """Whether ``getattr`` / ``hasattr`` nodes may read an attribute of this name."""
    return isinstance(name, str) and not name.startswith("__") and name not in _ESCAPES and (
        name in ATTRIBUTE_NAMES or name in _REGISTERED_ATTRS or name in _REGISTERED_METHODS)


def is_value_name(name: Any) -> bool:
    """Whether an allow-listed object may be a stored value (``$ref``) rather than only a call
    target: not one that reads attributes by a runtime name or calls what it is given."""
    return isinstance(name, str) and name not in _NOT_VALUES
