"""Convert between symtrace graphs and ``torch.fx``: :func:`to_fx` and :func:`from_fx`.

Both keep node names, opcodes, targets, arguments (nested containers, slices, dtypes, devices,
memory formats...), the module hierarchy (submodules, parameters, buffers, constants and
their ``training`` flags) and node metadata. Metadata keys with an equivalent on the other side
are translated; every other key travels as it is:

================================  ================================================================
symtrace ``node.meta``            torch.fx ``node.meta``
================================  ================================================================
``source`` (SourceLocation)       ``stack_trace`` (innermost user frame; torch frames skipped)
``module_path`` (``"layer1.0"``)  ``nn_module_stack`` (``{path: (path, module class)}``; Dynamo's
                                  ``L['self'].layer1[0]`` paths are read too)
``tensor_meta`` (TensorMeta)      ``tensor_meta`` (``TensorMetadata``; FX has no device, so the
                                  TensorMeta also rides along as ``symtrace_tensor_meta``)
``tensor_meta``                   read from ``val`` / ``example_value`` (fake tensors) when FX
                                  has no ``tensor_meta``
``type_expr``                     ``node.type``
================================  ================================================================

When both keys are present and disagree (a Dynamo stack trace with several frames), both are
kept, so ``symtrace -> fx -> symtrace`` and ``fx -> symtrace -> fx`` give back what went in.

What FX lacks:

* **Entry guards** (the assumptions ``forward`` checks first) travel in
  ``fx_gm.meta["symtrace_guards"]`` and :func:`from_fx` restores them, with the module
  attributes they read. **The FX module does not check them** unless you ask for
  ``to_fx(gm, check_guards=True)``, which puts one ``check_entry_guards`` call after the
  placeholders (it raises :class:`~symtrace.errors.GuardError` like symtrace does;
  :func:`from_fx` removes it again).
* **Data guards** stay ordinary ``call_function`` nodes of ``check_data_guard`` and run in FX
  too. Their ``Guard`` argument, like any constant FX cannot write as Python source, becomes a
  ``get_attr`` of a module attribute (``_symtrace_const0``...) marked
  ``meta["symtrace_role"] = "constant"``; :func:`from_fx` puts the object back in the argument.
* **Symbolic sizes** (``symbolic_trace(..., dynamic_shapes=...)``): FX's ``tensor_meta`` holds
  ints, so a symbolic TensorMeta travels only as ``symtrace_tensor_meta``; each placeholder with
  symbolic dimensions gets ``meta["symtrace_dynamic_dims"] = {dim: Dim}``, the module
  ``meta["symtrace_dynamic_shapes"] = {input: {dim: Dim} or None}`` (every input), and
  :func:`export_dynamic_shapes` turns that into ``torch.export.Dim`` objects for
  ``torch.export.export(fx_gm, args, dynamic_shapes=...)``.
* **In-place semantics**: the nodes are the same, but FX's dead-code elimination treats
  ``call_method`` nodes as pure (an unused ``x.add_(1)`` is dropped). Pass
  ``is_impure_node=symtrace.interop.fx.is_impure`` to ``fx_gm.graph.eliminate_dead_code`` to
  apply symtrace's rules (``check_data_guard`` and ``check_entry_guards`` are registered
  with ``torch.fx.node.has_side_effect``, so FX keeps them either way).
"""
from __future__ import annotations

import enum
import math
import operator
import os
import re
import sys
from types import FunctionType
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

from ..errors import SymtraceError
from ..graph import Graph, GraphModule, TensorMeta
from ..graph.graph_module import _Installer, class_name_from, resolve_attr
from ..graph.guards import (LIVE_GUARD_KINDS, attribute_form, check_data_guard, entry_guard_test,
                            raise_entry_guard_failure)
from ..graph.node import _NO_DEFAULT, OPCODES, Node
from ..graph.replay import ROOT_HELPERS, describe_effect
from ..graph.source import SourceLocation
from ..graph.symbolic_shapes import input_symbols
from ..graph.symbols import Dim, is_symbolic
from ..graph.tree import tree_map
from ..graph.effects import is_impure as _symtrace_is_impure
from ..transformer import _guard_attr_chains, _plain_attr

__all__ = ["to_fx", "from_fx", "is_impure", "check_entry_guards", "EntryGuardSpec", "FxConversionError",
           "export_dynamic_shapes"]

