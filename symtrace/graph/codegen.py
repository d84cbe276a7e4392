"""Python code generation: a graph becomes a readable ``forward`` function.

Each statement carries the user's source line as a comment, values are deleted after their
last use, and the entry guards are checked in one short-circuit test at the top.

A value used once, by the next operation of the same source line, is written inline in that
operation's expression (``relu = torch.relu(self.fc(x))``, as the user wrote it) when that
keeps the order in which operations run exactly as in the graph. Fewer statements make the
code shorter to read and cheaper for CPython to compile. Error notes still name the inner
operation that failed: each inlined node's columns are recorded (``PythonCode.spans``).

Compiled code objects are cached by source text, so regenerating an unchanged graph (a copy,
an unpickled module, a re-capture) does not compile again.
"""
from __future__ import annotations

import sys
import linecache
import builtins
import keyword
import math
import operator
import itertools
import re
from collections import OrderedDict
from collections.abc import Mapping
from types import FunctionType
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from .code_text import MAX_NESTING, UnsafeNameError, attr_access, check_identifier, comment_text, is_identifier
from .guards import check_data_guard, entry_guard_test, needs_live_root, raise_entry_guard_failure
from .replay import ROOT_HELPERS
from .node import _NO_DEFAULT, Node, importable_name
from .tree import tree_depth

__all__ = ["PythonCode", "python_code", "compile_python", "compile_cached", "clear_code_cache", "check_code_names"]

_BINARY = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
    operator.lshift: "<<", operator.rshift: ">>", operator.and_: "&", operator.or_: "|",
    operator.xor: "^", operator.eq: "==", operator.ne: "!=", operator.lt: "<", operator.le: "<=",
    operator.gt: ">", operator.ge: ">=",
}
_UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}
#: call_function targets written as Python syntax: target -> (number of arguments, symbol);
#: symbol "[" is indexing, "." attribute access
_SYNTAX: Dict[Any, Tuple[int, str]] = {**{f: (2, s) for f, s in _BINARY.items()},
                                       **{f: (1, s) for f, s in _UNARY.items()},
                                       operator.getitem: (2, "["), getattr: (2, ".")}
_counter = itertools.count()

#: An inlined expression is at most this long (longer values get their own statement).
MAX_INLINE_CHARS = 100
_INLINABLE_OPS = frozenset({"call_function", "call_method", "call_module", "get_attr"})
_NOT_IDENT = re.compile(r"[^0-9a-zA-Z_]")
_MARK = "\x00"  # brackets an inlined value's index when _Spans writes a line again (never in code)


class PythonCode(NamedTuple):
    """Generated source, the globals it needs, and which node each line computes.

    ``spans``: for lines that compute several nodes (inlined values), ``line -> [(start,
    end, node)]``, the character columns of each inlined node's expression."""

    src: str
    globals: Dict[str, Any]
    line_to_node: Dict[int, Node]
    spans: Optional[Mapping] = None  # line -> [(start, end, node)], computed on access


