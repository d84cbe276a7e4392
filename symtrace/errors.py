"""The errors symtrace raises. One base class, a few subclasses; every message is a sentence
written for the user who hits it, naming the node or the user's own source line."""
from __future__ import annotations

__all__ = ["SymtraceError", "TraceError", "AssumedTypeAttributeError", "UninitializedModuleError", "SpecializedDimError",
           "GraphError", "GuardError", "NodeRunError"]


class SymtraceError(Exception):
    """Base class of every error symtrace raises on purpose."""


class TraceError(SymtraceError):
    """Tracing could not record the program faithfully.

    Example: ``if x.sum() > 0`` traced without example inputs. The message names the line of
    the user's code and suggests a fix (``example_inputs=...``, ``concrete_args=...``, a leaf).
    """


class SpecializedDimError(TraceError):
    """A dimension declared dynamic was used where the program needs one value (``int(n)``,
    ``range(n)``, ``n == 4``): the graph would hold only for the example size. ``pinned`` lists
    the ``(input name, dim)`` pairs concerned.

    Fix: drop the dimension from ``dynamic_shapes``, or keep the size a traced value
    (``x.view(b, n * 2, -1)`` rather than ``x.view(b, int(n) * 2, -1)``).
    """

    def __init__(self, message: str, pinned=()):
        super().__init__(message)
        self.pinned = set(pinned)


class AssumedTypeAttributeError(TraceError, AttributeError):
    """Traced without example inputs, a value is taken for a type (an input for a Tensor: the
    graph checks that at every call), and the program read an attribute that type lacks.

    It is a :class:`TraceError`, so tracing stops loudly, and an ``AttributeError``, so
    ``hasattr(x, name)`` and ``getattr(x, name, default)`` answer as they would for that type.
    """


class UninitializedModuleError(TraceError):
    """The program runs a lazy module (``LazyModuleMixin``) that has not initialised itself yet:
    its first call changes the model, which a graph cannot record. Call the model once before
    tracing; :func:`symtrace.capture` does that for you (its first call runs eagerly)."""


class GraphError(SymtraceError):
    """A graph broke one of its invariants (raised by ``Graph.lint`` and graph edits).

    The message shows the offending node with its neighbours.
    """


class GuardError(SymtraceError):
    """A traced module was called with inputs (or module state) that fail one of the guards
    recorded while tracing, so the graph would not compute what eager PyTorch computes.

    ``guard`` is the failing :class:`~symtrace.graph.guards.Guard`, ``seen`` the value found.
    Re-trace with the new inputs, or use :func:`symtrace.capture`, which re-captures for you.
    """

    def __init__(self, message: str, guard=None, seen=None):
        super().__init__(message)
        self.guard = guard
        self.seen = seen


class NodeRunError(SymtraceError):
    """Running one node of a graph raised; wraps the original exception (``__cause__``)."""
