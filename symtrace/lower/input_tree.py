"""Inputs that hold tensors in tuples, lists and dicts (``images: list[Tensor]``, a dict of
feature maps), flattened so that each tensor is an input of the lowered graph.

The kernels take tensors as arguments of their own. :meth:`InputTree.of` looks at the example
inputs; where some hold tensors in plain containers (``tuple``, ``list``, ``dict`` with string
keys, nested; their other leaves are Python values), :meth:`InputTree.flat_graph` gives a copy
of the graph whose placeholders are the tensors:

* every ``x[k]`` of such an input, with a constant ``k``, becomes the leaf (or the sub-container)
  it reads; other uses (``torch.cat(xs)``) read a literal container of the leaves;
* the graph's guards are rewritten onto the leaves (``images[0].shape[1] == 3`` becomes
  ``images_0.shape[1] == 3``); guards on the structure itself (types, lengths, keys, the other
  leaves' values) are dropped, since :meth:`InputTree.flatten` checks exactly that per call.

A call whose inputs have another structure (another length, a key more, another value at a
non-tensor leaf) gets None from :meth:`flatten`: :class:`~.module.LoweredModule` then runs the
original graph through torch, whose guards answer as they would without lowering. An input
whose structure this cannot flatten (an object, a namedtuple, a use of the container other than
indexing and torch calls, such as a method call on it) leaves the tree None, and the graph runs
through torch with that reason.
"""
from __future__ import annotations

import copy
import keyword
import operator
import re
from typing import Any, Dict, List, Optional

import torch

from ..graph.guard_expr import Const, GExpr, Input, Item
from ..graph.node import _NO_DEFAULT, Node, TensorMeta, map_aggregate

__all__ = ["InputTree", "bind_inputs", "plain_placeholders"]

_MAX_LEAVES = 4096
_LEAF = "leaf"   # a tensor leaf in a spec


def bind_inputs(placeholders: List[Node], args: tuple, kwargs: dict) -> tuple:
    """A call's arguments in placeholder order: keywords by the forward's parameter names (a
    placeholder's target: ``input`` is named ``input_1`` in the graph), defaults filled; a
    ``*args`` placeholder takes the positional arguments past the named ones as a tuple, a
    ``**kwargs`` one the keywords no named input takes as a dict (in the call's order)."""
    named = [n for n in placeholders if not _variadic(n)]
    star = next((i for i, n in enumerate(placeholders) if _variadic(n) == "*"), None)
    takes_rest = any(_variadic(n) == "**" for n in placeholders)
    n_pos = sum(1 for n in placeholders[:star] if not _variadic(n)) if star is not None else len(named)
    if len(args) > n_pos and star is None:
        raise TypeError(f"expected at most {n_pos} arguments, got {len(args)}")
    kwargs = dict(kwargs)
    values: Dict[str, Any] = {}
    for node, a in zip(named[:n_pos], args):
        if node.target in kwargs:
            raise TypeError(f"got multiple values for argument {node.target!r}")
        values[node.name] = a
    for node in named[len(values):]:
        if node.target in kwargs:
            values[node.name] = kwargs.pop(node.target)
        elif node.default is not _NO_DEFAULT:
            values[node.name] = node.default
        else:
            raise TypeError(f"missing argument {node.target!r}")
    if kwargs and not takes_rest:
        raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    rest = tuple(args[n_pos:])
    return tuple(rest if _variadic(n) == "*" else kwargs if _variadic(n) == "**" else values[n.name]
                 for n in placeholders)


class _Param:
    """A placeholder as :func:`bind_inputs` reads it."""

    __slots__ = ("name", "target", "default")

    def __init__(self, name: str, target: str, default: Any):
        self.name, self.target, self.default = name, target, default


def _variadic(node: Node) -> str:
    """``"*"`` for a ``*args`` placeholder, ``"**"`` for ``**kwargs``, else ``""``."""
    target = str(node.target)
    return "**" if target.startswith("**") else "*" if target.startswith("*") else ""


