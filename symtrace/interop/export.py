"""Convert between symtrace graphs and ``torch.export``: :func:`from_export` and :func:`to_export`.

:func:`from_export` turns an ``ExportedProgram`` (ATen-level graph, lifted state, pytree calling
convention) into a symtrace :class:`~symtrace.graph.GraphModule` that is called like the module
that was exported:

* lifted **parameters, buffers and tensor constants** become attributes of the returned module
  under their original qualified names (``layer1.0.weight``), read by ``get_attr`` nodes
  (parameters and buffers registered as such, non-persistent buffers too); they are shared
  with the program's ``state_dict`` / ``constants``, as ``ExportedProgram.module()`` does;
* **inputs**: one placeholder per argument of the exported call (positional arguments by the
  names of ``forward``'s parameters, then keyword arguments), taken apart by ``getitem`` nodes
  as the program's input tree says (tuples, lists, dicts, namedtuples, ``None``, and other
  classes registered with ``torch.utils._pytree`` through their flatten function);
* **outputs** are rebuilt in the nesting the program returns (registered classes by their
  unflatten function);
* **mutations**: in-place ops on buffers and inputs stay in place; a functional program's
  buffer and input mutations (``run_decompositions()``) become ``copy_`` nodes before the output;
* **entry guards** check what the program was specialised on: the input structure, each
  tensor's dtype, device, rank and static sizes, the range of each dynamic dimension
  (``range_constraints``) and equalities between dimensions sharing a symbol, and the value of
  each non-tensor input that was specialised (``n: int`` passed as ``3``). Other inputs raise
  :class:`~symtrace.errors.GuardError` instead of computing something else;
* higher-order ops (``torch.cond``, ``no_grad`` regions) keep their bodies as ``torch.fx``
  submodules: they run, but :func:`symtrace.save` refuses them;
* the program was exported in one mode: ``gm.train()`` / ``gm.eval()`` do not change what runs;
* node metadata is translated as :func:`~symtrace.interop.fx.from_fx` does (``stack_trace`` →
  ``source``, ``nn_module_stack`` → ``module_path``, fake ``val`` → ``tensor_meta`` at the
  example sizes); the fake values themselves are dropped, and nodes whose sizes are symbolic
  keep them as text in ``meta["symbolic_shape"]`` (``("s77", 4)``), with
  ``gm.meta["range_constraints"]`` (``{"s77": (2, 64)}``, ``None`` for no upper bound).

:func:`to_export` goes the other way through :func:`~symtrace.interop.fx.to_fx` and
``torch.export.export``.
"""
from __future__ import annotations

import collections
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch import nn

from ..graph import Graph, GraphModule
from ..graph.graph_module import class_name_from
from ..graph.guard_expr import Attr, BinOp, Call, Const, GExpr, Input, Item
from ..graph.guards import LIVE_GUARD_KINDS, Guard, check_data_guard, check_entry_guards
from ..graph.node import _NO_DEFAULT, Node
from ..graph.pytree_bridge import pytree_children, rebuild_pytree
from .fx import FxConversionError, _check_node, _default_device, _from_fx_arg, _meta_from_fx, export_dynamic_shapes, to_fx

__all__ = ["from_export", "to_export"]

_REASON = "what the ExportedProgram was exported for"


def _err(msg: str) -> FxConversionError:
    return FxConversionError("from_export: " + msg)


def _kind(spec: Any) -> str:
    return spec.kind.name


def _children(spec: Any) -> list:
    fn = getattr(spec, "children", None)  # torch >= 2.13; children_specs before
    return list(fn()) if callable(fn) else list(spec.children_specs)


