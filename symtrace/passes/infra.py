"""Running passes: a pass is a plain function of a :class:`~symtrace.graph.GraphModule`.

A pass returns one of

* ``None`` -- it edited ``gm`` in place;
* ``True``/``False`` -- it edited ``gm`` in place, and says whether anything changed;
* a ``GraphModule`` -- the result (maybe a new module);
* a :class:`PassResult` -- the result and whether anything changed.

:func:`run_passes` runs a list of them in order. A :class:`PassContext` adds instruments
around every pass: ``lint`` (check the graph and the module's attributes; the error names the
pass that broke them), ``time`` (``ctx.timings``), ``dump`` (the graph and code after each
pass, to a directory or a callable) and ``verbose`` (a line per pass on stderr).

After a pass that changed (or may have changed) the graph, ``gm.graph.created_by`` names
it, so ``print(gm.graph)`` starts with ``graph():  # made by cse`` and ``gm.print_readable()``
with ``# made by cse``::

    gm = run_passes(gm, [dead_code_elimination, common_subexpression_elimination],
                    PassContext(lint=True, time=True))
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from ..errors import GraphError
from ..graph.graph_module import GraphModule, resolve_attr

__all__ = ["PassResult", "PassContext", "run_passes", "graph_pass", "pass_name", "lint_module"]


@dataclasses.dataclass
class PassResult:
    """What a pass may return: the resulting module and whether the pass changed anything."""

    graph_module: GraphModule
    modified: bool = True


class PassContext:
    """Instruments :func:`run_passes` applies after every pass.

    ``lint``: run :func:`lint_module` on the input and after each pass; a failure raises
    :class:`~symtrace.errors.GraphError` naming the pass. ``time``: append ``(pass name,
    seconds)`` to :attr:`timings`. ``dump``: after each pass write ``str(gm.graph)`` and
    ``gm.code`` -- to ``<dump>/<NN>_<pass>.txt`` when ``dump`` is a directory (created if
    needed; ``00_input.txt`` holds the input), or call ``dump(pass_name, text)``.
    ``verbose``: print one line per pass (name, node counts, time) to stderr.
    """

    def __init__(self, lint: bool = False, time: bool = False,
                 dump: Union[None, str, os.PathLike, Callable[[str, str], Any]] = None,
                 verbose: bool = False):
        self.lint = lint
        self.time = time
        self.dump = dump
        self.verbose = verbose
        #: ``(pass name, seconds)`` per pass run with ``time=True``
        self.timings: List[Tuple[str, float]] = []
        #: ``(pass name, modified)`` per pass run (``modified`` is None when unknown)
        self.history: List[Tuple[str, Optional[bool]]] = []
        self._dumps = 0

    def __repr__(self) -> str:
        return (f"PassContext(lint={self.lint}, time={self.time}, dump={self.dump!r}, "
                f"verbose={self.verbose})")


def pass_name(p: Any) -> str:
    """The name a pass is reported under: its ``pass_name``, ``__name__`` (through
    ``functools.partial``), or its class name."""
    while isinstance(p, functools.partial):
        p = p.func
    return getattr(p, "pass_name", None) or getattr(p, "__name__", None) or type(p).__name__


def graph_pass(fn: Optional[Callable] = None, *, name: Optional[str] = None) -> Callable:
    """Decorator for a pass: records its name (``pass_name``) and, when the pass is called
    directly (outside :func:`run_passes`) and changes the graph, sets ``created_by``.

    >>> @graph_pass
    ... def strip_asserts(gm): ...
    """
    def wrap(f: Callable) -> Callable:
        label = name or f.__name__

        @functools.wraps(f)
        def wrapper(gm, *args, **kwargs):
            result = f(gm, *args, **kwargs)
            out, modified = _unpack(result, gm, label)
            if modified is not False:
                out.graph.created_by = label
            return result

        wrapper.pass_name = label
        return wrapper

    return wrap(fn) if fn is not None else wrap


def _unpack(result: Any, gm: GraphModule, name: str) -> Tuple[GraphModule, Optional[bool]]:
    if result is None:
        return gm, None
    if isinstance(result, bool):
        return gm, result
    if isinstance(result, int):  # a count of changes made in place
        return gm, result > 0
    if isinstance(result, PassResult):
        return result.graph_module, result.modified
    if isinstance(result, GraphModule):
        return result, None
    raise TypeError(f"pass {name!r} returned a value of type {type(result).__name__}; a pass returns None (edited "
                    "in place), a bool or a count (edited in place; changed or not), a GraphModule or a PassResult")


def lint_module(gm: GraphModule) -> None:
    """``gm.graph.lint()``, and check that every ``get_attr``/``call_module`` target exists on
    ``gm`` (a pass that adds ``get_attr`` nodes must register what they name)."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        missing = resolve_attr(gm, node.target)[1]
        if missing is not None:
            raise GraphError(f"node {node.name!r} ({node.op}) names {node.target!r}, but the "
                             f"module has no attribute {missing!r} there:\n    {node.format_node()}")


def run_passes(gm: GraphModule, passes: Sequence[Callable], ctx: Optional[PassContext] = None) -> GraphModule:
    """Run ``passes`` in order on ``gm``; returns the final module (``gm`` itself unless a pass
    returned a new one). See :class:`PassContext` for linting, timing and dumps.

    An exception raised inside a pass gets a note naming the pass (``in pass 'cse' (2 of 3)``).
    """
    if not isinstance(gm, GraphModule):
        raise TypeError(f"run_passes needs a GraphModule, got {type(gm).__name__}")
    ctx = ctx or PassContext()
    if ctx.lint:
        _lint(gm, "the input of run_passes", before=True)
    if ctx.dump is not None:
        _dump(ctx, "input", gm)
    total = len(passes)
    for i, p in enumerate(passes, 1):
        if not callable(p):
            raise TypeError(f"pass {i} of {total} is a {type(p).__name__}, not a callable")
        name = pass_name(p)
        before = len(gm.graph)
        start = time.perf_counter()
        try:
            result = p(gm)
        except Exception as e:
            e.add_note(f"in pass {name!r} ({i} of {total}) of run_passes")
            raise
        seconds = time.perf_counter() - start
        gm, modified = _unpack(result, gm, name)
        if modified is not False:
            gm.graph.created_by = name
        ctx.history.append((name, modified))
        if ctx.time:
            ctx.timings.append((name, seconds))
        if ctx.lint:
            _lint(gm, f"pass {name!r} ({i} of {total})")
        if ctx.dump is not None:
            _dump(ctx, name, gm)
        if ctx.verbose:
            change = {True: "changed", False: "unchanged", None: "ran"}[modified]
            print(f"[symtrace] {name}: {change}, {before} -> {len(gm.graph)} nodes, "
                  f"{seconds * 1e3:.2f} ms", file=sys.stderr)
    return gm


def _lint(gm: GraphModule, who: str, before: bool = False) -> None:
    try:
        lint_module(gm)
    except GraphError as e:
        what = "was already invalid" if before else "left an invalid graph"
        raise GraphError(f"{who} {what}: {e}") from e


def _dump(ctx: PassContext, name: str, gm: GraphModule) -> None:
    text = f"{gm.graph}\n\n{gm.code}"
    if callable(ctx.dump):
        ctx.dump(name, text)
        return
    os.makedirs(ctx.dump, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    path = os.path.join(os.fspath(ctx.dump), f"{ctx._dumps:02d}_{safe}.txt")
    ctx._dumps += 1
    with open(path, "w") as f:
        f.write(text + "\n")