class _Names:
    """Readable, importable names for call targets and constants, bound in the globals."""

    _cache: Dict[Any, str] = {}

    def __init__(self, globals_: Dict[str, Any]):
        self.g = globals_
        self.n_const = 0
        # pending values a consumer may write inline: node -> (text, is an operator
        # expression that needs parentheses as an operand)
        self.sub: Dict[Node, Tuple[str, bool]] = {}
        self.refs: List[Node] = []  # pending values written inline so far, in order
        self.replay = False  # True: constants must already be bound in the globals (_Spans)
        self.me = "self"
        self.aliases: Dict[str, str] = {}  # submodule path -> local variable holding it
        self.attrs: Dict[str, str] = {}  # call_module/get_attr target -> expression

    def alias_modules(self, nodes: List[Node], taken: set) -> List[Tuple[str, Node]]:
        """Local names for submodules whose children are used more than once and that take
        more than one attribute step to reach (``_m_layer1_0 = getattr(self.layer1, '0')``):
        shorter code, read once per call. Returns the assignment lines, each with the first
        node that uses it."""
        counts: Dict[str, int] = {}
        first: Dict[str, Node] = {}
        for n in nodes:
            op = n.op
            if op == "call_module" or op == "get_attr":
                t = n._target
                if type(t) is str:
                    c = t.rpartition(".")[0]
                    if c in counts:
                        counts[c] += 1
                    elif c:
                        counts[c] = 1
                        first[c] = n
        chosen = []
        for c, k in counts.items():
            if k >= 2:
                path = _attr_path(self.me, c)
                if "getattr(" in path or path.count(".") >= 2:
                    chosen.append(c)
        chosen.sort(key=lambda c: c.count("."))  # outer ones first: inner ones start from them
        lines = []
        aliases = self.aliases
        for c in chosen:
            base, rest = self.me, c
            head, _, tail = c.rpartition(".")
            while head:
                if head in aliases:
                    base, rest = aliases[head], c[len(head) + 1:]
                    break
                head = head.rpartition(".")[0]
            name = "_m_" + _NOT_IDENT.sub("_", c)
            while name in taken or name in self.g:
                name += "_"
            taken.add(name)
            aliases[c] = name
            lines.append((f"    {name} = {_attr_path(base, rest)}", first[c]))
        return lines

    def attr(self, target: str) -> str:
        """The expression reading submodule or attribute ``target``."""
        text = self.attrs.get(target)
        if text is None:
            c, _, leaf = target.rpartition(".")
            a = self.aliases.get(c) if c else None
            text = _attr_path(self.me, target) if a is None else _attr_path(a, leaf)
            self.attrs[target] = text
        return text

    def target(self, fn: Any) -> str:
        try:
            name = _Names._cache.get(fn)
        except TypeError:
            name = None
        if name is None:
            name = importable_name(fn)
            if name is not None:
                try:
                    _Names._cache[fn] = name
                except TypeError:
                    pass
        if name is not None:
            return name
        base = getattr(fn, "__name__", "fn")
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in base)
        key = f"_fn_{base}"
        i = 0
        while key in self.g and self.g[key] is not fn:
            i += 1
            key = f"_fn_{base}_{i}"
        self.g[key] = fn
        return key

    def const(self, value: Any) -> str:
        if self.replay:
            for key, v in self.g.items():
                if v is value and key.startswith("_const_"):
                    return key
            raise LookupError("constant not bound")
        key = f"_const_{self.n_const}"
        self.n_const += 1
        self.g[key] = value
        return key


_REPR_TYPES = frozenset({int, bool, str, type(None), type(Ellipsis)})


def _literal(a: Any, names: _Names) -> str:
    t = type(a)
    if t is Node:
        s = names.sub.get(a)
        if s is None:
            return a.name
        names.refs.append(a)
        return s[0]
    if t in _REPR_TYPES:
        return repr(a)
    if t is float:
        if a - a == 0.0:  # finite
            return repr(a)
        if a != a:
            return "float('nan')"
        return "float('inf')" if a > 0 else "-float('inf')"
    if t is tuple:
        inner = ", ".join([_literal(x, names) for x in a])
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if t is list:
        return "[" + ", ".join([_literal(x, names) for x in a]) + "]"
    if t is dict:
        return "{" + ", ".join([f"{_literal(k, names)}: {_literal(v, names)}" for k, v in a.items()]) + "}"
    if t is slice:
        return f"slice({_literal(a.start, names)}, {_literal(a.stop, names)}, {_literal(a.step, names)})"
    if t is torch.dtype:
        return str(a)
    if t is torch.device:
        return f"torch.device({str(a)!r})"
    if t is torch.Size:
        return f"torch.Size({_literal(list(a), names)})"
    if t is complex:
        return f"complex({_literal(a.real, names)}, {_literal(a.imag, names)})"
    if isinstance(a, tuple) and hasattr(a, "_fields"):  # namedtuple: rebuild it
        return f"{names.target(t)}({', '.join([_literal(x, names) for x in a])})"
    if isinstance(a, (torch.memory_format, torch.layout)):
        return str(a)
    return names.const(a)


_ATTR_PATHS: Dict[Tuple[str, str], str] = {}


def _attr_path(base: str, qualified: str) -> str:
    key = (base, qualified)
    out = _ATTR_PATHS.get(key)
    if out is None:
        out = base
        for part in qualified.split("."):
            out = attr_access(out, part)
        if len(_ATTR_PATHS) > 100_000:
            _ATTR_PATHS.clear()
        _ATTR_PATHS[key] = out
    return out


