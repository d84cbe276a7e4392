"""The public entry points of tracing: :func:`symbolic_trace` and :func:`leaf_function`."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from torch import nn

from ..graph._gc import gc_paused
from ..graph.graph_module import GraphModule, class_name_from
from .patches import _active_tracer
from ..errors import SpecializedDimError
from ..graph.symbolic_shapes import symbolic_metadata
from ..graph.symbols import SymbolicSizeError
from .inputs import CallArgs
from .tracer import Tracer, module_of_method
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
                   dynamic_shapes: Any = None, _live: bool = False, _specialise_pinned: bool = False,
                   _dynamic_values: Any = frozenset()) -> GraphModule:
    """Record ``root`` (an ``nn.Module`` or a function) as a :class:`GraphModule`.

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments. With
    them, Python decisions on traced values resolve and are guarded; without, tracing is
    symbolic (torch.fx-like) and such decisions raise :class:`TraceError`. ``concrete_args``
    specialises named arguments to fixed Python values (guarded). ``leaf_modules``: module
    types recorded as one ``call_module`` node, besides torch's own layers.

    ``dynamic_shapes`` (needs ``example_inputs``): which input dimensions are symbolic, as
    ``torch.export`` takes it — a dict by input name or a tuple by position, each entry ``None``
    or ``{dim: Dim("seq", min=.., max=..)}`` (a name or ``True`` also work; one Dim shared
    declares equal sizes). Their ``tensor_meta`` shows symbols (``float32[seq, 8, 256]``), the
    graph computes sizes from its inputs, the declared ranges are entry guards (default
    ``2..inf``: 0 and 1 specialise), and a Python decision that holds only at the example size
    raises :class:`~symtrace.errors.SpecializedDimError`. See ``docs/dynamic_shapes.md``.

    Calling the result with inputs that break a guard raises :class:`GuardError`.
    """
    tr = tracer or Tracer(leaf_modules=leaf_modules, record_source=record_source, live=_live,
                          specialise_pinned=_specialise_pinned, dynamic_values=_dynamic_values)
    with gc_paused():
        graph = tr.trace(root, example_inputs, concrete_args, dynamic_shapes=dynamic_shapes)
    owner = module_of_method(root)
    name = type(root).__name__ if isinstance(root, nn.Module) else \
        type(owner).__name__ if owner is not None else getattr(root, "__name__", "function")
    gm = GraphModule(tr.root, graph, class_name=class_name_from(name), attrs=tr.extra_attrs)
    gm.meta["trace_notes"] = tr.notes
    if tr.pinned:
        gm.meta["pinned_dims"] = tr.pinned
    if tr.dynamic_inputs:
        _symbolic_metadata(gm, tr, example_inputs)
    return gm


def _symbolic_metadata(gm: GraphModule, tr: Tracer, example_inputs: Any) -> None:
    """Every node's ``tensor_meta`` in terms of the input symbols (one fake run)."""
    if isinstance(example_inputs, CallArgs):
        args, kwargs = example_inputs.args, example_inputs.kwargs
    elif isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    try:
        notes, assumptions = symbolic_metadata(gm, gm.graph, args, kwargs)
    except SymbolicSizeError as e:
        raise SpecializedDimError(f"symbolic_trace: {e}",
                                  {(d.param, i) for d in tr.dynamic_inputs.values() for i in d.dims}) from None
    for node, why in notes:
        tr.notes.append(("symbolic shape", f"{node} has no tensor_meta: it cannot run on fake tensors ({why})", None))
    gm.meta["dynamic_inputs"] = tr.dynamic_inputs
    gm.meta["shape_assumptions"] = assumptions
