"""``capture``: the flip-switch form. Trace on first call, re-capture when guards fail.

``capture(model, passes=[...])(*inputs)`` gives the eager answer for every input: each call
checks the entry guards of the cached graphs (most recently used first) and runs the first
whose guards hold; when none does, it traces the model again on these inputs, applies the
passes, and caches the new specialisation (at most ``cache_size`` of them; beyond that it warns
once and runs the model eagerly for inputs no cached graph accepts).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Sequence

from torch import nn

from .errors import GuardError
from .graph.graph_module import GraphModule
from .tracer import CallArgs, symbolic_trace

__all__ = ["capture", "Captured"]

Pass = Callable[[GraphModule], Optional[GraphModule]]


class Captured:
    """A callable standing in for ``model``; see :func:`capture`."""

    def __init__(self, model: Any, passes: Sequence[Pass] = (), cache_size: int = 8,
                 leaf_modules: Sequence[type] = ()):
        self.model = model
        self.passes = list(passes)
        self.cache_size = cache_size
        self.leaf_modules = tuple(leaf_modules)
        #: the captured graphs, most recently used first
        self.graphs: List[GraphModule] = []
        self.captures = 0
        self._warned = False

    def __call__(self, *args, **kwargs):
        graphs = self.graphs
        for i, gm in enumerate(graphs):
            try:
                out = gm(*args, **kwargs)
            except GuardError as e:
                if e.guard is not None and e.guard.kind == "data":
                    # a data guard failed part-way: re-run from scratch on a new capture
                    pass
                continue
            if i:
                graphs.insert(0, graphs.pop(i))
            return out
        if len(graphs) >= self.cache_size:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"symtrace.capture: {self.cache_size} specialisations of "
                    f"{type(self.model).__name__} are cached and these inputs fit none; running "
                    "eagerly from now on for such inputs. Raise cache_size, or look at "
                    "symtrace.explain(model, ...) to see which guards keep failing.", stacklevel=2)
            return self.model(*args, **kwargs)
        gm = self._capture(args, kwargs)
        graphs.insert(0, gm)
        return gm(*args, **kwargs)

    def _capture(self, args, kwargs) -> GraphModule:
        example = CallArgs(args, kwargs)
        gm = symbolic_trace(self.model, example_inputs=example, leaf_modules=self.leaf_modules)
        if isinstance(self.model, nn.Module):
            gm.guard_root = self.model
        for p in self.passes:
            result = p(gm)
            if isinstance(result, GraphModule):
                result.guard_root = gm.guard_root
                gm = result
        self.captures += 1
        return gm

    def __repr__(self) -> str:
        return f"Captured({type(self.model).__name__}, {len(self.graphs)} graphs, passes={len(self.passes)})"


def capture(model: Any, passes: Sequence[Pass] = (), cache_size: int = 8,
            leaf_modules: Sequence[type] = ()) -> Captured:
    """Wrap ``model`` (a module or function) so that calls run captured graphs.

    ``passes``: functions ``GraphModule -> GraphModule | None`` applied to each new capture
    (return a new module, or edit in place and return None). Module state is read live from
    ``model``: ``model.eval()`` or changing an attribute the graph depends on triggers a new
    capture instead of a wrong answer.
    """
    return Captured(model, passes, cache_size, leaf_modules)
