"""What torch's ATen operator schemas say about a call's target: which arguments it writes,
whether it draws random numbers, whether its result may share memory with an argument.

* ``aten::add_.Tensor(Tensor(a!) self, ...)``: ``self`` has a *write* annotation, so
  ``x.add_(y)``, ``torch.Tensor.add_(x, y)`` and ``torch.ops.aten.add_.Tensor(x, y)`` write
  ``x``. Keyword-only writes (``out=``) are listed apart: they count only when a call passes them.
* ops tagged ``nondeterministic_seeded`` (``randn``, ``bernoulli``, ``dropout``...), or that
  write a ``Generator``, are random.
* ``aten::view(Tensor(a) self, ...) -> Tensor(a)``: the result may alias ``self``.

``OpOverload`` targets use their own schema. For other targets the overload is unknown, so
every overload of the name counts (conservative). Targets outside torch (user functions,
``print``) have no schema, even when named like an ATen op. Lookups are cached per target (per
method name for ``call_method``). :mod:`symtrace.graph.effects` turns these facts into answers
per node.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Dict, FrozenSet, Optional, Tuple

import torch

__all__ = ["OpSchemaInfo", "schema_info", "register_schema", "cacheable_target"]

#: modules whose functions may be looked up as ATen ops by name
_TORCH_MODULES = ("torch", "_operator", "operator")


@dataclasses.dataclass(frozen=True)
class OpSchemaInfo:
    """What the ATen schemas of one operator (all overloads of a name, or one overload) say.

    ``write_positions``/``write_names``: positions and names of (non keyword-only) arguments
    some overload writes. ``kwarg_writes``: keyword-only written arguments (``out``).
    ``container_writes``: positions of written list/dict arguments (TorchScript's
    ``sort.int(int[](a!) self)``, ``append``; also ``_foreach_add_``'s tensor lists).
    ``random``: tagged ``nondeterministic_seeded`` or writes a ``Generator``.
    ``result_aliases``: the result may share memory with an argument.
    ``arg_names``: positional argument names of the main overload (to bind a call).
    """

    name: str
    write_positions: FrozenSet[int] = frozenset()
    write_names: FrozenSet[str] = frozenset()
    kwarg_writes: FrozenSet[str] = frozenset()
    container_writes: FrozenSet[int] = frozenset()
    random: bool = False
    result_aliases: bool = False
    arg_names: Tuple[str, ...] = ()

    @property
    def mutates(self) -> bool:
        return bool(self.write_positions)


# --- schema lookup -----------------------------------------------------------------------
_CACHE: Dict[Any, Optional[OpSchemaInfo]] = {}
#: callables that drop caches built on schema answers, called when a schema is registered
ON_CHANGE: list = []
_CACHED_KINDS = (type, str, types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
                 types.WrapperDescriptorType, types.MethodWrapperType, types.ClassMethodDescriptorType,
                 torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_INPLACE_PARAM: Dict[Any, bool] = {}


def cacheable_target(target: Any) -> bool:
    """Whether facts about ``target`` may be cached per target: functions, method names and
    operators and module-level classes live as long as the process; callable objects (a packed
    layer) and classes made in a function do not, and objects may change what they do (a layer
    made to accumulate in place)."""
    return isinstance(target, _CACHED_KINDS) and not (isinstance(target, type) and "<locals>" in target.__qualname__)


def schema_info(node) -> Optional[OpSchemaInfo]:
    """The schema summary of a ``call_function``/``call_method`` node's target, or None when
    torch has no ATen schema for it. Cached per target (functions, method names, operators;
    not callable objects, whose schema may change and which the cache would keep alive)."""
    if node.op not in ("call_function", "call_method"):
        return None
    if not cacheable_target(node.target):
        return _lookup(node.op, node.target)
    key = (node.op, node.target)
    try:
        return _CACHE[key]
    except KeyError:
        info = _lookup(node.op, node.target)
        _CACHE[key] = info
        return info
    except TypeError:  # unhashable target
        return _lookup(node.op, node.target)


#: functions of symtrace's own (no ATen schema) that declared what they write and alias
_DECLARED: Dict[Any, OpSchemaInfo] = {}


def register_schema(fn: Any, info: OpSchemaInfo) -> Any:
    """Declare, for a function torch has no schema for, what its schema would say (for
    example that it writes none of its arguments and returns a new tensor: ``OpSchemaInfo(
    name)``). The effect model and alias analysis then treat its calls like an ATen op's."""
    _DECLARED[fn] = info
    _CACHE.clear()
    for clear in ON_CHANGE:   # (answers cached from the old schema: the effect model's)
        clear()
    return fn


def _declared(fn: Any) -> Optional[OpSchemaInfo]:
    """A schema declared with :func:`register_schema`, or by a callable object's own
    ``op_schema`` attribute (symtrace's packed layers: one object per layer)."""
    own = getattr(fn, "op_schema", None) if not isinstance(fn, (type, types.FunctionType)) else None
    if isinstance(own, OpSchemaInfo):
        return own
    try:
        return _DECLARED.get(fn)
    except TypeError:   # unhashable
        return None


def is_declared(fn: Any) -> bool:
    """Whether ``fn``'s schema was declared with :func:`register_schema` (so it is exact)."""
    return _declared(fn) is not None


def _lookup(op: str, target: Any) -> Optional[OpSchemaInfo]:
    if op == "call_function":
        declared = _declared(target)
        if declared is not None:
            return declared
    if op == "call_method":
        name = target
    elif isinstance(target, torch._ops.OpOverload):
        return _summarise(target._schema.name.partition("::")[2], [target._schema], [target.tags])
    elif isinstance(target, torch._ops.OpOverloadPacket):
        ovs = [getattr(target, o) for o in target.overloads()]
        name = target._qualified_op_name.partition("::")[2]
        return _summarise(name, [o._schema for o in ovs], [o.tags for o in ovs]) if ovs else None
    else:
        name = getattr(target, "__name__", None)
        if not isinstance(name, str):
            return None
        module = getattr(target, "__module__", None)
        if module is None:  # method descriptors such as torch.Tensor.add_
            module = getattr(getattr(target, "__objclass__", None), "__module__", None) or ""
        if not module.startswith(_TORCH_MODULES):
            return None  # a user function named like an ATen op is not that op
    if not name.isidentifier():
        return None
    try:
        schemas = list(torch._C._jit_get_schemas_for_operator(f"aten::{name}"))
    except Exception:  # pragma: no cover - defensive
        return None
    if not schemas:
        return None
    tags: list = []
    try:
        packet = getattr(torch.ops.aten, name)
        tags = [getattr(packet, o).tags for o in packet.overloads()]
    except Exception:  # TorchScript-only operators have no Python packet
        pass
    return _summarise(name, schemas, tags)


def _is_container(ty: Any) -> bool:
    kind = ty.kind()
    if kind == "OptionalType":
        return _is_container(ty.getElementType())
    return kind in ("ListType", "DictType")


#: composite ops whose schemas annotate no alias although they may return an input itself or a
#: view of one (``atleast_1d(x)`` is ``x`` when x has a dim; ``type_as`` of the same type is
#: ``self``; ``broadcast_tensors`` and ``meshgrid`` return expanded views; dropout when not
#: training, ``einsum('i->i')``, one-input ``cartesian_prod`` return their input)
_UNANNOTATED_ALIASES = frozenset({"atleast_1d", "atleast_2d", "atleast_3d", "type_as", "broadcast_tensors",
                                  "meshgrid", "sum_to_size", "dropout", "alpha_dropout", "feature_dropout",
                                  "feature_alpha_dropout", "einsum", "cartesian_prod", "unsafe_chunk", "unsafe_split",
                                  "unsafe_split_with_sizes", "to_dense", "conj_physical", "dequantize"})


def _summarise(name: str, schemas: list, tags: list) -> OpSchemaInfo:
    seeded = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)
    random = seeded is not None and any(seeded in t for t in tags)
    positions, names, kw, container = set(), set(), set(), set()
    aliases = name in _UNANNOTATED_ALIASES
    for s in schemas:
        pos = 0
        for a in s.arguments:
            info = a.alias_info
            if info is not None and not a.kwarg_only:
                aliases = True  # an annotated input: a result (or the op) may share its memory
            if info is not None and info.is_write:
                if "Generator" in str(a.type):
                    random = True
                elif _is_container(a.type):
                    container.add(pos)
                elif a.kwarg_only:
                    kw.add(a.name)
                else:
                    positions.add(pos)
                    names.add(a.name)
            if not a.kwarg_only:
                pos += 1
    main = next((s for s in schemas if s.overload_name in ("", "default", "Tensor")), schemas[0])
    arg_names = tuple(a.name for a in main.arguments if not a.kwarg_only)
    return OpSchemaInfo(name, frozenset(positions), frozenset(names), frozenset(kw),
                        frozenset(container), random, aliases, arg_names)
