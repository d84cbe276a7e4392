"""Compiling the straight-line Python that the matcher and the rewriter generate per pattern.

The generated source names its constants (``k1``, ``k2``, ...) instead of embedding them, so
two matchers for the same pattern shape generate the same text; the code object is cached by
that text and each caller executes it in its own namespace. Compiling costs ~0.7 ms, more than
matching a small graph.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from ..graph.codegen import compile_cached


def define(src: str, label: str, name: str, namespace: Dict[str, Any]) -> Callable:
    """Run ``src`` (which defines function ``name``) in ``namespace`` and return the function.
    The code object is shared by every caller with the same text (the graph's code cache,
    :func:`~symtrace.graph.codegen.compile_cached`; tracebacks show the source)."""
    exec(compile_cached(src, label), namespace)
    return namespace[name]


class Constants:
    """The names generated code reads: ``namespace`` (a plain dict: CPython only specializes
    global reads of an exact dict) and :meth:`name`, which binds an object to a fresh name."""

    def __init__(self, **fixed: Any):
        self.namespace: Dict[str, Any] = dict(fixed)

    def name(self, obj: Any) -> str:
        key = f"k{len(self.namespace)}"
        self.namespace[key] = obj
        return key
