"""``Graph``: an ordered, editable list of nodes with an index by (op, target).

Invariants (checked by :meth:`Graph.lint`): every node belongs to this graph; every input of a
node comes before it; ``users`` mirror ``args``/``kwargs``; names are unique Python
identifiers; there is at most one ``output`` node and it is last.
"""
from __future__ import annotations

import builtins
import contextlib
import keyword
import pickle
import re
from typing import Any, Callable, Dict, Iterator, List, Optional

from .code_text import check_identifier, is_identifier
from ..errors import GraphError
from .effects import is_impure
from . import graph_pickle
from .graph_pickle import _Ref  # noqa: F401  (payloads pickled before graph_pickle.py name it here)
from .node import _NO_DEFAULT, Node, map_arg
from .source import one_line

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

    # --- copying and pickling: the work is in graph_pickle.py ----------------------------
    def __deepcopy__(self, memo) -> "Graph":
        new = memo[id(self)] = Graph()
        graph_pickle.copy_graph(self, new)
        return new

    def __reduce__(self):
        # one bytes payload; unpickled, it stays packed until first used (see _PackedGraph)
        return (_graph_from_bytes, (graph_pickle.dump(self),))

    def __getstate__(self):
        return {"version": graph_pickle.PAYLOAD_VERSION, "data": graph_pickle.dump(self)}

    def __setstate__(self, state) -> None:
        # reached only for pickles of older symtrace versions, made without ``__reduce__``
        if state.get("version", 1) == 1:
            self.__init__()
            graph_pickle.load_rows(self, state)
        else:
            self.__dict__.clear()
            self.__class__ = _PackedGraph
            self.__dict__.update(_payload=state["data"], _clean=set())

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


class _PackedGraph(Graph):
    """A graph unpickled but not used since: it holds only its payload (and the callbacks of
    the modules that own it). The first attribute it lacks (any node state: ``_root``,
    ``_len``...) builds its nodes and makes it a plain :class:`Graph`, as torch's lazy modules
    become their real class. Until then, pickling or copying it reuses the payload."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"'Graph' object has no attribute {name!r}")
        graph_pickle.unpack(self, Graph)
        return object.__getattribute__(self, name)

    def __deepcopy__(self, memo) -> Graph:
        new = memo[id(self)] = _graph_from_bytes(self._payload)
        return new

    def __reduce__(self):
        return (_graph_from_bytes, (self._payload,))

    def __getstate__(self):
        return {"version": graph_pickle.PAYLOAD_VERSION, "data": self._payload}


def _graph_from_bytes(data: bytes) -> Graph:
    """Unpickle a graph (the name pickles refer to): packed until first used."""
    if type(data) is not bytes or not data:
        raise pickle.UnpicklingError("not a symtrace graph payload")
    graph = Graph.__new__(_PackedGraph)
    graph.__dict__.update(_payload=data, _clean=set())
    return graph


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


