"""``Graph``: an ordered, editable list of nodes with an index by (op, target).

Invariants (checked by :meth:`Graph.lint`): every node belongs to this graph; every input of a
node comes before it; ``users`` mirror ``args``/``kwargs``; names are unique Python
identifiers; there is at most one ``output`` node and it is last.
"""
from __future__ import annotations

import builtins
import contextlib
import keyword
import operator
import pickle
import re
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

from .code_text import check_identifier, is_identifier
from ..errors import GraphError
from .effects import is_impure
from ._gc import gc_paused
from .node import _NO_DEFAULT, Node, format_target, iter_nodes, map_arg
from .source import SourceLocation, one_line

__all__ = ["Graph"]

_RESERVED = frozenset(dir(builtins)) | frozenset(keyword.kwlist) | {
    "self", "torch", "operator", "math", "sys", "inf", "nan", "root", "_ok"}
_NOT_IDENT = re.compile(r"[^0-9a-zA-Z_]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")
_NUMBERED = re.compile(r"^(.*)_(\d+)$")
_SANITIZED: Dict[str, str] = {}


class _Namespace:
    """Hands out unique, valid Python identifiers derived from candidate names."""

    __slots__ = ("_used", "_counters")

    def __init__(self):
        self._used: set = set()
        self._counters: Dict[str, int] = {}

    def create(self, candidate: str) -> str:
        used = self._used
        if candidate not in used and candidate.isidentifier() and candidate not in _RESERVED \
                and not candidate.startswith("_"):
            used.add(candidate)
            return candidate
        base = _SANITIZED.get(candidate)
        if base is None:
            base = _SANITIZED[candidate] = _sanitize(candidate)
        if base in used:
            m = _NUMBERED.match(base)
            if m:
                base = m.group(1)
        name = base
        if name in used or name in _RESERVED:
            i = self._counters.get(base, 0)
            while True:
                i += 1
                name = f"{base}_{i}"
                if name not in used:
                    break
            self._counters[base] = i
        used.add(name)
        return name


def _sanitize(candidate: str) -> str:
    s = _CAMEL.sub(r"_\1", candidate).lower() if any(c.isupper() for c in candidate) else candidate
    s = _NOT_IDENT.sub("_", s).strip("_") or "v"
    if s[0].isdigit():
        s = "_" + s
    if s.startswith("_"):
        s = "v" + s
    return s


def _candidate_name(op: str, target: Any) -> str:
    if op == "call_function":
        name = getattr(target, "__name__", None) or type(target).__name__
    elif isinstance(target, str):
        name = target.replace(".", "_")
    else:
        name = op
    return name


class _NodeList:
    """A live view of a graph's nodes; iteration tolerates erasing and inserting nodes."""

    __slots__ = ("_graph", "_reverse")

    def __init__(self, graph: "Graph", reverse: bool = False):
        self._graph = graph
        self._reverse = reverse

    def __len__(self) -> int:
        return self._graph._len

    def __iter__(self) -> Iterator[Node]:
        root = self._graph._root
        step = "_prev" if self._reverse else "_next"
        cur = getattr(root, step)
        while cur is not root:
            nxt = getattr(cur, step)
            if not cur._erased:
                yield cur
            cur = nxt

    def __reversed__(self) -> Iterator[Node]:
        return iter(_NodeList(self._graph, not self._reverse))

    def __repr__(self) -> str:
        return f"<{len(self)} nodes>"


