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

from ..errors import GraphError
from .effects import is_impure
from ._gc import gc_paused
from .node import _NO_DEFAULT, Node, format_target, iter_nodes, map_arg
from .source import SourceLocation

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
        root.users, root.meta, root._args, root._kwargs, root._inputs = {}, {}, (), {}, {}
        self._root = root
        self._len = 0
        self._names = _Namespace()
        self._index: Dict[tuple, Dict[Node, None]] = {}
        self._insert_before = root
        self._positions: Optional[Dict[Node, int]] = None
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
        self._index.setdefault(_index_key(node.op, node._target), {})[node] = None

    def _index_remove(self, node: Node) -> None:
        key = _index_key(node.op, node._target)
        d = self._index.get(key)
        if d is not None:
            d.pop(node, None)
            if not d:
                del self._index[key]

    def _retarget(self, node: Node, target: Any) -> None:
        self._index_remove(node)
        node._target = target
        self._index_add(node)
        self._mutated()

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
        if sort and len(found) > 1:
            pos = self.positions()
            found.sort(key=pos.__getitem__)
        return found

    def positions(self) -> Dict[Node, int]:
        """Each node's index in graph order (cached until the structure changes)."""
        if self._positions is None:
            self._positions = {n: i for i, n in enumerate(self.nodes)}
        return self._positions

    def output_node(self) -> Optional[Node]:
        """The ``output`` node, or None if the graph has none yet."""
        last = self._root._prev
        return last if last.op == "output" else None

    def placeholders(self) -> List[Node]:
        return [n for n in self.nodes if n.op == "placeholder"]

    # --- creating ------------------------------------------------------------------------
    def create_node(self, op: str, target: Any, args: tuple = (), kwargs: Optional[dict] = None,
                    name: Optional[str] = None, meta: Optional[dict] = None) -> Node:
        """Create a node at the current insertion point (the end unless moved)."""
        name = self._names.create(name or _candidate_name(op, target))
        node = Node(self, name, op, target, args, kwargs, meta)
        self._link_before(node, self._insert_before)
        self._index_add(node)
        self._len += 1
        return node

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
        node._set_inputs((), {})
        self._index_remove(node)
        if self._insert_before is node:
            self._insert_before = node._next
        node._prev._next = node._next
        node._next._prev = node._prev
        node._erased = True
        self._len -= 1
        self._structure_changed()

    def _link_before(self, node: Node, anchor: Node) -> None:
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
        new = Graph()
        memo[id(self)] = new
        with gc_paused():
            env: Dict[Node, Node] = {}
            new._append_copies(self.nodes, env.__getitem__, env)
        new.guards = list(self.guards)
        new.created_by = self.created_by
        new._names._counters = dict(self._names._counters)
        return new

    def _append_copies(self, rows, lookup: Callable[[Any], Node], env: Optional[Dict[Node, Node]]) -> List[Node]:
        """Bulk-append copies of nodes at the end: the fast path behind deepcopy. Names are
        taken as they are (they are unique already)."""
        out: List[Node] = []
        for row in rows:
            m = self._append_node((row.name, row.op, row._target, row._args, row._kwargs, dict(row.meta),
                                   row.default), lookup)
            if env is not None:
                env[row] = m
            out.append(m)
        self._len += len(out)
        self._structure_changed()
        return out

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

    # Pickled form: one row per node, ``(name, op, target, args, kwargs, mask, meta, loc)``.
    # Node references in a flat ``args`` tuple are stored as ints, with bit k of ``mask`` set
    # when position k is a reference (mask -1: nested args, references stored as ``_Ref``).
    # Source locations are stored once in a table and referenced by index (``loc``, -1: none).
    def __getstate__(self):
        ids: Dict[Node, int] = {}
        ref = lambda n: _Ref(ids[n])  # noqa: E731
        locs: Dict[Any, int] = {}
        rows = []
        with gc_paused():
            for i, n in enumerate(self.nodes):
                ids[n] = i
                args, mask = n._args, 0
                for k, a in enumerate(args):
                    t = type(a)
                    if t is Node:
                        mask |= 1 << k
                    elif t not in _ATOMS:
                        mask = -1
                        break
                if mask > 0:
                    args = tuple([ids[a] if type(a) is Node else a for a in args])
                elif mask < 0:
                    args = _remap(args, ref)
                meta = n.meta
                loc = meta.get("source")
                if loc is not None:
                    meta = dict(meta)
                    del meta["source"]
                    loc = locs.setdefault(loc, len(locs))
                else:
                    loc = -1
                if not meta:
                    meta = None
                rows.append((n.name, n.op, n._target, args, _remap(n._kwargs, ref) if n._kwargs else None,
                             mask, meta, loc, None if n.default is _NO_DEFAULT else (n.default,)))
        return {"version": 1, "rows": rows, "locs": [tuple(loc) for loc in locs],
                "guards": self.guards, "created_by": self.created_by, "counters": self._names._counters}

    def __reduce__(self):
        # the rows travel as one bytes object, so unpickling them runs inside _graph_from_bytes
        # with the cyclic GC paused (building ~10k small objects otherwise triggers full sweeps)
        return (_graph_from_bytes, (pickle.dumps(self.__getstate__(), protocol=pickle.HIGHEST_PROTOCOL),))

    def __setstate__(self, state) -> None:
        self.__init__()
        locs = [SourceLocation(*loc) for loc in state["locs"]]
        nodes: List[Node] = []
        lookup = lambda r: nodes[r.i]  # noqa: E731
        with gc_paused():
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
        self._structure_changed()
        self.guards = state["guards"]
        self.created_by = state.get("created_by", "")
        self._names._counters = dict(state.get("counters", {}))

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
        head = "graph():" if not self.created_by else f"graph():  # made by {self.created_by}"
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
    with gc_paused():
        state = pickle.loads(data)
        graph = Graph.__new__(Graph)
        graph.__setstate__(state)
    return graph


class _Unhashable:
    """Index key standing for every unhashable target of one opcode."""

    def __repr__(self):
        return "<unhashable target>"


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
