"""Pictures of lowered graphs: the graph's nodes, one cluster per kernel."""
from __future__ import annotations

from typing import Dict, List, Optional

__all__ = ["lowered_dot", "draw_lowered"]

_KERNEL_COLORS = ("#cfe8ff", "#d9f2d0", "#ffe4c4", "#f3d1f4", "#fff3b0", "#d0f0f0")


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("{", "\\{").replace("}", "\\}") \
        .replace("<", "\\<").replace(">", "\\>").replace("|", "\\|")


def lowered_dot(lm) -> str:
    """DOT source: every node of ``lm.gm``'s graph; nodes fused into a kernel are drawn inside
    that kernel's cluster (a node recomputed in several kernels is drawn in the first); torch
    calls are grey boxes labelled with the reason they were not lowered."""
    import graphviz
    g = graphviz.Digraph(name="lowered")
    g.attr("graph", rankdir="TB", fontname="Helvetica", fontsize="11", label=_esc(f"lowered to {lm.target}"), labelloc="t")
    g.attr("node", shape="box", style="rounded,filled", fontname="Courier", fontsize="10", fillcolor="#ffffff")
    first_kernel: Dict[str, str] = {}
    for k in lm.kernels:
        for n in k.nodes:
            first_kernel.setdefault(n, k.name)
    reports = lm._first.reports if lm._first is not None else {}
    members: Dict[str, List] = {}
    nodes = list(lm.gm.graph.nodes)
    for n in nodes:
        members.setdefault(first_kernel.get(n.name, ""), []).append(n)

    def add(target, n):
        r = reports.get(n.name)
        label = f"{n.name}\\n{_esc(r.target if r else str(n.target))}"
        color = "#ffffff"
        if r is not None and r.where == "torch":
            label += f"\\n[torch: {_esc(r.reason[:60])}]"
            color = "#e0e0e0"
        elif r is not None and r.where == "view":
            color = "#f7f7f7"
        target.node(n.name, label=label, fillcolor=color)

    for i, k in enumerate(lm.kernels):
        if k.name not in members:
            continue
        with g.subgraph(name=f"cluster_{k.name}") as sub:
            sub.attr(label=f"{k.name} ({k.kind})", style="rounded,filled", color="#7a9cc6",
                     fillcolor=_KERNEL_COLORS[i % len(_KERNEL_COLORS)])
            for n in members[k.name]:
                add(sub, n)
    for n in members.get("", []):
        add(g, n)
    for n in nodes:
        for inp in n.all_input_nodes:
            g.edge(inp.name, n.name)
    return g.source


def draw_lowered(lm, path: str, format: Optional[str] = None) -> str:
    """Write the picture of :func:`lowered_dot` to ``path`` (see :func:`symtrace.draw`)."""
    from ..graph.drawing import render_dot
    return render_dot(lowered_dot(lm), path, format, stacklevel=4)
