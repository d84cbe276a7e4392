"""The public entry points of tracing: :func:`symbolic_trace` and :func:`leaf_function`."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from torch import nn

from ..graph._gc import gc_paused
from ..graph.graph_module import GraphModule, class_name_from
from .patches import _active_tracer
from .tracer import Tracer
from .values import _contains_proxy

__all__ = ["symbolic_trace", "leaf_function"]

def leaf_function(fn: Callable) -> Callable:
    """Decorator: record calls to ``fn`` as one ``call_function`` node instead of tracing into
    it (torch.fx's ``wrap``). Outside tracing the function runs as usual.

    >>> @symtrace.leaf_function
    ... def my_op(x, k): ...
    """
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tracer = _active_tracer()
        if tracer is not None and _contains_proxy((args, kwargs)):
            return tracer.call_function(fn, args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__symtrace_leaf__ = fn
    return wrapper


def symbolic_trace(root: Any, concrete_args: Optional[Dict[str, Any]] = None, *,
                   example_inputs: Any = None, leaf_modules: Sequence[type] = (),
                   tracer: Optional[Tracer] = None, record_source: bool = True,
                   _live: bool = False) -> GraphModule:
    """Record ``root`` (an ``nn.Module`` or a function) as a :class:`GraphModule`.

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments. With
    them, Python decisions on traced values resolve and are guarded; without, tracing is
    symbolic (torch.fx-like) and such decisions raise :class:`TraceError`. ``concrete_args``
    specialises named arguments to fixed Python values (guarded). ``leaf_modules``: module
    types recorded as one ``call_module`` node, besides torch's own layers.

    Calling the result with inputs that break a guard raises :class:`GuardError`.
    """
    tr = tracer or Tracer(leaf_modules=leaf_modules, record_source=record_source, live=_live)
    with gc_paused():
        graph = tr.trace(root, example_inputs, concrete_args)
    name = type(root).__name__ if isinstance(root, nn.Module) else getattr(root, "__name__", "function")
    gm = GraphModule(tr.root, graph, class_name=class_name_from(name), attrs=tr.extra_attrs)
    gm.meta["trace_notes"] = tr.notes
    return gm
