"""Python code generation: a graph becomes a readable ``forward`` function.

Each statement carries the user's source line as a comment, values are deleted after their
last use, and the entry guards are checked in one short-circuit test at the top.
"""
from __future__ import annotations

import sys
import linecache
import builtins
import keyword
import math
import operator
import itertools
from typing import Any, Dict, List, NamedTuple

import torch

from .guards import LIVE_GUARD_KINDS, check_data_guard, entry_guard_test, raise_entry_guard_failure
from .node import _NO_DEFAULT, Node, importable_name

__all__ = ["PythonCode", "python_code", "compile_python"]

_BINARY = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
    operator.lshift: "<<", operator.rshift: ">>", operator.and_: "&", operator.or_: "|",
    operator.xor: "^", operator.eq: "==", operator.ne: "!=", operator.lt: "<", operator.le: "<=",
    operator.gt: ">", operator.ge: ">=",
}
_UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}
_counter = itertools.count()


class PythonCode(NamedTuple):
    """Generated source, the globals it needs, and which node each line computes."""

    src: str
    globals: Dict[str, Any]
    line_to_node: Dict[int, Node]


class _Names:
    """Readable, importable names for call targets and constants, bound in the globals."""

    _cache: Dict[Any, str] = {}

    def __init__(self, globals_: Dict[str, Any]):
        self.g = globals_
        self.n_const = 0

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
        key = f"_const_{self.n_const}"
        self.n_const += 1
        self.g[key] = value
        return key