def _is_namedtuple(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")


def _type(spec: Any) -> Any:
    """The class a tree node stands for (pytree files namedtuples under a marker type, with the
    class as context)."""
    return spec.context if _is_namedtuple(spec.context) else spec.type


def _is_dict(spec: Any) -> bool:
    """A dict or OrderedDict tree node (its context is the key list)."""
    return spec.type is dict or spec.type is collections.OrderedDict


def _keys(spec: Any) -> list:
    return list(spec.context)


def _registered(t: Any) -> bool:
    from torch.utils import _pytree
    return t in _pytree.SUPPORTED_NODES


# --- sizes -----------------------------------------------------------------------------------
def _bound(v: Any) -> Optional[int]:
    """A range end as an int; None for infinity."""
    return int(v) if type(v) is int or getattr(v, "is_Integer", False) is True else None


def _ranges(ep: Any) -> Dict[Any, Tuple[Optional[int], Optional[int]]]:
    out = {}
    for sym, vr in (getattr(ep, "range_constraints", None) or {}).items():
        out[sym] = (_bound(vr.lower), _bound(vr.upper))
    return out


class _Sizes:
    """Guards on tensor sizes from the program's symbolic shapes: static sizes, the range of
    each dynamic dimension where it first appears, and every later use of a symbol (or a
    linear expression of symbols) as an equality with that first appearance."""

    def __init__(self, ranges: Dict[Any, Tuple[Optional[int], Optional[int]]], guards: List[Guard]):
        self.ranges = ranges
        self.guards = guards
        self.first: Dict[Any, GExpr] = {}  # symbol -> where it is first read
        self.pending: List[Tuple[GExpr, Any, str]] = []  # expressions of symbols, checked last

    def add(self, kind: str, expr: GExpr, expected: Any, check: str, reason: str) -> None:
        self.guards.append(Guard(kind, expr, expected, check, None, reason))

    def value(self, read: GExpr, v: Any, what: str) -> None:
        """Guard one size (or SymInt input) ``v`` read by ``read``."""
        if type(v) is int:
            self.add("shape", read, v, "eq", f"a static size of {what}")
            return
        expr = getattr(getattr(v, "node", None), "expr", None)
        if expr is None:
            raise _err(f"{what} has a size {v!r} that symtrace cannot read")
        if getattr(expr, "is_Symbol", False):
            if expr not in self.first:
                self.first[expr] = read
                lo, hi = self.ranges.get(expr, (None, None))
                if lo is not None and lo > 0:
                    self.add("shape", BinOp(">=", read, Const(lo)), True, "bool", f"the range of dynamic size {expr}")
                if hi is not None:
                    self.add("shape", BinOp("<=", read, Const(hi)), True, "bool", f"the range of dynamic size {expr}")
                return
            self.add("shape", BinOp("==", read, self.first[expr]), True, "bool", f"dimensions sharing dynamic size {expr}")
            return
        self.pending.append((read, expr, what))

    def finish(self) -> None:
        for read, expr, what in self.pending:
            self.add("shape", BinOp("==", read, self._sym(expr, what)), True, "bool",
                     f"a derived dynamic size ({expr})")

    def _sym(self, e: Any, what: str) -> GExpr:
        if getattr(e, "is_Integer", False):
            return Const(int(e))
        if getattr(e, "is_Symbol", False) and e in self.first:
            return self.first[e]
        if getattr(e, "is_Add", False) or getattr(e, "is_Mul", False):
            op = "+" if e.is_Add else "*"
            args = [self._sym(a, what) for a in e.args]
            out = args[0]
            for a in args[1:]:
                out = BinOp(op, out, a)
            return out
        raise _err(f"{what} has the size {e}, an expression symtrace cannot check on entry (only "
                   "sizes, symbols that also appear alone as a size, and sums and products of them)")


# --- inputs ----------------------------------------------------------------------------------
class _Inputs:
    """Binds the program's flat user inputs to nodes under the new placeholders, writing the
    entry guards the program was specialised on."""

    def __init__(self, graph: Graph, sizes: _Sizes, leaf_names: List[str]):
        self.graph = graph
        self.sizes = sizes
        self.leaf_names = leaf_names  # the program's names of its flat inputs
        self.leaves: List[Tuple[Node, GExpr, str]] = []  # in the program's flat order

    def bind(self, spec: Any, node: Node, expr: GExpr, what: str) -> None:
        t = _type(spec)
        add = self.sizes.add
        if spec.is_leaf():
            self.leaves.append((node, expr, what))
            return
        if t is type(None):
            add("value", expr, None, "is", _REASON)
            return
        kids = _children(spec)
        if t in (tuple, list) or _is_namedtuple(t):
            add("type", expr, t, "type", _REASON)
            add("shape", Call("len", (expr,)), len(kids), "eq", _REASON)
            keys: list = list(range(len(kids)))
        elif _is_dict(spec):
            keys = _keys(spec)
            add("type", expr, t, "type", _REASON)
            add("value", Call("list", (expr,)), keys, "eq", _REASON)
        elif _registered(t):  # another class registered with torch.utils._pytree: its flatten function
            add("type", Call("type", (expr,)), t, "is", _REASON)
            add("value", Call("_st_pytree_context", (expr,)), spec.context, "eq", _REASON)
            expr = Call("_st_pytree_children", (expr,))
            add("shape", Call("len", (expr,)), len(kids), "eq", _REASON)
            node = self.graph.create_node("call_function", pytree_children, (node,), name=f"{node.name}_children")
            keys = list(range(len(kids)))
        else:
            raise _err(f"the input {what} is a {getattr(t, '__qualname__', t)}, which symtrace cannot take apart")
        for key, kid in zip(keys, kids):
            i = len(self.leaves)  # a leaf child is the next leaf: named after the program's placeholder
            if kid.is_leaf() and i < len(self.leaf_names):
                name = self.leaf_names[i]
            else:
                name = f"{node.name}_{key}" if isinstance(key, int) or str(key).isidentifier() else f"{node.name}_item"
            child = self.graph.create_node("call_function", operator.getitem, (node, key), name=name)
            self.bind(kid, child, Item(expr, Const(key)), f"{what}[{key!r}]")

    def guard_leaf(self, expr: GExpr, arg: Any, val: Any, what: str) -> None:
        add = self.sizes.add
        kind = type(arg).__name__
        if kind == "TensorArgument":
            if not isinstance(val, torch.Tensor):
                raise _err(f"the input {what} has no example tensor in its metadata")
            add("type", expr, torch.Tensor, "isinstance", _REASON)
            add("dtype", Attr(expr, "dtype"), val.dtype, "is", _REASON)
            add("device", Attr(expr, "device"), val.device, "eq", _REASON)
            add("ndim", Attr(expr, "ndim"), val.ndim, "eq", _REASON)
            for i, d in enumerate(val.shape):
                self.sizes.value(Item(Attr(expr, "shape"), Const(i)), d, what)
        elif kind == "SymIntArgument":
            add("type", expr, int, "type", _REASON)
            self.sizes.value(expr, val, what)
        elif kind in ("SymFloatArgument", "SymBoolArgument"):
            add("type", expr, float if kind == "SymFloatArgument" else bool, "type", _REASON)
        elif kind == "ConstantArgument":
            v = arg.value
            if v is None or type(v) is bool:
                add("value", expr, v, "is", _REASON + " (a specialised value)")
            else:
                add("type", expr, type(v), "type", _REASON + " (a specialised value)")
                add("value", expr, v, "eq", _REASON + " (a specialised value)")
        else:
            raise _err(f"the input {what} is a {kind}, which symtrace cannot take (script objects and effect "
                       "tokens have no symtrace form)")


def _arg_names(ep: Any, n_args: int, kw_keys: list) -> List[str]:
    names: List[str] = []
    try:
        sig = ep.module_call_graph[0].signature
        names = list(sig.forward_arg_names or ()) if sig is not None else []
    except (AttributeError, IndexError):
        names = []
    out = []
    for i in range(n_args):
        n = names[i] if i < len(names) and isinstance(names[i], str) and names[i].isidentifier() else f"arg{i}"
        out.append(n)
    return out + [str(k) for k in kw_keys]


# --- outputs ---------------------------------------------------------------------------------
def _rebuild(graph: Graph, spec: Any, leaves: list) -> Any:
    """The program's output structure with ``leaves`` (nodes or constants) in it: tuples, lists,
    dicts and namedtuples as they are, other registered pytree classes (OrderedDict, a library's
    output class) rebuilt by their unflatten function in a ``rebuild_pytree`` node."""
    if spec.is_leaf():
        return leaves.pop(0)
    t = _type(spec)
    if t is type(None):
        return None
    kids = [_rebuild(graph, k, leaves) for k in _children(spec)]
    if t in (tuple, list):
        return t(kids)
    if _is_namedtuple(t):
        return t(*kids)
    if t is dict:
        return dict(zip(_keys(spec), kids))
    if not _registered(t):
        raise _err(f"the program returns a {getattr(t, '__qualname__', t)}, which is no longer registered with "
                   "torch.utils._pytree; register it again before converting")
    return graph.create_node("call_function", rebuild_pytree, (t, kids, spec.context),
                             name=class_name_from(getattr(t, "__name__", "pytree")).lower())


def _class_name(ep: Any) -> str:
    for n in ep.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if isinstance(stack, dict):
            for path, cls in stack.values():
                if path == "" and isinstance(cls, str):
                    return class_name_from(cls.rpartition(".")[2])
                if path == "" and isinstance(cls, type):
                    return class_name_from(cls.__name__)
    return "ExportedModule"


def _symbolic(val: Any) -> Optional[Any]:
    if isinstance(val, torch.Tensor):
        dims = tuple(d if type(d) is int else str(d) for d in val.shape)
        return dims if any(type(d) is str for d in dims) else None
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(val)
    return None


def _state_module(ep: Any, specs: list) -> nn.Module:
    """A plain module tree holding the program's lifted state at its qualified names."""
    root = nn.Module()
    nonpersistent = set(getattr(ep.graph_signature, "non_persistent_buffers", ()) or ())

    def put(path: str, value: Any, kind: str) -> None:
        *prefix, last = path.split(".")
        mod = root
        for part in prefix:
            sub = mod._modules.get(part)
            if sub is None:
                sub = nn.Module()
                mod.add_module(part, sub)
            mod = sub
        if kind == "PARAMETER":
            p = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=value.requires_grad)
            mod.register_parameter(last, p)
        elif kind == "BUFFER":
            mod.register_buffer(last, value, persistent=path not in nonpersistent)
        else:
            setattr(mod, last, value)

    for spec in specs:
        kind, target = _kind(spec), spec.target
        if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            if target in ep.state_dict:
                value = ep.state_dict[target]
            elif target in ep.constants:
                value = ep.constants[target]
            else:
                raise _err(f"the program lifts {target!r} ({kind.lower()}) but has no value for it")
            put(target, value, kind)
    for n in ep.graph.nodes:  # bodies of higher-order ops (cond, wrap_with_set_grad_enabled...)
        if n.op == "get_attr":
            obj: Any = ep.graph_module
            for part in n.target.split("."):
                obj = getattr(obj, part)
            put(n.target, obj, "CONSTANT")
    return root