#: node-meta key marking the helper nodes to_fx adds ("constant", "guard_check", "guard_state")
ROLE = "symtrace_role"
#: FX node-meta key holding the symtrace TensorMeta (FX's TensorMetadata has no device)
TENSOR_META = "symtrace_tensor_meta"
#: a placeholder's symbolic dimensions ``{dim: Dim}``, and all of them by input name on the module
DYNAMIC_DIMS = "symtrace_dynamic_dims"
DYNAMIC_SHAPES = "symtrace_dynamic_shapes"
#: fx_gm.meta keys
GUARDS, CREATED_BY, NAMES = "symtrace_guards", "symtrace_created_by", "symtrace_names"

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class FxConversionError(SymtraceError):
    """A graph cannot be converted between torch.fx and symtrace; the message names the node."""


# --- entry guards in FX ----------------------------------------------------------------------
class EntryGuardSpec:
    """What :func:`check_entry_guards` tests: the guards, the placeholder names they read and the
    module attributes (``root.training``...) passed in as ``get_attr`` values."""

    def __init__(self, guards: list, names: List[List[str]], paths: List[str]):
        self.guards = guards
        self.names = names  # per input: the names guards may call it by (node name, parameter)
        self.paths = paths
        self._code = None

    def __getstate__(self):
        return {"guards": self.guards, "names": self.names, "paths": self.paths, "_code": None}

    def check(self, inputs: tuple, state: tuple) -> None:
        if self._code is None:
            g = {"torch": torch, "operator": operator, "math": math, "sys": sys}
            self._code = (compile(entry_guard_test(self.guards, g), "<symtrace-entry-guards>", "eval"), g)
        code, g = self._code
        env: Dict[str, Any] = {}
        for names, value in zip(self.names, inputs):
            for name in names:
                env[name] = value
        env["root"] = _attr_tree(dict(zip(self.paths, state)))
        try:
            ok = eval(code, g, env)
        except Exception:
            ok = False
        if not ok:
            raise_entry_guard_failure(self.guards, env, g)


def check_entry_guards(spec: EntryGuardSpec, inputs: tuple, state: tuple) -> None:
    """Run-time check of symtrace's entry guards inside an FX graph (``to_fx(check_guards=True)``):
    raises :class:`~symtrace.errors.GuardError` when the inputs break one."""
    spec.check(inputs, state)


class _Attrs:
    """``root`` for guard expressions: nested attributes built from dotted paths."""


def _attr_tree(values: Dict[str, Any]) -> _Attrs:
    root = _Attrs()
    for path in sorted(values, key=lambda p: p.count(".")):
        obj = root
        *prefix, last = path.split(".")
        for part in prefix:
            if not isinstance(obj, _Attrs):  # a real object: read through it, never write to it
                break
            nxt = getattr(obj, part, None)
            if nxt is None:
                nxt = _Attrs()
                setattr(obj, part, nxt)
            obj = nxt
        if isinstance(obj, _Attrs):
            setattr(obj, last, values[path])
    return root


if hasattr(fx.node, "has_side_effect"):  # keep FX's dead-code elimination off the guards
    fx.node.has_side_effect(check_data_guard)
    fx.node.has_side_effect(check_entry_guards)


def is_impure(node: fx.Node) -> bool:
    """symtrace's side-effect rules for an FX node (in-place methods, random ops, guards...):
    use as ``fx_gm.graph.eliminate_dead_code(is_impure_node=is_impure)``."""
    return _symtrace_is_impure(node, node.graph.owning_module)


# --- metadata --------------------------------------------------------------------------------
def _format_stack(loc: SourceLocation) -> str:
    return f'  File "{loc.filename}", line {loc.lineno}, in {loc.function}\n    {loc.line()}\n'


_FRAME = re.compile(r'File "([^"\n]+)", line (\d+), in ([^\n]*)')


def _parse_stack(text: str) -> Optional[SourceLocation]:
    """The innermost frame of an FX stack trace outside torch (else the innermost one)."""
    frames = _FRAME.findall(text)
    if not frames:
        return None
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    filename, line, function = (user or frames)[-1]
    return SourceLocation(filename, int(line), function.strip())


def _module_stack(path: str, root: nn.Module) -> dict:
    stack: dict = {}
    if not path:
        return stack
    parts = path.split(".")
    obj: Any = root
    for i, part in enumerate(parts):
        obj = getattr(obj, part, None) if obj is not None else None
        p = ".".join(parts[:i + 1])
        stack[p] = (p, type(obj) if isinstance(obj, nn.Module) else nn.Module)
    return stack


