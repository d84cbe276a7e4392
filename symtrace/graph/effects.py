"""The effect model: what a node does beyond computing its result, and so whether a pass may
drop it when unused (dead-code elimination), merge it with an equal one (CSE), fold it, or
move it past other nodes (``split_module``, the matcher, capture's roll-back).

Each answer combines two sources of facts:

* the operator's ATen schema wherever torch has one (:mod:`~symtrace.graph.op_schema`): written
  arguments (``aten::add_.Tensor(Tensor(a!) self, ...)``), the ``nondeterministic_seeded`` tag,
  result aliasing. ``x.add_(y)``, ``torch.Tensor.add_(x, y)`` and ``torch.ops.aten.add_.Tensor``
  all write ``x``; ``out=`` counts only when the call passes it;
* names and a registry for what has no schema: functions registered with
  :func:`register_side_effect` (``print``, ``operator.setitem``, guard checks, the replay of
  Python side effects), methods such as ``copy_`` and ``backward``, in-place forms (a trailing
  ``_``, ``__iadd__``, ``out=``, ``inplace=True``), random names, and modules (``call_module``:
  buffers updated or dropout in training mode, ``inplace=True``, a ``_is_impure`` mark).
  ``batch_norm``/``instance_norm`` hide their writes of running statistics from the schema;
  dropout-like ops (and ``scaled_dot_product_attention``) draw random numbers only while
  ``training`` may be true and their probability may be non-zero.

API (``module`` is the graph's owning module, to look ``call_module`` targets up; without it
every ``call_module`` counts as impure):

* :func:`effects_of` -- the whole answer as an :class:`Effects` record; ``str()`` says why.
* :func:`is_impure` -- ``effects_of(node, module).impure``, fast: keep when unused, never merge,
  fold or move across.
* :func:`written_inputs`, :func:`is_random`, :func:`may_alias_inputs`,
  :func:`has_registered_side_effect` -- the parts; :func:`is_pure_target` -- whether every call
  of a target without keyword arguments is pure (what passes may cache per target).
* :func:`is_inplace` -- whether a call is *written* in an in-place form (lowering turns those
  into their out-of-place op); :func:`written_inputs` says what a call may actually write.
"""
from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .node import Node
from . import op_schema
from .op_schema import OpSchemaInfo, cacheable_target, is_declared, schema_info
from .tree import tree_iter

__all__ = ["Effects", "effects_of", "is_impure", "is_pure_target", "written_inputs", "is_random", "reads_global_state", "GRAD_MODE_SWITCHES",
           "is_inplace", "may_alias_inputs", "has_registered_side_effect", "register_side_effect",
           "is_torch_module", "may_keep_arguments", "layout_dependent_view"]

_CALLS = ("call_function", "call_method")

# --- the registry and names (for targets without a schema) ---------------------------------
#: grad-mode switches (``with torch.no_grad()`` inside a program records them): they write no tensor
GRAD_MODE_SWITCHES = frozenset({torch.set_grad_enabled, torch._C._set_grad_enabled, torch.autograd.set_grad_enabled})
_SIDE_EFFECT_FUNCTIONS: set = {
    operator.setitem, operator.delitem, print, torch._assert, torch.manual_seed, *GRAD_MODE_SWITCHES,
}
_SIDE_EFFECT_FUNCTIONS.update(getattr(operator, f"i{op}") for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
    "rshift"))

_SIDE_EFFECT_METHODS = frozenset({"copy_", "set_", "backward", "retain_grad", "register_hook",
                                  "record_stream", "share_memory_"})
_RANDOM_NAMES = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "normal_",
    "bernoulli", "bernoulli_", "multinomial", "poisson", "random_", "uniform_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "rrelu", "rrelu_", "rrelu_with_noise", "native_dropout"})
_INPLACE_DUNDERS = frozenset({"__setitem__", "__delitem__"} | {
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
                            "or", "xor", "lshift", "rshift")})
#: random only while training may be true and the probability may be non-zero: per op, the
#: default of ``training`` (or ``train``), the probability's name and its default
_RANDOM_WHEN = {**{n: (True, "p", 0.5) for n in (
    "dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
    "dropout3d")}, "rrelu": (False, "p", 0.5), "rrelu_": (False, "p", 0.5),
    "scaled_dot_product_attention": (True, "dropout_p", 0.0)}
