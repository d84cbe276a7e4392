""""Lowering never makes a model slower than eager": a bounded measurement at compile time.

:func:`slower_than_eager` times the lowered module against the caller's graph run through
torch on the example inputs, interleaved, and returns why the lowered module should not be
used (it lost) or None. ``lower.compile`` then makes the module run the graph through torch
for every call, and ``report()`` starts with that reason.

Bounds: each side is called once to warm up, then in rounds of samples of at least
:data:`SAMPLE_S` seconds (several calls of a small graph per sample) until
:data:`BUDGET_S` seconds have passed (at least one round, at most :data:`ROUNDS`); the
lowered module loses when its fastest sample is more than :data:`MARGIN` slower than
torch's fastest (minimums: the least disturbed by other processes). A graph whose single
eager call takes more than :data:`MAX_CALL_S` is not measured (the kernels then matter less
than the torch ops, and measuring would cost seconds), nor one that cannot run twice with the
same effect: it draws random numbers, has side effects other than guard checks, or writes its
inputs or the model's state. The answer is one measurement on a machine that may be busy:
it guards against clear losses, not against a few percent.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..graph.effects import has_registered_side_effect, is_random
from ..graph.graph_module import GraphModule

__all__ = ["slower_than_eager", "rerunnable", "BUDGET_S", "MARGIN"]

BUDGET_S = 1.0
SAMPLE_S = 0.002
ROUNDS = 5
MARGIN = 1.03
MAX_CALL_S = 0.25


def rerunnable(gm: GraphModule) -> Optional[str]:
    """Why ``gm`` cannot be run again on the same inputs without effects (None: it can)."""
    from ..graph.guards import check_data_guard
    from ..passes.alias import AliasAnalysis
    alias = AliasAnalysis(gm.graph, gm)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            if alias.is_written(n):
                return f"it writes {n.name}"
            continue
        if n.op == "output":
            continue
        if is_random(n):
            return f"{n.name} draws random numbers"
        if has_registered_side_effect(n) and n.target not in (check_data_guard, torch._assert):
            return f"{n.name} has a side effect"
    return None


def _sample(fn: Callable, args: Sequence[Any], n: int, clock) -> float:
    t = clock()
    for _ in range(n):
        fn(*args)
    return (clock() - t) / n


def slower_than_eager(lowered: Callable, gm: GraphModule, inputs: Sequence[Any],
                      clock=time.perf_counter) -> Optional[str]:
    """The reason to run ``gm`` through torch instead of ``lowered`` (None: keep the kernels,
    or nothing was measured); see the module doc."""
    if rerunnable(gm) is not None:
        return None
    with torch.no_grad():
        t = clock()
        gm(*inputs)
        first = clock() - t
        if first > MAX_CALL_S:
            return None
        lowered(*inputs)
        n = max(1, int(SAMPLE_S / max(first, 1e-7)))
        eager_s, lowered_s = [], []
        start = clock()
        for r in range(ROUNDS):
            pair = [(gm, eager_s), (lowered, lowered_s)]
            for fn, out in (pair if r % 2 == 0 else pair[::-1]):
                out.append(_sample(fn, inputs, n, clock))
            if clock() - start > BUDGET_S:
                break
    e, low = min(eager_s), min(lowered_s)
    if low > e * MARGIN:
        return (f"measured at compile time, the lowered module took {low * 1e3:.3f} ms per call and the "
                f"graph through torch {e * 1e3:.3f} ms: it runs through torch")
    return None