def plain_placeholders(gm) -> Optional[tuple]:
    """``(graph, signature)`` for a graph with ``*args``/``**kwargs`` inputs: a copy whose
    placeholders all take one value each (the tuple and the dict: the lowering's inputs are in
    placeholder order), and the original placeholders, which bind a call (:func:`bind_inputs`);
    None for a graph without them."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not any(_variadic(n) for n in phs):
        return None
    signature = [_Param(n.name, n.target, n.default) for n in phs]
    plain = copy.copy(gm)   # (with a copy of the graph)
    for n in plain.graph.nodes:   # (no defaults: calls bind against the signature first)
        if n.op == "placeholder":
            n.default = _NO_DEFAULT
            if _variadic(n):
                n.target = n.name
    plain.recompile()
    return plain, signature


def _spec(value: Any, depth: int = 0) -> Any:
    """The structure of ``value`` with each tensor replaced by :data:`_LEAF` (None: not a plain
    container of tensors and Python values, or too deep)."""
    if isinstance(value, torch.Tensor):
        return _LEAF
    if depth > 8:
        return None
    if type(value) in (tuple, list):
        items = [_spec(v, depth + 1) for v in value]
        return None if any(i is None for i in items) else (type(value), tuple(items))
    if type(value) is dict and all(type(k) is str for k in value):
        items = {k: _spec(v, depth + 1) for k, v in value.items()}
        return None if any(i is None for i in items.values()) else (dict, items)
    if isinstance(value, (int, float, bool, str, type(None))) and type(value) in (int, float, bool, str, type(None)):
        return ("value", type(value), value)
    return None


def _shares_containers(values: list) -> bool:
    """Whether a container is reached twice from ``values`` (the same list passed twice, or
    nested twice)."""
    seen: set = set()
    stack = list(values)
    while stack:
        v = stack.pop()
        if type(v) in (tuple, list, dict):
            if type(v) is not tuple:   # (tuples are immutable: sharing one is harmless, and
                if id(v) in seen:      # small ones may be shared by the interpreter)
                    return True
                seen.add(id(v))
            stack.extend(v.values() if type(v) is dict else v)
    return False


def _leaf_paths(spec: Any) -> list:
    """The paths of a spec's tensor leaves, in flattening order (empty: it holds none)."""
    if spec == _LEAF:
        return [()]
    if spec[0] == "value":
        return []
    items = spec[1].items() if spec[0] is dict else enumerate(spec[1])
    return [(k,) + p for k, sub in items for p in _leaf_paths(sub)]


def _leaves(value: Any, spec: Any, out: list) -> bool:
    """Append ``value``'s tensor leaves to ``out`` if it has the structure ``spec``."""
    if spec == _LEAF:
        if not isinstance(value, torch.Tensor):
            return False
        out.append(value)
        return True
    kind = spec[0]
    if kind == "value":
        return type(value) is spec[1] and (value == spec[2]) is True
    if type(value) is not kind:
        return False
    items = spec[1]
    if kind is dict:
        if len(value) != len(items) or list(value) != list(items):   # (order too: iteration follows it)
            return False
        return all(_leaves(value[k], s, out) for k, s in items.items())
    if len(value) != len(items):
        return False
    return all(_leaves(v, s, out) for v, s in zip(value, items))


class _Refused(Exception):
    pass