#: ops that write running statistics without saying so in their schema, and their flag
_HIDDEN_WRITES = {"batch_norm": "training", "instance_norm": "use_input_stats"}
#: Python operators that write their first argument (``x[i] = v``, ``x += y``)
_WRITE_FIRST = frozenset({operator.setitem, operator.delitem} | {
    getattr(operator, f"i{op}") for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                           "matmul", "and", "or", "xor", "lshift", "rshift", "concat")})


def register_side_effect(fn: Callable) -> Callable:
    """Mark ``fn`` as having side effects: calls to it are kept, never merged or moved.

    Usable as a decorator."""
    _SIDE_EFFECT_FUNCTIONS.add(fn)
    _PURE_TARGETS.clear()  # answers cached per target may have counted ``fn`` as pure
    _NO_WRITES.clear()
    return fn


# --- the answer ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Effects:
    """What one node does beyond computing its result. ``impure`` (any of them) means: keep it
    when unused, never merge, fold or move it across other nodes."""

    #: input nodes whose memory it may write
    writes: Tuple[Node, ...] = ()
    #: draws random numbers (advances the RNG)
    random: bool = False
    #: a registered side effect (``print``, ``setitem``, guard checks, grad mode, ``copy_``...)
    side_effect: bool = False
    #: any other reason, in words (a module's state, an input of the graph...)
    other: str = ""

    @property
    def impure(self) -> bool:
        return bool(self.writes or self.random or self.side_effect or self.other)

    def __str__(self) -> str:
        parts = []
        if self.writes:
            parts.append("writes " + ", ".join(n.name for n in self.writes))
        if self.random:
            parts.append("draws random numbers")
        if self.side_effect:
            parts.append("has a registered side effect")
        if self.other:
            parts.append(self.other)
        return "; ".join(parts) or "pure"


def effects_of(node: Node, module: Optional[nn.Module] = None) -> Effects:
    """What ``node`` does beyond its result, and why (``str(effects_of(n))``)."""
    op = node.op
    if op == "placeholder":
        return Effects(other="an input of the graph")
    if op == "output":
        return Effects(other="the graph's result")
    if op == "get_attr":
        return Effects()
    if op == "call_module":
        return Effects(tuple(written_inputs(node, module)), other=_module_effects(node, module))
    if op not in _CALLS:
        return Effects(other=f"unknown opcode {op!r}")
    writes = tuple(written_inputs(node, module))
    return Effects(writes, is_random(node), has_registered_side_effect(node),
                   "an in-place call with no input known to be written"
                   if not writes and is_inplace(node) else "")


def is_impure(node: Node, module: Optional[nn.Module] = None) -> bool:
    """Whether ``node`` must be kept even when unused, and never merged, folded or moved:
    placeholders and outputs; writes (``x.mul_(2)``, ``x.copy_(y)``, ``out=``, ``inplace=True``,
    batch norm in training); random ops; registered side effects (``print``, ``setitem``, data
    guards); ``call_module`` of modules that update state or draw random numbers in training
    mode, or run in place. The same answer as ``effects_of(node, module).impure``."""
    op = node.op
    if op == "call_function" or op == "call_method":
        try:
            effect_kwargs = _PURE_TARGETS[(op, node.target)]
        except KeyError:
            effect_kwargs = _pure_target_entry(node)
        except TypeError:  # an unhashable target: unknown, so impure
            return True
        if effect_kwargs is not None:  # a pure target: only keyword arguments can say otherwise
            kw = node.kwargs
            if not kw or effect_kwargs.isdisjoint(kw):
                return False
        return (has_registered_side_effect(node) or is_random(node)
                or bool(written_inputs(node, module)) or is_inplace(node))
    if op == "get_attr":
        return False
    if op == "call_module":
        return _module_effects(node, module) != ""
    return True


#: modules whose callables keep no reference to their arguments after the call
_NO_KEEP_MODULES = ("torch", "_operator", "operator", "math", "builtins", "symtrace.graph.guards", "symtrace.lower",
                    "symtrace.passes")