def _literal(a: Any, names: _Names) -> str:
    t = type(a)
    if t is Node:
        return a.name
    if t in (int, bool, str) or a is None or a is Ellipsis:
        return repr(a)
    if t is float:
        if math.isnan(a):
            return "float('nan')"
        if math.isinf(a):
            return "float('inf')" if a > 0 else "-float('inf')"
        return repr(a)
    if t is tuple:
        inner = ", ".join(_literal(x, names) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if t is list:
        return "[" + ", ".join(_literal(x, names) for x in a) + "]"
    if t is dict:
        return "{" + ", ".join(f"{_literal(k, names)}: {_literal(v, names)}" for k, v in a.items()) + "}"
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
        return f"{names.target(t)}({', '.join(_literal(x, names) for x in a)})"
    if isinstance(a, (torch.memory_format, torch.layout)):
        return str(a)
    return names.const(a)


def _attr_path(base: str, qualified: str) -> str:
    out = base
    for part in qualified.split("."):
        ok = part.isidentifier() and not keyword.iskeyword(part)
        out = f"{out}.{part}" if ok else f"getattr({out}, {part!r})"
    return out


def _operand(a: Any, names: "_Names") -> str:
    text = _literal(a, names)
    return f"({text})" if text.startswith("-") else text


def _call_expr(node: Node, names: _Names, me: str = "self") -> str:
    op, target, args, kwargs = node.op, node.target, node.args, node.kwargs
    lit = _literal
    if op == "call_function":
        if not kwargs:
            sym = _BINARY.get(target) if len(args) == 2 else None
            if sym is not None:
                return f"{_operand(args[0], names)} {sym} {_operand(args[1], names)}"
            if target is operator.getitem and len(args) == 2:
                return f"{lit(args[0], names)}[{_index_literal(args[1], names)}]"
            if target is getattr and len(args) == 2 and isinstance(args[1], str) and args[1].isidentifier():
                return f"{lit(args[0], names)}.{args[1]}"
            if len(args) == 1:
                try:
                    usym = _UNARY.get(target)
                except TypeError:
                    usym = None
                if usym is not None:
                    return f"{usym}{_operand(args[0], names)}"
        fn = names.target(target)
        return f"{fn}({_arglist(args, kwargs, names)})"
    if op == "call_method":
        return f"{lit(args[0], names)}.{target}({_arglist(args[1:], kwargs, names)})"
    if op == "call_module":
        return f"{_attr_path(me, target)}({_arglist(args, kwargs, names)})"
    if op == "get_attr":
        return _attr_path(me, target)
    raise AssertionError(op)


def _index_literal(idx: Any, names: _Names) -> str:
    if type(idx) is slice:
        return _slice_text(idx, names)
    if type(idx) is tuple and idx:
        return ", ".join(_slice_text(i, names) if type(i) is slice else _literal(i, names) for i in idx) \
            + ("," if len(idx) == 1 else "")
    return _literal(idx, names)


def _slice_text(s: slice, names: _Names) -> str:
    a = "" if s.start is None else _literal(s.start, names)
    b = "" if s.stop is None else _literal(s.stop, names)
    return f"{a}:{b}" if s.step is None else f"{a}:{b}:{_literal(s.step, names)}"


def _arglist(args, kwargs, names: _Names) -> str:
    parts = [_literal(a, names) for a in args]
    parts.extend(f"{k}={_literal(v, names)}" for k, v in kwargs.items())
    return ", ".join(parts)


_COMMENTS: Dict[Any, str] = {}


def _comment(loc) -> str:
    text = _COMMENTS.get(loc)
    if text is None:
        line = loc.line()
        text = f"    # {loc}: {line}" if line else f"    # {loc}"
        if len(_COMMENTS) > 100_000:
            _COMMENTS.clear()
        _COMMENTS[loc] = text
    return text


def python_code(graph, fn_name: str = "forward") -> PythonCode:
    """Generate the source of ``def forward(self, ...)`` for ``graph``."""
    g: Dict[str, Any] = {"torch": torch, "operator": operator, "math": math, "sys": sys,
                         "_check_data_guard": check_data_guard}
    names = _Names(g)
    _Names._cache.setdefault(check_data_guard, "_check_data_guard")
    nodes = list(graph.nodes)
    last_use: Dict[Node, Node] = {}
    for n in nodes:
        for inp in n._inputs:
            last_use[inp] = n
    frees: Dict[Node, List[str]] = {}
    for value, user in last_use.items():
        if user.op != "output":
            frees.setdefault(user, []).append(value.name)

    placeholders = [n for n in nodes if n.op == "placeholder"]
    me = "_self" if any(n.target.lstrip("*") == "self" for n in placeholders) else "self"
    params: List[str] = []
    body: List[str] = []
    line_to_node: Dict[int, Node] = {}
    for n in placeholders:
        t = n.target
        bare = t.lstrip("*")
        if t.startswith("*") or n.default is _NO_DEFAULT:
            params.append(t)
        else:
            params.append(f"{t}={_literal(n.default, names)}")
        if bare != n.name:
            body.append(f"    {n.name} = {bare}")
        if bare in g or hasattr(builtins, bare):  # the parameter hides a name the code uses
            alias = f"_shadowed_{bare}"
            g[alias] = g[bare] if bare in g else getattr(builtins, bare)
            body.append(f"    {bare} = {alias}")
    own = [gd for gd in graph.guards if gd.kind not in LIVE_GUARD_KINDS]
    live = [gd for gd in graph.guards if gd.kind in LIVE_GUARD_KINDS]
    env = ", ".join(f"{n.name!r}: {n.name}" for n in placeholders)
    for i, guards in enumerate((own, live)):
        if not guards:
            continue
        g[f"_guards{i}"] = guards
        g["_raise_guard"] = raise_entry_guard_failure
        needs_root = i == 1 or any("root" in gd.expr for gd in guards)
        test = entry_guard_test(guards, g, prefix=f"_guard{i}_e")
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
        root_env = ", 'root': root" if needs_root else ""
        body.append(f"{indent}    _raise_guard(_guards{i}, {{{env}{root_env}}}, globals(), prefix='_guard{i}_e')")
    last_loc = None
    for n in nodes:
        op = n.op
        if op == "placeholder":
            continue
        loc = n.meta.get("source")
        if loc is not None and loc != last_loc:
            body.append(_comment(loc))
        last_loc = loc
        if op == "output":
            body.append(f"    return {_literal(n.args[0], names)}")
            line_to_node[len(body)] = n
            continue
        expr = _call_expr(n, names, me)
        if n.users:
            body.append(f"    {n.name} = {expr}")
        else:
            body.append(f"    {expr}")
        line_to_node[len(body)] = n
        dead = frees.get(n)
        if dead:
            body.append(f"    del {', '.join(dead)}")
    if not nodes or nodes[-1].op != "output":
        body.append("    return None")
    head = f"def {fn_name}({me}{', ' if params else ''}{', '.join(params)}):"
    src = head + "\n" + "\n".join(body) + "\n"
    # line numbers: line 1 is the def; body line k is source line k + 1
    return PythonCode(src, g, {k + 1: v for k, v in line_to_node.items()})


def compile_python(code: PythonCode, fn_name: str = "forward"):
    """Compile generated code into a function; its source is visible to tracebacks."""
    filename = f"<symtrace-{fn_name}-{next(_counter)}>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
    exec(compile(code.src, filename, "exec"), code.globals)
    fn = code.globals[fn_name]
    fn.__symtrace_lines__ = code.line_to_node
    return fn
