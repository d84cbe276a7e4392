"""Effects of nodes, derived from ATen operator schemas: what a node writes, whether it draws
random numbers, whether its result may share memory with an input.

:mod:`symtrace.graph.effects` decides from names (``add_`` ends in ``_``, ``"rand"`` in the
name). Here the answer comes from the operator's schema wherever torch has one:

* ``aten::add_.Tensor(Tensor(a!) self, ...)``: ``self`` has a *write* annotation, so
  ``x.add_(y)``, ``torch.Tensor.add_(x, y)`` and ``torch.ops.aten.add_.Tensor(x, y)`` write
  ``x``. Keyword-only writes (``out=``) count only when the call passes them.
* ops tagged ``nondeterministic_seeded`` (``randn``, ``bernoulli``, ``dropout``...) are
  random; dropout-like ops (and ``rrelu``) only while ``training`` may be true and ``p != 0``.
* ``aten::view(Tensor(a) self, ...) -> Tensor(a)``: the result may alias ``self``.

``OpOverload`` targets use their own schema. For other targets the overload is unknown, so
every overload of the name counts (conservative) -- except TorchScript's list/dict overloads
(``aten::sort.int(int[](a!) self)``), which calls on tensors never reach. Targets without a
schema (user functions, ``operator.setitem``, ``print``) fall back to
:func:`symtrace.graph.effects.is_impure`; when impure they are assumed to write all their
inputs. ``batch_norm``/``instance_norm`` hide their writes of ``running_mean``/``running_var``
from the schema and are special-cased; so are modules run in place (``nn.ReLU(inplace=True)``).

Schema lookups are cached per target (per method name for ``call_method``).

:class:`AliasAnalysis` groups the nodes whose values may share memory and records which groups
are written where: CSE and constant folding use it to stay sound around in-place ops.
"""
from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..graph import effects
from ..graph.effects import has_registered_side_effect
from ..graph.node import Node

__all__ = ["OpSchemaInfo", "schema_info", "is_impure", "is_random", "is_mutating",
           "is_torch_module",
           "written_inputs", "may_alias_inputs", "AliasAnalysis"]

#: random only while training (and ``p != 0``); the flag's name and default per op
_TRAINING_RANDOM = {"dropout": True, "alpha_dropout": True, "feature_dropout": True,
                    "feature_alpha_dropout": True, "dropout1d": True, "dropout2d": True,
                    "dropout3d": True, "rrelu": False, "rrelu_": False}
#: ops that write running statistics without saying so in their schema, and their flag
_HIDDEN_WRITES = {"batch_norm": "training", "instance_norm": "use_input_stats"}
#: Python operators that write their first argument (``x[i] = v``, ``x += y``)
_WRITE_FIRST = frozenset({operator.setitem, operator.delitem} | {
    getattr(operator, f"i{op}") for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                           "matmul", "and", "or", "xor", "lshift", "rshift", "concat")})
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
_INPLACE_PARAM: Dict[Any, bool] = {}


def schema_info(node: Node) -> Optional[OpSchemaInfo]:
    """The schema summary of a ``call_function``/``call_method`` node's target, or None when
    torch has no ATen schema for it. Cached per target."""
    if node.op not in ("call_function", "call_method"):
        return None
    key = (node.op, node.target)
    try:
        return _CACHE[key]
    except KeyError:
        info = _lookup(node.op, node.target)
        _CACHE[key] = info
        return info
    except TypeError:  # unhashable target
        return _lookup(node.op, node.target)


def _lookup(op: str, target: Any) -> Optional[OpSchemaInfo]:
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


def _summarise(name: str, schemas: list, tags: list) -> OpSchemaInfo:
    seeded = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)
    random = seeded is not None and any(seeded in t for t in tags)
    positions, names, kw, container = set(), set(), set(), set()
    aliases = False
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