def _node_operand(a: Node, names: "_Names") -> str:
    """Node ``a``'s name, or its inlined expression (parenthesised if it is an operator one)."""
    s = names.sub.get(a)
    if s is None:
        return a.name
    names.refs.append(a)
    return f"({s[0]})" if s[1] else s[0]


def _operand(a: Any, names: "_Names") -> str:
    """``a`` as an operand of an operator."""
    if type(a) is Node:
        return _node_operand(a, names)
    text = _literal(a, names)
    return f"({text})" if text.startswith("-") else text


def _receiver(a: Any, names: "_Names") -> str:
    """``a`` as the object of ``.attr``, ``.method()`` or ``[i]``."""
    if type(a) is Node:
        return _node_operand(a, names)
    text = _literal(a, names)
    return f"({text})" if text[:1] == "-" or text[:1].isdigit() else text


def _call_expr(node: Node, names: _Names) -> Tuple[str, bool]:
    """The expression computing ``node``, and whether it is an operator expression (which
    needs parentheses where it is an operand)."""
    op = node.op
    target = node._target
    args = node._args
    kwargs = node._kwargs
    if op == "call_function":
        try:
            syntax = _SYNTAX.get(target)
        except TypeError:
            syntax = None
        if syntax is not None and not kwargs and len(args) == syntax[0]:
            sym = syntax[1]
            if sym == "[":
                return f"{_receiver(args[0], names)}[{_index_literal(args[1], names)}]", False
            if sym == ".":
                if type(args[1]) is str and args[1].isidentifier() and not keyword.iskeyword(args[1]):
                    return f"{_receiver(args[0], names)}.{args[1]}", False
            elif len(args) == 1:
                return f"{sym}{_operand(args[0], names)}", True
            else:
                a, b = args
                # (nodes and plain numbers written directly: the common operands)
                a = _node_operand(a, names) if type(a) is Node else _operand(a, names)
                tb = type(b)
                if tb is Node:
                    b = _node_operand(b, names)
                elif (tb is float or tb is int) and b >= 0 and b - b == 0:
                    b = repr(b)
                else:
                    b = _operand(b, names)
                return f"{a} {sym} {b}", True
        try:
            fn = _Names._cache.get(target) or names.target(target)
        except TypeError:
            fn = names.target(target)
        if type(target) is FunctionType and target in ROOT_HELPERS:  # a replayed side effect
            return f"{fn}({names.me}.guard_root or {names.me}, {_arglist(args, kwargs, names)})", False
        return f"{fn}({_arglist(args, kwargs, names)})", False
    if op == "call_method":
        if not (type(target) is str and target.isidentifier() and not keyword.iskeyword(target)):
            check_identifier(target, f"the method name of node {node.name!r}")
        a = args[0]
        a = _node_operand(a, names) if type(a) is Node else _receiver(a, names)
        return f"{a}.{target}({_arglist(args[1:], kwargs, names)})", False
    if op == "call_module":
        return f"{names.attr(target)}({_arglist(args, kwargs, names)})", False
    if op == "get_attr":
        return names.attr(target), False
    raise AssertionError(op)


def _index_literal(idx: Any, names: _Names) -> str:
    if type(idx) is slice:
        return _slice_text(idx, names)
    if type(idx) is tuple and idx:
        return ", ".join([_slice_text(i, names) if type(i) is slice else _literal(i, names) for i in idx]) \
            + ("," if len(idx) == 1 else "")
    return _literal(idx, names)


def _slice_text(s: slice, names: _Names) -> str:
    a = "" if s.start is None else _literal(s.start, names)
    b = "" if s.stop is None else _literal(s.stop, names)
    return f"{a}:{b}" if s.step is None else f"{a}:{b}:{_literal(s.step, names)}"


def _arglist(args, kwargs, names: _Names) -> str:
    sub = names.sub
    parts = []
    for a in args:  # (the common arguments written out: nodes and plain numbers)
        t = type(a)
        if t is Node:
            parts.append(_literal(a, names) if sub and a in sub else a.name)
        elif t is int or (t is float and a - a == 0.0):
            parts.append(repr(a))
        else:
            parts.append(_literal(a, names))
    if kwargs:
        odd = None
        for k, v in kwargs.items():
            if type(k) is str and k.isidentifier() and not keyword.iskeyword(k):
                parts.append(f"{k}={_literal(v, names)}")
            else:  # not an identifier: passed by a dict literal, its key quoted
                odd = [] if odd is None else odd
                odd.append(f"{_literal(k, names)}: {_literal(v, names)}")
        if odd:
            parts.append("**{" + ", ".join(odd) + "}")
    return ", ".join(parts)