class Graph:
    """An ordered list of :class:`Node` s that can be edited while iterating over it.

    Build one with :meth:`placeholder`, :meth:`call_function`, ... and :meth:`output`, or get one
    from :func:`symtrace.symbolic_trace`. ``guards`` holds the entry guards recorded while
    tracing (see :mod:`symtrace.graph.guards`); code generation checks them on every call.
    """

    def __init__(self):
        root = object.__new__(Node)
        root.graph, root.name, root.op, root._target = self, "__root__", "root", None
        root._prev = root._next = root
        root._erased = False
        root.default = _NO_DEFAULT
        root.users, root.meta, root._args, root._kwargs, root._inputs = {}, {}, (), {}, {}
        self._root = root
        self._len = 0
        self._names = _Namespace()
        self._index: Dict[tuple, Dict[Node, None]] = {}
        self._insert_before = root
        self._positions: Optional[Dict[Node, int]] = None
        # True while nodes were only appended at the end (never inserted, moved or retargeted):
        # then each index bucket lists its nodes in graph order
        self._in_order = True
        # callbacks of the modules whose generated code is up to date; any edit calls them once
        self._clean: set = set()
        self.guards: list = []
        self.created_by: str = ""

    # --- change notification -------------------------------------------------------------
    def _mutated(self) -> None:
        if self._clean:
            stale = list(self._clean)
            self._clean.clear()
            for w in stale:
                w()

    def _index_add(self, node: Node) -> None:
        key = _index_key(node.op, node._target)
        bucket = self._index.get(key)
        if bucket is None:
            self._index[key] = {node: None}
        else:
            bucket[node] = None

    def _index_remove(self, node: Node) -> None:
        key = _index_key(node.op, node._target)
        d = self._index.get(key)
        if d is not None:
            d.pop(node, None)
            if not d:
                del self._index[key]

    def _retarget(self, node: Node, target: Any) -> None:
        self._in_order = False
        self._index_remove(node)
        node._target = target
        self._index_add(node)
        if self._clean:
            self._mutated()

    def _rename(self, node: Node, candidate: str) -> str:
        """Give ``node`` a fresh unique name derived from ``candidate``; returns it."""
        name = node.name = self._names.create(candidate)
        if self._clean:
            self._mutated()
        return name

    def _structure_changed(self) -> None:
        self._positions = None
        self._mutated()

    # --- reading -------------------------------------------------------------------------
    @property
    def nodes(self) -> _NodeList:
        """All nodes in order (a live view; safe to mutate the graph while iterating)."""
        return _NodeList(self)

    def __len__(self) -> int:
        return self._len

    def find_nodes(self, *, op: str, target: Any = None, sort: bool = True) -> List[Node]:
        """Nodes with this opcode (and target, if given), from the index: no scan of the graph.

        ``sort`` returns them in graph order (O(k log k) after an O(n) position refresh that is
        cached until the graph's structure changes); otherwise in insertion order.
        """
        if target is None:
            found = [n for (o, _), d in self._index.items() if o == op for n in d]
        else:
            try:
                found = list(self._index.get((op, target), ()))
            except TypeError:
                found = [n for n in self.nodes if n.op == op and n.target is target]
        if sort and len(found) > 1 and (target is None or not self._in_order):
            pos = self.positions()
            found.sort(key=pos.__getitem__)
        return found

    def positions(self) -> Dict[Node, int]:
        """Each node's index in graph order (cached until the structure changes)."""
        pos = self._positions
        if pos is None:
            order = []
            root = self._root
            n = root._next
            while n is not root:  # (erased nodes are unlinked)
                order.append(n)
                n = n._next
            pos = self._positions = dict(zip(order, range(len(order))))
        return pos

    def output_node(self) -> Optional[Node]:
        """The ``output`` node, or None if the graph has none yet."""
        last = self._root._prev
        return last if last.op == "output" else None

    def placeholders(self) -> List[Node]:
        return [n for n in self.nodes if n.op == "placeholder"]

    # --- creating ------------------------------------------------------------------------
    def create_node(self, op: str, target: Any, args: tuple = (), kwargs: Optional[dict] = None,
                    name: Optional[str] = None, meta: Optional[dict] = None) -> Node:
        """Create a node at the current insertion point (the end unless moved). A
        ``call_method`` target must be an identifier (it is written into code)."""
        if op == "call_method" and type(target) is str and not is_identifier(target):
            check_identifier(target, "a call_method node's target (the method name)")
        name = self._names.create(name or _candidate_name(op, target))
        node = Node(self, name, op, target, args, kwargs, meta)
        return self._attach_new(node, _index_key(op, target))

    def _attach_new(self, node: Node, key: tuple) -> Node:
        """Link a newly made ``node`` at the insertion point and index it under ``key``
        (written out: this is the hot path of every pass)."""
        anchor = self._insert_before
        if anchor is not self._root:
            self._in_order = False
        p = anchor._prev
        node._prev = p
        node._next = anchor
        p._next = node
        anchor._prev = node
        bucket = self._index.get(key)
        if bucket is None:
            self._index[key] = {node: None}
        else:
            bucket[node] = None
        self._len += 1
        self._positions = None
        if self._clean:
            self._mutated()
        return node

    def _create_flat(self, op: str, target: Any, args: tuple, name: str, meta: dict) -> Node:
        """``create_node`` for passes that know ``op`` is a call opcode, ``target`` hashable,
        ``args`` a flat tuple of nodes and atoms (nothing nested) and no kwargs: the same node,
        without the general argument walk."""
        node = Node._flat(self, self._names.create(name), op, target, args, meta)
        return self._attach_new(node, (op, target))

    def placeholder(self, name: str, default: Any = _NO_DEFAULT, meta: Optional[dict] = None) -> Node:
        """An input named ``name`` (``"*args"``/``"**kwargs"`` for variadic inputs)."""
        node = self.create_node("placeholder", name, name=name.lstrip("*"), meta=meta)
        node.default = default
        return node

    def get_attr(self, qualified_name: str, meta: Optional[dict] = None) -> Node:
        """Read a parameter, buffer or constant of the owning module."""
        return self.create_node("get_attr", qualified_name, meta=meta)

    def call_function(self, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None,
                      name: Optional[str] = None, meta: Optional[dict] = None) -> Node:
        return self.create_node("call_function", fn, args, kwargs, name, meta)

    def call_method(self, method: str, args: tuple = (), kwargs: Optional[dict] = None,
                    name: Optional[str] = None, meta: Optional[dict] = None) -> Node:
        return self.create_node("call_method", method, args, kwargs, name, meta)

    def call_module(self, qualified_name: str, args: tuple = (), kwargs: Optional[dict] = None,
                    name: Optional[str] = None, meta: Optional[dict] = None) -> Node:
        return self.create_node("call_module", qualified_name, args, kwargs, name, meta)

    def output(self, result: Any, meta: Optional[dict] = None) -> Node:
        """The graph's result (any nesting of tuples, lists and dicts of nodes and constants)."""
        return self.create_node("output", "output", (result,), name="output", meta=meta)

    @contextlib.contextmanager
    def inserting_before(self, node: Optional[Node] = None):
        """Within the block, new nodes go just before ``node`` (None: the end)."""
        saved = self._insert_before
        self._insert_before = self._root if node is None else node
        try:
            yield
        finally:
            self._insert_before = saved

    @contextlib.contextmanager
    def inserting_after(self, node: Optional[Node] = None):
        """Within the block, new nodes go just after ``node``, in the order created."""
        saved = self._insert_before
        self._insert_before = (self._root._next if node is None else node._next)
        try:
            yield
        finally:
            self._insert_before = saved

    # --- erasing and moving --------------------------------------------------------------
    def erase_node(self, node: Node) -> None:
        """Remove a node that nothing uses any more."""
        if node.graph is not self:
            raise GraphError(f"cannot erase {node.name!r}: it belongs to another graph")
        if node._erased:
            raise GraphError(f"node {node.name!r} was already erased")
        if node.users:
            users = ", ".join(u.name for u in node.users)
            raise GraphError(
                f"cannot erase {node.name!r}: it still has {len(node.users)} user(s) ({users}); "
                f"call {node.name}.replace_all_uses_with(...) first")
        for n in node._inputs:
            n.users.pop(node, None)
        node._args, node._kwargs, node._inputs = (), {}, {}
        self._index_remove(node)
        nxt = node._next
        if self._insert_before is node:
            self._insert_before = nxt
        node._prev._next = nxt
        nxt._prev = node._prev
        node._erased = True
        self._len -= 1
        self._positions = None
        if self._clean:
            self._mutated()

    def _link_before(self, node: Node, anchor: Node) -> None:
        if anchor is not self._root:
            self._in_order = False
        p = anchor._prev
        node._prev, node._next = p, anchor
        p._next = node
        anchor._prev = node
        self._structure_changed()

    def _move_before(self, node: Node, anchor: Node) -> None:
        if node.graph is not self or anchor.graph is not self:
            raise GraphError(f"cannot move {node.name!r} next to {anchor.name!r}: they belong to "
                             "different graphs (copy it with Graph.node_copy first)")
        if node is anchor or node._next is anchor:
            return
        node._prev._next = node._next
        node._next._prev = node._prev
        self._in_order = False
        self._link_before(node, anchor)

    # --- copying -------------------------------------------------------------------------
    def node_copy(self, node: Node, arg_transform: Callable[[Node], Any] = lambda n: n) -> Node:
        """Create a copy of ``node`` (from any graph) here, mapping its input nodes through
        ``arg_transform``. ``meta`` is copied (one level deep)."""
        args = map_arg(node.args, arg_transform)
        kwargs = map_arg(node.kwargs, arg_transform)
        new = self.create_node(node.op, node.target, args, kwargs, node.name, dict(node.meta))
        new.default = node.default
        return new

    def graph_copy(self, src: "Graph", val_map: Dict[Node, Any], return_output_node: bool = False):
        """Copy every node of ``src`` except its output into this graph.

        ``val_map`` maps nodes of ``src`` to values here; pre-fill it to substitute inputs (e.g.
        map ``src``'s placeholders to nodes of this graph). Returns what ``src`` outputs, mapped.
        """
        out = None
        get = val_map.__getitem__
        for node in src.nodes:
            if node.op == "output":
                out = node
                continue
            if node in val_map:
                continue
            val_map[node] = self.node_copy(node, get)
        if out is None:
            return None
        if return_output_node:
            return self.node_copy(out, get)
        return map_arg(out.args[0], get)

    def __deepcopy__(self, memo) -> "Graph":
        packed = self.__dict__.get("_packed")
        if packed is not None:  # not used since unpickled: the copy shares the payload
            new = Graph.__new__(Graph)
            new.__dict__.update(_packed=packed, _clean=set())
            memo[id(self)] = new
            return new
        new = Graph()
        memo[id(self)] = new
        with gc_paused():
            new._copy_nodes_from(self)
        new.guards = list(self.guards)
        new.created_by = self.created_by
        new._names._counters = dict(self._names._counters)
        return new

    def _copy_nodes_from(self, src: "Graph") -> None:
        """Make this empty graph a copy of ``src``: the fast path behind deepcopy. Nodes keep
        their names, ``meta`` is copied one level deep, and the index, the users and the used
        names are copied in bulk instead of node by node."""
        env: Dict[Node, Node] = {}
        get = env.__getitem__
        new_node = object.__new__
        atoms = _ATOMS
        root = self._root
        prev = root
        src_root = src._root
        n = src_root._next
        while n is not src_root:  # (erased nodes are unlinked: the list holds live nodes only)
            m = new_node(Node)
            m.graph = self
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
                    args = _remap(args, get) if out is None else tuple(out)
                else:
                    args = _remap(args, get)
                new_inputs = {}
                for x in inputs:
                    y = env[x]
                    new_inputs[y] = None
                    y.users[m] = None
                m._inputs = new_inputs
            else:  # no node inside: a tuple of atoms can be shared, containers are copied
                for a in args:
                    if type(a) not in atoms:
                        args = _remap(args, get)
                        break
                m._inputs = {}
            kw = n._kwargs
            m._kwargs = _remap(kw, get) if kw else {}
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
        self._index = {k: dict.fromkeys(map(get, d)) for k, d in src._index.items()}
        self._in_order = src._in_order
        self._names._used = set(src._names._used)
        self._len = len(env)
        self._structure_changed()

    def _append_node(self, row: tuple, lookup: Callable[[Any], Node]) -> Node:
        """Append one node from ``(name, op, target, args, kwargs, meta, default)``, mapping
        references in args through ``lookup``; the caller updates ``_len``."""
        name, op, target, args, kwargs, meta, default = row
        m = object.__new__(Node)
        m.graph, m.name, m.op, m._target = self, name, op, target
        args = _remap(args, lookup)
        m._args = args
        m._kwargs = kwargs = _remap(kwargs, lookup) if kwargs else {}
        inputs: Dict[Node, None] = {}
        for x in iter_nodes(args):
            inputs[x] = None
        if kwargs:
            for x in iter_nodes(kwargs):
                inputs[x] = None
        for x in inputs:
            x.users[m] = None
        m._inputs, m.users, m.meta, m.default, m._erased = inputs, {}, meta, default, False
        root = self._root
        last = root._prev
        m._prev, m._next = last, root
        last._next = m
        root._prev = m
        self._index_add(m)
        self._names._used.add(name)
        return m

    # Pickled form: ``__reduce__`` stores the graph as one bytes payload (``_dump_graph``).
    # Unpickling keeps that payload and builds the nodes on first use (see ``__getattr__``),
    # so loading a module costs little until its graph is read or run; pickling or copying a
    # graph that was not used since is then nearly free (the payload is reused).
    def __reduce__(self):
        packed = self.__dict__.get("_packed")
        return (_graph_from_bytes, (_dump_graph(self) if packed is None else packed,))

    def __getstate__(self):
        packed = self.__dict__.get("_packed")
        return {"version": _PAYLOAD_VERSION, "data": _dump_graph(self) if packed is None else packed}

    def __setstate__(self, state) -> None:
        if state.get("version", 1) != 1:
            self.__dict__.clear()
            self.__dict__.update(_packed=state["data"], _clean=set())
            return
        self.__init__()
        with gc_paused():
            self._load_rows(state)
        self._structure_changed()
        self.guards = state["guards"]
        self.created_by = state.get("created_by", "")
        self._names._counters = dict(state.get("counters", {}))

    def __getattr__(self, name: str):
        # Reached only for attributes the instance lacks: a graph unpickled but not used yet
        # ("packed") builds its nodes now.
        d = self.__dict__
        if "_packed" in d and not (name.startswith("__") and name.endswith("__")):
            with _UNPACK_LOCK:
                packed = d.get("_packed")
                if packed is not None and not d.get("_unpacking"):
                    d["_unpacking"] = True
                    try:
                        _load_graph(self, packed)
                        del d["_packed"]
                    finally:
                        del d["_unpacking"]
            if name in d:
                return d[name]
        raise AttributeError(f"'Graph' object has no attribute {name!r}")

    def _load_rows(self, state) -> None:
        """Version 1 of the pickled form: one row per node."""
        locs = [SourceLocation(*loc) for loc in state["locs"]]
        nodes: List[Node] = []
        lookup = lambda r: nodes[r.i]  # noqa: E731
        for name, op, target, args, kwargs, mask, meta, loc, default in state["rows"]:
            if mask > 0:
                args = tuple([nodes[a] if mask >> k & 1 else a for k, a in enumerate(args)])
            elif mask < 0:
                args = _remap(args, lookup)
            meta = {} if meta is None else dict(meta)
            if loc >= 0:
                meta["source"] = locs[loc]
            row = (name, op, target, args, _remap(kwargs, lookup) if kwargs else None, meta,
                   _NO_DEFAULT if default is None else default[0])
            nodes.append(self._append_node(row, _identity))
        self._len = len(nodes)

    # --- checking ------------------------------------------------------------------------
    def lint(self) -> None:
        """Check the graph's invariants; raise :class:`GraphError` showing the faulty node."""
        seen: Dict[Node, None] = {}
        names: Dict[str, Node] = {}
        count = 0
        for node in self.nodes:
            count += 1
            if node.graph is not self:
                self._lint_fail(node, "belongs to another graph")
            if node.op == "output" and node._next is not self._root:
                self._lint_fail(node, "is an output node but not the last node")
            if not node.name.isidentifier() or keyword.iskeyword(node.name):
                self._lint_fail(node, "does not have a valid Python name")
            if node.name in names:
                self._lint_fail(node, f"has the same name as another node ({names[node.name].format_node()})")
            names[node.name] = node
            for inp in node._inputs:
                if inp.graph is not self:
                    self._lint_fail(node, f"reads {inp.name!r}, a node of another graph")
                if inp._erased:
                    self._lint_fail(node, f"reads {inp.name!r}, which was erased")
                if inp not in seen:
                    self._lint_fail(node, f"reads {inp.name!r} before it is defined")
                if node not in inp.users:
                    self._lint_fail(node, f"reads {inp.name!r} but is missing from its users")
            for user in node.users:
                if node not in user._inputs or user._erased or user.graph is not self:
                    self._lint_fail(node, f"lists {user.name!r} as a user, but it does not read it")
            if node.op in ("call_module", "get_attr", "call_method") and not isinstance(node.target, str):
                self._lint_fail(node, f"is {node.op} but its target {node.target!r} is not a string")
            if node.op == "call_function" and not callable(node.target):
                self._lint_fail(node, f"is call_function but its target {node.target!r} is not callable")
            seen[node] = None
        if count != self._len:
            raise GraphError(f"graph holds {count} nodes but counts {self._len}")

    def _lint_fail(self, node: Node, problem: str) -> None:
        lines = []
        prev2 = [node._prev._prev, node._prev]
        for n in prev2:
            if n is not self._root and n.op != "root":
                lines.append(f"      {n.format_node()}")
        lines.append(f"  >>> {node.format_node()}")
        for n in (node._next, node._next._next):
            if n is not self._root and n.op != "root":
                lines.append(f"      {n.format_node()}")
        raise GraphError(f"node {node.name!r} {problem}:\n" + "\n".join(lines))

    # --- clean-up ------------------------------------------------------------------------
    def eliminate_dead_code(self, is_impure_node: Optional[Callable[[Node], bool]] = None,
                            module=None) -> bool:
        """Erase nodes whose results nobody uses, keeping impure ones (in-place ops, random
        ops, guards, side effects; see :func:`~symtrace.graph.effects.is_impure`).
        Returns whether anything was erased."""
        impure = is_impure_node or (lambda n: is_impure(n, module))
        changed = False
        for node in reversed(self.nodes):
            if not node.users and not impure(node):
                self.erase_node(node)
                changed = True
        return changed

    # --- printing ------------------------------------------------------------------------
    def __str__(self) -> str:
        head = "graph():" if not self.created_by else f"graph():  # made by {one_line(self.created_by)}"
        return "\n".join([head] + [f"    {n.format_node()}" for n in self.nodes])

    def print_tabular(self, **kwargs) -> None:
        """Print the nodes as a table (see :func:`symtrace.graph.tabular.print_tabular`)."""
        from .tabular import print_tabular
        print_tabular(self, **kwargs)

    def python_code(self, root_name: str = "self"):
        """The generated Python for this graph (see :mod:`symtrace.graph.codegen`)."""
        from .codegen import python_code
        return python_code(self)