def from_export(ep: "torch.export.ExportedProgram", *, class_name: Optional[str] = None) -> GraphModule:
    """Convert a ``torch.export.ExportedProgram`` into a symtrace :class:`~symtrace.graph.GraphModule`
    that is called like the exported module (same positional and keyword arguments, same nested
    outputs) and computes the same values. See the module docstring for lifted state, inputs,
    outputs, mutations, guards and metadata.

    Raises :class:`~symtrace.interop.fx.FxConversionError` for what symtrace cannot represent:
    joint (training) graphs with gradient outputs, effect tokens, script objects and parameter
    mutations.
    """
    if not isinstance(ep, torch.export.ExportedProgram):
        hint = " (for ep.module(), pass the ExportedProgram itself)" if isinstance(ep, fx.GraphModule) else ""
        raise TypeError(f"from_export needs a torch.export.ExportedProgram, got {type(ep).__name__}{hint}")
    sig = ep.graph_signature
    in_specs, out_specs = list(sig.input_specs), list(sig.output_specs)
    fx_gm = ep.graph_module
    in_spec = ep.call_spec.in_spec
    out_spec = ep.call_spec.out_spec
    if in_spec is None or out_spec is None:
        raise _err("the program has no input/output tree spec (call_spec); export it with torch.export.export")

    user_specs = [s for s in in_specs if _kind(s) == "USER_INPUT"]
    graph = Graph()
    guards: List[Guard] = []
    sizes = _Sizes(_ranges(ep), guards)
    inputs = _Inputs(graph, sizes, [s.arg.name for s in user_specs])
    args_spec, kwargs_spec = _children(in_spec)
    kw_keys = _keys(kwargs_spec) if not kwargs_spec.is_leaf() else []
    names = _arg_names(ep, len(_children(args_spec)), kw_keys)
    for name, spec in zip(names, _children(args_spec) + _children(kwargs_spec)):
        ph = graph.create_node("placeholder", name, name=name)
        inputs.bind(spec, ph, Input(ph.name), repr(name))

    if len(user_specs) != len(inputs.leaves):
        raise _err(f"the program's input tree has {len(inputs.leaves)} leaves but its signature lists "
                   f"{len(user_specs)} user inputs")
    by_name = {s.arg.name: s for s in in_specs if hasattr(s.arg, "name")}
    user_leaf = {s.arg.name: leaf for s, leaf in zip(user_specs, inputs.leaves)}
    for s in in_specs:
        if _kind(s) not in ("USER_INPUT", "PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            raise _err(f"the program takes {s.arg.name!r} as a {_kind(s)} input, which symtrace cannot represent "
                       "(script objects and effect tokens)")
    root = _state_module(ep, in_specs)
    device = _default_device(fx_gm)

    env: Dict[fx.Node, Any] = {}
    state_nodes: Dict[str, Node] = {}  # qualified name -> its get_attr node
    out_node: Optional[fx.Node] = None
    for n in fx_gm.graph.nodes:
        meta = _meta_from_fx(n.meta, fx_gm, device)
        val = meta.pop("val", None)
        sym = _symbolic(val)
        if sym is not None:
            meta["symbolic_shape" if isinstance(sym, tuple) else "symbolic_value"] = sym
        if n.op == "placeholder":
            spec = by_name.get(n.name)
            if spec is None:
                raise _err(f"the placeholder %{n.name} has no entry in the graph signature")
            if _kind(spec) == "USER_INPUT":
                leaf, expr, what = user_leaf[n.name]
                inputs.guard_leaf(expr, spec.arg, val, what)
                leaf.meta.update(meta)
                env[n] = leaf
            else:
                node = graph.create_node("get_attr", spec.target, name=n.name, meta=meta)
                state_nodes[spec.target] = node
                env[n] = node
            continue
        if n.op == "output":
            out_node = n
            continue
        _check_node(n, fx_gm)
        if n.op == "get_attr":
            node = graph.create_node("get_attr", n.target, name=n.name, meta=meta)
        else:
            node = graph.create_node(n.op, n.target, _from_fx_arg(n.args, env, n),
                                     _from_fx_arg(dict(n.kwargs), env, n), name=n.name, meta=meta)
        env[n] = node
    sizes.finish()

    flat = list(_from_fx_arg(out_node.args[0], env, out_node)) if out_node is not None else []
    if len(flat) != len(out_specs):
        raise _err(f"the program returns {len(flat)} values but its signature lists {len(out_specs)} outputs")
    user_outputs = []
    for value, spec in zip(flat, out_specs):
        kind = _kind(spec)
        if kind in ("USER_OUTPUT", "LOSS_OUTPUT"):
            user_outputs.append(value)
        elif kind == "BUFFER_MUTATION":
            dest = state_nodes.get(spec.target)
            if dest is None:
                raise _err(f"the program updates the buffer {spec.target!r}, which it does not take as an input")
            graph.create_node("call_method", "copy_", (dest, value), name=f"update_{dest.name}")
        elif kind == "USER_INPUT_MUTATION":
            leaf = user_leaf.get(spec.target)
            if leaf is None:
                raise _err(f"the program updates the input {spec.target!r}, which is not one of its user inputs")
            graph.create_node("call_method", "copy_", (leaf[0], value), name=f"update_{leaf[0].name}")
        else:
            what = {"GRADIENT_TO_PARAMETER": "gradients (a joint forward-backward graph)",
                    "GRADIENT_TO_USER_INPUT": "gradients (a joint forward-backward graph)",
                    "PARAMETER_MUTATION": "a new value of a parameter", "TOKEN": "an effect token"}.get(kind, kind)
            raise _err(f"the program returns {what} as its output {spec.arg.name!r} ({kind}), which symtrace "
                       "cannot represent; convert the program torch.export.export gives before joint or "
                       "effectful transformations")
    if out_spec.num_leaves != len(user_outputs):
        raise _err(f"the program's output tree has {out_spec.num_leaves} leaves but it returns "
                   f"{len(user_outputs)} user outputs")
    result = _rebuild(graph, out_spec, list(user_outputs))
    graph.create_node("output", "output", (result,), name="output")
    graph.guards = guards
    graph.created_by = "from_export"
    gm = GraphModule(root, graph, class_name=class_name or _class_name(ep))
    gm.meta["range_constraints"] = {str(k): v for k, v in sizes.ranges.items()}
    return gm