_COMMENTS: Dict[Any, str] = {}


def _comment(loc) -> str:
    key = (loc, loc.text)  # equal locations may carry different text (traced / loaded)
    text = _COMMENTS.get(key)
    if text is None:
        line = loc.line()
        text = comment_text(f"{loc}: {line}" if line else f"{loc}")
        text = f"    # {text}"
        if len(_COMMENTS) > 100_000:
            _COMMENTS.clear()
        _COMMENTS[key] = text
    return text


def python_code(graph, fn_name: str = "forward") -> PythonCode:
    """Generate the source of ``def forward(self, ...)`` for ``graph``."""
    g: Dict[str, Any] = {"torch": torch, "operator": operator, "math": math, "sys": sys,
                         "_check_data_guard": check_data_guard}
    names = _Names(g)
    _Names._cache.setdefault(check_data_guard, "_check_data_guard")
    nodes = list(graph.nodes)
    check_code_names(nodes)

    placeholders = [n for n in nodes if n.op == "placeholder"]
    me = "_self" if any(n.target.lstrip("*") == "self" for n in placeholders) else "self"
    names.me = me
    params: List[str] = []
    head: List[str] = []
    for n in placeholders:
        t = n.target
        bare = t.lstrip("*")
        if t.startswith("*") or n.default is _NO_DEFAULT:
            params.append(t)
        else:
            params.append(f"{t}={_literal(n.default, names)}")
        if bare != n.name:
            head.append(f"    {n.name} = {bare}")
        if bare in g or hasattr(builtins, bare):  # the parameter hides a name the code uses
            alias = f"_shadowed_{bare}"
            g[alias] = g[bare] if bare in g else getattr(builtins, bare)
            head.append(f"    {bare} = {alias}")
    head.extend(_guard_prologue(graph, g, placeholders, me))
    alias_lines = names.alias_modules(nodes, {n.target.lstrip("*") for n in placeholders})
    line_to_node: Dict[int, Node] = {}
    for text, first_user in alias_lines:
        head.append(text)
        line_to_node[len(head) + 1] = first_user

    stmts, inlined = _statements(nodes, names)
    roots = _write(stmts, inlined, head, line_to_node)
    append = head.append
    if not nodes or nodes[-1].op != "output":
        append("    return None")
    src = f"def {fn_name}({me}{', ' if params else ''}{', '.join(params)}):\n" + "\n".join(head) + "\n"
    return PythonCode(src, g, line_to_node, _Spans(roots, inlined, head, names) if roots else None)


_PARAMETER = re.compile(r"\*{0,2}[^\W\d]\w*")
_KEYWORDS = frozenset(keyword.kwlist)


def check_code_names(nodes) -> None:
    """Refuse node names, input names and method names that are not identifiers: they become
    variables, parameters and attribute reads of generated code (:mod:`.code_text`). Every code
    generator over a graph (``forward``, the lowering wrapper) calls this first."""
    keywords = _KEYWORDS
    for n in nodes:
        name = n.name
        if type(name) is not str or not name.isidentifier() or name in keywords:
            check_identifier(name, f"the name of a {n.op} node")
        op = n.op
        if op == "call_function" or op == "call_module" or op == "get_attr":
            continue
        if op == "output" and tree_depth(n._args, MAX_NESTING + 2) > MAX_NESTING + 1:
            raise UnsafeNameError(f"the graph's output nests containers more than {MAX_NESTING} levels deep; "
                                  "generated Python cannot write it (flatten the output)")
        if op == "placeholder":
            t = n.target
            if type(t) is not str or not _PARAMETER.fullmatch(t) or not is_identifier(t.lstrip("*")):
                raise UnsafeNameError(f"the input name of placeholder {name!r} must be an identifier (with * or ** "
                                      f"for variadic inputs), got {t!r}")
        elif n.op == "call_method" and not is_identifier(n.target):
            check_identifier(n.target, f"the method name of node {name!r}")