def may_keep_arguments(kind: str, target: Any) -> bool:
    """Whether a call (``kind``: ``function``, ``method`` or ``module``; ``target``: the
    function, method name or module object) may keep a reference to its tensor arguments past
    the call: replayed stores into Python state (``symtrace.graph.replay``), the user's own
    functions and modules. torch ops, methods of tensors and symtrace's own ops do not (a view
    they return is an alias edge, handled apart)."""
    if kind == "function":
        module = getattr(target, "__module__", None) or ""
        return not module.startswith(_NO_KEEP_MODULES)
    if kind == "module":
        return not type(target).__module__.startswith(("torch.", "symtrace."))
    return False


#: calls that return a view of their first argument (or it) or a copy, by its strides
_LAYOUT_DEPENDENT_VIEWS = frozenset({"reshape", "flatten", "reshape_as", "contiguous"})


def layout_dependent_view(node: Node) -> bool:
    """Whether ``node`` is ``reshape``/``flatten``/``reshape_as``/``contiguous`` of a graph value:
    a view of it (or the value itself) in eager where its strides allow, else a copy."""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function" and node.target in (torch.reshape, torch.flatten):
        name = node.target.__name__
    else:
        return False
    return name in _LAYOUT_DEPENDENT_VIEWS and bool(node.args) and type(node.args[0]) is Node


def is_pure_target(node: Node) -> bool:
    """Whether every call of ``node``'s target without keyword arguments is pure, whatever its
    positional arguments: its schema (or, without one, its name) says it writes nothing and
    draws no random numbers, and it is not registered as a side effect. Cached per (op,
    target), so callers may cache per target what follows from it."""
    if node.op not in _CALLS:
        return False
    try:
        return _PURE_TARGETS[(node.op, node.target)] is not None
    except KeyError:
        return _pure_target_entry(node) is not None
    except TypeError:  # unhashable target
        return False


#: (op, target) of a pure target -> the keyword arguments that may make one of its calls impure
#: (``out``, ``inplace``, keyword-only writes); None for the other targets
_PURE_TARGETS: Dict[Any, Optional[frozenset]] = {}
_EFFECT_KWARGS = frozenset({"out", "inplace"})


def _pure_target_entry(node: Node) -> Optional[frozenset]:
    info = schema_info(node)
    name = _name(node)
    if has_registered_side_effect(node) or name in _RANDOM_WHEN or name in _HIDDEN_WRITES:
        entry = None
    elif info is not None:
        entry = _EFFECT_KWARGS | info.kwarg_writes | info.write_names \
            if _writes_nothing(node) and not info.random else None
    else:  # no schema: what the names say (dropout-like names depend on the arguments)
        entry = _EFFECT_KWARGS if (
            not _inplace_target(node) and "dropout" not in name and name not in _RANDOM_NAMES
            and not _has_inplace_param(node) and not _is_write_first(node.target)) else None
    if cacheable_target(node.target):
        _PURE_TARGETS[(node.op, node.target)] = entry
    return entry


def has_registered_side_effect(node: Node) -> bool:
    """Whether the node calls a function registered with :func:`register_side_effect` (or a
    known side-effecting method such as ``copy_``)."""
    try:
        if node.op == "call_function":
            return node.target in _SIDE_EFFECT_FUNCTIONS
    except TypeError:
        return True
    return node.op == "call_method" and node.target in _SIDE_EFFECT_METHODS


def _module_effects(node: Node, module: Optional[nn.Module]) -> str:
    """Why a ``call_module`` node is impure, or ``""``."""
    sub = _submodule(node, module)
    if sub is None:
        return "calls a module the graph's owner does not have" if module is not None else \
            "calls a module of an unknown owner"
    if getattr(sub, "_is_impure", False):
        return "calls a module marked impure"
    if getattr(sub, "inplace", False) is True:
        return "calls a module that runs in place"
    for m in sub.modules():
        if m.training and (next(iter(m._buffers.values()), None) is not None
                           or isinstance(m, torch.nn.modules.dropout._DropoutNd)):
            return "calls a module that updates buffers or draws random numbers in training mode"
    return ""


