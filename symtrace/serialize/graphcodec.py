"""A graph as JSON: its nodes (with meta), entry guards and source-location table.

Every string that ends up as code in the generated ``forward`` is checked on load: node names
and placeholder targets are identifiers, ``kwargs`` keys are identifiers, ``call_method``
targets are allowed method names, ``call_function`` targets resolve through the allow-list,
source locations and the ``created_by`` label are one printable line each (a location carries
its line's text, so no path named in the file is ever read), and entry guards are expression
trees rebuilt through the checking constructors of :mod:`symtrace.graph.guard_expr`.
"""
from __future__ import annotations

import builtins
import keyword
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..graph.graph import Graph
from ..graph.graph_module import GraphModule
from ..graph.guard_expr import GExpr
from ..graph.guards import Guard
from ..graph.node import _NO_DEFAULT, OPCODES, Node, TensorMeta
from ..graph.replay import (ROOT_HELPERS, describe_effect, read_cell, read_state, refill, set_attributes,
                            set_cell, set_class_attributes)
from ..graph.code_text import CONTROL_CHARS, one_line
from ..graph.source import SourceLocation
from .allowlist import how_to_register, is_allowed_attribute, is_allowed_method, name_of, resolve
from .errors import SerializationError
from .values import (ENTRY_CHECKS, Decoder, Encoder, Unencodable, decode_tensor_meta, location_record,
                     make_location)

__all__ = ["encode_graph", "decode_graph", "check_entry_guard", "node_where"]

_RESERVED_NAMES = frozenset(dir(builtins)) | frozenset(keyword.kwlist) | {
    "self", "torch", "operator", "math", "sys", "inf", "nan", "root", "_ok"}
_PLACEHOLDER = re.compile(r"^\*{0,2}[A-Za-z_][A-Za-z0-9_]*$")
# names the generated forward binds in its globals; an input named like this would shadow them
_CODEGEN_PREFIXES = ("_guard", "_raise_guard", "_check_data_guard", "_fn_", "_const_", "_shadowed_",
                     "_self", "_ok")
_ATTR_CALLS = ("getattr", "hasattr")
_CALL_VALUE = "symtrace.proxy._call_value"
_APPLY_FUNCTION = "symtrace.tracer.apply_autograd_function"
# what a GraphModule holds in its __dict__ besides its state: never a get_attr / call_module target
_GRAPH_MODULE_INTERNALS = frozenset({"_graph", "_code", "forward", "_guard_root", "_class_name", "meta"})
MAX_NODES = 5_000_000
MAX_CREATED_BY = 4096  # characters of a graph's created_by label
_ATOMS = frozenset({int, str, bool, type(None)})
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


class _Where:
    """A node's location for error messages, formatted only when an error is raised."""

    __slots__ = ("prefix", "rec", "i")

    def __init__(self, prefix: str, rec: Any, i: int):
        self.prefix, self.rec, self.i = prefix, rec, i

    def __str__(self) -> str:
        return f"{self.prefix} {node_where(self.rec, self.i)}"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


class _NodeWhere:
    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    def __str__(self) -> str:
        return node_where(self.node)

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


def node_where(node_rec_or_node: Any, i: Optional[int] = None) -> str:
    if isinstance(node_rec_or_node, Node):
        n = node_rec_or_node
        loc = n.meta.get("source")
        return f"node {n.name!r}" + (f" (from {loc})" if isinstance(loc, SourceLocation) else "")
    name = node_rec_or_node.get("name") if isinstance(node_rec_or_node, dict) else None
    return f"node {i} ({name!r})" if isinstance(name, str) else f"node {i}"