def _guard_prologue(graph, g: Dict[str, Any], placeholders: List[Node], me: str) -> List[str]:
    """The lines checking the entry guards: one short-circuit test per group."""
    body: List[str] = []
    guards = graph.guards
    if not guards:
        return body
    own = [gd for gd in guards if not needs_live_root(gd)]
    live = [gd for gd in guards if needs_live_root(gd)]
    env = ", ".join(f"{n.name!r}: {n.name}" for n in placeholders)
    for i, group in enumerate((own, live)):
        if not group:
            continue
        g[f"_guards{i}"] = group
        g["_raise_guard"] = raise_entry_guard_failure
        needs_root = i == 1 or any(gd.reads_root() for gd in group)
        test = entry_guard_test(group, g, prefix=f"_guard{i}_e", share=f"_gv{i}_")
        indent = "    "
        if i == 1:  # only when running against a live model (symtrace.capture)
            body.append(f"    root = {me}.guard_root")
            body.append("    if root is not None:")
            indent = "        "
        body.append(f"{indent}try:")
        if needs_root and i == 0:
            body.append(f"{indent}    root = {me}.guard_root or {me}")
        body.append(f"{indent}    _ok = {test}")
        body.append(f"{indent}except Exception:")
        body.append(f"{indent}    _ok = False")
        body.append(f"{indent}if not _ok:")
        entries = ([env] if env else []) + (["'root': root"] if needs_root else [])
        body.append(f"{indent}    _raise_guard(_guards{i}, {{{', '.join(entries)}}}, globals(), prefix='_guard{i}_e')")
    return body


def _statements(nodes: List[Node], names: _Names) -> Tuple[list, set]:
    """The statements of the body, in order: ``(node, text, tree, loc)`` each, a node's
    expression with the inputs written inline, the nodes it computes in evaluation order,
    ending with ``node`` (None: only ``node``), and its source location. Also returns the set
    of inlined nodes.

    A value is held back (pending) when it is used once, by a node of the same source line;
    its user writes it inline when the pending values it reads are exactly the last ones held
    back, in the order its expression evaluates them (so every node still runs in graph
    order). Otherwise, or when a statement comes first, the pending values become statements.
    """
    stmts: list = []
    statement = stmts.append
    inlined: set = set()
    pending: list = []  # (node, text, tree, loc), in graph order
    sub = names.sub  # pending node -> (text, is an operator expression)
    refs = names.refs  # the pending nodes the expression just built wrote inline, in order
    inlinable = _INLINABLE_OPS
    max_chars = MAX_INLINE_CHARS
    call_expr = _call_expr

    def flush():  # the pending values become statements
        stmts.extend(pending)
        pending.clear()
        sub.clear()

    for n in nodes:
        op = n.op
        if op == "placeholder":
            continue
        if op == "output":
            text, is_op = _literal(n._args[0], names), False
        else:
            text, is_op = call_expr(n, names)
        tree = None
        if refs:
            k = len(refs)
            if k == 1:  # the common case: one value written inline
                cn = refs[0]
                ok = pending[-1][0] is cn
                if ok:
                    tree = pending.pop()[2]
                    del sub[cn]
                    inlined.add(cn)
                    if tree is None:
                        tree = [cn, n]
                    else:
                        tree.append(n)
            else:
                base = len(pending) - k
                ok = base >= 0
                if ok:
                    for i in range(k):
                        if pending[base + i][0] is not refs[i]:
                            ok = False
                            break
                if ok:
                    tree = []
                    for cn, _, ctree, _ in pending[base:]:
                        if ctree is None:
                            tree.append(cn)
                        else:
                            tree.extend(ctree)
                        del sub[cn]
                        inlined.add(cn)
                    del pending[base:]
                    tree.append(n)
            refs.clear()
            if not ok:  # the order does not allow writing them inline: they become statements
                tree = None
                flush()
                text, is_op = call_expr(n, names)
        loc = n.meta.get("source")
        users = n.users
        if len(users) == 1 and op in inlinable and len(text) <= max_chars:
            (user,) = users
            src = user.meta.get("source")
            if user.op != "output" and (src is loc or src == loc):
                sub[n] = (text, is_op)
                pending.append((n, text, tree, loc))
                continue
        if pending:  # values held back but not used here: they run first
            flush()
        statement((n, text, tree, loc))
    flush()  # only possible for a graph without output
    return stmts, inlined