_DYNAMO_ROOT = re.compile(r"^L\['[^']*'\]")


def _module_path_of(stack: Any) -> Optional[str]:
    """The module path of the innermost entry of an ``nn_module_stack``."""
    if not isinstance(stack, dict):
        return None
    if not stack:
        return ""
    last = list(stack.values())[-1]
    path = last[0] if isinstance(last, tuple) and last and isinstance(last[0], str) else None
    if path is None:
        return None
    path = _DYNAMO_ROOT.sub("", path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.strip(".")


_FORMATS = ((torch.contiguous_format, None), (torch.channels_last, (1, 3, 2, 0)),
            (torch.channels_last_3d, (1, 4, 3, 2, 0)))


def _memory_format(shape: tuple, stride: tuple) -> Optional[torch.memory_format]:
    """The memory format a tensor of this shape and stride is dense in (as FX's ShapeProp
    reports it: contiguous first), or None."""
    if len(stride) != len(shape):
        return None
    if 0 in shape:  # empty tensors count as contiguous
        return torch.contiguous_format
    for fmt, order in _FORMATS:
        if order is None:
            order = tuple(range(len(shape) - 1, -1, -1))
        elif len(order) != len(shape):
            continue
        expected, dense = 1, True
        for d in order:
            if shape[d] != 1:
                if stride[d] != expected:
                    dense = False
                    break
                expected *= shape[d]
        if dense:
            return fmt
    return None


def _fx_tensor_meta(tm: Any) -> Any:
    if isinstance(tm, TensorMeta) and (is_symbolic(tm.shape) or is_symbolic(tm.stride)):
        return None  # FX's TensorMetadata holds ints; the symbolic TensorMeta rides along
    if isinstance(tm, TensorMeta):
        return TensorMetadata(torch.Size(tm.shape), tm.dtype, tm.requires_grad, tuple(tm.stride),
                              _memory_format(tm.shape, tm.stride), tm.qparams is not None, dict(tm.qparams or {}))
    if type(tm) is tuple or type(tm) is list:
        return tuple(_fx_tensor_meta(x) for x in tm)
    return None


def _concrete(sizes: Any) -> Optional[tuple]:
    """Sizes as ints (a SymInt gives its example value, its hint); None when one has none."""
    out = []
    for s in sizes:
        if type(s) is int:
            out.append(s)
            continue
        hint = getattr(getattr(s, "node", None), "hint", None)
        if hint is None:
            return None
        out.append(int(hint))
    return tuple(out)


def _device_of(hint: Any) -> Optional[torch.device]:
    if isinstance(hint, (TensorMeta, torch.Tensor)):
        return hint.device
    return None


def _from_fx_tensor_meta(tm: Any, hint: Any, default_device: torch.device) -> Any:
    if tm is None and isinstance(hint, TensorMeta) and (is_symbolic(hint.shape) or is_symbolic(hint.stride)):
        return hint  # symbolic: it travelled only as symtrace_tensor_meta
    if isinstance(tm, TensorMetadata):
        shape, stride = _concrete(tm.shape), _concrete(tm.stride or ())
        if shape is None or stride is None:
            return None
        new = TensorMeta(shape, tm.dtype, _device_of(hint) or default_device, stride, bool(tm.requires_grad),
                         dict(tm.qparams) if tm.is_quantized else None)
        return hint if new == hint else new
    if isinstance(tm, (tuple, list)):
        hints = hint if isinstance(hint, (tuple, list)) and len(hint) == len(tm) else (None,) * len(tm)
        items = tuple(_from_fx_tensor_meta(x, h, default_device) for x, h in zip(tm, hints))
        return items if any(i is not None for i in items) else None
    return None


def _tensor_meta_of_value(v: Any) -> Any:
    """TensorMeta of a (fake) tensor value as Dynamo records it (``val``/``example_value``)."""
    if isinstance(v, torch.Tensor):
        shape = _concrete(v.shape)
        try:
            stride = _concrete(v.stride())
        except RuntimeError:
            stride = ()
        if shape is None:
            return None
        return TensorMeta(shape, v.dtype, v.device, stride or (), v.requires_grad)
    if isinstance(v, (tuple, list)):
        items = tuple(_tensor_meta_of_value(x) for x in v)
        return items if any(i is not None for i in items) else None
    return None


def _meta_to_fx(meta: dict, root: nn.Module) -> dict:
    out = {k: v for k, v in meta.items() if k not in ("source", "module_path", "tensor_meta", "type_expr")}
    src = meta.get("source")
    if src is not None:
        if isinstance(src, SourceLocation) and "stack_trace" not in out:
            out["stack_trace"] = _format_stack(src)
        if not isinstance(out.get("stack_trace"), str) or _parse_stack(out["stack_trace"]) != src:
            out["source"] = src
    path = meta.get("module_path")
    if path is not None:
        if isinstance(path, str) and "nn_module_stack" not in out:
            out["nn_module_stack"] = _module_stack(path, root)
        if _module_path_of(out.get("nn_module_stack")) != path:
            out["module_path"] = path
    tm = meta.get("tensor_meta")
    if tm is not None:
        fx_tm = _fx_tensor_meta(tm)
        if fx_tm is not None:
            out["tensor_meta"] = fx_tm
        out[TENSOR_META] = tm
    return out


def _meta_from_fx(meta: dict, root: nn.Module, default_device: torch.device) -> dict:
    out = {k: v for k, v in meta.items() if k not in ("tensor_meta", TENSOR_META, ROLE, DYNAMIC_DIMS)}
    trace = meta.get("stack_trace")
    if "source" not in out and isinstance(trace, str):
        loc = _parse_stack(trace)
        if loc is not None:
            out["source"] = loc
    if isinstance(out.get("source"), SourceLocation) and trace == _format_stack(out["source"]):
        del out["stack_trace"]
    stack = meta.get("nn_module_stack")
    if "module_path" not in out:
        path = _module_path_of(stack)
        if path is not None:
            out["module_path"] = path
    if isinstance(out.get("module_path"), str) and stack == _module_stack(out["module_path"], root):
        del out["nn_module_stack"]
    hint = meta.get(TENSOR_META)
    value = meta.get("val", meta.get("example_value"))
    tm = _from_fx_tensor_meta(meta.get("tensor_meta"), hint if hint is not None else value, default_device)
    if tm is None:
        tm = _tensor_meta_of_value(value)
    if tm is not None:
        out["tensor_meta"] = tm
    return out


# --- arguments and targets -------------------------------------------------------------------
_PRINTABLE = (int, float, bool, str, type(None), complex, type(Ellipsis), torch.dtype, torch.device,
              torch.memory_format, torch.layout)


def _printable(a: Any) -> bool:
    """Whether FX's code generator writes ``a`` as valid Python."""
    return type(a) in _PRINTABLE or isinstance(a, (enum.Enum, torch._ops.OpOverload, torch._ops.HigherOrderOperator))


class _Named:
    """A call target FX cannot name (no ``__name__``: a ``functools.partial``, a callable
    object): FX's code calls it under ``name``. :func:`from_fx` unwraps it."""

    def __init__(self, fn: Any, name: str):
        self.fn = fn
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self):
        return f"<{self.__name__}: {self.fn!r}>"