class _Ref:
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __reduce__(self):
        return (_Ref, (self.i,))


_ATOMS = frozenset({int, float, bool, str, type(None)})


def _graph_from_bytes(data: bytes) -> "Graph":
    """A graph from a payload of ``_dump_graph``: packed, its nodes are built on first use."""
    if type(data) is not bytes or not data:
        raise pickle.UnpicklingError("not a symtrace graph payload")
    graph = Graph.__new__(Graph)
    graph.__dict__.update(_packed=data, _clean=set())
    return graph


_UNPACK_LOCK = threading.RLock()


# Payload: one pickle of columns, one entry per node in graph order (gathered with C-level
# ``map`` where possible). In ``args``, references to nodes are stored as their index, with
# bit k of ``masks[i]`` set when position k is a reference (mask -1: nested arguments, where
# references are ``_Ref`` objects; 0: no reference). ``kwargs`` (references as ``_Ref``) and
# ``metas`` (meta without "source") are None where empty. Source locations are stored once
# in a table and referenced by index. The (op, target) index is stored as lists of indices.
_PAYLOAD_VERSION = 5
_get_name = operator.attrgetter("name")
_get_op = operator.attrgetter("op")
_get_target = operator.attrgetter("_target")
_get_default = operator.attrgetter("default")


def _dump_graph(graph: "Graph") -> bytes:
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
                    args = _remap(args, ref)
                kw = n._kwargs
                kwargs_col.append(_remap(kw, ref) if kw else None)
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
            _PAYLOAD_VERSION,
            list(map(_get_name, nodes)), list(map(_get_op, nodes)), list(map(_get_target, nodes)),
            args_col, masks, kwargs_col, metas, loc_ids, list(map(_get_default, nodes)),
            [tuple(loc) for loc in locs],
            [(key, list(map(ids.__getitem__, d))) for key, d in graph._index.items()],
            graph.guards, graph.created_by, graph._names._counters, graph._in_order,
        )
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def _load_graph(graph: "Graph", data: bytes) -> None:
    """Build the nodes of a ``_dump_graph`` payload into ``graph`` (packed, or bare)."""
    with gc_paused():
        state = pickle.loads(data)
        if type(state) is not tuple or not state or state[0] != _PAYLOAD_VERSION:
            raise pickle.UnpicklingError("not a symtrace graph payload of a known version")
        (_, names, ops, targets, args_col, masks, kwargs_col, metas, loc_ids, defaults, table,
         index, guards, created_by, counters, in_order) = state
        fresh = Graph()  # built aside, moved into ``graph`` at the end (all or nothing)
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
                    args = _remap(args, lookup)
                    inputs = dict.fromkeys(iter_nodes(args))
                if kwargs:
                    kwargs = _remap(kwargs, lookup)
                    inputs.update(dict.fromkeys(iter_nodes(kwargs)))
                for x in inputs:
                    x.users[m] = None
            elif kwargs:
                kwargs = _remap(kwargs, lookup)
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