def _write(stmts: list, inlined: set, lines: List[str], line_to_node: Dict[int, Node]) -> Dict[int, Node]:
    """Append the statements' lines: the source comment when the location changes, the
    statement, and a ``del`` of the values it read for the last time (counted down from their
    users). Returns ``line -> node`` for the lines with inlined values."""
    append = lines.append
    spans: Dict[int, Node] = {}
    left: Dict[Node, int] = {}  # value -> users not written yet
    last_loc = None
    for n, text, tree, loc in stmts:
        if loc is not last_loc:
            if loc is not None and loc != last_loc:
                append(_COMMENTS.get((loc, loc.text)) or _comment(loc))
            last_loc = loc
        if n.users:
            append(f"    {n.name} = {text}")
        elif n.op == "output":
            append("    return " + text)
            line_to_node[len(lines) + 1] = n  # line 1 is the def
            if tree is not None:
                spans[len(lines) + 1] = n
            continue  # returned values are not deleted
        else:
            append("    " + text)
        line = len(lines) + 1
        line_to_node[line] = n
        dead = None
        if tree is not None:
            spans[line] = n  # columns worked out when asked (_Spans)
        for m in (n,) if tree is None else tree:
            for inp in m._inputs:
                k = left.get(inp)
                k = (len(inp.users) if k is None else k) - 1
                if k:
                    left[inp] = k
                elif inp not in inlined:  # (inlined values are not variables)
                    if dead is None:
                        dead = [inp.name]
                    else:
                        dead.append(inp.name)
        if dead:
            append(f"    del {', '.join(dead)}")
    return spans


class _Spans(Mapping):
    """``line -> [(start, end, node)]`` for the lines with inlined values: the character
    columns of each inlined node's expression. Only error notes need them, so each line's
    columns are worked out on first access, by writing its expressions again with markers
    where the inlined values go; a line whose nodes have been edited since (so its text no
    longer comes out the same) gets no columns."""

    __slots__ = ("_roots", "_inlined", "_lines", "_names", "_done")

    def __init__(self, roots: Dict[int, Node], inlined: set, lines: List[str], names: _Names):
        self._roots = roots  # line -> the node it assigns (or returns)
        self._inlined = inlined
        self._lines = lines  # the body: line k of the source is lines[k - 2]
        self._names = names
        self._done: Dict[int, list] = {}

    def __getitem__(self, line: int) -> list:
        out = self._done.get(line)
        if out is None:
            root = self._roots[line]
            try:
                out = _line_spans(root, self._inlined, self._lines[line - 2], self._names)
            except Exception:  # (a node edited or erased since: no columns)
                out = []
            self._done[line] = out
        return out

    def __contains__(self, line: object) -> bool:
        return line in self._roots

    def __iter__(self):
        return iter(self._roots)

    def __len__(self) -> int:
        return len(self._roots)


def _line_spans(root: Node, inlined: set, line: str, names: _Names) -> list:
    """``(start, end, node)`` columns in ``line`` of the nodes written inline in ``root``'s
    expression, or [] when writing that expression again does not give ``line``."""
    replay = _Names(dict(names.g))
    replay.me, replay.aliases, replay.attrs, replay.replay = names.me, names.aliases, names.attrs, True
    marks: List[Node] = []

    def expression(m: Node) -> Tuple[str, list, bool]:
        """``m``'s text with its inlined inputs written out, their columns within it, and
        whether it is an operator expression."""
        inner = {}
        for inp in m._inputs:
            if inp in inlined:
                ct, deeper, is_op = expression(inp)
                inner[inp] = ct, deeper
                replay.sub[inp] = (f"{_MARK}{len(marks)}{_MARK}", is_op)
                marks.append(inp)
        if m.op == "output":
            text, is_op = _literal(m._args[0], replay), False
        else:
            text, is_op = _call_expr(m, replay)
        for inp in inner:
            del replay.sub[inp]
        parts = text.split(_MARK)
        out, cols = [parts[0]], []
        col = len(parts[0])
        for j in range(1, len(parts), 2):
            cn = marks[int(parts[j])]
            ct, deeper = inner.pop(cn)  # (a value written twice raises: no columns)
            cols.extend([(s + col, e + col, x) for s, e, x in deeper])
            cols.append((col, col + len(ct), cn))
            col += len(ct) + len(parts[j + 1])
            out.append(ct)
            out.append(parts[j + 1])
        if inner:  # an inlined input not written: the graph changed
            raise LookupError("inlined value not in its user's expression")
        return "".join(out), cols, is_op

    text, cols, _ = expression(root)
    if root.op == "output":
        head = "    return "
    elif line.startswith(f"    {root.name} = "):
        head = f"    {root.name} = "
    else:
        head = "    "
    if line != head + text:
        return []
    width = len(head)
    return [(s + width, e + width, x) for s, e, x in cols]


