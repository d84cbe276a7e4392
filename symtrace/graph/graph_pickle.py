"""How a :class:`~symtrace.graph.graph.Graph` is copied and pickled, fast.

``Graph`` keeps only the dunders; the work is here, as functions over a graph's internals:

* :func:`copy_graph` -- ``copy.deepcopy(graph)``: nodes, users, the (op, target) index and the
  used names copied in bulk (no per-node ``create_node``); ``meta`` copied one level deep.
* :func:`dump` -- the pickled form: one bytes *payload* of columns (below).
* :func:`unpack` -- build the nodes of a payload into a graph. An unpickled graph is a
  ``_PackedGraph`` (see ``graph.py``) that holds only the payload until first used, so loading
  a module costs little until its graph is read or run, and pickling or copying a graph not
  used since reuses the payload.
* :func:`load_rows` -- graphs pickled by older symtrace (version 1: one row per node).

Payload (version 5): one pickle of a tuple of columns with one entry per node in graph order
(gathered with C-level ``map`` where possible). In ``args``, references to nodes are stored as
their index, with bit k of ``masks[i]`` set when position k is a reference (mask -1: nested
arguments, where references are ``_Ref`` objects; 0: no reference). ``kwargs`` (references as
``_Ref``) and ``metas`` (meta without "source") are None where empty. Source locations are
stored once in a table and referenced by index. The (op, target) index is stored as lists of
node indices.
"""
from __future__ import annotations

import operator
import pickle
import threading
from typing import Any, Dict, List

from ._gc import gc_paused
from .node import _NO_DEFAULT, Node, iter_nodes, remap_args
from .source import SourceLocation

__all__ = ["PAYLOAD_VERSION", "copy_graph", "dump", "unpack", "load_rows"]

PAYLOAD_VERSION = 5
_ATOMS = frozenset({int, float, bool, str, type(None)})
_UNPACK_LOCK = threading.RLock()
_get_name = operator.attrgetter("name")
_get_op = operator.attrgetter("op")
_get_target = operator.attrgetter("_target")
_get_default = operator.attrgetter("default")


