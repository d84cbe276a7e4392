"""Lowering as the last pass of ``symtrace.capture(model, passes=[...])``."""
from __future__ import annotations

from ..graph.graph import Graph
from ..graph.graph_module import GraphModule

__all__ = ["wrap_lowered"]


def wrap_lowered(gm: GraphModule, lowered) -> GraphModule:
    """A GraphModule whose graph is one ``call_module`` of ``lowered`` (a LoweredModule of
    ``gm``). The lowered module checks ``gm``'s entry guards (live ones on every call, all of
    them when its own shape guards miss), so ``capture`` re-captures exactly when ``gm`` would."""
    g = Graph()
    inputs = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            inputs.append(g.placeholder(n.name, n.default))
    g.output(g.call_module("lowered", tuple(inputs)))
    out = GraphModule({"lowered": lowered}, g)
    out.meta["lowered_from"] = gm
    return out
