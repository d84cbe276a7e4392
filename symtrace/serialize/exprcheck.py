"""Allow-list check of entry-guard expressions read from a file.

Entry guards are Python expressions that become code in the generated ``forward`` prologue,
so a file's guard text is parsed with :mod:`ast` and accepted only when it is made of names
(the graph's inputs, ``root``, ``torch``, safe builtins), attribute reads (no dunders),
subscripts, constants, comparisons, boolean and arithmetic operators, and calls of
``len``/``type``/``isinstance``/... or of a few read-only tensor methods (``size``, ``dim``,
``stride``...). ``sys`` may only appear as ``sys.modules['<module>'].<name>`` (global guards).
"""
from __future__ import annotations

import ast
import io
import tokenize
from typing import Iterable

from .errors import SerializationError

__all__ = ["check_guard_expr", "GUARD_BUILTINS", "GUARD_METHODS"]

GUARD_BUILTINS = frozenset({"len", "type", "isinstance", "list", "tuple", "bool", "int", "float", "str",
                            "abs", "min", "max", "getattr", "hasattr", "sorted", "slice"})
GUARD_METHODS = frozenset({"size", "numel", "dim", "ndimension", "is_contiguous", "is_floating_point",
                           "is_complex", "element_size", "get_device", "is_pinned", "storage_offset",
                           "stride", "has_names", "is_signed", "nelement", "data_ptr", "count", "index",
                           "bit_length", "keys", "values", "items"})
_TORCH_CALLS = frozenset({"is_grad_enabled", "get_default_dtype", "is_inference_mode_enabled"})
_OPS = (ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.Subscript, ast.Attribute,
        ast.Name, ast.Constant, ast.Tuple, ast.List, ast.Slice, ast.Call, ast.keyword, ast.Load,
        ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, ast.Invert, ast.Add, ast.Sub, ast.Mult, ast.Div,
        ast.FloorDiv, ast.Mod, ast.Pow, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is,
        ast.IsNot, ast.In, ast.NotIn, ast.BitAnd, ast.BitOr, ast.BitXor)
MAX_EXPR_CHARS = 4000


def check_guard_expr(expr: str, names: Iterable[str], where: str) -> None:
    """Raise SerializationError unless ``expr`` is a guard expression on the allow-list.

    ``names``: the free names it may use besides ``root``, ``torch``, ``sys`` and safe builtins
    (the graph's inputs, the guard's expected-value name)."""
    if not isinstance(expr, str) or not expr or len(expr) > MAX_EXPR_CHARS:
        raise SerializationError(f"{where}: the guard expression is not a string of 1 to {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
        tokens = list(tokenize.generate_tokens(io.StringIO(expr).readline))
    except (SyntaxError, ValueError, tokenize.TokenError, RecursionError, MemoryError) as e:
        raise SerializationError(f"{where}: the guard expression {expr!r} is not valid Python ({e})") from None
    if any(t.type in (tokenize.COMMENT, tokenize.NL) for t in tokens) or "\n" in expr or "\r" in expr:
        raise SerializationError(f"{where}: the guard expression {expr!r} spans lines or holds a comment")
    allowed = set(names) | GUARD_BUILTINS | {"root", "torch", "sys"}
    _check(tree, allowed, expr, where)


def _refuse(expr: str, where: str, what: str) -> None:
    raise SerializationError(
        f"{where}: refusing the guard expression {expr!r}: {what}. Guard expressions become code in "
        "the loaded module's forward, so only names, attribute reads, subscripts, constants, "
        "comparisons, boolean/arithmetic operators and calls of a few safe builtins and read-only "
        "tensor methods are accepted")


def _check(node: ast.AST, allowed: set, expr: str, where: str) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, _OPS):
            _refuse(expr, where, f"{type(n).__name__} is not allowed")
        if isinstance(n, ast.Name):
            if n.id not in allowed:
                _refuse(expr, where, f"the name {n.id!r} is not an input of the graph nor a safe builtin")
            if n.id == "sys":
                _refuse(expr, where, "sys may only be used as sys.modules['<module>'].<name>")
        elif isinstance(n, ast.Attribute):
            if n.attr.startswith("__"):
                _refuse(expr, where, f"the attribute {n.attr!r} is a dunder")
            if _is_sys_modules_read(n.value):
                continue  # sys.modules['mod'].name: a global's value
            if isinstance(n.value, ast.Name) and n.value.id == "sys":
                _refuse(expr, where, "sys may only be used as sys.modules['<module>'].<name>")
        elif isinstance(n, ast.Constant):
            if not isinstance(n.value, (int, float, complex, str, bool, type(None))) and n.value is not Ellipsis:
                _refuse(expr, where, f"the constant {n.value!r} is not a number, string, bool or None")
        elif isinstance(n, ast.Call):
            _check_call(n, expr, where)
        stack.extend(ast.iter_child_nodes(n))


def _is_sys_modules_read(n: ast.AST) -> bool:
    return (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "modules"
            and isinstance(n.value.value, ast.Name) and n.value.value.id == "sys"
            and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str))


def _check_call(n: ast.Call, expr: str, where: str) -> None:
    f = n.func
    if isinstance(f, ast.Name):
        if f.id not in GUARD_BUILTINS:
            _refuse(expr, where, f"calling {f.id!r} is not allowed")
        if f.id in ("getattr", "hasattr"):
            if len(n.args) < 2 or not isinstance(n.args[1], ast.Constant) or not isinstance(n.args[1].value, str) \
                    or n.args[1].value.startswith("__"):
                _refuse(expr, where, f"{f.id} needs a constant attribute name that is not a dunder")
        return
    if isinstance(f, ast.Attribute):
        if isinstance(f.value, ast.Name) and f.value.id == "torch":
            if f.attr not in _TORCH_CALLS:
                _refuse(expr, where, f"calling torch.{f.attr} is not allowed")
            return
        if f.attr in GUARD_METHODS:
            return
        _refuse(expr, where, f"calling the method {f.attr!r} is not allowed")
    _refuse(expr, where, "only named functions and methods may be called")