# --- the parts -----------------------------------------------------------------------------
def _name(node: Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        info = schema_info(node)
        return info.name if info is not None else ""
    return getattr(t, "__name__", "") or ""


def _name_of(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", "") or ""


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


#: torch's global switches read by a call with no arguments (grad mode, inference mode, the
#: default dtype): the answer can change between calls of a graph with the same inputs
GLOBAL_STATE_READS = frozenset(f for f in (torch.is_grad_enabled, getattr(torch, "is_inference_mode_enabled", None),
                                           torch.get_default_dtype) if f is not None)


def reads_global_state(node: Node) -> bool:
    """Whether ``node`` asks torch's global state (``torch.is_grad_enabled()``)."""
    try:
        return node.op == "call_function" and node.target in GLOBAL_STATE_READS
    except TypeError:   # an unhashable callable
        return False


def is_random(node: Node) -> bool:
    """Whether the node draws random numbers (so it is never merged, folded or dropped)."""
    if node.op not in _CALLS:
        return False
    name = _name(node)
    info = schema_info(node)
    when = _RANDOM_WHEN.get(name)
    if when is not None:
        b = _bind(node, info)
        if b is None:
            return True
        training_default, p_name, p_default = when
        training = b.get("training", b.get("train", training_default))
        return _maybe_true(training) and _maybe_true(b.get(p_name, p_default))
    if info is None:
        return _random_by_name(node)
    return info.random


def _random_by_name(node: Node) -> bool:
    name = _name_of(node.target)
    if "dropout" in name:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        return bool(node.kwargs.get("training", True)) and not (p == 0 or p == 0.0)
    return name in _RANDOM_NAMES


def is_inplace(node: Node) -> bool:
    """Whether the call is written in an in-place form: a name with a trailing ``_``
    (``x.add_(y)``), ``x += y``, ``x[i] = v``, ``out=``, ``inplace=True``, or an ``OpOverload``
    whose schema writes. (:func:`written_inputs` says which inputs a call may write.)"""
    if node.op not in _CALLS:
        return False
    by_target = _inplace_target(node)
    if by_target is not None:
        return by_target
    kw = node.kwargs
    return bool(kw) and (kw.get("out") is not None or kw.get("inplace") is True)


def _operator_function(node: Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator")


def _inplace_target(node: Node) -> Optional[bool]:
    """:func:`is_inplace` by the target alone: True or False, or None when keyword arguments
    decide."""
    name = _name_of(node.target)
    if name.endswith("_") and not name.endswith("__") and not _operator_function(node):
        return True   # (operator.and_/or_/not_ are the out-of-place a & b, a | b, not a)
    if name in _INPLACE_DUNDERS:
        return True
    if node.op == "call_function":
        try:
            if node.target in _SIDE_EFFECT_FUNCTIONS and node.target is not print:
                return name.startswith("i") or node.target is operator.setitem
        except TypeError:
            pass
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    return None


def _hidden_writes(node: Node, info: Optional[OpSchemaInfo]) -> List[Node]:
    flag = _HIDDEN_WRITES.get(_name(node))
    if flag is None:
        return []
    b = _bind(node, info)
    if b is None:
        return list(node.all_input_nodes[1:])
    if not _maybe_true(b.get(flag, True)):
        return []
    return [v for v in (b.get("running_mean"), b.get("running_var")) if type(v) is type(node)]


def _inplace_flag(node: Node) -> bool:
    """``inplace=True`` passed by keyword, or positionally to a Python function."""
    if node.kwargs.get("inplace") is True:
        return True
    if not _has_inplace_param(node):
        return False
    b = _bind(node, None)
    return b is None or b.get("inplace") is True or type(b.get("inplace")) is type(node)


_INPLACE_PARAM: Dict[Any, bool] = {}


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


def _iter_nodes(v: Any, node_type: type) -> Iterable[Node]:
    # (subclasses: torch.fx keeps lists as its immutable_list)
    return (x for x in tree_iter(v, subclasses=True) if type(x) is node_type)


def written_inputs(node: Node, module: Optional[nn.Module] = None) -> List[Node]:
    """The input nodes whose memory ``node`` may write (conservative; ``[]`` when none).

    ``x.copy_(y)`` -> ``[x]``; ``torch.add(a, b, out=c)`` -> ``[c]``;
    ``F.batch_norm(x, rm, rv, training=True)`` -> ``[rm, rv]``; an impure call without a
    schema (``operator.setitem``, a registered side effect), a module run in place, or an
    impure user leaf module -> all its inputs. (A ``call_module`` of torch's own layers writes
    only their buffers: :class:`~symtrace.passes.alias.AliasAnalysis` accounts for those.)
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
        return list(node.all_input_nodes) if _module_effects(node, module) else []
    if op not in _CALLS:
        return []
    info = schema_info(node)
    node_type = type(node)  # (the model also answers for torch.fx nodes: see interop/fx.py)
    first = node.args[0] if node.args and type(node.args[0]) is node_type else None
    if op == "call_function" and first is not None and _is_write_first(node.target):
        return [first]
    if info is None and has_registered_side_effect(node):
        return list(node.all_input_nodes)
    out: Dict[Node, None] = dict.fromkeys(_hidden_writes(node, info))
    if _inplace_flag(node) and first is not None:
        out[first] = None
    if info is None:
        if is_inplace(node):  # by name only: which inputs is unknown
            out.update(dict.fromkeys(node.all_input_nodes))
        return list(out)
    if info.mutates:
        if op == "call_function" and inspect.isfunction(node.target):
            # a Python wrapper (F.relu_, nn.init.normal_): arguments need not match the schema
            out.update(dict.fromkeys(node.all_input_nodes))
        else:
            for i in info.write_positions:
                if i < len(node.args):
                    out.update(dict.fromkeys(_iter_nodes(node.args[i], node_type)))
    for k, v in node.kwargs.items():
        if k == "out" or k in info.kwarg_writes or k in info.write_names:
            out.update(dict.fromkeys(_iter_nodes(v, node_type)))
    for i in info.container_writes:
        # a list written in place: the tensors of a literal list (``_foreach_add_([a, b])``);
        # a list-valued node only for in-place names, or a method on a value of unknown type
        # (TorchScript's ``sort.int`` is never reached from a call on a tensor)
        arg = node.args[i] if i < len(node.args) else None
        if isinstance(arg, (list, tuple)):
            out.update(dict.fromkeys(_iter_nodes(arg, node_type)))
        elif type(arg) is node_type and (_name(node).endswith("_") or (
                op == "call_method" and arg.meta.get("tensor_meta") is None)):
            out[arg] = None
    if not out and (is_inplace(node) or (has_registered_side_effect(node) and not is_declared(node.target))):
        # a trailing "_" or registered effect the schemas do not explain: any input (a
        # declared schema, as symtrace's data guards have, is exact)
        out.update(dict.fromkeys(node.all_input_nodes))
    return list(out)


_NO_WRITES: Dict[Any, bool] = {}


def _clear_target_caches() -> None:
    _PURE_TARGETS.clear()
    _NO_WRITES.clear()


op_schema.ON_CHANGE.append(_clear_target_caches)


def _writes_nothing(node: Node) -> bool:
    """Fast path, cached per target: a call that writes nothing unless keyword arguments
    (``out=``, ``inplace=``) say so."""
    if node.op not in _CALLS:
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
             and not _inplace_target(node) and not _has_inplace_param(node))
    if cacheable_target(target):
        _NO_WRITES[key] = plain
    return plain


def _is_write_first(target: Any) -> bool:
    try:
        return target in _WRITE_FIRST
    except TypeError:
        return False


#: builtins whose result is a new Python scalar, never memory an input holds
_FRESH_SCALAR_BUILTINS = frozenset({len, int, float, bool, complex, str, isinstance, hasattr, callable})


def _fresh_scalar(target: Any) -> bool:
    try:
        return target in _FRESH_SCALAR_BUILTINS
    except TypeError:   # unhashable
        return False


#: tensor attributes that are metadata, never memory (``x.T`` and ``x.real`` are views)
_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda",
                             "is_sparse", "is_quantized", "is_meta", "is_complex", "is_floating_point"})

#: torch layers whose result is always a new tensor (unless run in place): not Identity,
#: Dropout (the input itself in eval mode), Flatten/Unflatten (views) or containers
_FRESH_LAYERS = tuple(getattr(nn.modules, name) for name in (
    "Linear", "Bilinear", "Embedding", "EmbeddingBag", "LayerNorm", "GroupNorm", "LocalResponseNorm",
    "RMSNorm", "PReLU", "Softmax", "LogSoftmax", "Softmin", "MultiheadAttention") if hasattr(nn.modules, name)) + (
    nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase, nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh,
    nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.Softplus, nn.Hardtanh, nn.Tanhshrink, nn.Softsign)


def _fresh_layer(node: Node, module: Optional[nn.Module]) -> bool:
    sub = _submodule(node, module) if module is not None else None
    return (sub is not None and is_torch_module(sub) and isinstance(sub, _FRESH_LAYERS)
            and getattr(sub, "inplace", False) is not True)


def may_alias_inputs(node: Node, module: Optional[nn.Module] = None) -> bool:
    """Whether the node's result may share memory with an input: views, ``x.to()`` returning
    ``x``, in-place ops returning ``self``, ``out=``, and (conservatively) modules and callables
    without a schema. Not: builtins giving new scalars (``len``), metadata reads
    (``x.shape``), and, with ``module`` given, torch's computing layers (conv, linear, norms,
    pooling, activations not in place)."""
    op = node.op
    if op in ("placeholder", "get_attr", "output"):
        return False
    if op == "call_module":
        return not _fresh_layer(node, module)
    if op == "call_function" and _fresh_scalar(node.target):
        return False
    if op == "call_function" and node.target is getattr and len(node.args) == 2 \
            and node.args[1] in _METADATA_ATTRS:
        return False
    info = schema_info(node)
    if info is None:
        return True
    return info.result_aliases or "out" in node.kwargs or _inplace_flag(node)


#: ops whose result may share memory with any argument, not only the first (``x.set_(y)``
#: makes ``x`` a view of ``y``'s storage)
_ALIAS_ANY_ARG = frozenset({"set_", "as_strided_", "set"})


def _tensor_shape(item: Any, module: Optional[nn.Module]) -> Optional[tuple]:
    """The shape of the tensor node ``item`` stands for (recorded metadata, or the module's
    attribute for a ``get_attr``); None when unknown or not a tensor."""
    if not isinstance(item, Node):
        return None
    shape = getattr(item.meta.get("tensor_meta"), "shape", None)
    if shape is None and item.op == "get_attr" and module is not None:
        obj: Any = module
        for part in str(item.target).split("."):   # (graph_module.resolve_attr: an import cycle)
            obj = getattr(obj, part, None)
        shape = obj.shape if isinstance(obj, torch.Tensor) else None
    return None if shape is None else tuple(shape)


def _advanced_index(indexed: Any, index: Any, module: Optional[nn.Module]) -> bool:
    """Whether ``indexed[index]`` is a tensor indexed by advanced indexing (a list of ints, or a
    tensor of rank >= 1, in the index), whose result torch always copies. A 0-d integer tensor
    indexes like an int (a view); a list holding slices, None, ... is read as a tuple by torch
    (a view may come out), and values of unknown kind count as not advanced."""
    if _tensor_shape(indexed, module) is None:
        return False
    for item in index if isinstance(index, tuple) else (index,):
        if isinstance(item, list):
            if item and all(type(v) in (int, bool) for v in item):
                return True
            continue
        shape = _tensor_shape(item, module)
        if shape is not None and len(shape) >= 1:
            return True
    return False


def aliased_inputs(node: Node, module: Optional[nn.Module] = None) -> List[Node]:
    """The input nodes whose memory ``node``'s result may share (``[]``: none; see
    :func:`may_alias_inputs`). A view, or an op returning its written first argument
    (``x.add_(y)``, ``x += y``, ``F.relu(x, inplace=True)``), shares only its first argument
    (and ``out=``); modules and callables without a schema may share any input."""
    if not may_alias_inputs(node, module):
        return []
    inputs = node.all_input_nodes
    if node.op == "call_module":
        return list(inputs)
    first = node.args[0] if node.args and type(node.args[0]) is type(node) else None
    if node.op == "call_function" and first is not None and node.target is operator.getitem:
        # x[i] is a view of x or a copy, never memory of the index i; a copy for certain when
        # the index is advanced (``biases[:, idxs]``), whatever is later done with it
        return [] if len(node.args) > 1 and _advanced_index(first, node.args[1], module) else [first]
    if node.op == "call_function" and first is not None and _is_write_first(node.target):
        return [first]
    info = schema_info(node)
    if info is None or first is None or _name(node) in _ALIAS_ANY_ARG:
        return list(inputs)
    # a method's result shares its receiver's memory (x.view(...), x.add_(y), x.expand_as(y)); a
    # function's may share any input's (torch.broadcast_tensors(a, b)), unless it writes its
    # first argument in place and returns it (F.relu(x, inplace=True), torch.add(a, b, out=c))
    if node.op == "call_method" or _inplace_flag(node) or _name(node).endswith("_"):
        return [first] + [x for x in _iter_nodes(node.kwargs.get("out"), type(node)) if x is not first]
    return list(inputs)
