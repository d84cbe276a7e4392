"""Draw a graph with Graphviz: DOT source from :func:`to_dot`, image files from :func:`draw`.

Each node is a box coloured by opcode whose label shows its name, opcode, target, arguments
and source ``file:line``. Nodes are grouped into nested ``cluster_<module path>`` subgraphs
by ``node.meta["module_path"]`` (``layer1`` holds ``layer1.0``, which holds
``layer1.0.downsample``); a ``call_module`` node sits in the cluster of the module that calls
it, not in a cluster of its own. Edges run from each input to its user and are labelled with
the producer's ``dtype[shape]`` when its ``tensor_meta`` is known.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .node import Node
from .source import one_line
from .tabular import _as_graph, format_arg

if TYPE_CHECKING:
    import graphviz

__all__ = ["to_dot", "draw", "render_dot", "OP_COLORS", "FORMATS"]

#: Fill colour of each opcode's boxes.
OP_COLORS: Dict[str, str] = {
    "placeholder": "#d5e8d4",    # green
    "get_attr": "#fff2cc",       # yellow
    "call_function": "#dae8fc",  # blue
    "call_method": "#e1d5e7",    # purple
    "call_module": "#ffe6cc",    # orange
    "output": "#f8cecc",         # red
}

#: Fill colours of module clusters, by nesting depth (cycled).
_CLUSTER_COLORS = ("#f5f5f5", "#e8e8e8", "#dcdcdc")

#: Output formats :func:`draw` understands; ``dot``/``gv`` write DOT text.
FORMATS = ("svg", "png", "pdf", "dot", "gv")

_MAX_LINE = 60


def _graphviz():
    """The ``graphviz`` package, imported on first use so that ``import symtrace`` works
    where it is not installed (drawing is the only feature that needs it)."""
    try:
        import graphviz
    except ImportError as e:
        raise ImportError("drawing a graph needs the `graphviz` Python package "
                          "(`pip install graphviz`); everything else in symtrace works "
                          "without it") from e
    return graphviz


# --- labels --------------------------------------------------------------------------------
_CONTROL = {i: " " for i in range(32)}


def _clip(text: str) -> str:
    text = str(text).translate(_CONTROL)  # one line: control characters become spaces
    return text if len(text) <= _MAX_LINE else text[:_MAX_LINE - 1] + "…"


def _escape(text: str) -> str:
    """One line of plain (non-record, non-HTML) label text, escaped for DOT.

    Backslashes are doubled so that no escString sequence (``\\n``, ``\\N``...) is triggered;
    ``graphviz.quote`` then escapes the double quotes; ``nohtml`` stops ``<...>`` from being
    read as an HTML label. ``{ } | < >`` are plain characters in a ``box`` label.
    """
    return _graphviz().nohtml(_clip(text).replace("\\", "\\\\"))


def _label(lines: List[str]) -> str:
    """A multi-line label, each line left-justified (``\\l``)."""
    return _graphviz().nohtml("".join(_escape(line) + "\\l" for line in lines))


def _compact_meta(tm: Any) -> str:
    """``float32[2,3]`` (no spaces) for edge labels; tuples of metas are joined."""
    if tm is None:
        return ""
    if isinstance(tm, (tuple, list)):
        return "(" + ",".join(_compact_meta(t) for t in tm) + ")"
    return str(tm).replace(" ", "")


def _node_lines(n: Node) -> List[str]:
    lines = [n.name]
    target = n.format_target()
    if n.op == "placeholder" or n.op == "output":
        lines.append(n.op if target in (n.name, "output") else f"{n.op}: {target}")
    else:
        lines.append(f"{n.op}: {target}")
    if n.op not in ("placeholder", "get_attr"):
        parts = [format_arg(a) for a in n.args]
        parts += [f"{k}={format_arg(v)}" for k, v in n.kwargs.items()]
        lines.append("(" + ", ".join(parts) + ")")
    loc = n.meta.get("source")
    if loc is not None:
        lines.append(str(loc))
    return lines


# --- clusters ------------------------------------------------------------------------------
def _cluster_path(n: Node) -> str:
    path = n.meta.get("module_path") or ""
    if n.op == "call_module" and path == n.target:
        path = path.rpartition(".")[0]  # a leaf module's node belongs to its caller
    return path


def _cluster_tree(nodes: List[Node]):
    """``members[path]`` (nodes, in order) and ``children[path]`` (sub-paths, in order of
    first appearance); the root is ``""``."""
    members: Dict[str, List[Node]] = {"": []}
    children: Dict[str, List[str]] = {"": []}
    for n in nodes:
        path = _cluster_path(n)
        if path not in members:
            parts = path.split(".")
            for i in range(1, len(parts) + 1):
                p = ".".join(parts[:i])
                if p not in members:
                    members[p], children[p] = [], []
                    children[".".join(parts[:i - 1])].append(p)
        members[path].append(n)
    return members, children


def _emit(dot: "graphviz.Digraph", path: str, depth: int, members, children) -> None:
    for n in members[path]:
        dot.node(n.name, _label(_node_lines(n)),
                 fillcolor=OP_COLORS.get(n.op, "#ffffff"))
    for child in children[path]:
        with dot.subgraph(name=f"cluster_{child}") as sub:
            sub.attr(label=_escape(child), style="rounded,filled", color="#999999",
                     fillcolor=_CLUSTER_COLORS[depth % len(_CLUSTER_COLORS)], labeljust="l")
            _emit(sub, child, depth + 1, members, children)


# --- public API ----------------------------------------------------------------------------
def to_dot(graph_or_gm: Any, name: str = "graph") -> str:
    """DOT source of a Graph (or a GraphModule's graph); the same graph gives the same text."""
    g = _as_graph(graph_or_gm)
    nodes = list(g.nodes)
    dot = _graphviz().Digraph(name=name)
    graph_attr = {"rankdir": "TB", "fontname": "Helvetica", "fontsize": "11"}
    made_by = getattr(g, "created_by", "")
    if made_by:
        graph_attr.update(label=_escape(f"made by {one_line(made_by)}"), labelloc="t")
    dot.attr("graph", **graph_attr)
    dot.attr("node", shape="box", style="rounded,filled", fontname="Courier", fontsize="10")
    dot.attr("edge", fontname="Helvetica", fontsize="9", color="#555555")
    members, children = _cluster_tree(nodes)
    _emit(dot, "", 0, members, children)
    for n in nodes:
        for inp in n.all_input_nodes:
            label = _compact_meta(inp.meta.get("tensor_meta"))
            dot.edge(inp.name, n.name, label=_escape(label) if label else None)
    return dot.source


def _format_of(path: str, format: Optional[str]) -> str:
    fmt = (format or os.path.splitext(path)[1].lstrip(".")).lower()
    if not fmt:
        raise ValueError(f"cannot tell the image format of {path!r}: give it a suffix "
                         f"({', '.join('.' + f for f in FORMATS)}) or pass format=")
    if fmt not in FORMATS:
        raise ValueError(f"unsupported format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return fmt


def draw(graph_or_gm: Any, path: Any, format: Optional[str] = None) -> str:
    """Draw the graph to ``path`` and return the path of the file written.

    The format comes from ``format`` or the suffix of ``path`` (svg, png, pdf or dot). Images
    need Graphviz's ``dot`` program; without it, DOT text is written next to ``path`` with a
    ``.dot`` suffix instead, a ``UserWarning`` says so, and that path is returned.
    """
    return render_dot(to_dot(graph_or_gm), path, format, stacklevel=3)


def render_dot(source: str, path: Any, format: Optional[str] = None, stacklevel: int = 2) -> str:
    """Write DOT ``source`` to ``path`` as :func:`draw` does (image via ``dot``, or DOT text
    next to it with a warning when ``dot`` is missing); returns the path written."""
    path = os.fspath(path)
    fmt = _format_of(path, format)
    if fmt in ("dot", "gv"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        return path
    exe = shutil.which("dot")
    if exe is None:
        dot_path = os.path.splitext(path)[0] + ".dot"
        with open(dot_path, "w", encoding="utf-8") as f:
            f.write(source)
        warnings.warn(f"graphviz's `dot` program is missing, so {path!r} was not drawn; wrote "
                      f"the DOT source to {dot_path!r} instead (install it with "
                      "`apt-get install graphviz`)", UserWarning, stacklevel=stacklevel)
        return dot_path
    res = subprocess.run([exe, f"-T{fmt}", "-o", path], input=source.encode("utf-8"),
                         capture_output=True)
    if res.returncode != 0:
        raise RuntimeError(f"`dot -T{fmt}` failed drawing {path!r}: "
                           f"{res.stderr.decode('utf-8', 'replace').strip()}")
    return path