class _Unhashable:
    """Index key standing for every unhashable target of one opcode."""

    def __repr__(self):
        return "<unhashable target>"

    def __reduce__(self):
        return "_UNHASHABLE"


_UNHASHABLE = _Unhashable()


def _index_key(op: str, target: Any) -> tuple:
    try:
        hash(target)
    except TypeError:
        return (op, _UNHASHABLE)
    return (op, target)


def _identity(x):
    return x


def _remap(a: Any, f: Callable[[Any], Any]) -> Any:
    """Copy a nested argument structure, replacing nodes (or pickled node refs) through ``f``
    (a faster ``map_arg`` for flat tuples; public as :func:`remap_args`)."""
    t = type(a)
    if t is Node or t is _Ref:
        return f(a)
    if t is tuple:
        return tuple([f(x) if type(x) is Node or type(x) is _Ref else
                      (x if type(x) in _ATOMS else _remap(x, f)) for x in a])
    if t is list:
        return [_remap(x, f) for x in a]
    if t is dict:
        return {k: _remap(v, f) for k, v in a.items()}
    if t is slice:
        return slice(_remap(a.start, f), _remap(a.stop, f), _remap(a.step, f))
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return t(*[_remap(x, f) for x in a])
    return a


format_target = format_target

remap_args = _remap
