"""Lowering as the last pass of ``symtrace.capture(model, passes=[...])``."""
from __future__ import annotations

import warnings
from typing import Callable, Optional

from torch import nn

from ..graph.graph import Graph
from ..graph.graph_module import GraphModule

__all__ = ["wrap_lowered", "lower_regions", "LazyRegion"]


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


class LazyRegion(nn.Module):
    """One tensor region of a captured graph (see :mod:`symtrace.passes.tensor_regions`),
    lowered on its first call with that call's tensors as the example inputs (their values,
    sizes and strides are the real ones; the region mutates none of them). Later sizes are
    served as ``compile(dynamic="auto")`` serves them. If lowering fails, the region runs as
    captured, with one warning naming the reason.

    ``lowered`` is the :class:`~symtrace.lower.LoweredModule` once built (``None`` before the
    first call, and after a failure, when ``failure`` says why)."""

    def __init__(self, region: GraphModule, lower: Callable[[GraphModule, tuple], nn.Module]):
        super().__init__()
        self.region = region
        self._lower = lower   # (graph, example inputs) -> lowered module
        self.lowered: Optional[nn.Module] = None
        self.failure: Optional[str] = None

    @property
    def captured_graph(self) -> GraphModule:
        """The graph this module runs (what ``capture`` inspects for effects and data guards)."""
        return self.region

    def forward(self, *args):
        lowered = self.lowered
        if lowered is not None:
            return lowered(*args)
        if self.failure is not None:
            return self.region(*args)
        try:
            self.lowered = self._lower(self.region, args)
        except Exception as e:   # the region runs through torch: never a failed call
            self.failure = f"{type(e).__name__}: {e}"
            warnings.warn(f"symtrace.lower: a tensor region of the captured graph could not be lowered "
                          f"({self.failure}); it runs as captured", stacklevel=2)
            return self.region(*args)
        return self.lowered(*args)


def lower_regions(gm: GraphModule, lower: Callable[[GraphModule, tuple], nn.Module]) -> Optional[GraphModule]:
    """``gm`` with each tensor region replaced by a :class:`LazyRegion` that ``lower``s it on
    its first call, the object plumbing around them left as captured; None when ``gm`` has no
    region that computes a tensor."""
    from ..passes.tensor_regions import split_tensor_regions
    top = split_tensor_regions(gm)
    if top is None:
        return None
    from .kv_append import written_in_graph
    calls = {n.target: n for n in top.graph.nodes if n.op == "call_module"}
    for name, sub in list(top.named_children()):
        if isinstance(sub, GraphModule) and sub.graph.created_by == "split_tensor_regions":
            if name in calls and written_in_graph(top, calls[name]):
                # the plumbing writes into a result in place: the region may not hand out
                # results that share storage with its inputs (see .kv_append)
                sub.meta["results_written_in_place"] = True
            setattr(top, name, LazyRegion(sub, lower))
    top.meta["lowered_from"] = gm
    return top