class _Ref:
    """The i-th node of a payload, inside nested arguments."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __reduce__(self):
        return (_Ref, (self.i,))


# --- deepcopy ------------------------------------------------------------------------------
def copy_graph(src, new) -> None:
    """Make the empty graph ``new`` a copy of ``src`` (nodes keep their names)."""
    with gc_paused():
        _copy_nodes(src, new)
    new.guards = list(src.guards)
    new.created_by = src.created_by
    new._names._counters = dict(src._names._counters)


def _copy_nodes(src, new) -> None:
    env: Dict[Node, Node] = {}
    get = env.__getitem__
    new_node = object.__new__
    atoms = _ATOMS
    root = new._root
    prev = root
    src_root = src._root
    n = src_root._next
    while n is not src_root:  # (erased nodes are unlinked: the list holds live nodes only)
        m = new_node(Node)
        m.graph = new
        m.name = n.name
        m.op = n.op
        m._target = n._target
        args = n._args
        inputs = n._inputs
        if inputs:
            # a flat tuple of nodes and atoms (the common case) without a helper call
            if type(args) is tuple:
                out = []
                for a in args:
                    t = type(a)
                    if t is Node:
                        out.append(env[a])
                    elif t in atoms:
                        out.append(a)
                    else:
                        out = None
                        break
                args = remap_args(args, get) if out is None else tuple(out)
            else:
                args = remap_args(args, get)
            new_inputs = {}
            for x in inputs:
                y = env[x]
                new_inputs[y] = None
                y.users[m] = None
            m._inputs = new_inputs
        else:  # no node inside: a tuple of atoms can be shared, containers are copied
            for a in args:
                if type(a) not in atoms:
                    args = remap_args(args, get)
                    break
            m._inputs = {}
        kw = n._kwargs
        m._kwargs = remap_args(kw, get) if kw else {}
        m._args = args
        m.users = {}
        m.meta = dict(n.meta)
        m.default = n.default
        m._erased = False
        m._prev = prev
        prev._next = m
        prev = m
        env[n] = m
        n = n._next
    prev._next = root
    root._prev = prev
    new._index = {k: dict.fromkeys(map(get, d)) for k, d in src._index.items()}
    new._in_order = src._in_order
    new._names._used = set(src._names._used)
    new._len = len(env)
    new._structure_changed()


# --- pickling ------------------------------------------------------------------------------
def dump(graph) -> bytes:
    """The payload of a (built) graph."""
    with gc_paused():
        root = graph._root
        nodes = []
        n = root._next
        while n is not root:  # (erased nodes are unlinked)
            nodes.append(n)
            n = n._next
        ids = dict(zip(nodes, range(len(nodes))))
        ref = lambda n: _Ref(ids[n])  # noqa: E731
        atoms = _ATOMS
        locs: Dict[Any, int] = {}
        args_col, masks, kwargs_col, metas, loc_ids = [], [], [], [], []
        for n in nodes:
            args = n._args
            mask = 0
            if n._inputs:
                out = []
                k = 1
                for a in args:
                    t = type(a)
                    if t is Node:
                        mask |= k
                        out.append(ids[a])
                    elif t in atoms:
                        out.append(a)
                    else:
                        mask = -1
                        break
                    k <<= 1
                if mask > 0:
                    args = tuple(out)
                elif mask < 0:
                    args = remap_args(args, ref)
                kw = n._kwargs
                kwargs_col.append(remap_args(kw, ref) if kw else None)
            else:
                kwargs_col.append(n._kwargs or None)
            args_col.append(args)
            masks.append(mask)
            meta = n.meta
            loc = meta.get("source")
            if loc is None:
                loc_ids.append(-1)
                metas.append(meta or None)
                continue
            lid = locs.get(loc)
            if lid is None:
                lid = locs[loc] = len(locs)
            loc_ids.append(lid)
            if len(meta) == 1:
                metas.append(None)
            else:
                meta = dict(meta)
                del meta["source"]
                metas.append(meta)
        state = (
            PAYLOAD_VERSION,
            list(map(_get_name, nodes)), list(map(_get_op, nodes)), list(map(_get_target, nodes)),
            args_col, masks, kwargs_col, metas, loc_ids, list(map(_get_default, nodes)),
            [tuple(loc) for loc in locs],
            [(key, list(map(ids.__getitem__, d))) for key, d in graph._index.items()],
            graph.guards, graph.created_by, graph._names._counters, graph._in_order,
        )
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(packed, graph_class: type) -> None:
    """Build the nodes of the packed graph ``packed`` (its ``_payload``) and make it a plain
    ``graph_class``. Safe from several threads: one builds, the others wait for it."""
    d = packed.__dict__
    with _UNPACK_LOCK:
        data = d.get("_payload")
        if data is None or d.get("_unpacking"):
            return  # built by another thread meanwhile, or being built by this one
        d["_unpacking"] = True
        try:
            _load(packed, data, graph_class)
            del d["_payload"]
            packed.__class__ = graph_class
        finally:
            del d["_unpacking"]


def _load(graph, data: bytes, graph_class: type) -> None:
    """Build the nodes of ``data`` into ``graph``, all or nothing."""
    with gc_paused():
        state = pickle.loads(data)
        if type(state) is not tuple or not state or state[0] != PAYLOAD_VERSION:
            raise pickle.UnpicklingError("not a symtrace graph payload of a known version")
        (_, names, ops, targets, args_col, masks, kwargs_col, metas, loc_ids, defaults, table,
         index, guards, created_by, counters, in_order) = state
        fresh = graph_class()  # built aside, moved into ``graph`` at the end
        table = [SourceLocation(*loc) for loc in table]
        nodes: List[Node] = []
        get = nodes.__getitem__
        lookup = lambda r: nodes[r.i]  # noqa: E731
        new_node = object.__new__
        append = nodes.append
        root = fresh._root
        root.graph = graph
        prev = root
        for name, op, target, args, mask, kwargs, meta, lid, default in zip(
                names, ops, targets, args_col, masks, kwargs_col, metas, loc_ids, defaults):
            m = new_node(Node)
            m.graph = graph
            m.name = name
            m.op = op
            m._target = target
            m.users = {}
            if mask:
                if mask > 0:
                    out = []
                    inputs = {}
                    for a in args:
                        if mask & 1:
                            a = nodes[a]
                            inputs[a] = None
                        out.append(a)
                        mask >>= 1
                    args = tuple(out)
                else:
                    args = remap_args(args, lookup, _Ref)
                    inputs = dict.fromkeys(iter_nodes(args))
                if kwargs:
                    kwargs = remap_args(kwargs, lookup, _Ref)
                    inputs.update(dict.fromkeys(iter_nodes(kwargs)))
                for x in inputs:
                    x.users[m] = None
            elif kwargs:
                kwargs = remap_args(kwargs, lookup, _Ref)
                inputs = dict.fromkeys(iter_nodes(kwargs))
                for x in inputs:
                    x.users[m] = None
            else:
                inputs = {}
            m._inputs = inputs
            m._args = args
            m._kwargs = kwargs or {}
            if lid >= 0:
                if meta is None:
                    meta = {"source": table[lid]}
                else:
                    meta["source"] = table[lid]
            elif meta is None:
                meta = {}
            m.meta = meta
            m.default = default
            m._erased = False
            m._prev = prev
            prev._next = m
            prev = m
            append(m)
        prev._next = root
        root._prev = prev
        fresh._index = {key: dict.fromkeys(map(get, group)) for key, group in index}
        fresh._in_order = in_order
        fresh._names._used = set(names)
        fresh._names._counters = dict(counters)
        fresh._len = len(nodes)
        fresh.guards = guards
        fresh.created_by = created_by
        attrs = fresh.__dict__
        clean = graph.__dict__.get("_clean")
        if clean is not None:  # modules may have registered there while it was packed
            attrs["_clean"] = clean
        graph.__dict__.update(attrs)


# --- older pickles -------------------------------------------------------------------------
def load_rows(graph, state: dict) -> None:
    """Build version 1 of the pickled form (a dict with one row per node) into the empty
    ``graph``."""
    with gc_paused():
        locs = [SourceLocation(*loc) for loc in state["locs"]]
        nodes: List[Node] = []
        lookup = lambda r: nodes[r.i]  # noqa: E731
        for name, op, target, args, kwargs, mask, meta, loc, default in state["rows"]:
            if mask > 0:
                args = tuple([nodes[a] if mask >> k & 1 else a for k, a in enumerate(args)])
            else:  # (containers are copied, as nested arguments always are)
                args = remap_args(args, lookup, _Ref)
            meta = {} if meta is None else dict(meta)
            if loc >= 0:
                meta["source"] = locs[loc]
            kwargs = remap_args(kwargs, lookup, _Ref) if kwargs else {}
            nodes.append(_append_row(graph, name, op, target, args, kwargs, meta,
                                     _NO_DEFAULT if default is None else default[0]))
        graph._len = len(nodes)
    graph._structure_changed()
    graph.guards = state["guards"]
    graph.created_by = state.get("created_by", "")
    graph._names._counters = dict(state.get("counters", {}))


def _append_row(graph, name, op, target, args, kwargs, meta, default) -> Node:
    m = object.__new__(Node)
    m.graph, m.name, m.op, m._target = graph, name, op, target
    m._args, m._kwargs = args, kwargs
    inputs: Dict[Node, None] = {}
    for x in iter_nodes(args):
        inputs[x] = None
    if kwargs:
        for x in iter_nodes(kwargs):
            inputs[x] = None
    for x in inputs:
        x.users[m] = None
    m._inputs, m.users, m.meta, m.default, m._erased = inputs, {}, meta, default, False
    root = graph._root
    last = root._prev
    m._prev, m._next = last, root
    last._next = m
    root._prev = m
    graph._index_add(m)
    graph._names._used.add(name)
    return m
