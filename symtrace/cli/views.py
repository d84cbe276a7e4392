"""Text views of a traced graph for the command line: the op histogram, the node table without
source locations, and comparisons of two graphs (unified diff, histogram deltas)."""
from __future__ import annotations

import collections
import difflib
from typing import Any, List, Sequence, Tuple

from tabulate import tabulate

from ..graph.tabular import HEADERS, format_arg, format_source, format_tensor_meta

__all__ = ["op_key", "histogram", "format_histogram", "format_histogram_diff", "table_rows",
           "aligned_tables", "table_text", "graph_text", "unified_diff", "VIEWS"]

#: What ``diff --by`` can compare.
VIEWS = ("table", "histogram", "code", "graph")


def _module_type(gm: Any, target: str) -> str:
    try:
        cls = type(gm.get_submodule(target))
    except (AttributeError, TypeError):
        return target
    import torch.nn
    if getattr(torch.nn, cls.__name__, None) is cls:
        return f"nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def op_key(gm: Any, node: Any) -> Tuple[str, str]:
    """What the histogram counts a node as: ``(op, target)``, with modules by their type
    (``nn.Conv2d``), functions by name (``torch.relu``), methods by name (``view``) and
    placeholders, parameters and outputs by opcode alone."""
    if node.op == "call_module":
        return node.op, _module_type(gm, node.target)
    if node.op in ("call_function", "call_method"):
        return node.op, node.format_target()
    return node.op, ""


def histogram(gm: Any) -> List[Tuple[str, str, int]]:
    """``(op, target, count)`` rows, most frequent first (ties by op, then target)."""
    counts = collections.Counter(op_key(gm, n) for n in gm.graph.nodes)
    return sorted(((op, t, c) for (op, t), c in counts.items()), key=lambda r: (-r[2], r[0], r[1]))


def format_histogram(gm: Any) -> str:
    """The histogram as a table with a total line."""
    rows = histogram(gm)
    table = tabulate([[c, op, t] for op, t, c in rows], headers=["count", "op", "target"],
                     disable_numparse=True, colalign=("right", "left", "left"))
    return f"{table}\n{sum(r[2] for r in rows)} nodes, {len(rows)} distinct ops"


def format_histogram_diff(a: Any, b: Any, name_a: str, name_b: str) -> str:
    """Rows of the two histograms whose counts differ, biggest change first, with the change;
    '' when none do."""
    ca = collections.Counter({(op, t): c for op, t, c in histogram(a)})
    cb = collections.Counter({(op, t): c for op, t, c in histogram(b)})
    changed = [k for k in set(ca) | set(cb) if ca[k] != cb[k]]
    changed.sort(key=lambda k: (-abs(cb[k] - ca[k]), k))
    if not changed:
        return ""
    rows = [[op, t, ca[(op, t)], cb[(op, t)], f"{cb[(op, t)] - ca[(op, t)]:+d}"] for op, t in changed]
    return tabulate(rows, headers=["op", "target", name_a, name_b, "change"], disable_numparse=True)


def _module_text(gm: Any, target: str) -> str:
    try:
        m = gm.get_submodule(target)
    except (AttributeError, TypeError):
        return target
    return f"{target}: {_module_type(gm, target)}({m.extra_repr()})"


def table_rows(gm: Any, source: bool = False) -> List[List[str]]:
    """Rows of the comparison table: like :func:`~symtrace.print_tabular`, but a module call's
    target also shows the module (``act: nn.GELU(approximate='none')``), so swapping a layer
    shows up, and the file:line column is left out unless ``source`` (it differs between
    models defined in different files)."""
    rows = []
    for n in gm.graph.nodes:
        target = _module_text(gm, n.target) if n.op == "call_module" else n.format_target()
        # the output's type is its arguments' (shown on their rows); shape propagation records
        # it and tracing does not, so it is left out to compare graphs made either way
        meta = "" if n.op == "output" else format_tensor_meta(n.meta.get("tensor_meta"))
        row = [n.op, n.name, target, format_arg(n.args), format_arg(n.kwargs), meta]
        if source:
            row.append(format_source(n))
        rows.append([str(c).replace("\n", " ") for c in row])
    return rows


def aligned_tables(gms: Sequence[Any], source: bool = False) -> List[str]:
    """The comparison table of each graph, all with the same column widths, so that a diff
    shows only the rows that changed."""
    per_gm = [table_rows(gm, source) for gm in gms]
    headers = HEADERS if source else HEADERS[:-1]
    lines = tabulate([r for rows in per_gm for r in rows], headers=headers,
                     disable_numparse=True).split("\n")
    head, body, out = lines[:2], lines[2:], []
    for rows in per_gm:
        out.append("\n".join(head + body[:len(rows)]))
        body = body[len(rows):]
    return out


def table_text(gm: Any, source: bool = False) -> str:
    """The comparison table of one graph (see :func:`table_rows`)."""
    return aligned_tables([gm], source)[0]


def graph_text(gm: Any, view: str, source: bool = False) -> str:
    """``gm`` as text in one of :data:`VIEWS`."""
    if view == "table":
        return table_text(gm, source)
    if view == "histogram":
        return format_histogram(gm)
    if view == "code":
        return gm.code
    if view == "graph":
        return str(gm.graph)
    raise ValueError(f"unknown view {view!r}; expected one of {', '.join(VIEWS)}")


def unified_diff(a: str, b: str, name_a: str, name_b: str, context: int = 3) -> str:
    """A unified diff of two texts ('' when they are equal)."""
    lines = difflib.unified_diff(a.splitlines(), b.splitlines(), fromfile=name_a, tofile=name_b,
                                 lineterm="", n=context)
    return "\n".join(lines)
