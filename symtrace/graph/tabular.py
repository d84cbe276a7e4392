"""Print a graph as a table: one row per node with its opcode, name, target, arguments,
tensor type and source location."""
from __future__ import annotations

import sys
from typing import Any, Iterable, List, Optional, TextIO

from tabulate import tabulate

from .node import Node
from .node import format_arg as _format_arg
from .source import one_line
from .symbols import shape_str

__all__ = ["format_tabular", "print_tabular", "format_arg", "format_tensor_meta"]

HEADERS = ("opcode", "name", "target", "args", "kwargs", "tensor", "source")


def _as_graph(graph_or_gm: Any):
    """The graph itself, or the ``.graph`` of a GraphModule."""
    g = getattr(graph_or_gm, "graph", None)
    if g is not None and hasattr(g, "nodes"):
        return g
    if hasattr(graph_or_gm, "nodes"):
        return graph_or_gm
    raise TypeError(f"expected a Graph or GraphModule, got {type(graph_or_gm).__name__}")


def format_arg(a: Any) -> str:
    """An argument as text, with nodes shown by their bare name: ``(x, 1)``."""
    return _format_arg(a, node_prefix="")


def format_tensor_meta(tm: Any) -> str:
    """``float32[2, 3]`` for a TensorMeta (a tuple/list of them is joined); '' when unknown."""
    if tm is None:
        return ""
    if isinstance(tm, (tuple, list)):
        return "(" + ", ".join(format_tensor_meta(t) for t in tm) + ")"
    return str(tm)


def _format_size(size: Any) -> str:
    """A symbolic size a node computes (``meta["size"]``): ``seq*2``, or ``[3, seq]`` for a shape."""
    if size is None:
        return ""
    return shape_str(size) if isinstance(size, tuple) else str(size)


def format_source(node: Node) -> str:
    """``file:line`` of the user's code that made the node, or ''."""
    loc = node.meta.get("source")
    return "" if loc is None else str(loc)


def _rows(nodes: Iterable[Node]) -> List[list]:
    rows = []
    for n in nodes:
        tm = n.meta.get("tensor_meta")
        tensor = format_tensor_meta(tm) if tm is not None else _format_size(n.meta.get("size"))
        rows.append([n.op, n.name, n.format_target(), format_arg(n.args), format_arg(n.kwargs),
                     tensor, format_source(n)])
    return rows


def format_tabular(graph: Any) -> str:
    """The graph (or a GraphModule's graph) as a text table, one row per node.

    Columns: opcode, name, target, args, kwargs, tensor (``dtype[shape]`` when known, sizes
    possibly symbolic: ``float32[seq, 8]``; a node computing a symbolic size shows it) and
    source (``file:line``). When ``graph.created_by`` is set, a first line names the pass.
    """
    g = _as_graph(graph)
    table = tabulate(_rows(g.nodes), headers=HEADERS, disable_numparse=True)
    made_by = getattr(g, "created_by", "")
    return f"# graph made by {one_line(made_by)}\n{table}" if made_by else table


def print_tabular(graph: Any, file: Optional[TextIO] = None) -> None:
    """Print :func:`format_tabular` of the graph to ``file`` (default: stdout)."""
    print(format_tabular(graph), file=sys.stdout if file is None else file)