class InputTree:
    """How the graph's inputs map to the flat graph's (see the module doc)."""

    def __init__(self, gm, placeholders: List[Node], specs: List[Any]):
        self.original = gm                 # the graph as traced: what a call of another structure runs
        self.placeholders = placeholders   # its inputs (calls bind to them)
        self._specs = specs                # per input: None (passed as it is) or its structure

    @classmethod
    def of(cls, gm, example_inputs: tuple) -> Optional["InputTree"]:
        """The tree of ``gm``'s inputs, or None where no input holds tensors in plain containers."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs) or any(str(n.target).startswith("*") for n in placeholders):
            return None
        specs = []
        for n, value in zip(placeholders, example_inputs):
            spec = None if isinstance(value, torch.Tensor) else _spec(value)
            specs.append(spec if spec is not None and _leaf_paths(spec) else None)
        if not any(specs):
            return None
        if _shares_containers([v for v, s in zip(example_inputs, specs) if s is not None]):
            return None   # (one list reached twice: the graph reads one stand-in, guarded `ys is xs`)
        dynamic = (gm.meta.get("dynamic_inputs") or {}) if hasattr(gm, "meta") else {}
        if any(s is not None and n.name in dynamic for n, s in zip(placeholders, specs)):
            return None   # (declared dynamic dims of a container: not flattened)
        tree = cls(gm, placeholders, specs)
        if sum(len(_leaf_paths(s)) for s in specs if s is not None) > _MAX_LEAVES:
            return None
        return tree

    def flatten(self, args: tuple) -> Optional[tuple]:
        """The flat graph's arguments for ``args`` (the original graph's, bound in placeholder
        order), or None when an input's structure differs from the example's."""
        if len(args) != len(self._specs):
            return None
        out: list = []
        for value, spec in zip(args, self._specs):
            if spec is None:
                out.append(value)
            elif not _leaves(value, spec, out):
                return None
        return tuple(out)

    # ------------------------------------------------------------- dynamic shapes
    def check_dynamic_shapes(self, spec) -> None:
        """Refuse ``dynamic_shapes`` entries for a container input (clear error, by its name)."""
        if spec is None:
            return
        entries = (spec.items() if isinstance(spec, dict) else
                   ((str(self.placeholders[i].target), v) for i, v in enumerate(spec) if i < len(self.placeholders)))
        by_name = {str(n.target): s for n, s in zip(self.placeholders, self._specs)}
        by_name.update({n.name: s for n, s in zip(self.placeholders, self._specs)})
        for name, dims in entries:
            if dims is not None and by_name.get(name) is not None:
                raise ValueError(f"symtrace.lower.compile: dynamic_shapes declares dims of {name!r}, which holds "
                                 "tensors in a container; declare dims of tensor arguments only (or pass that "
                                 "input's tensors as arguments of their own)")

    def flat_dynamic_shapes(self, spec):
        """``spec`` for the flat graph: by name as it is (other inputs keep their names), by
        position moved past the leaves (a container's entry is None)."""
        if spec is None or isinstance(spec, dict):
            return spec
        out: list = []
        for i, s in enumerate(self._specs):
            if s is None:
                out.append(spec[i] if i < len(spec) else None)
            else:
                out.extend([None] * len(_leaf_paths(s)))
        return type(spec)(out) if isinstance(spec, (tuple, list)) else out

    # ------------------------------------------------------------- the flat graph
    def flat_graph(self, example_inputs: tuple):
        """A copy of the graph (modules shared) whose placeholders are the tensor leaves; raises
        :class:`ValueError` where a use of a container cannot be flattened."""
        new = copy.copy(self.original)
        graph = new.graph
        nodes = [n for n in graph.nodes if n.op == "placeholder"]
        containers: set = set()                  # the flattened inputs' names
        rename: Dict[tuple, str] = {}             # (input name, path...) of a leaf -> its flat name
        for n, value, spec in zip(nodes, example_inputs, self._specs):
            if spec is None:
                continue
            with graph.inserting_before(n):
                struct = self._leaf_nodes(graph, n, value, spec, (n.name,), rename)
            try:
                self._substitute(n, struct)
            except _Refused as e:
                raise ValueError(f"the input {n.target!r} is used as {e}, not only indexed or passed to torch "
                                 "calls") from None
            graph.erase_node(n)
            containers.add(n.name)
        for n in graph.nodes:   # (calls are bound before they are flattened: no defaults, which
            if n.op == "placeholder":   # could not precede the leaves' anyway)
                n.default = _NO_DEFAULT
        graph.guards = [g for g in (self._guard_onto_leaves(g, rename, containers) for g in graph.guards)
                        if g is not None]
        new.recompile()
        return new

    def _leaf_nodes(self, graph, node: Node, value, spec, path: tuple, rename: dict):
        """The literal structure of ``value`` with a new placeholder per tensor leaf."""
        if spec == _LEAF:
            leaf = graph.placeholder(self._leaf_name(graph, path), meta={"tensor_meta": TensorMeta.of(value)})
            rename[path] = leaf.name
            return leaf
        kind = spec[0]
        if kind == "value":
            return value
        if kind is dict:
            return {k: self._leaf_nodes(graph, node, value[k], s, path + (k,), rename) for k, s in spec[1].items()}
        items = [self._leaf_nodes(graph, node, v, s, path + (i,), rename) for i, (v, s) in enumerate(zip(value, spec[1]))]
        return tuple(items) if kind is tuple else items

    @staticmethod
    def _leaf_name(graph, path: tuple) -> str:
        """A parameter name for a leaf (``images_0``, ``feats_layer1_0``) that no other input has."""
        base = re.sub(r"\W", "_", "_".join(str(p) for p in path)) or "leaf"
        if base[0].isdigit() or keyword.iskeyword(base):
            base = "_" + base
        taken = {str(n.target) for n in graph.nodes if n.op == "placeholder"}
        name, i = base, 1
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        return name

    def _substitute(self, node: Node, struct: Any) -> None:
        """Every use of ``node`` reads ``struct`` instead; ``node[k]`` becomes ``struct[k]``."""
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem and user.args[0] is node \
                    and len(user.args) == 2 and not user.kwargs and not isinstance(user.args[1], Node) \
                    and node not in _nodes_in(user.args[1]):
                key = user.args[1]
                try:
                    part = struct[key]
                except (KeyError, IndexError, TypeError):
                    raise _Refused(f"{node.name}[{key!r}]")
                if isinstance(part, (tuple, list, dict)):
                    self._substitute(user, part)
                else:
                    _replace_uses(user, part)
                user.graph.erase_node(user)
            elif user.op == "call_function" and _torch_callable(user.target) or user.op == "output":
                _replace_in_args(user, node, struct)
            else:
                raise _Refused(f"an argument of {user.format_target() if hasattr(user, 'format_target') else user.target}")

    @staticmethod
    def _guard_onto_leaves(guard, rename: dict, containers: set):
        """``guard`` over the flat inputs; None where it tests the structure only (flatten checks
        that) or reads a container in a way not resolved to a leaf."""
        expr = getattr(guard, "expr", None)
        if not isinstance(expr, GExpr):
            return guard
        if not containers.intersection(expr.inputs()):
            return guard
        new = _rewrite(expr, rename, containers)
        if new is None:
            return None
        out = copy.copy(guard)
        out.expr = new
        return out


def _path(e: GExpr) -> Optional[tuple]:
    """``(name, k1, k2...)`` for ``name[k1][k2]...`` with constant keys."""
    keys = []
    while type(e) is Item and type(e.key) is Const:
        keys.append(e.key.value)
        e = e.obj
    if type(e) is Input:
        return (e.name,) + tuple(reversed(keys))
    return None


def _rewrite(e: GExpr, rename: dict, containers: set) -> Optional[GExpr]:
    path = _path(e)
    if path is not None and path[0] in containers:
        name = rename.get(path)
        return Input(name) if name is not None else None   # (a container or a plain value: structure)
    if type(e) is Input:
        return e
    parts = []
    for p in e._parts():
        if isinstance(p, GExpr):
            p = _rewrite(p, rename, containers)
            if p is None:
                return None
        elif type(p) is tuple and type(e).__name__ != "Const":
            q = tuple(_rewrite(a, rename, containers) if isinstance(a, GExpr) else a for a in p)
            if any(a is None for a in q):
                return None
            p = q
        parts.append(p)
    return type(e)(*parts)


def _nodes_in(value) -> list:
    out: list = []
    map_aggregate(value, lambda v: out.append(v) if isinstance(v, Node) else None)
    return out


def _torch_callable(target) -> bool:
    module = getattr(target, "__module__", None) or ""
    return module.startswith("torch") or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def _replace_in_args(user: Node, node: Node, value: Any) -> None:
    swap = (lambda v: value if v is node else v)
    user.args = map_aggregate(user.args, swap)
    user.kwargs = map_aggregate(user.kwargs, swap)


def _replace_uses(node: Node, value: Any) -> None:
    if isinstance(value, Node):
        node.replace_all_uses_with(value)
        return
    for user in list(node.users):   # (a plain value at that leaf: a constant from now on)
        _replace_in_args(user, node, value)