# --- saving ----------------------------------------------------------------------------------
def encode_graph(graph: Graph, enc_tensors, dropped: Dict[str, int]) -> dict:
    """The JSON record of ``graph``; meta values that cannot be encoded are left out and their
    keys counted in ``dropped``."""
    ids: Dict[Node, int] = {}
    enc = Encoder(enc_tensors, ids)
    meta_enc = Encoder(enc_tensors, None)
    sources: Dict[Tuple, int] = {}
    tmetas: Dict[TensorMeta, int] = {}
    table: List[dict] = []
    tm_ids: Dict[int, int] = {}  # by identity first: most nodes share few TensorMeta objects
    names: Dict[int, Optional[str]] = {}
    keep = []  # the TensorMeta objects keyed by id stay alive while encoding
    nodes = []
    for i, n in enumerate(graph.nodes):
        where = _NodeWhere(n)
        op = n.op
        rec: Dict[str, Any] = {"name": n.name, "op": op}
        if op == "call_function":
            key = id(n.target)
            name = names.get(key)
            if name is None:
                name = names[key] = name_of(n.target)
            if name is None and n.target is read_cell:
                raise SerializationError(
                    f"{where} reads a closure variable of the traced function at run time (a tensor it closes "
                    "over, or state its Python depends on); a saved graph cannot refer to the loading "
                    "program's closures. Pass the tensor as an input or register it as a buffer, then trace again")
            if name is None and n.target is read_state:
                raise SerializationError(
                    f"{where} reads Python state holding tensors at run time ({n.args[0]}: a list, dict or "
                    "plain attribute of tensors that is not a buffer); a loaded graph cannot refer to the "
                    "loading program's objects. Register the tensors as buffers (or pass them as inputs), "
                    "then trace again")
            if name is None and _is_replay(n.target):
                raise SerializationError(
                    f"{where} replays a Python side effect of forward ({describe_effect(n)}); a loaded graph "
                    "never writes to the loading program's objects, so graphs with side effects cannot be "
                    "saved. Keep such state out of forward (or in buffers), then trace again")
            if name is None:
                raise SerializationError(
                    f"{where} calls {_target_text(n.target)}, which is not on the allow-list of loadable "
                    f"targets; {how_to_register(n.target)}")
            if name in _ATTR_CALLS or name == _CALL_VALUE or name == _APPLY_FUNCTION:
                check_call(name, n.args, where)
            rec["target"] = name
        else:
            if not isinstance(n.target, str):
                raise SerializationError(f"{where} ({op}) has the target {n.target!r}, which is not a string")
            if op == "call_method" and not is_allowed_method(n.target):
                raise SerializationError(
                    f"{where} calls the method {n.target!r}, which is not a torch.Tensor or container method; if "
                    f"you trust it, call symtrace.serialize.register_target({n.target!r}) before saving and loading")
            rec["target"] = n.target
        if n.args:
            rec["args"] = [a if type(a) in _ATOMS else {"$node": ids[a]} if type(a) is Node and a in ids
                           else enc(a, where) for a in n.args]
        if n.kwargs:
            rec["kwargs"] = {k: a if type(a) in _ATOMS else enc(a, where) for k, a in n.kwargs.items()}
        if op == "placeholder" and n.default is not _NO_DEFAULT:
            rec["default"] = enc(n.default, where)
        meta = None
        for k, v in n.meta.items():
            if type(k) is not str:
                dropped[repr(k)] = dropped.get(repr(k), 0) + 1
                continue
            tv = type(v)
            if k == "source" and tv is SourceLocation:
                rec["src"] = sources.setdefault(v, len(sources))
                continue
            if k == "tensor_meta" and tv is TensorMeta:
                hit = tm_ids.get(id(v))
                if hit is None:
                    try:
                        hit = tmetas.get(v)
                        if hit is None:
                            table.append(meta_enc(v, where)["$tmeta"])
                            hit = tmetas[v] = len(table) - 1
                        tm_ids[id(v)] = hit
                        keep.append(v)
                    except TypeError:  # unhashable qparams: stored inline below
                        pass
                    except Unencodable:
                        dropped[k] = dropped.get(k, 0) + 1
                        continue
                if hit is not None:
                    rec["tm"] = hit
                    continue
            try:
                value = meta_enc(v, where)
            except Unencodable:
                dropped[k] = dropped.get(k, 0) + 1
                continue
            if meta is None:
                meta = rec["meta"] = {}
            meta[k] = value
        nodes.append(rec)
        ids[n] = i
    inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    guards = []
    genc = Encoder(enc_tensors, None)
    for g in graph.guards:
        check_entry_guard(g, inputs, "saving")
        guards.append(genc.guard(g, f"entry guard {g.expr!r}"))
    return {"created_by": one_line(graph.created_by, MAX_CREATED_BY), "sources": [location_record(s) for s in sources],
            "tensor_metas": table, "nodes": nodes,
            "guards": guards}


def _is_replay(fn: Any) -> bool:
    try:
        return fn in ROOT_HELPERS or fn in (refill, set_cell, set_attributes, set_class_attributes)
    except TypeError:
        return False


