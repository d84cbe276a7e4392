"""Where a node came from in the user's code: cheap capture of the first frame outside
symtrace and torch, recorded for every node while tracing."""
from __future__ import annotations

import linecache
import os
import sys
from typing import NamedTuple, Optional

from .code_text import one_line  # noqa: F401 - re-exported for the printers

__all__ = ["SourceLocation", "user_location", "add_internal_path", "one_line"]


_SHORT_NAMES: dict = {}


class SourceLocation(NamedTuple):
    """A position in the user's source: file, line and function name, and optionally the
    line's text (stripped). A location with ``text`` (every one loaded from a file) never reads
    ``filename``; one without reads the line through :mod:`linecache` when asked."""

    filename: str
    lineno: int
    function: str = ""
    text: Optional[str] = None

    # ``text`` is a copy of what the file holds, not part of the position: a location loaded
    # from a file equals the traced one it was saved from
    def __eq__(self, other):
        if isinstance(other, SourceLocation):
            return self[0] == other[0] and self[1] == other[1] and self[2] == other[2]
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        if isinstance(other, SourceLocation):
            return self[0] != other[0] or self[1] != other[1] or self[2] != other[2]
        return tuple.__ne__(self, other)

    def __hash__(self) -> int:
        return hash((self[0], self[1], self[2]))

    def __str__(self) -> str:
        return f"{self.short_filename()}:{self.lineno}"

    def short_filename(self) -> str:
        """The file name relative to the working directory when below it, else its base name."""
        path = self.filename
        short = _SHORT_NAMES.get(path)
        if short is None:
            try:
                rel = os.path.relpath(path)
                short = rel if not rel.startswith("..") else os.path.basename(path)
            except ValueError:
                short = os.path.basename(path)
            _SHORT_NAMES[path] = short
        return short

    def line(self) -> str:
        """The text of the source line, stripped ('' when unavailable): ``text`` when set,
        else read through :mod:`linecache`."""
        if self.text is not None:
            return self.text
        return linecache.getline(self.filename, self.lineno).strip()

    def describe(self) -> str:
        """``file:line in function: code`` for error messages."""
        text = self.line()
        where = f"{self}" + (f" in {self.function}" if self.function else "")
        return f"{where}: {text}" if text else where


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


_INTERNAL_PREFIXES: list[str] = []
_LOCATIONS: dict = {}  # (file, line, function) -> its SourceLocation
_internal_cache: dict = {}


def add_internal_path(path: str) -> None:
    """Treat frames from files below ``path`` as library code, not the user's."""
    _INTERNAL_PREFIXES.append(path)
    _internal_cache.clear()


def _init() -> None:
    import torch

    import symtrace

    add_internal_path(_package_dir(symtrace))
    add_internal_path(_package_dir(torch))
    add_internal_path(os.path.dirname(os.path.abspath(__import__("contextlib").__file__)) + os.sep + "contextlib")
    add_internal_path(os.path.abspath(__import__("functools").__file__))


def _is_internal(code) -> bool:
    hit = _internal_cache.get(code)
    if hit is None:
        if not _INTERNAL_PREFIXES:
            _init()
        name = code.co_filename
        hit = name.startswith("<frozen") or any(name.startswith(p) for p in _INTERNAL_PREFIXES)
        _internal_cache[code] = hit
    return hit


def user_location(depth: int = 1, frame=None) -> Optional[SourceLocation]:
    """The innermost frame of the caller's stack (or of ``frame`` and its callers) that is not
    library code, or None."""
    if not _INTERNAL_PREFIXES:
        _init()
    if frame is None:
        frame = sys._getframe(depth)
    cache = _internal_cache
    while frame is not None:
        code = frame.f_code
        internal = cache.get(code)
        if internal is None:
            internal = _is_internal(code)
        if not internal:
            key = (code.co_filename, frame.f_lineno, code.co_name)
            loc = _LOCATIONS.get(key)
            if loc is None:  # one object per line: codegen compares locations by identity first
                if len(_LOCATIONS) > 100_000:
                    _LOCATIONS.clear()
                loc = _LOCATIONS[key] = SourceLocation(code.co_filename, frame.f_lineno, code.co_name)
            return loc
        frame = frame.f_back
    return None