# --- symtrace -> torch.export ----------------------------------------------------------------
def _data_guard_in(e: BaseException) -> Optional[Guard]:
    """The data guard whose check raised ``e`` (or an exception it was raised from), if any:
    a decision on a tensor's value, which torch.export cannot trace."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is check_data_guard.__code__:
                guard = tb.tb_frame.f_locals.get("guard")
                if isinstance(guard, Guard):
                    return guard
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return None


def _bind(gm: GraphModule, args: tuple, kwargs: dict) -> Tuple[Dict[str, Any], tuple, dict]:
    """The call's inputs by placeholder name (as entry guards name them), and the arguments to
    export with. torch.export feeds an FX module's placeholders in order, so keyword arguments
    become positional, with the defaults of the inputs skipped before them (``*args`` /
    ``**kwargs`` graphs are exported with the arguments as given)."""
    phs = gm.graph.placeholders()
    env: Dict[str, Any] = {}
    if any(str(ph.target).startswith("*") for ph in phs):
        for i, ph in enumerate(phs):
            target = str(ph.target)
            if target.startswith("**"):
                env[ph.name] = {k: v for k, v in kwargs.items() if k not in env}
            elif target.startswith("*"):
                env[ph.name] = tuple(args[i:])
            elif i < len(args):
                env[ph.name] = args[i]
            elif target in kwargs:
                env[ph.name] = kwargs[target]
            elif ph.default is not _NO_DEFAULT:
                env[ph.name] = ph.default
        return env, args, kwargs
    unknown = set(kwargs) - {str(ph.target) for ph in phs[len(args):]}
    if unknown or len(args) > len(phs):
        what = f"the keyword argument {sorted(unknown)[0]!r}" if unknown else f"{len(args)} positional arguments"
        raise TypeError(f"to_export: the graph's forward takes ({', '.join(str(p.target) for p in phs)}), not {what}")
    given = [i for i, ph in enumerate(phs) if i < len(args) or str(ph.target) in kwargs]
    flat = []
    for i, ph in enumerate(phs[:given[-1] + 1] if given else ()):
        if i < len(args):
            flat.append(args[i])
        elif str(ph.target) in kwargs:
            flat.append(kwargs[str(ph.target)])
        elif ph.default is not _NO_DEFAULT:
            flat.append(ph.default)
        else:
            raise TypeError(f"to_export: no example value for the graph's input {ph.target!r}")
    for ph, value in zip(phs, flat):
        env[ph.name] = value
    for ph in phs[len(flat):]:
        if ph.default is not _NO_DEFAULT:
            env[ph.name] = ph.default
    return env, tuple(flat), {}


def _traced_dims(fx_gm: Any, n_args: int) -> Optional[dict]:
    """:func:`~symtrace.interop.fx.export_dynamic_shapes` for the first ``n_args`` inputs (the
    ones the export passes), or None when the graph has no symbolic sizes."""
    spec = export_dynamic_shapes(fx_gm)
    if spec is None:
        return None
    names = list(spec)[:n_args]
    return {n: spec[n] for n in names} if any(spec[n] for n in names) else None


def to_export(gm: GraphModule, example_inputs: tuple, example_kwargs: Optional[dict] = None, *,
              dynamic_shapes: Any = None) -> "torch.export.ExportedProgram":
    """Export a symtrace graph with ``torch.export.export``: ``to_fx(gm, check_guards=True)``
    exported on ``example_inputs`` (and ``example_kwargs``); ``dynamic_shapes`` is passed
    through (keys are ``gm``'s input names, e.g. ``{"x": {0: torch.export.Dim("batch")}}``); without
    it, the dimensions ``gm`` was traced with as symbols (``symbolic_trace(..., dynamic_shapes=...)``)
    are exported as ``torch.export.Dim`` of the same names and ranges. The
    program takes the inputs positionally, up to the last one given (keyword arguments, and the
    defaults of inputs skipped before them, become positional: torch.export feeds an FX module's
    inputs in order).
    The export is non-strict (``strict=False``): the generated code runs as Python, as symtrace's
    own guard checks need.

    ``gm``'s entry guards are checked while exporting: on the example inputs first (a
    :class:`~symtrace.errors.GuardError` if they break one), and on the symbolic sizes, so a
    dimension the graph was specialised on cannot be exported as dynamic (torch.export reports
    the conflict). Data guards on sizes are traced like the program they came from; a graph
    specialised on a tensor's value (``if x.sum() > 0``) or replaying Python side effects
    cannot be exported (:class:`~symtrace.interop.fx.FxConversionError`).
    """
    if not isinstance(gm, GraphModule):
        raise TypeError(f"to_export needs a symtrace GraphModule, got {type(gm).__name__}")
    fx_gm = to_fx(gm, check_guards=True)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    env, args, kwargs = _bind(gm, args, kwargs)
    env["root"] = gm.guard_root or gm
    check_entry_guards([g for g in gm.graph.guards if g.kind not in LIVE_GUARD_KINDS], env, {})
    if dynamic_shapes is None:  # the dimensions gm was traced with as symbols (dynamic_shapes=...)
        dynamic_shapes = _traced_dims(fx_gm, len(args))
    try:
        return torch.export.export(fx_gm, args, kwargs or None, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:
        guard = _data_guard_in(e)
        if guard is not None:
            loc = guard.source.describe() if guard.source is not None else "forward"
            raise FxConversionError(
                f"to_export: the graph was specialised on a value computed from tensor data ({guard.describe()}, "
                f"a data guard from {loc}), which an ExportedProgram cannot check. Move that decision out of "
                "forward (or express it with tensor ops such as torch.where) and trace again") from e
        shape = [g.describe() for g in gm.graph.guards if g.kind == "shape"]
        if dynamic_shapes is not None and shape and hasattr(e, "add_note"):
            e.add_note(f"symtrace: the graph was specialised on {'; '.join(shape)} (its shape guards, checked "
                       "while exporting): a dynamic dimension must stay within what they allow")
        raise
