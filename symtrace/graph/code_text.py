"""The one place where names and free text become parts of generated source.

Every generator of code (a graph's ``forward``, the lowering wrapper and kernels, the matcher's
and rewriter's compiled searches) writes names only through :func:`check_identifier` (or
:func:`attr_access`), literals with ``repr``, and comments through :func:`comment_text`. A
name that is not an identifier is refused with :class:`UnsafeNameError`, naming what it was
meant to be; text in comments is cut to one printable line. So no string a program, a pass or
a file hands us can add a statement to generated code.
"""
from __future__ import annotations

import keyword
import re
from typing import Any

from ..errors import SymtraceError

__all__ = ["UnsafeNameError", "is_identifier", "check_identifier", "attr_access", "comment_text",
           "one_line", "CONTROL_CHARS", "MAX_NESTING"]


class UnsafeNameError(SymtraceError, ValueError):
    """A name that would be written into generated code is not a Python identifier (or is a
    keyword, or a dunder where those are refused)."""


def is_identifier(name: Any) -> bool:
    """Whether ``name`` can be written into code as a variable, parameter or attribute name."""
    return type(name) is str and name.isidentifier() and not keyword.iskeyword(name)


def check_identifier(name: Any, what: str) -> str:
    """``name`` itself when it is an identifier that is not a keyword; else UnsafeNameError
    saying that ``what`` (e.g. "a node name") must be one."""
    if type(name) is str and name.isidentifier() and not keyword.iskeyword(name):
        return name
    raise UnsafeNameError(f"{what} must be a Python identifier that is not a keyword, got {name!r}; "
                          "symtrace writes it into generated code and refuses anything else")


def attr_access(base: str, name: str) -> str:
    """``base.name``, or ``getattr(base, 'name')`` when ``name`` is not an identifier."""
    if type(name) is str and name.isidentifier() and not keyword.iskeyword(name):
        return f"{base}.{name}"
    if type(name) is not str:
        raise UnsafeNameError(f"an attribute name must be a string, got {type(name).__name__}")
    return f"getattr({base}, {name!r})"


#: How deeply containers may nest in one generated expression (CPython's parser stops at 200
#: nested brackets); deeper structures are refused with a clear error where they are made
#: (measured with :func:`~symtrace.graph.tree.tree_depth`).
MAX_NESTING = 100


#: control characters (C0, DEL, C1) and the characters ``str.splitlines`` breaks lines at
CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_COMMENT_CHARS = 300


def one_line(text: Any, limit: int = 4096) -> str:
    """``text`` as one printable line: control characters and line breaks become ``?``, and
    it is cut to ``limit`` characters."""
    text = CONTROL_CHARS.sub("?", str(text))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def comment_text(text: Any) -> str:
    """``text`` made safe to follow ``#`` in generated code (one printable line of at most
    :data:`MAX_COMMENT_CHARS` characters)."""
    return one_line(text, MAX_COMMENT_CHARS)
