"""Tracing: running a module or function on proxies and recording what it does as a graph.

One job per module: :mod:`.api` (``symbolic_trace``, ``leaf_function``), :mod:`.tracer` (the
core that records calls), :mod:`.inputs` (binding inputs), :mod:`.decisions` (guards and the
concrete answers Python needs), :mod:`.modules` (``self`` inside forward, submodules, globals),
:mod:`.patches` (process-wide patches while tracing), :mod:`.values` (helpers on values).
"""
from .api import leaf_function, symbolic_trace
from .inputs import CallArgs
from .patches import apply_autograd_function, proxies_pass_isinstance
from .tracer import DEFAULT_LEAF_MODULE_PREFIXES, GraphAppendingTracer, Tracer

__all__ = ["Tracer", "CallArgs", "symbolic_trace", "leaf_function", "GraphAppendingTracer",
           "DEFAULT_LEAF_MODULE_PREFIXES", "proxies_pass_isinstance", "apply_autograd_function"]
