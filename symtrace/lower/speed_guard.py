""""Lowering never makes a model slower than eager": a bounded measurement at compile time.

:func:`slower_than_eager` times the lowered module against the caller's graph run through
torch on the example inputs (and, after the inference pipeline, against the pipeline's graph
run through torch: packed oneDNN layers, every other op by torch), interleaved, and returns
the fastest of those when the kernels lost, with the reason. ``lower.compile`` then makes
the module run that for every call, and ``report()`` starts with the reason.

Bounds: each side is called once to warm up (torch's call is timed for the limit below, so
a large graph costs the compile one eager call), then in rounds of samples of at least
:data:`SAMPLE_S` seconds (several calls of a small graph per sample) until
:data:`BUDGET_S` seconds have passed since the first warm-up call (at least one round, at
most :data:`ROUNDS`), or, after two rounds, until the lowered module clearly won (every sample
beat every sample of the graph through torch by more than :data:`MARGIN`, and its median is
no slower than the pipeline graph's: most models); the
lowered module loses when its fastest sample is more than :data:`MARGIN` slower than
torch's fastest (minimums: the least disturbed by other processes) and its median sample
more than :data:`MARGIN` slower than torch's median: a burst of load that slows a few of its
samples (right after another compile, say) does not send a faster module to torch. A graph whose single
eager call takes more than :data:`MAX_CALL_S` is not measured (the convolutions and matmuls
both sides run through the same libraries dominate it, and measuring would cost over a second
of compile: three warm-up calls and a round of three samples), nor one that cannot run twice with the
same effect: it draws random numbers, has side effects other than guard checks, or writes its
inputs or the model's state. The answer is one measurement on a machine that may be busy:
it guards against clear losses, not against a few percent. On a GPU the clock
(:func:`clock_for`) waits for the queued kernels before each reading, torch's graph is called
once more untimed first (a first call may start cuBLAS or cuDNN), and the budget starts after
the warm-ups (the lowered module's first call compiles its Triton kernels).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..graph.effects import has_registered_side_effect, is_random
from ..graph.graph_module import GraphModule

__all__ = ["slower_than_eager", "rerunnable", "clock_for", "BUDGET_S", "MARGIN"]

BUDGET_S = 1.0
SAMPLE_S = 0.002
ROUNDS = 5
MARGIN = 1.03
MAX_CALL_S = 0.15


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


def _on_gpu(inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in inputs)


def clock_for(inputs: Sequence[Any]) -> Callable[[], float]:
    """``time.perf_counter``, after waiting for the GPU's queued work when an input is on a
    CUDA device (a launch returns before its kernel ran)."""
    if not _on_gpu(inputs):
        return time.perf_counter
    sync = torch.cuda.synchronize

    def clock() -> float:
        sync()
        return time.perf_counter()
    return clock


def _sample(fn: Callable, args: Sequence[Any], n: int, clock) -> float:
    t = clock()
    for _ in range(n):
        fn(*args)
    return (clock() - t) / n


def _clear_win(runs) -> bool:
    """Whether more rounds would not change the answer: every sample of the lowered module (the
    first run) beat every sample of the caller's graph through torch (the second) by more than
    :data:`MARGIN`, and its median is no slower than that of the pipeline's graph through torch
    (the third, where there is one: its packed layers are the lowered module's, so the two are
    often close, and the lowered module loses only where its median is more than
    :data:`MARGIN` slower)."""
    lowered = runs[0][2]
    if not max(lowered) * MARGIN < min(runs[1][2]):
        return False
    return all(statistics.median(lowered) <= statistics.median(out) for _, _, out in runs[2:])


def slower_than_eager(lowered: Callable, gm: GraphModule, inputs: Sequence[Any],
                      clock=time.perf_counter, pipeline: Optional[GraphModule] = None):
    """``(runner, reason)`` when ``lowered`` lost: ``runner`` is ``gm`` (the graph through
    torch) or ``pipeline`` (the inference pipeline's graph through torch, when given and
    faster still); None when the kernels stay (or nothing was measured). See the module doc."""
    if rerunnable(gm) is not None:
        return None
    on_gpu = _on_gpu(inputs)
    with torch.no_grad():
        start = clock()    # (the budget counts the warm-up calls too, on a CPU)
        gm.forward         # (generates and compiles its code: not part of the call's time)
        if on_gpu:
            gm(*inputs)    # (a first GPU call may start libraries, cuBLAS or cuDNN: not timed)
        t = clock()
        gm(*inputs)        # (the warm-up call, timed for the limit below)
        first = clock() - t
        if first > MAX_CALL_S:
            return None
        lowered(*inputs)
        others = [("the graph through torch", gm)]
        if pipeline is not None:
            pipeline(*inputs)
            others.append(("the inference pipeline's graph through torch", pipeline))
        if on_gpu:         # (the lowered warm-up compiled its Triton kernels: the budget is for samples)
            start = clock()
        n = max(1, int(SAMPLE_S / max(first, 1e-7)))
        runs = [(label, fn, []) for label, fn in [("lowered", lowered)] + others]
        for r in range(ROUNDS):
            for _, fn, out in (runs if r % 2 == 0 else runs[::-1]):
                out.append(_sample(fn, inputs, n, clock))
            if clock() - start > BUDGET_S or r >= 1 and _clear_win(runs):
                break
    best = {label: min(out) for label, _, out in runs}
    middle = {label: statistics.median(out) for label, _, out in runs}
    low = best["lowered"]
    label, fn = min(others, key=lambda o: best[o[0]])
    if low > best[label] * MARGIN and middle["lowered"] > middle[label] * MARGIN:
        return fn, (f"measured at compile time, the lowered module took {low * 1e3:.3f} ms per call "
                    f"(median {middle['lowered'] * 1e3:.3f}) and {label} {best[label] * 1e3:.3f} ms "
                    f"(median {middle[label] * 1e3:.3f}): it runs {label}")
    return None
