"""Dead-code elimination as a pass, with the effect model of :mod:`symtrace.graph.effects`.

Before::

    %x : [users=3] = placeholder[x]
    %relu : [users=0] = call_method[relu](%x)          # dead and pure: removed
    %mul_ : [users=0] = call_method[mul_](%x, 2)       # writes x: kept
    %randn : [users=0] = call_function[torch.randn](3) # random (advances the RNG): kept
    %add : [users=1] = call_function[operator.add](%x, 1)
    %output : [users=0] = output[output](%add)

After ``dead_code_elimination(gm)``::

    graph():  # made by dead_code_elimination
    %x : [users=2] = placeholder[x]
    %mul_ : [users=0] = call_method[mul_](%x, 2)
    %randn : [users=0] = call_function[torch.randn](3)
    %add : [users=1] = call_function[operator.add](%x, 1)
    %output : [users=0] = output[output](%add)
"""
from __future__ import annotations

from ..graph.graph_module import GraphModule
from .infra import graph_pass

__all__ = ["dead_code_elimination"]


@graph_pass
def dead_code_elimination(gm: GraphModule) -> bool:
    """Erase nodes whose results nobody reads and that have no effect (pure by
    :func:`~symtrace.graph.effects.is_impure`: no writes, no randomness, no registered side
    effect, no stateful module). One backward sweep removes whole dead chains.

    Placeholders, the output, in-place ops (``x.mul_(2)``, ``x.copy_(y)``,
    ``x.index_put_(...)``, ``torch.Tensor.add_(x, y)``), random ops and data guards stay.
    Attributes that unused ``get_attr`` nodes named stay on ``gm`` (they may be shared with the
    original model). Returns whether anything was erased.
    """
    return gm.graph.eliminate_dead_code(module=gm)