def _target_text(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{name}" if mod else name


def check_entry_guard(g: Guard, inputs: List[str], doing: str) -> None:
    """Refuse an entry guard with an unknown check, or one that reads something other than the
    graph's inputs, ``root``, module globals and torch's state (its expression tree checked
    everything else when it was built)."""
    where = f"{doing} entry guard {str(g.expr)!r}"
    if g.check not in ENTRY_CHECKS:
        raise SerializationError(f"{where}: unknown check {g.check!r}")
    if not isinstance(g.expr, GExpr):
        raise SerializationError(f"{where}: an entry guard's expression must be a guard expression tree "
                                 f"(symtrace.graph.guard_expr), not a {type(g.expr).__name__}")
    unknown = [name for name in g.expr.inputs() if name not in inputs]
    if unknown:
        raise SerializationError(f"{where}: it reads {unknown[0]!r}, which is not an input of the graph")


# --- loading ---------------------------------------------------------------------------------
def decode_graph(rec: Any, tensors, where: str, version: int = 2) -> Graph:
    """Rebuild a graph from its record, checking everything that becomes code (``version``:
    the file's format version; version 1 stored entry guards as text)."""
    if not isinstance(rec, dict):
        raise SerializationError(f"{where}: the graph record is not an object")
    created_by = rec.get("created_by", "")
    sources_rec, nodes_rec, guards_rec = rec.get("sources", []), rec.get("nodes"), rec.get("guards", [])
    tm_rec = rec.get("tensor_metas", [])
    if not isinstance(created_by, str) or not all(
            isinstance(x, list) for x in (sources_rec, nodes_rec, guards_rec, tm_rec)):
        raise SerializationError(f"{where}: the graph record needs lists 'nodes', 'sources', 'tensor_metas', "
                                 "'guards'")
    if len(nodes_rec) > MAX_NODES:
        raise SerializationError(f"{where}: {len(nodes_rec)} nodes is more than the limit {MAX_NODES}")
    if CONTROL_CHARS.search(created_by) or len(created_by) > MAX_CREATED_BY:
        raise SerializationError(f"{where}: the graph's created_by label must be one line of at most "
                                 f"{MAX_CREATED_BY} printable characters, got {created_by[:60]!r}")
    sources = [make_location(s, f"{where} source table") for s in sources_rec]
    meta_dec = Decoder(tensors, None)
    tmetas = [decode_tensor_meta(meta_dec, t, f"{where} tensor metadata table", 0) for t in tm_rec]
    graph = Graph()
    graph.created_by = created_by
    nodes: List[Node] = []
    dec = Decoder(tensors, nodes)
    count = len(nodes_rec)
    cache: Dict[str, Any] = {}
    for i, nrec in enumerate(nodes_rec):
        nodes.append(_decode_node(graph, nrec, _Where(where, nrec, i), i == count - 1, dec, meta_dec, sources,
                                  tmetas, cache))
    inputs = [n.name for n in nodes if n.op == "placeholder"]
    guards = []
    for grec in guards_rec:
        g = meta_dec.guard(grec, f"{where} entry guard", checks=ENTRY_CHECKS, inputs=inputs, legacy=version < 2)
        check_entry_guard(g, inputs, f"{where}:")
        guards.append(g)
    graph.guards = guards
    return graph


def _index(table: list, ref: Any, what: str, here: Any) -> Any:
    if type(ref) is not int or not 0 <= ref < len(table):
        raise SerializationError(f"{here}: {what} reference {ref!r} is out of range")
    return table[ref]


def _decode_node(graph: Graph, rec: Any, here: _Where, last: bool, dec: Decoder, meta_dec: Decoder,
                 sources: List[SourceLocation], tmetas: List[TensorMeta], cache: Dict[str, Any]) -> Node:
    if not isinstance(rec, dict):
        raise SerializationError(f"{here}: the node record is not an object")
    name, op, target = rec.get("name"), rec.get("op"), rec.get("target")
    if op not in OPCODES:
        raise SerializationError(f"{here}: unknown opcode {op!r}")
    if not isinstance(name, str) or not name.isidentifier() or name in _RESERVED_NAMES or name.startswith("_"):
        raise SerializationError(f"{here}: {name!r} is not a valid node name")
    if op == "output" and not last:
        raise SerializationError(f"{here}: the output node must be the last node")
    args_rec, kwargs_rec = rec.get("args", ()), rec.get("kwargs")
    if not isinstance(args_rec, (list, tuple)) or not (kwargs_rec is None or isinstance(kwargs_rec, dict)):
        raise SerializationError(f"{here}: args must be a list and kwargs an object")
    args = tuple([a if type(a) in _ATOMS else dec(a, here) for a in args_rec])
    if kwargs_rec:
        for k in kwargs_rec:
            if not k.isidentifier() or keyword.iskeyword(k):
                raise SerializationError(f"{here}: keyword argument name {k!r} is not an identifier")
        kwargs = {k: a if type(a) in _ATOMS else dec(a, here) for k, a in kwargs_rec.items()}
    else:
        kwargs = None
    target = _decode_target(op, target, args, here, cache)
    meta_rec = rec.get("meta")
    if meta_rec is None:
        meta = {}
    elif isinstance(meta_rec, dict):
        meta = {k: meta_dec(v, here) for k, v in meta_rec.items()}
    else:
        raise SerializationError(f"{here}: meta must be an object")
    src = rec.get("src")
    if src is not None:
        meta["source"] = _index(sources, src, "source location", here)
    tm = rec.get("tm")
    if tm is not None:
        meta["tensor_meta"] = _index(tmetas, tm, "tensor metadata", here)
    if op == "output" and (len(args) != 1 or kwargs):
        raise SerializationError(f"{here}: the output node takes exactly one argument")
    node = graph.create_node(op, target, args, kwargs, name=name, meta=meta)
    if node.name != name:
        raise SerializationError(f"{here}: the node name {name!r} is used twice")
    if "default" in rec:
        if op != "placeholder":
            raise SerializationError(f"{here}: only placeholders have default values")
        node.default = meta_dec(rec["default"], here)
    return node


def _decode_target(op: str, target: Any, args: tuple, here: Any, cache: Dict[str, Any]) -> Any:
    if not isinstance(target, str):
        raise SerializationError(f"{here}: the target must be a string, got {type(target).__name__}")
    if op == "call_function":
        fn = cache.get(target)
        if fn is None:
            fn = cache[target] = resolve(target, f"call target (at {here})")
        if not callable(fn):
            raise SerializationError(f"{here}: {target!r} is not callable")
        if target in _ATTR_CALLS or target == _CALL_VALUE or target == _APPLY_FUNCTION:
            check_call(target, args, here)
        return fn
    if op == "call_method":
        if not is_allowed_method(target):
            raise SerializationError(
                f"{here}: the method {target!r} is not a torch.Tensor or container method; if you trust it, "
                f"call symtrace.serialize.register_target({target!r}) before loading")
        if not args:
            raise SerializationError(f"{here}: a call_method node needs the object as its first argument")
        return target
    if op == "placeholder":
        bare = target.lstrip("*")
        if not _PLACEHOLDER.match(target) or keyword.iskeyword(bare) or bare.startswith(_CODEGEN_PREFIXES):
            raise SerializationError(f"{here}: {target!r} is not a valid input name")
        return target
    if op == "output":
        if target != "output":
            raise SerializationError(f"{here}: the output node's target must be 'output'")
        return target
    parts = target.split(".")  # get_attr / call_module: checked against the module tree later
    if not target or any(not p or p.startswith("__") for p in parts):
        raise SerializationError(f"{here}: {target!r} is not a qualified attribute name")
    return target


def check_call(target: str, args: tuple, here: Any) -> None:
    """The calls whose callee or attribute comes from their arguments: ``getattr`` / ``hasattr``
    read a constant name of the allow-list of attributes (``ATTRIBUTE_NAMES``, registered fields
    and names); ``_call_value`` calls a value the graph computed (a node), never a stored
    callable; ``apply_autograd_function`` applies an ``autograd.Function`` class."""
    if target in _ATTR_CALLS:
        name = args[1] if len(args) >= 2 else None
        if not isinstance(name, str) or name.startswith("__"):
            raise SerializationError(f"{here}: {target} needs a constant attribute name that is not a dunder, "
                                     f"got {name!r}")
        if not is_allowed_attribute(name):
            raise SerializationError(
                f"{here}: {target} reads the attribute {name!r}, which is not on the allow-list of attributes a "
                f"graph may read (tensor, container and value attributes; fields of registered classes); if you "
                f"trust it, register the class that has it, or call symtrace.serialize.register_target({name!r}), "
                "before saving and loading")
    elif target == _CALL_VALUE:
        if not args or type(args[0]) is not Node:
            raise SerializationError(f"{here}: _call_value calls a value the graph computed, so its callee must be "
                                     f"a node, not {type(args[0]).__name__ if args else 'nothing'} (a function "
                                     "known in advance is a call_function target of its own)")
    elif not args or not (isinstance(args[0], type) and issubclass(args[0], torch.autograd.Function)):
        raise SerializationError(f"{here}: apply_autograd_function needs an autograd.Function class as its "
                                 "first argument")


def check_targets(graph: Graph, root, where: str) -> None:
    """Every get_attr / call_module target names state that the rebuilt module holds."""
    for n in graph.nodes:
        if n.op not in ("get_attr", "call_module"):
            continue
        obj = root
        parts = n.target.split(".")
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            d = obj.__dict__
            if part in d["_modules"] and d["_modules"][part] is not None:
                obj = d["_modules"][part]
                continue
            if last and n.op == "get_attr" and (part in d["_parameters"] or part in d["_buffers"] or (
                    part in d and part not in _MODULE_INTERNALS
                    and not (isinstance(obj, GraphModule) and part in _GRAPH_MODULE_INTERNALS))):
                obj = None
                break
            raise SerializationError(
                f"{where} {node_where(n)}: {n.op} names {n.target!r}, which the saved module does not hold")
        if n.op == "call_module" and obj is None:
            raise SerializationError(f"{where} {node_where(n)}: {n.target!r} is not a submodule")
