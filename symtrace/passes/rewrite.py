"""Replace instances of a pattern by a replacement graph: ``replace_pattern``.

>>> def pattern(a, b):
...     return torch.relu(torch.add(a, b))
>>> def replacement(a, b):
...     return torch.clamp_min(torch.add(a, b), 0.0)
>>> replace_pattern(gm, pattern, replacement)

For each match (see :class:`~symtrace.passes.matcher.SubgraphMatcher`) a copy of the
replacement graph is spliced in just before the match's last node, the users of the pattern's
outputs are pointed at the replacement's outputs, and the matched nodes are erased. New nodes
inherit ``meta`` (``source``, ``module_path``...) from the nodes they replace, so errors and
tables still point at the user's line. Matched nodes are updated in place where that gives the
same graph with fewer edits: a replacement node with the same op and target as an internal
matched node reuses that node (it keeps its name and meta), and the replacement's output, when
it is computed last and has the op of the matched output, becomes that node (it keeps its
users, position and meta, and is renamed after the replacement's node when the target
changes), so the users need no rewiring. Edits only invalidate the module's code: it is
regenerated once, on its next use.

Complexity: matching (see the matcher) plus O(r) per match for r replacement nodes: O(n + k·r).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
from torch import nn

from ..graph._gc import gc_paused
from ..graph.graph_module import GraphModule
from ..graph.node import _NO_DEFAULT, Node, map_arg, remap_args
from ..graph.tree import tree_iter
from ._compiled import Constants, define
from .matcher import Match, SubgraphMatcher, load_pattern

__all__ = ["replace_pattern", "apply_replacements", "Replacement", "per_match"]


@dataclass(eq=False, slots=True)
class Replacement:
    """What one match was replaced by: the ``match`` and ``new_nodes``, the replacement's nodes
    now in the graph (including matched internal nodes reused in place). ``anchor`` and
    ``nodes_map`` mirror the match (torch.fx's ``ReplacedPatterns``)."""

    match: Match
    new_nodes: List[Node]

    @property
    def anchor(self) -> Node:
        return self.match.anchor

    @property
    def nodes_map(self) -> Dict[str, Node]:
        return self.match.nodes_map

    @property
    def replacements(self) -> List[Node]:
        return self.new_nodes


class per_match:  # noqa: N801 - used like a function
    """Wrap ``fn(match) -> replacement or None`` to choose the replacement per match
    (None skips the match)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Match], Any]):
        self.fn = fn


def replace_pattern(gm: GraphModule, pattern: Any, replacement: Any, *,
                    filters: Sequence[Callable[[Match], bool]] = (), literals: str = "exact",
                    commutative: Union[bool, Iterable] = False, predicates: Optional[dict] = None,
                    alternatives: Optional[dict] = None, module_match: Any = "type") -> List[Replacement]:
    """Replace every non-overlapping match of ``pattern`` in ``gm`` by ``replacement``.

    ``pattern``: a function, module, ``GraphModule``, ``Graph`` or a ready
    :class:`SubgraphMatcher` (then the matching options here are ignored). ``replacement``: a
    function (or module/GraphModule) taking the pattern's inputs — by name when its parameter
    names are pattern inputs or captured literals (``literals="capture"``), else by position,
    extra parameters by captured-literal name — and returning as many values as the pattern;
    or ``per_match(fn)`` where ``fn(match)`` returns such a replacement or None to skip.
    ``filters``: ``fn(match) -> bool`` deciding which matches to replace (run during matching,
    so a rejected match leaves room for an overlapping one).

    A replacement module's submodule or attribute with the same qualified name as one of the
    pattern's stands for the one matched in ``gm`` (so ``self.conv`` reuses the matched conv);
    others are copied into ``gm``. New nodes inherit ``meta``: the k-th output the k-th matched
    output's; other nodes that of the matched node of the same (op, target), else the anchor's
    (without ``tensor_meta``). Pattern and replacement functions are traced once (cached), and
    with the default matching options and no ``call_module`` nodes in the pattern, it is
    compiled once too: later calls with the same pattern reuse it (until the pattern or
    replacement graph is edited).

    Returns one :class:`Replacement` per match replaced. Edits invalidate ``gm``'s code, which
    is regenerated once, on its next use.
    """
    if not isinstance(gm, GraphModule):
        raise TypeError(f"replace_pattern expects a GraphModule, not {type(gm).__name__}")
    templates = None
    if isinstance(pattern, SubgraphMatcher):
        matcher = pattern
    elif predicates or alternatives or module_match != "type" or type(commutative) is not bool:
        matcher = SubgraphMatcher(pattern, literals=literals, commutative=commutative, predicates=predicates,
                                  alternatives=alternatives, module_match=module_match)
    else:
        matcher, templates = _prepared(pattern, literals, commutative)
    with gc_paused():  # (one pause for both: the collector then runs once, afterwards)
        matches = matcher.match(gm, filters=filters)
        return apply_replacements(gm, matcher, matches, replacement, _templates=templates)


#: (pattern graph, literals, commutative) -> (matcher, its replacement templates by graph)
_PREPARED: Dict[tuple, tuple] = {}
_PREPARED_MAX = 256


def _prepared(pattern: Any, literals: str, commutative: bool) -> tuple:
    """The matcher of ``pattern`` with these options and the templates prepared for it, made
    once per pattern graph (repeated ``replace_pattern`` calls skip compiling the pattern).
    Patterns with ``call_module`` nodes are not kept (the matcher notes their module types);
    an entry is dropped when its pattern graph or a template's graph is edited."""
    graph, _ = load_pattern(pattern)
    key = (graph, literals, commutative)
    hit = _PREPARED.get(key)
    if hit is not None:
        return hit
    matcher = SubgraphMatcher(pattern, literals=literals, commutative=commutative)
    if any(n.op == "call_module" for n in graph.nodes):
        return matcher, None
    if len(_PREPARED) >= _PREPARED_MAX:
        _PREPARED.clear()
    hit = _PREPARED[key] = (matcher, _Templates(key))
    graph._clean.add(hit[1].forget)
    return hit


class _Templates(dict):
    """Replacement graph -> :class:`_Template` for one cached matcher (see :func:`_prepared`)."""

    __slots__ = ("key",)

    def __init__(self, key: tuple):
        super().__init__()
        self.key = key

    def forget(self) -> None:  # the pattern or a replacement graph was edited
        _PREPARED.pop(self.key, None)
        self.clear()


def apply_replacements(gm: GraphModule, matcher: SubgraphMatcher, matches: Sequence[Match],
                       replacement: Any, *, _templates: Optional[dict] = None) -> List[Replacement]:
    """Splice ``replacement`` in for each of ``matches`` (found by ``matcher`` in ``gm``, in
    graph order, not overlapping). See :func:`replace_pattern`."""
    splicer = _Splicer(gm, matcher, _templates)
    done = []
    choose = replacement.fn if isinstance(replacement, per_match) else None
    fixed = splicer.template(replacement) if choose is None else None
    graph = splicer.graph
    saved = graph._insert_before
    with gc_paused():  # many small objects: keep the cyclic GC from making this super-linear
        try:
            for match in matches:
                if splicer.replaced:
                    splicer.refresh(match)
                t = fixed
                if choose is not None:
                    repl = choose(match)
                    if repl is None:
                        continue
                    t = splicer.template(repl)
                done.append(Replacement(match, splicer.splice(match, t)))
        finally:
            graph._insert_before = saved
    return done


class _Template:
    """A replacement graph prepared for splicing."""

    __slots__ = ("graph", "module", "placeholders", "outputs", "body", "sources", "roles", "bound",
                 "bases", "in_place", "fast")

    def __init__(self, graph, module: Optional[nn.Module], matcher: SubgraphMatcher):
        self.graph, self.module = graph, module
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        out = self.graph.output_node()
        if out is None:
            raise ValueError("the replacement graph has no output")
        self.outputs = list(tree_iter(out.args[0]))
        if len(self.outputs) != len(matcher.outputs):
            raise ValueError(f"the replacement returns {len(self.outputs)} value(s) but the pattern "
                             f"returns {len(matcher.outputs)}; they must correspond one to one")
        self.body = [n for n in self.graph.nodes if n.op not in ("placeholder", "output")]
        self.bases = [_base_name(n.name) for n in self.body]
        self.sources = self._sources(matcher)
        self.roles = self._roles(matcher)
        # the replacement's output may update the matched output in place when it is the
        # last node computed (so the matched output's position stays right)
        last = self.body[-1] if self.body else None
        self.in_place = len(self.outputs) == 1 and self.outputs[0] is last \
            and last.op in ("call_function", "call_method", "call_module")
        # a submodule/attribute the pattern also names stands for the one matched in the graph
        self.bound: Dict[tuple, tuple] = {}
        for p in matcher._order:
            if p.op == "call_module":
                self.bound.setdefault(("call_module", p.node.target), ("node", p.name))
        for n in matcher.pattern_graph.nodes:
            if n.op == "get_attr":
                self.bound.setdefault(("get_attr", n.target), ("input", n.name))
        self.fast = _compile_splice(self, matcher)

    def _roles(self, matcher: SubgraphMatcher) -> List[tuple]:
        """Whose meta each body node inherits: ``(0, k)`` the k-th matched output's, ``(1, name)``
        the node matched by the i-th pattern node with the same (op, target), ``(2, None)`` the
        anchor's without ``tensor_meta`` (which would describe another value). ``(3, name)`` is
        ``(1, name)`` for an internal pattern node: its matched node may be reused in place."""
        internal = {p.name for p in matcher.internals if p.op in ("call_function", "call_method")}
        outs: Dict[Node, int] = {}
        for k, rv in enumerate(self.outputs):
            if type(rv) is Node and rv.op not in ("placeholder", "get_attr"):
                outs.setdefault(rv, k)
        same: Dict[tuple, List[str]] = {}
        for p in matcher._order:
            try:
                same.setdefault((p.op, p.node.target), []).append(p.name)
            except TypeError:
                pass
        used: Dict[tuple, int] = {}
        roles = []
        for n in self.body:
            if n in outs:
                roles.append((0, outs[n]))
                continue
            try:
                key = (n.op, n.target)
                names = same.get(key)
            except TypeError:
                names = None
            if names:
                i = used.get(key, 0)
                used[key] = i + 1
                name = names[min(i, len(names) - 1)]
                roles.append((3 if i < len(names) and name in internal else 1, name))
            else:
                roles.append((2, None))
        return roles

    def _sources(self, matcher: SubgraphMatcher) -> List[tuple]:
        """Where each replacement input comes from: ("bind", name), ("lit", name) or
        ("default", value)."""
        inputs = matcher.input_names
        lits = set(matcher.literal_names)
        names = [p.name for p in self.placeholders]
        by_name = all(n in inputs or n in lits for n in names)
        out = []
        for i, p in enumerate(self.placeholders):
            name = p.name
            if by_name:
                out.append(("bind", name) if name in inputs else ("lit", name))
            elif i < len(inputs):
                out.append(("bind", inputs[i]))
            elif name in lits:
                out.append(("lit", name))
            elif p.default is not _NO_DEFAULT:
                out.append(("default", p.default))
            else:
                have = ", ".join(sorted(lits)) or "none; use literals='capture'"
                raise ValueError(f"replacement parameter {name!r} is neither a pattern input "
                                 f"({', '.join(inputs)}) nor a captured literal ({have})")
        return out


class _Splicer:
    """Splices replacement copies into one module, keeping track of replaced outputs."""

    def __init__(self, gm: GraphModule, matcher: SubgraphMatcher, templates: Optional["_Templates"] = None):
        self.gm = gm
        self.graph = gm.graph
        self.matcher = matcher
        self.templates = {} if templates is None else templates  # by replacement graph
        self.installed: Dict[tuple, str] = {}  # (template, its attribute) -> name installed in gm
        self.replaced: Dict[Node, Any] = {}  # erased output -> the value now standing for it
        self.next_index: Dict[str, int] = {}  # name base -> next free-looking suffix
        self.n_attrs = 0
        self.fast_args = (self.graph, self._new, self._become, self.replaced, self.graph.erase_node)  # (made once)

    def template(self, obj: Any) -> _Template:
        graph, module = load_pattern(obj)  # cached: fresh closures of one function share a graph
        templates = self.templates
        t = templates.get(graph)
        if t is None or t.module is not module:
            t = templates[graph] = _Template(graph, module, self.matcher)
            if type(templates) is _Templates:
                graph._clean.add(templates.forget)
        return t

    def _resolve(self, v: Any) -> Any:
        replaced = self.replaced
        if not replaced:
            return v

        def follow(n: Node) -> Any:
            while type(n) is Node and n in replaced:
                n = replaced[n]
            return n
        return map_arg(v, follow)

    def refresh(self, match: Match) -> None:
        """Point the match's bindings at what replaced them (outputs of earlier matches)."""
        replaced = self.replaced
        if not replaced:
            return
        b = match.bindings
        for k, v in b.items():
            if type(v) is Node:
                if v in replaced:
                    b[k] = self._resolve(v)
            elif type(v) not in _ATOMS:
                b[k] = self._resolve(v)

    def _new(self, op: str, target: Any, args: tuple, stem: str, meta: dict) -> Node:
        """A new node before the insertion point, named after ``stem`` (asking for a name
        likely to be free: the graph then skips its slow renaming path)."""
        asked = self._free_name(stem)
        new = self.graph._create_flat(op, target, args, asked, meta)
        self._took_name(stem, asked, new.name)
        return new

    def _become(self, node: Node, target: Any, args: tuple, stem: str, kwargs: Optional[dict] = None) -> Node:
        """Make the matched output ``node`` compute the replacement's output instead: it takes
        ``target`` and the arguments, and, when the target changes, a name after ``stem``; it
        keeps its users, position and meta."""
        if node._target is not target:
            graph = self.graph
            graph._retarget(node, target)
            asked = self._free_name(stem)
            self._took_name(stem, asked, graph._rename(node, asked))
        node._set_inputs(args, kwargs or {})
        return node

    def _free_name(self, stem: str) -> str:
        """A name after ``stem`` likely to be free (the graph then skips its slow renaming path)."""
        k = self.next_index.get(stem)
        return stem if k is None else f"{stem}_{k}"

    def _took_name(self, stem: str, asked: str, got: str) -> None:
        """Remember that ``got`` was given when ``asked`` for ``stem``, so the next ask starts
        after it."""
        if got is asked:  # (the namespace hands back the very string it accepted)
            self.next_index[stem] = self.next_index.get(stem, 0) + 1
        elif got == stem:
            self.next_index[stem] = 1
        else:
            head, _, tail = got.rpartition("_")
            if head == stem and tail.isdigit():
                self.next_index[stem] = int(tail) + 1

    def splice(self, match: Match, t: _Template) -> List[Node]:
        """Put one copy of ``t`` in place of ``match``; returns the nodes now standing for the
        replacement's (the caller restores the graph's insertion point)."""
        graph = self.graph
        if t.fast is not None and (match._packed is not None or len(match.outputs) == 1):
            return t.fast(match, *self.fast_args)
        env: Dict[Node, Any] = {}
        bindings = match.bindings
        for ph, (kind, what) in zip(t.placeholders, t.sources):
            if kind == "bind":
                env[ph] = bindings[what]
            elif kind == "lit":
                if what not in match.literals:
                    raise ValueError(f"the replacement needs the literal {what!r}, which this match did not capture")
                env[ph] = match.literals[what]
            else:
                env[ph] = what
        insert = match.insert_point
        new_nodes: List[Node] = []
        base = None
        reused = None
        get = env.__getitem__
        graph._insert_before = insert
        for n, (role, ref), stem in zip(t.body, t.roles, t.bases):
            if role == 0:
                old = match.outputs[ref]
                if t.in_place and old.op == n.op:  # (in_place: n is the one output, computed last)
                    target = self._target(t, n, match) if n.op == "call_module" else n._target
                    kwargs = remap_args(n._kwargs, get) if n._kwargs else {}
                    env[n] = self._become(old, target, remap_args(n._args, get), stem, kwargs)
                    new_nodes.append(old)
                    if reused is None:
                        reused = set()
                    reused.add(old)
                    continue
                meta = dict(old.meta)
            elif role != 2:
                old = match.nodes_map[ref]
                if role == 3 and old.op == n.op and old._target == n._target:
                    # an internal node re-created with the same op: update it in place (it
                    # keeps its name and meta) and move it to the insertion point
                    args = remap_args(n._args, get)
                    kwargs = remap_args(n._kwargs, get) if n._kwargs else {}
                    if not (kwargs or old._kwargs) and _same(args, old._args):
                        pass  # already reads the same values
                    else:
                        old._set_inputs(args, kwargs if (kwargs or old._kwargs) else old._kwargs)
                    if old._next is not insert:
                        insert.prepend(old)
                    if reused is None:
                        reused = set()
                    reused.add(old)
                    env[n] = old
                    new_nodes.append(old)
                    continue
                meta = dict(old.meta)
            else:
                if base is None:
                    base = {k: v for k, v in match.anchor.meta.items() if k != "tensor_meta"}
                meta = dict(base)
            op = n.op
            target = self._target(t, n, match) if op == "get_attr" or op == "call_module" else n._target
            asked = self._free_name(stem)
            new = graph.create_node(op, target, remap_args(n._args, get),
                                    remap_args(n._kwargs, get) if n._kwargs else None, asked, meta)
            self._took_name(stem, asked, new.name)
            env[n] = new
            new_nodes.append(new)
        # outside users of the outputs now read the replacement (with one output, all users
        # are outside: the output is the last matched node)
        outputs = match.outputs
        matched = set(match.nodes) if len(outputs) > 1 else ()
        replaced = self.replaced
        for old, rv in zip(outputs, t.outputs):
            new = env[rv] if type(rv) is Node else remap_args(rv, get)
            if new is old:  # updated in place
                continue
            if type(new) is Node:
                if matched:
                    old.replace_all_uses_with(new, lambda u: u not in matched)
                else:
                    for user in list(old.users):
                        if user is not new:
                            user.replace_input_with(old, new)
            else:  # the replacement returns a constant (or a structure)
                for user in list(old.users):
                    if user not in matched:
                        fn = lambda x, old=old, new=new: new if x is old else x  # noqa: E731
                        user.args = map_arg(user.args, fn)
                        user.kwargs = map_arg(user.kwargs, fn)
            replaced[old] = new
        for w in match.moves:  # readers of outputs that came before the last matched node
            insert.prepend(w)
        erase = graph.erase_node
        for old in reversed(match.nodes):
            if reused is None or old not in reused:
                erase(old)
        return new_nodes

    def _target(self, t: _Template, n: Node, match: Match) -> str:
        """The target in the module for a replacement ``get_attr``/``call_module``: the matched
        one when the pattern names the same attribute, else a copy of the replacement's."""
        bound = t.bound.get((n.op, n.target))
        if bound is not None:
            kind, name = bound
            return (match.nodes_map[name] if kind == "node" else match.bindings[name]).target
        return self._install(t, n.target)

    def _install(self, t: _Template, target: str) -> str:
        """Copy a replacement attribute or submodule into the module (once per template)."""
        name = self.installed.get((t, target))
        if name is not None:
            return name
        if t.module is None:
            raise ValueError(f"the replacement reads {target!r} but has no module to take it from")
        value = t.module
        for part in target.split("."):
            value = getattr(value, part)
        gm = self.gm
        base = "_rewrite_" + target.replace(".", "_").lstrip("_")
        name = base
        while hasattr(gm, name):
            self.n_attrs += 1
            name = f"{base}_{self.n_attrs}"
        if isinstance(value, nn.Parameter):
            gm.register_parameter(name, value)
        elif isinstance(value, nn.Module):
            gm.add_module(name, value)
        elif isinstance(value, torch.Tensor):
            gm.register_buffer(name, value)
        else:
            setattr(gm, name, value)
        self.installed[(t, target)] = name
        return name


def _compile_splice(t: _Template, matcher: SubgraphMatcher) -> Optional[Callable]:
    """Straight-line Python for :meth:`_Splicer.splice` with template ``t``, in the common case:
    one output computed by the body, only ``call_function``/``call_method`` nodes with flat
    positional arguments, and inputs bound to pattern inputs or defaults. It does exactly what
    the general loop does, without its per-node dispatch. None when not applicable.

    ``splice(match, graph, new, become, replaced, erase)`` reads the match as a tuple in
    ``matcher``'s layout (:meth:`Match._pack`: matches of its compiled search already come as
    that tuple); it sets the graph's insertion point to the last matched node;
    ``new(op, target, args, stem, meta)`` makes a node there; ``become(node, target, args,
    stem)`` updates the matched output in place (:meth:`_Splicer._become`)."""
    if len(t.outputs) != 1 or type(t.outputs[0]) is not Node or t.outputs[0] not in t.body:
        return None
    layout = matcher._layout
    node_names, inputs = layout  # (the anchor first: p[0] below)
    for kind, what in t.sources:
        if kind == "bind" and what not in inputs:
            return None
    for kind, _ in t.sources:
        if kind == "lit":
            return None
    for n in t.body:
        if n.op not in ("call_function", "call_method") or n._kwargs:
            return None
        try:
            hash(n._target)
        except TypeError:
            return None
        for a in n._args:
            if type(a) is not Node and type(a) not in _ATOMS:
                return None
    consts = Constants()
    const = consts.name
    var: Dict[Node, str] = {}

    k = len(node_names)
    lines = ["def splice(match, graph, new, become, replaced, erase):",
             "    p = match._packed",
             f"    if p is None or match._layout is not {const(layout)}:",
             f"        p = match._pack({const(layout)})",
             "    insert = graph._insert_before = p[-1]"]
    emit = lines.append
    for i, (ph, (kind, what)) in enumerate(zip(t.placeholders, t.sources)):
        var[ph] = f"e{i}"
        emit(f"    e{i} = p[{k + inputs.index(what)}]" if kind == "bind" else f"    e{i} = {const(what)}")
    if any(role == 2 for role, _ in t.roles):
        emit("    base = {k: v for k, v in match.anchor.meta.items() if k != 'tensor_meta'}")
    reuse = []  # body indices of nodes that may be the matched node, updated in place
    for j, (n, (role, ref), stem) in enumerate(zip(t.body, t.roles, t.bases)):
        names = [var[a] if type(a) is Node else const(a) for a in n._args]
        args = f"({names[0]},)" if len(names) == 1 else f"({', '.join(names)})"
        target = const(n._target)
        make = f"new({n.op!r}, {target}, {args}, {stem!r}, {{meta}})"
        v = var[n] = f"n{j}"
        if role == 0 and t.in_place:
            emit(f"    if insert.op == {n.op!r}:")
            emit(f"        {v} = become(insert, {target}, {args}, {stem!r})")
            emit("    else:")
            emit(f"        {v} = " + make.format(meta="dict(p[0].meta)"))
        elif role == 0:
            emit(f"    {v} = " + make.format(meta="dict(p[0].meta)"))
        elif role == 2:
            emit(f"    {v} = " + make.format(meta="dict(base)"))
        else:
            emit(f"    o{j} = p[{node_names.index(ref)}]")
            if role == 3:
                # an internal node re-created with the same op: update it in place (it keeps
                # its name and meta) and move it to the insertion point
                reuse.append(j)
                emit(f"    if o{j}.op == {n.op!r} and o{j}._target == {target}:")
                same = " and ".join([f"len(o{j}._args) == {len(names)}"] +
                                    [f"o{j}._args[{i}] is {a}" for i, a in enumerate(names)])
                emit(f"        if o{j}._kwargs or not ({same}):")
                emit(f"            o{j}._set_inputs({args}, {{}})")
                emit(f"        if o{j}._next is not insert:")
                emit(f"            insert.prepend(o{j})")
                emit(f"        {v} = r{j} = o{j}")
                emit("    else:")
                emit(f"        r{j} = None")
                emit(f"        {v} = " + make.format(meta=f"dict(o{j}.meta)"))
            else:
                emit(f"    {v} = " + make.format(meta=f"dict(o{j}.meta)"))
    out = var[t.outputs[0]]
    # outside users of the output now read the replacement (all users are outside: the
    # output is the last matched node)
    emit("    old = p[0]  # (the one output: the anchor)")
    emit(f"    if old is not {out}:  # (else updated in place)")
    emit("        for user in list(old.users):")
    emit(f"            if user is not {out}:")
    emit(f"                user.replace_input_with(old, {out})")
    emit(f"        replaced[old] = {out}")
    emit("    for w in match.moves:")
    emit("        insert.prepend(w)")
    emit(f"    for old in p[:{k + len(inputs) - 1}:-1]:  # the matched nodes, last first")
    emit(f"        if {' and '.join([f'old is not r{j}' for j in reuse] + [f'old is not {out}'])}:")
    emit("            erase(old)")
    emit(f"    return [{', '.join(var[n] for n in t.body)}]")
    return define("\n".join(lines), "splice", "splice", consts.namespace)


_ATOMS = frozenset({int, float, bool, str, type(None)})


def _base_name(name: str) -> str:
    """``add_3`` -> ``add``: the stem new node names are derived from."""
    head, _, tail = name.rpartition("_")
    return head if head and tail.isdigit() else name


def _remap(a: Any, env: Dict[Node, Any]) -> Any:
    """Copy a nested argument, replacing replacement-graph nodes by their values in ``env``."""
    return remap_args(a, env.__getitem__)


def _same(a: tuple, b: tuple) -> bool:
    """Whether two argument tuples hold the very same objects."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is not y:
            return False
    return True