# --- per-node questions ------------------------------------------------------------------
def _name(node: Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        info = schema_info(node)
        return info.name if info is not None else ""
    return getattr(t, "__name__", "") or ""


def _bind(node: Node, info: Optional[OpSchemaInfo]) -> Optional[Dict[str, Any]]:
    """The call's arguments by parameter name (Python defaults applied), or None."""
    target = node.target
    if node.op == "call_function" and inspect.isfunction(target):
        try:
            ba = inspect.signature(target).bind(*node.args, **node.kwargs)
        except (TypeError, ValueError):
            return None
        ba.apply_defaults()
        return dict(ba.arguments)
    if info is not None and info.arg_names and len(node.args) <= len(info.arg_names):
        out = dict(zip(info.arg_names, node.args))
        out.update(node.kwargs)
        return out
    return None


def _maybe_true(v: Any) -> bool:
    """False only for a literal false value: a node or unknown value may be true."""
    return not (isinstance(v, (bool, int, float)) and not v)


def is_random(node: Node) -> bool:
    """Whether the node draws random numbers (so it is never merged, folded or dropped)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = _name(node)
    info = schema_info(node)
    if name in _TRAINING_RANDOM:
        b = _bind(node, info)
        if b is None:
            return True
        training = b.get("training", b.get("train", _TRAINING_RANDOM[name]))
        p = b.get("p", 0.5)
        return _maybe_true(training) and _maybe_true(p)
    if info is None:
        return effects.is_random(node)
    return info.random


def _hidden_writes(node: Node, info: Optional[OpSchemaInfo]) -> List[Node]:
    flag = _HIDDEN_WRITES.get(_name(node))
    if flag is None:
        return []
    b = _bind(node, info)
    if b is None:
        return list(node.all_input_nodes[1:])
    if not _maybe_true(b.get(flag, True)):
        return []
    return [v for v in (b.get("running_mean"), b.get("running_var")) if type(v) is Node]


def _inplace_flag(node: Node) -> bool:
    """``inplace=True`` passed by keyword, or positionally to a Python function."""
    if node.kwargs.get("inplace") is True:
        return True
    if not _has_inplace_param(node):
        return False
    b = _bind(node, None)
    return b is None or b.get("inplace") is True or type(b.get("inplace")) is Node


def _has_inplace_param(node: Node) -> bool:
    """Whether the target is a Python function with an ``inplace`` parameter (cached)."""
    target = node.target
    if node.op != "call_function" or not inspect.isfunction(target):
        return False
    try:
        return _INPLACE_PARAM[target]
    except KeyError:
        pass
    try:
        has = "inplace" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        has = False
    _INPLACE_PARAM[target] = has
    return has


def _submodule(node: Node, module: Optional[nn.Module]) -> Optional[nn.Module]:
    if module is None:
        return None
    try:
        return module.get_submodule(node.target)
    except AttributeError:
        return None


def is_torch_module(m: nn.Module) -> bool:
    """Whether ``m`` is one of torch's own layers (``torch.nn``, ``torch.ao.nn``): their
    behaviour is known, unlike user leaf modules, which may keep any state."""
    return (type(m).__module__ + ".").startswith(("torch.nn.", "torch.ao.nn."))


def _inplace_module(node: Node, module: Optional[nn.Module]) -> bool:
    sub = _submodule(node, module)
    return sub is not None and getattr(sub, "inplace", False) is True


def _iter_nodes(v: Any) -> Iterable[Node]:
    if type(v) is Node:
        yield v
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _iter_nodes(x)


def written_inputs(node: Node, module: Optional[nn.Module] = None) -> List[Node]:
    """The input nodes whose memory ``node`` may write (conservative; ``[]`` when none).

    ``x.copy_(y)`` -> ``[x]``; ``torch.add(a, b, out=c)`` -> ``[c]``;
    ``F.batch_norm(x, rm, rv, training=True)`` -> ``[rm, rv]``; an impure call without a
    schema (``operator.setitem``, a registered side effect), a module run in place, or an
    impure user leaf module -> all its inputs. (A ``call_module`` of torch's own layers writes
    only their buffers: :class:`AliasAnalysis` accounts for those.)
    """
    op = node.op
    if not node.kwargs and _writes_nothing(node):
        return []
    if op == "call_module":
        sub = _submodule(node, module)
        if sub is not None and getattr(sub, "inplace", False) is True:
            return list(node.all_input_nodes)
        if sub is not None and is_torch_module(sub):
            return []  # torch's layers write only their own buffers (see AliasAnalysis)
        return list(node.all_input_nodes) if effects.is_impure(node, module) else []
    if op not in ("call_function", "call_method"):
        return []
    info = schema_info(node)
    first = node.args[0] if node.args and type(node.args[0]) is Node else None
    if op == "call_function" and first is not None and _is_write_first(node.target):
        return [first]
    if info is None and has_registered_side_effect(node):
        return list(node.all_input_nodes)
    out: Dict[Node, None] = dict.fromkeys(_hidden_writes(node, info))
    if _inplace_flag(node) and first is not None:
        out[first] = None
    if info is None:
        if effects.is_inplace(node):  # by name only: which inputs is unknown
            out.update(dict.fromkeys(node.all_input_nodes))
        return list(out)
    if info.mutates:
        if op == "call_function" and inspect.isfunction(node.target):
            # a Python wrapper (F.relu_, nn.init.normal_): arguments need not match the schema
            out.update(dict.fromkeys(node.all_input_nodes))
        else:
            for i in info.write_positions:
                if i < len(node.args):
                    out.update(dict.fromkeys(_iter_nodes(node.args[i])))
    for k, v in node.kwargs.items():
        if k == "out" or k in info.kwarg_writes or k in info.write_names:
            out.update(dict.fromkeys(_iter_nodes(v)))
    for i in info.container_writes:
        # a list written in place: the tensors of a literal list (``_foreach_add_([a, b])``);
        # a list-valued node only for in-place names, or a method on a value of unknown type
        # (TorchScript's ``sort.int`` is never reached from a call on a tensor)
        arg = node.args[i] if i < len(node.args) else None
        if isinstance(arg, (list, tuple)):
            out.update(dict.fromkeys(_iter_nodes(arg)))
        elif type(arg) is Node and (_name(node).endswith("_") or (
                op == "call_method" and arg.meta.get("tensor_meta") is None)):
            out[arg] = None
    if not out and (effects.is_inplace(node) or has_registered_side_effect(node)):
        # a trailing "_" or registered effect the schemas do not explain: any input
        out.update(dict.fromkeys(node.all_input_nodes))
    return list(out)


_NO_WRITES: Dict[Any, bool] = {}


def _writes_nothing(node: Node) -> bool:
    """Fast path, cached per target: a call that writes nothing unless keyword arguments
    (``out=``, ``inplace=``) say so."""
    if node.op not in ("call_function", "call_method"):
        return False
    key = (node.op, node.target)
    try:
        return _NO_WRITES[key]
    except KeyError:
        pass
    except TypeError:
        return False
    info = schema_info(node)
    name = _name(node)
    target = node.target
    plain = (info is not None and not info.mutates and not info.container_writes
             and name not in _HIDDEN_WRITES and not name.endswith("_") and not name.startswith("__i")
             and not has_registered_side_effect(node) and not _is_write_first(target)
             and not effects.is_inplace(node) and not _has_inplace_param(node))
    _NO_WRITES[key] = plain
    return plain


def _is_write_first(target: Any) -> bool:
    try:
        return target in _WRITE_FIRST
    except TypeError:
        return False


def is_mutating(node: Node, module: Optional[nn.Module] = None) -> bool:
    """Whether the node may write the memory of one of its inputs (state that modules update
    internally, such as batch-norm statistics, makes a node impure but is no input)."""
    return bool(written_inputs(node, module))


def is_impure(node: Node, module: Optional[nn.Module] = None) -> bool:
    """Whether ``node`` has effects beyond its result, so it must be kept even when unused
    and never merged, folded or moved.

    True for placeholders and outputs; writes (``x.mul_(2)``, ``x.copy_(y)``,
    ``torch.Tensor.add_(x, y)``, ``out=``, ``inplace=True``, batch norm in training); random
    ops; registered side effects (``print``, ``setitem``, data guards); ``call_module`` of
    modules that update state or draw random numbers in training mode, or run in place.
    ``module``: the graph's owner, to look ``call_module`` targets up (without it every
    ``call_module`` is impure).
    """
    op = node.op
    if op in ("placeholder", "output"):
        return True
    if op == "get_attr":
        return False
    if op == "call_module":
        return effects.is_impure(node, module) or _inplace_module(node, module)
    if op not in ("call_function", "call_method"):
        return True
    return has_registered_side_effect(node) or is_random(node) or is_mutating(node, module)


def may_alias_inputs(node: Node) -> bool:
    """Whether the node's result may share memory with an input: views, ``x.to()`` returning
    ``x``, in-place ops returning ``self``, ``out=``, and (conservatively) modules and callables
    without a schema."""
    op = node.op
    if op in ("placeholder", "get_attr", "output"):
        return False
    if op == "call_module":
        return True
    info = schema_info(node)
    if info is None:
        return True
    return info.result_aliases or "out" in node.kwargs or _inplace_flag(node)


# --- alias analysis ----------------------------------------------------------------------
class AliasAnalysis:
    """Groups of nodes whose values may share memory, and where each group is written.

    A node joins its inputs' group when its result may alias them (views, modules, unknown
    callables, in-place ops returning ``self``). All placeholders form one group (a caller may
    pass one tensor twice). ``get_attr`` nodes are grouped by the storage of the tensor they
    name when ``module`` is given (tied weights share a group), else all together. A
    ``call_module`` that updates state also writes the groups of its parameters and buffers.

    Build it once per pass, before editing the graph (linear time).
    """

    _INPUTS = ("<inputs>",)
    _ATTRS = ("<attributes>",)

    def __init__(self, graph, module: Optional[nn.Module] = None):
        self._parent: Dict[Any, Any] = {}
        self._storages: Dict[Any, Any] = {}
        self.module = module
        #: node -> its index in graph order
        self.positions: Dict[Node, int] = {}
        #: node -> the nodes (or state groups) it may write
        self.writes: Dict[Node, List[Any]] = {}
        #: the impure nodes (:func:`is_impure`), computed once
        self.impure: set = set()
        for i, n in enumerate(graph.nodes):
            self.positions[n] = i
            op = n.op
            if op == "placeholder":
                self._union(n, self._INPUTS)
                self.impure.add(n)
            elif op == "get_attr":
                self._union(n, self._attr_key(n.target))
            elif op == "output":
                self.impure.add(n)
            else:
                written: List[Any] = list(written_inputs(n, module))
                if op == "call_module":
                    if is_impure(n, module):
                        self.impure.add(n)
                        written.extend(self._state_keys(n))
                elif written or op not in ("call_function", "call_method") or is_random(n) \
                        or has_registered_side_effect(n):
                    self.impure.add(n)
                if written:
                    self.writes[n] = written
                if may_alias_inputs(n):
                    for inp in n.all_input_nodes:
                        self._union(n, inp)
        #: group -> positions of the nodes writing it
        self.written_at: Dict[Any, List[int]] = {}
        for n, ws in self.writes.items():
            for w in ws:
                self.written_at.setdefault(self.find(w), []).append(self.positions[n])

    def find(self, x: Any) -> Any:
        """The representative of ``x``'s group (a node or a state key)."""
        parent = self._parent
        root = parent.setdefault(x, x)
        if root is x and parent[x] is x:
            return x
        while parent[root] is not root:
            root = parent[root]
        while x is not root:  # path compression
            nxt = parent[x]
            parent[x] = root
            x = nxt
        return root

    def _union(self, a: Any, b: Any) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self._parent[ra] = rb

    def _storage_key(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return self._ATTRS
        try:
            key = ("<storage>", str(t.device), t.untyped_storage().data_ptr())
        except Exception:  # storage-less tensors (fake, sparse...)
            return self._ATTRS
        return self._storages.setdefault(key, key)

    def _attr_key(self, target: str) -> Any:
        if self.module is None:
            return self._ATTRS
        obj: Any = self.module
        try:
            for part in target.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            return self._ATTRS
        return self._storage_key(obj)

    def _state_keys(self, node: Node) -> List[Any]:
        sub = _submodule(node, self.module)
        if sub is None:
            return [self._ATTRS]
        return [self._storage_key(t) for t in list(sub.parameters()) + list(sub.buffers())]

    def is_written(self, node: Node) -> bool:
        """Whether some node may write ``node``'s value, or memory it shares."""
        return self.find(node) in self.written_at

    def written_between(self, node: Node, start: int, stop: int) -> bool:
        """Whether ``node``'s group is written by a node at a position in ``(start, stop)``."""
        return any(start < p < stop for p in self.written_at.get(self.find(node), ()))