# --- compiling ---------------------------------------------------------------------------------
#: source text -> (code object, file name, lines); least recently used first
_CODE_CACHE: "OrderedDict[str, Tuple[Any, str, List[str]]]" = OrderedDict()
_CODE_CACHE_MAX_ENTRIES = 256
_CODE_CACHE_MAX_CHARS = 64 * 2 ** 20
_code_cache_chars = 0


def clear_code_cache() -> None:
    """Forget the compiled code objects (the next recompile of any graph compiles again)."""
    global _code_cache_chars
    _CODE_CACHE.clear()
    _code_cache_chars = 0


def compile_cached(src: str, label: str):
    """The code object of module source ``src``, compiled once per text (bounded, least
    recently used dropped first). Its file name, ``<symtrace-{label}-N>``, has the source in
    ``linecache``, so tracebacks show the generated lines. Used for ``forward`` and for the
    code passes generate (the matcher's and the rewriter's)."""
    global _code_cache_chars
    hit = _CODE_CACHE.get(src)
    if hit is None:
        filename = f"<symtrace-{label}-{next(_counter)}>"
        hit = (compile(src, filename, "exec"), filename, src.splitlines(True))
        _CODE_CACHE[src] = hit
        _code_cache_chars += len(src)
        while len(_CODE_CACHE) > _CODE_CACHE_MAX_ENTRIES or \
                (_code_cache_chars > _CODE_CACHE_MAX_CHARS and len(_CODE_CACHE) > 1):
            old, _ = _CODE_CACHE.popitem(last=False)
            _code_cache_chars -= len(old)
    else:
        _CODE_CACHE.move_to_end(src)
    compiled, filename, lines = hit
    linecache.cache[filename] = (len(src), None, lines, filename)
    return compiled


def compile_python(code: PythonCode, fn_name: str = "forward"):
    """Compile generated code into a function (:func:`compile_cached`: the same source compiles
    once, each call still gets its own globals, tracebacks show the source)."""
    exec(compile_cached(code.src, fn_name), code.globals)
    fn = code.globals[fn_name]
    fn.__symtrace_lines__ = code.line_to_node
    fn.__symtrace_spans__ = code.spans
    return fn


def node_at(fn, lineno: int, lasti: int = -1, code=None) -> Optional[Node]:
    """The node a generated function ``fn`` was computing at line ``lineno`` (and bytecode
    offset ``lasti`` of its code object ``code``, which picks the inlined expression that was
    running), or None."""
    lines = getattr(fn, "__symtrace_lines__", None)
    if lines is None:
        return None
    node = lines.get(lineno)
    spans = getattr(fn, "__symtrace_spans__", None)
    if node is None or not spans or lineno not in spans or lasti < 0:
        return node
    code = fn.__code__ if code is None else code
    try:
        pos = next(itertools.islice(code.co_positions(), lasti // 2, None))
    except (AttributeError, StopIteration):
        return node
    _, end_line, col, end_col = pos
    if col is None or end_col is None or end_line != lineno:
        return node
    text = linecache.getline(code.co_filename, lineno)
    if text:  # columns are UTF-8 byte offsets
        raw = text.encode("utf-8")
        col = len(raw[:col].decode("utf-8", "ignore"))
        end_col = len(raw[:end_col].decode("utf-8", "ignore"))
    best = None
    for s, t, n in spans[lineno]:
        if s <= col and end_col <= t and (best is None or t - s < best[1] - best[0]):
            best = (s, t, n)
    return node if best is None else best[2]
