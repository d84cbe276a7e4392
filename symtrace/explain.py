"""``explain``: one report of what a trace assumed and what it could not see.

Lists every guard (entry and data-dependent) with the user's file:line, every site the tracer
could not capture or guard, and the limits of a Python-level tracer.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from tabulate import tabulate

from .errors import TraceError
from .graph.graph_module import GraphModule
from .graph.guards import Guard, check_data_guard
from .trace import symbolic_trace

__all__ = ["explain", "ExplainReport", "LIMITS"]

#: What a Python-level tracer cannot see; shown in every report.
LIMITS = (
    "Writes to module attributes, to plain objects (held by modules or passed in), to lists, dicts "
    "and sets, to globals and to closure variables are replayed by the graph after it runs (listed "
    "above). Other Python side effects (print, logging, files, sockets) run once while tracing only.",
    "What forward reads is guarded: module and object attributes, globals and closure variables, "
    "also in the helper functions it reaches by name. Functions reached dynamically "
    "(getattr(obj, name)(), callbacks held in data) do not have their globals guarded.",
    "Calls into C extensions or code that bypasses torch's dispatch with raw data pointers are not seen.",
    "A data-dependent guard that fails part-way through a call of a GraphModule raises after earlier "
    "nodes have run; in-place updates before it are not undone (symtrace.capture restores them).",
    "`type(x) is torch.Tensor` is False for a traced tensor (isinstance works).",
    "Without example inputs, str()/format() or hashing of a traced number, size or dtype raises "
    "TraceError (its value is unknown); a traced tensor's text is a placeholder.",
    "A GraphModule keeps the objects it recorded: rebinding a function or submodule attribute of the "
    "original model afterwards is seen only through symtrace.capture.",
)

_FIXES = {
    "type": "pass inputs of the traced types, or trace with example inputs of this type",
    "dtype": "re-trace (or use symtrace.capture) for each input dtype",
    "device": "re-trace (or use symtrace.capture) for each device",
    "ndim": "re-trace (or use symtrace.capture) for each input rank",
    "shape": "the graph is specialised on this size; symtrace.capture re-captures for new sizes",
    "value": "a Python argument is specialised; pass it as a tensor if it should vary",
    "module": "the module attribute is baked into the graph; changing it needs a re-trace (capture does it)",
    "training": "train()/eval() changes need a re-trace (capture does it)",
    "global": "the global is baked in; changing it needs a re-trace (capture does it)",
    "grad_mode": "call the module under the same grad mode it was traced in, or use capture",
    "data": "a decision depends on tensor data; use torch.where / masking to keep it in the graph",
}


class ExplainReport:
    """The result of :func:`explain`: ``guards``, ``data_guards``, ``notes``, ``error``."""

    def __init__(self, gm: Optional[GraphModule], guards: List[Guard], data_guards: List[Guard],
                 notes: List[Tuple[str, str, Any]], error: Optional[BaseException], symbolic: bool = False):
        self.graph_module = gm
        self.guards = guards
        self.data_guards = data_guards
        self.notes = notes
        self.error = error
        self.symbolic = symbolic  # traced without example inputs

    @property
    def ok(self) -> bool:
        """Whether the model traced (possibly with guards)."""
        return self.error is None

    def __str__(self) -> str:
        out = []
        if self.error is not None:
            out.append(f"Tracing FAILED: {self.error}")
        else:
            n = len(self.graph_module.graph)
            how = "symbolically (no example inputs) " if self.symbolic else ""
            out.append(f"Traced {how}into {n} nodes with {len(self.guards)} entry guards and "
                       f"{len(self.data_guards)} data-dependent guards.")
            if self.symbolic:
                out.append("Without example inputs no shape, dtype or device is assumed; pass inputs "
                           "(explain(model, x)) to see what a trace on them specialises.")
        rows = [[g.kind, g.describe(), g.where(), _FIXES.get(g.kind, "")] for g in self.guards + self.data_guards]
        if rows:
            out.append("\nGuards and specialisations:")
            out.append(tabulate(rows, headers=["kind", "assumption", "where", "if it fails"]))
        effects = [m for k, m, s in self.notes if k == "side effect"]
        if effects:
            out.append("\nPython side effects (replayed by the graph after it runs):")
            out.extend(f"  - {m}" for m in effects)
        notes = [[k, m, str(s) if s else ""] for k, m, s in self.notes if k != "side effect"]
        if notes:
            out.append("\nNot captured or not guarded:")
            out.append(tabulate(notes, headers=["kind", "what", "where"]))
        out.append("\nWhat a Python-level tracer cannot see:")
        out.extend(f"  - {line}" for line in LIMITS)
        return "\n".join(out)

    __repr__ = __str__


def explain(model: Any, *inputs: Any, **kw_inputs: Any) -> ExplainReport:
    """Trace ``model`` on the given inputs and report every guard, specialisation and site that
    could not be captured, each with the user's file:line and a suggested fix.

    Without inputs the trace is symbolic (as ``symbolic_trace(model)``): nothing is specialised,
    and a Python decision on a traced value makes the report's ``error`` (naming the line).
    """
    if inputs and kw_inputs:
        raise TypeError("explain takes either positional or keyword inputs, not both")
    symbolic = not inputs and not kw_inputs
    example = None if symbolic else (inputs or kw_inputs)
    try:
        gm = symbolic_trace(model, example_inputs=example)
    except TraceError as e:
        return ExplainReport(None, [], [], [], e, symbolic=symbolic)
    data = [n.args[1] for n in gm.graph.find_nodes(op="call_function", target=check_data_guard)]
    return ExplainReport(gm, list(gm.graph.guards), data, list(gm.meta.get("trace_notes", [])), None,
                         symbolic=symbolic)
