"""Entry guards of version-1 files, which stored them as expression text.

The text is never evaluated: it is parsed with :mod:`ast` and converted, node by node, into a
guard expression tree (:mod:`symtrace.graph.guard_expr`) through its checking constructors. Only
the forms symtrace's tracer wrote convert: input names and ``root``; attribute reads (also as
``getattr(obj, 'name')``); subscripts; constants and tuples/slices of them; ``len``/``list``
and the other guard functions with positional arguments; read-only methods; the
``torch.is_grad_enabled()``-style state reads; ``sys.modules['pkg.mod'].name``; one binary
operator or comparison at a time. Everything else is refused.
"""
from __future__ import annotations

import ast
import io
import tokenize
from typing import Any, Iterable

from ..graph.code_text import UnsafeNameError
from ..graph.guard_expr import Attr, BinOp, Call, Const, GExpr, Global, Input, Item, Method, Root, TorchState
from .errors import SerializationError

__all__ = ["guard_expr_from_text"]

MAX_CHARS = 4000
_BIN = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
        ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^"}
_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Is: "is"}


class _Refused(Exception):
    pass


def guard_expr_from_text(text: Any, inputs: Iterable[str], where: str) -> GExpr:
    """The guard expression tree a version-1 file's guard text stands for; SerializationError
    when the text is anything but the read-only forms listed in the module docstring."""
    if not isinstance(text, str) or not text or len(text) > MAX_CHARS or "\n" in text or "\r" in text:
        raise SerializationError(f"{where}: a guard expression must be one line of 1 to {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
        if any(t.type == tokenize.COMMENT for t in tokenize.generate_tokens(io.StringIO(text).readline)):
            raise _Refused("a comment is not allowed")
        return _convert(tree.body, frozenset(inputs), 0)
    except (SyntaxError, ValueError, RecursionError, MemoryError, tokenize.TokenError, _Refused,
            UnsafeNameError) as e:
        raise SerializationError(f"{where}: refusing the guard expression {text[:200]!r}: {e}") from None


def _convert(n: ast.AST, inputs: frozenset, depth: int) -> GExpr:
    if depth > 64:
        raise _Refused("nested too deeply")
    d = depth + 1
    if isinstance(n, ast.Name):
        if n.id == "root":
            return Root()
        if n.id in inputs:
            return Input(n.id)
        raise _Refused(f"the name {n.id!r} is not an input of the graph")
    if isinstance(n, ast.Attribute):
        base = n.value
        if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Attribute) \
                and isinstance(base.value.value, ast.Name) and base.value.value.id == "sys" \
                and base.value.attr == "modules" and isinstance(base.slice, ast.Constant):
            return Global(base.slice.value, n.attr)
        return Attr(_convert(base, inputs, d), n.attr)
    if isinstance(n, ast.Subscript):
        return Item(_convert(n.value, inputs, d), _convert(n.slice, inputs, d))
    if isinstance(n, (ast.Constant, ast.Tuple, ast.Slice, ast.UnaryOp)):
        return Const(_constant(n, d))
    if isinstance(n, ast.Call):
        if n.keywords:
            raise _Refused("keyword arguments are not allowed")
        f = n.func
        if isinstance(f, ast.Name):
            if f.id == "getattr" and len(n.args) == 2 and isinstance(n.args[1], ast.Constant):
                return Attr(_convert(n.args[0], inputs, d), n.args[1].value)
            return Call(f.id, tuple(_convert(a, inputs, d) for a in n.args))
        if isinstance(f, ast.Attribute):
            if isinstance(f.value, ast.Name) and f.value.id == "torch" and not n.args:
                return TorchState(f.attr)
            return Method(_convert(f.value, inputs, d), f.attr, tuple(_convert(a, inputs, d) for a in n.args))
        raise _Refused("only named functions and methods may be called")
    if isinstance(n, ast.BinOp) and type(n.op) in _BIN:
        return BinOp(_BIN[type(n.op)], _convert(n.left, inputs, d), _convert(n.right, inputs, d))
    if isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in _CMP:
        return BinOp(_CMP[type(n.ops[0])], _convert(n.left, inputs, d), _convert(n.comparators[0], inputs, d))
    raise _Refused(f"{type(n).__name__} is not allowed")


def _constant(n: ast.AST, depth: int) -> Any:
    if depth > 64:
        raise _Refused("nested too deeply")
    if isinstance(n, ast.Constant):
        return n.value
    if isinstance(n, ast.Tuple):
        return tuple(_constant(x, depth + 1) for x in n.elts)
    if isinstance(n, ast.Slice):
        return slice(*(None if x is None else _constant(x, depth + 1) for x in (n.lower, n.upper, n.step)))
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) and isinstance(n.operand, ast.Constant) \
            and type(n.operand.value) in (int, float):
        return -n.operand.value
    raise _Refused(f"{type(n).__name__} is not a constant")
