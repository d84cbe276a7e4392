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

import torch
from torch import nn

from .errors import GuardError, UninitializedModuleError
from .graph.effects import is_impure
from .graph.graph_module import GraphModule
from .graph.guards import check_data_guard
from .graph.tree import tree_iter
from .trace import CallArgs, symbolic_trace

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
        #: calls answered by running the model eagerly (cache full, or a new graph refused its inputs)
        self.eager_calls = 0
        self._warned = False
        self._warned_self = False

    def __call__(self, *args, **kwargs):
        graphs = self.graphs
        for i, gm in enumerate(graphs):
            snapshot = _Snapshot(self.model, args, kwargs) if _effects_before_data_guard(gm) else None
            try:
                out = gm(*args, **kwargs)
            except GuardError as e:
                if snapshot is not None and e.guard is not None and e.guard.kind == "data":
                    snapshot.restore()  # undo what ran before the data guard failed part-way
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
            self.eager_calls += 1
            return self.model(*args, **kwargs)
        try:
            gm = self._capture(args, kwargs)
        except UninitializedModuleError:  # a lazy module initialises itself on its first call
            self.eager_calls += 1
            return self.model(*args, **kwargs)
        snapshot = _Snapshot(self.model, args, kwargs)
        try:
            out = gm(*args, **kwargs)
        except GuardError as e:
            # the new graph refuses the very inputs it was captured on (a decision the trace
            # could not reproduce, e.g. on random data): undo its partial run, answer eagerly
            snapshot.restore()
            self.eager_calls += 1
            if not self._warned_self:
                self._warned_self = True
                warnings.warn(f"symtrace.capture: the graph captured from {type(self.model).__name__} "
                              f"failed its own guard on the inputs it was captured with ({e}); this call "
                              "runs eagerly, and the graph stays cached for other inputs.", stacklevel=2)
            graphs.insert(0, gm)
            return self.model(*args, **kwargs)
        graphs.insert(0, gm)
        return out

    def _capture(self, args, kwargs) -> GraphModule:
        example = CallArgs(args, kwargs)
        gm = symbolic_trace(self.model, example_inputs=example, leaf_modules=self.leaf_modules, _live=True)
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


def _effects_before_data_guard(gm: GraphModule) -> bool:
    """Whether running ``gm`` can change state before one of its data guards fails (then a call
    whose data guard fails must be rolled back before re-running it). Cached on the module."""
    cached = gm.meta.get("_effects_before_data_guard")
    if cached is None:
        cached, seen_effect = False, False
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is check_data_guard:
                if seen_effect:
                    cached = True
                    break
            elif node.op not in ("placeholder", "output") and is_impure(node, gm):
                seen_effect = True
        gm.meta["_effects_before_data_guard"] = cached
    return cached


class _Snapshot:
    """Copies of what a call may change (tensor inputs, the model's buffers, the RNG state)."""

    def __init__(self, model: Any, args: tuple, kwargs: dict):
        tensors = [t for t in _tensors((args, kwargs))]
        if isinstance(model, nn.Module):
            tensors.extend(model.buffers())
        self.saved = [(t, t.detach().clone()) for t in tensors]
        self.rng = torch.get_rng_state()

    def restore(self) -> None:
        with torch.no_grad():
            for t, copy in self.saved:
                t.copy_(copy)
        torch.set_rng_state(self.rng)


def _tensors(a: Any):
    return (x for x in tree_iter(a, subclasses=True) if isinstance(x, torch.Tensor))


def capture(model: Any, passes: Sequence[Pass] = (), cache_size: int = 8,
            leaf_modules: Sequence[type] = ()) -> Captured:
    """Wrap ``model`` (a module or function) so that calls run captured graphs.

    ``passes``: functions ``GraphModule -> GraphModule | None`` applied to each new capture
    (return a new module, or edit in place and return None). Module state is read live from
    ``model``: ``model.eval()`` or changing an attribute the graph depends on triggers a new
    capture instead of a wrong answer.
    """
    return Captured(model, passes, cache_size, leaf_modules)