def _fx_target(target: Any) -> Any:
    try:
        fx.node._get_qualified_name(target)
        return target
    except Exception:
        name = "".join(c if c.isalnum() else "_" for c in type(target).__name__)
        return _Named(target, f"symtrace_call_{name}")


def _fetch(root: nn.Module, qualified: str) -> Any:
    obj: Any = root
    for part in qualified.split("."):
        obj = getattr(obj, part)
    return obj


# --- symtrace -> fx --------------------------------------------------------------------------
class _ToFx:
    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.graph = fx.Graph()
        self.env: Dict[Node, fx.Node] = {}
        self.consts: Dict[int, fx.Node] = {}
        self.const_values: Dict[str, Any] = {}
        self.targets: Dict[int, tuple] = {}  # id(target) -> (target, what FX calls)

    def target(self, target: Any) -> Any:
        hit = self.targets.get(id(target))
        if hit is None:
            hit = self.targets[id(target)] = (target, _fx_target(target))
        return hit[1]

    def arg(self, a: Any) -> Any:
        return tree_map(self._leaf_arg, a)

    def _leaf_arg(self, a: Any) -> Any:
        t = type(a)
        if t is Node:
            return self.env[a]
        if t is torch.Size:
            return tuple(a)
        if _printable(a):
            return a
        return self.constant(a)

    def constant(self, value: Any) -> fx.Node:
        node = self.consts.get(id(value))
        if node is None:
            name = f"_symtrace_const{len(self.consts)}"
            while hasattr(self.gm, name):
                name += "_"
            self.const_values[name] = value
            node = self.consts[id(value)] = self.graph.create_node("get_attr", name, name=name.lstrip("_"))
            node.meta[ROLE] = "constant"
        return node


