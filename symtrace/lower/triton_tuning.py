"""Optional launch tuning for Triton kernels (``compile(..., target="cuda", autotune=True)``).

The launch table (:func:`~symtrace.lower.codegen_triton.launch_plan`) picks the warps per
program from the block size. With autotuning, the first launch of a kernel also times it at
half and at twice those warps (one untimed run per configuration compiles it, then the median
of a few timed runs) and keeps the fastest. Choices are cached per kernel source and device
for the process, so other shapes' variants and other modules with the same kernel reuse them.

A kernel is timed only when running it again cannot change anything: it writes nothing it
reads and no memory of the caller's (inputs, parameters). Others keep the table's choice.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Dict, List

import torch

__all__ = ["Tuning", "warp_choices", "rerunnable", "measure", "tune", "clear_tuning_cache"]


@dataclasses.dataclass
class Tuning:
    """What tuning decided for one kernel: ``warps`` to launch with, ``timings`` (warps ->
    median seconds; empty when it was not timed) and ``note`` (why not, if so)."""

    warps: int
    timings: Dict[int, float]
    note: str = ""


_CACHE: Dict[tuple, Tuning] = {}


def clear_tuning_cache() -> None:
    """Forget every tuning choice of this process."""
    _CACHE.clear()


def warp_choices(warps: int) -> List[int]:
    """The configurations tried around the table's ``warps`` (powers of two, 1 to 32)."""
    return sorted({max(1, warps // 2), warps, min(32, warps * 2)})


def rerunnable(kernel) -> bool:
    """Whether running ``kernel`` more than once leaves the same results as running it once."""
    read = {id(b) for b in kernel.loaded()}
    return all(s.buffer.role in ("output", "temp") and id(s.buffer) not in read for s in kernel.stores)


def measure(run: Callable[[], None], sync: Callable[[], None], reps: int = 5) -> float:
    """Median seconds of ``run()`` over ``reps`` timed runs, after one untimed run."""
    run()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def tune(key: tuple, warps: int, launch: Callable[[int], None], device: torch.device) -> Tuning:
    """The cached choice for ``key``, or time ``launch(w)`` for each of :func:`warp_choices`
    and cache the fastest (ties go to fewer warps)."""
    hit = _CACHE.get(key)
    if hit is None:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        timings = {w: measure(lambda w=w: launch(w), sync) for w in warp_choices(warps)}
        best = min(timings, key=lambda w: (timings[w], w))
        hit = _CACHE[key] = Tuning(best, timings)
    return hit