def to_fx(gm: GraphModule, *, check_guards: bool = False) -> fx.GraphModule:
    """Convert a symtrace :class:`~symtrace.graph.GraphModule` into a ``torch.fx.GraphModule``.

    The FX module shares ``gm``'s parameters, buffers and submodules and computes the same
    outputs; existing FX passes run on it, and :func:`from_fx` converts it (edited or not)
    back. ``gm``'s entry guards are kept in ``fx_gm.meta["symtrace_guards"]`` but **the FX
    module does not check them** (it computes whatever the inputs give), unless
    ``check_guards=True``: then a ``check_entry_guards`` node right after the placeholders
    raises :class:`~symtrace.errors.GuardError` on inputs the graph was not traced for (module
    attributes the guards read are passed to it as ``get_attr`` values). Data guards are
    graph nodes and run either way. See the module docstring for the metadata mapping.
    """
    if not isinstance(gm, GraphModule):
        raise TypeError(f"to_fx needs a symtrace GraphModule, got {type(gm).__name__}")
    for n in gm.graph.nodes:
        if n.op == "call_function" and type(n.target) is FunctionType and n.target in ROOT_HELPERS:
            raise FxConversionError(
                f"node {n.name!r} replays a Python side effect of forward ({describe_effect(n)}); an FX "
                "graph cannot write to its module's Python state. Keep such state out of forward (or in "
                "buffers) to convert it")
    conv = _ToFx(gm)
    fxg = conv.graph
    guards = list(gm.graph.guards)
    # (module members read as attributes: the root the FX check builds has those, not the tables)
    checked = [attribute_form(g) for g in guards if g.kind not in LIVE_GUARD_KINDS] if check_guards else []
    guard_attrs = _guard_attrs(gm, guards)
    renamed: Dict[str, str] = {}
    placeholders: List[Node] = []
    dynamic: Dict[str, Dict[int, Dim]] = {}
    pending = bool(checked)  # the guard check goes right after the placeholders
    for n in gm.graph.nodes:
        if n.op != "placeholder" and pending:
            _add_guard_check(conv, checked, placeholders, guard_attrs)
            pending = False
        args, kwargs = conv.arg(n.args), conv.arg(n.kwargs)
        meta = _meta_to_fx(n.meta, gm)
        type_expr = n.meta.get("type_expr")
        if n.op == "placeholder":
            fargs = () if n.default is _NO_DEFAULT else (conv.arg(n.default),)
            f = fxg.create_node("placeholder", n.target, fargs, name=n.name, type_expr=type_expr)
            placeholders.append(n)
            dims = input_symbols(n.meta.get("tensor_meta"))
            dynamic[n.target] = None
            if dims:
                meta[DYNAMIC_DIMS] = dynamic[n.target] = {i: Dim(s.name, min=s.lo, max=s.hi) for i, s in dims.items()}
        else:
            target = conv.target(n.target) if n.op == "call_function" else n.target
            f = fxg.create_node(n.op, target, args, kwargs, name=n.name, type_expr=type_expr)
        f.meta.update(meta)
        if f.name != n.name:
            renamed[f.name] = n.name
        conv.env[n] = f
    if pending:  # a graph of placeholders only
        _add_guard_check(conv, checked, placeholders, guard_attrs)

    fx_gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name=getattr(gm, "_class_name", type(gm).__name__))
    fx_gm.training = gm.training
    installer = _Installer(fx_gm, gm)
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "call_module"):
            installer.install(n.target, _fetch(gm, n.target))
    for path, value in guard_attrs.items():
        installer.install(path, value)
    for name, value in conv.const_values.items():
        setattr(fx_gm, name, value)
    fx_gm.graph = fxg
    fx_gm.meta.update(getattr(gm, "meta", None) or {})
    fx_gm.meta[GUARDS] = guards
    fx_gm.meta[CREATED_BY] = gm.graph.created_by
    fx_gm.meta[NAMES] = renamed
    if any(dynamic.values()):
        fx_gm.meta[DYNAMIC_SHAPES] = dynamic
    return fx_gm


def export_dynamic_shapes(fx_gm: fx.GraphModule) -> Optional[Dict[str, Dict[int, Any]]]:
    """The symbolic dimensions :func:`to_fx` recorded (``fx_gm.meta["symtrace_dynamic_shapes"]``)
    as ``torch.export``'s ``dynamic_shapes`` argument: ``{input: {dim: torch.export.Dim} or None}``
    for every input, one ``torch.export.Dim`` per symbol (shared where symtrace's Dims were). None
    without symbols.

    >>> torch.export.export(fx_gm, args, dynamic_shapes=export_dynamic_shapes(fx_gm))
    """
    spec = fx_gm.meta.get(DYNAMIC_SHAPES)
    if not spec:
        return None
    made: Dict[str, Any] = {}
    out: Dict[str, Dict[int, Any]] = {}
    for name, dims in spec.items():
        out[name] = None if dims is None else {}
        for i, d in (dims or {}).items():
            if d.name not in made:
                kw = {"min": d.min} if d.max == math.inf else {"min": d.min, "max": d.max}
                made[d.name] = torch.export.Dim(d.name, **kw)
            out[name][i] = made[d.name]
    return out


def _guard_attrs(root: nn.Module, guards: list) -> Dict[str, Any]:
    """The module attributes entry guards read (``root.training``, ``root.child.flag``)."""
    attrs: Dict[str, Any] = {}
    for chain in _guard_attr_chains(guards):
        path, value = _plain_attr(root, chain)
        if path and path not in attrs:
            attrs[path] = value
    return attrs


def _add_guard_check(conv: _ToFx, guards: list, placeholders: List[Node], attrs: Dict[str, Any]) -> None:
    fxg = conv.graph
    paths = list(attrs)
    state = []
    for path in paths:
        s = fxg.create_node("get_attr", path, name=f"guard_state_{path.replace('.', '_')}")
        s.meta[ROLE] = "guard_state"
        state.append(s)
    names = [[n.name, n.target.lstrip("*")] for n in placeholders]
    spec = conv.constant(EntryGuardSpec(guards, names, paths))
    spec.meta[ROLE] = "guard_check"
    inputs = tuple(conv.env[n] for n in placeholders)
    check = fxg.create_node("call_function", check_entry_guards, (spec, inputs, tuple(state)),
                            name="symtrace_entry_guards")
    check.meta[ROLE] = "guard_check"


# --- fx -> symtrace --------------------------------------------------------------------------
def _from_fx_arg(a: Any, env: Dict[fx.Node, Any], user: fx.Node) -> Any:
    """An FX argument of ``user`` as a symtrace one: its nodes looked up in ``env``."""
    return tree_map(lambda x: _from_fx_leaf(x, env, user), a)


def _from_fx_leaf(a: Any, env: Dict[fx.Node, Any], user: fx.Node) -> Any:
    if isinstance(a, fx.Node):
        try:
            return env[a]
        except KeyError:
            raise FxConversionError(f"from_fx: node %{user.name} reads %{a.name}, which is not defined "
                                    "before it in the FX graph") from None
    if type(a) is torch.Size:
        return tuple(a)
    if isinstance(a, list):  # FX's immutable_list
        return _from_fx_arg(list(a), env, user)
    if isinstance(a, dict):  # FX's immutable_dict
        return _from_fx_arg(dict(a), env, user)
    return a


def _describe(n: fx.Node) -> str:
    try:
        target = fx.node._get_qualified_name(n.target) if n.op == "call_function" else n.target
    except Exception:
        target = repr(n.target)
    where = ""
    trace = n.meta.get("stack_trace")
    loc = _parse_stack(trace) if isinstance(trace, str) else None
    if loc is not None:
        where = f" (traced from {loc.describe()})"
    return f"%{n.name} = {n.op}[{target}]{where}"


def _check_node(n: fx.Node, fx_gm: fx.GraphModule) -> None:
    if n.op not in OPCODES:
        raise FxConversionError(
            f"from_fx: node {_describe(n)} has opcode {n.op!r}, which symtrace cannot represent "
            f"(symtrace graphs have {', '.join(OPCODES)})")
    if n.op in ("get_attr", "call_module", "call_method"):
        if not isinstance(n.target, str):
            raise FxConversionError(f"from_fx: node {_describe(n)} is {n.op} but its target "
                                    f"{n.target!r} is not a string")
    if n.op in ("get_attr", "call_module"):
        obj, missing = resolve_attr(fx_gm, n.target)
        if missing is not None:
            raise FxConversionError(f"from_fx: node {_describe(n)} names {n.target!r}, but the FX "
                                    f"module has no attribute {missing!r} there")
        if n.op == "call_module" and not isinstance(obj, nn.Module):
            raise FxConversionError(f"from_fx: node {_describe(n)} calls {n.target!r}, which is a "
                                    f"{type(obj).__name__}, not a module")
    if n.op == "call_function" and not callable(n.target):
        raise FxConversionError(f"from_fx: node {_describe(n)} calls {n.target!r}, which is not callable")


def _default_device(fx_gm: nn.Module) -> torch.device:
    for t in fx_gm.parameters():
        return t.device
    for t in fx_gm.buffers():
        return t.device
    return torch.device("cpu")


def _skippable(n: fx.Node) -> bool:
    role = n.meta.get(ROLE)
    if role == "guard_check":
        return True
    return role == "guard_state" and all(u.meta.get(ROLE) == "guard_check" for u in n.users)


def from_fx(fx_gm: fx.GraphModule, *, class_name: Optional[str] = None) -> GraphModule:
    """Convert a ``torch.fx.GraphModule`` into a symtrace :class:`~symtrace.graph.GraphModule`.

    Takes graphs from :func:`to_fx` (after any FX passes), from ``torch.fx.symbolic_trace``
    (leaf modules become ``call_module`` nodes) and from Dynamo (``torch.compile`` backends).
    Entry guards recorded by :func:`to_fx` come back from ``fx_gm.meta["symtrace_guards"]``,
    with the module attributes they read (an FX pass that renames or removes the placeholders
    they test makes every call fail its guard check); graphs from elsewhere have none. Other
    keys of ``fx_gm.meta`` go to ``gm.meta``. The result shares
    ``fx_gm``'s parameters, buffers and submodules. Raises :class:`FxConversionError` naming the
    node for what symtrace cannot represent (custom FX code generators such as the pytree
    calling convention of ``torch.export``, unknown opcodes, targets the module lacks).
    """
    if not isinstance(fx_gm, fx.GraphModule):
        raise TypeError(f"from_fx needs a torch.fx.GraphModule, got {type(fx_gm).__name__}")
    fxg = fx_gm.graph
    codegen = getattr(fxg, "_codegen", None)
    if codegen is not None and type(codegen) is not fx.graph.CodeGen:
        raise FxConversionError(
            f"from_fx: the FX graph uses a custom code generator ({type(codegen).__name__}), which changes "
            "how forward takes its inputs and returns its outputs (e.g. pytree flattening from "
            "torch.export or make_fx); symtrace graphs take their inputs as they are. Convert a graph "
            "with the default torch.fx.graph.CodeGen (for ExportedProgram.module(), convert the "
            "ExportedProgram itself with symtrace.from_export(ep))")
    gm_meta = getattr(fx_gm, "meta", None) or {}
    names = gm_meta.get(NAMES) or {}
    device = _default_device(fx_gm)
    graph = Graph()
    env: Dict[fx.Node, Any] = {}
    for n in fxg.nodes:
        _check_node(n, fx_gm)
        if _skippable(n):
            continue
        if n.meta.get(ROLE) == "constant" and n.op == "get_attr":
            env[n] = _fetch(fx_gm, n.target)
            continue
        meta = _meta_from_fx(n.meta, fx_gm, device)
        if n.type is not None:
            meta["type_expr"] = n.type
        name = names.get(n.name, n.name)
        if n.op == "placeholder":
            node = graph.create_node("placeholder", n.target, name=name, meta=meta)
            if n.args:
                node.default = _from_fx_arg(n.args[0], env, n)
        else:
            target = n.target.fn if isinstance(n.target, _Named) else n.target
            node = graph.create_node(n.op, target, _from_fx_arg(n.args, env, n),
                                     _from_fx_arg(dict(n.kwargs), env, n), name=name, meta=meta)
        env[n] = node
    graph.guards = list(gm_meta.get(GUARDS) or ())
    graph.created_by = gm_meta.get(CREATED_BY, "from_fx")
    attrs = _guard_attrs(fx_gm, graph.guards)
    gm = GraphModule(fx_gm, graph, class_name=class_name or class_name_from(type(fx_gm).__name__), attrs=attrs)
    gm.meta.update({k: v for k, v in gm_meta.items() if k not in (GUARDS, CREATED_BY, NAMES)})
    return gm
