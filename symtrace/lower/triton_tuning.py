"""Optional launch tuning for Triton kernels (``compile(..., target="cuda", autotune=True)``).

The launch table (:func:`~symtrace.lower.codegen_triton.launch_plan`) picks the warps per
program from the block size. With autotuning, the first launch of a kernel also times it at
half and at twice those warps and keeps the fastest: on a CUDA device with
``triton.testing.do_bench`` (median of its timed runs, after its warm-up, which compiles the
configuration); elsewhere (CPU, the Triton interpreter) the median of a few timed runs after
one untimed run. Choices are cached per kernel source and device
for the process, so other shapes' variants and other modules with the same kernel reuse them.

A kernel is timed only when running it again cannot change anything: it writes nothing it
reads and no memory of the caller's (inputs, parameters). Others keep the table's choice.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Dict, List, Optional

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


#: ``triton.testing.do_bench``'s warm-up and timing budgets (milliseconds) per configuration
BENCH_WARMUP_MS, BENCH_REP_MS = 10, 40


def _do_bench():
    """``triton.testing.do_bench``, or None where it cannot be imported."""
    try:
        from triton.testing import do_bench
    except Exception:  # no triton, or a build without the testing module
        return None
    return do_bench


def measure(run: Callable[[], None], sync: Callable[[], None], reps: int = 5, *,
            device: Optional[torch.device] = None) -> float:
    """Median seconds of ``run()``: with ``triton.testing.do_bench`` on a CUDA ``device``, else
    over ``reps`` timed runs (``sync()`` after each) after one untimed run."""
    bench = _do_bench() if device is not None and device.type == "cuda" else None
    if bench is not None:
        try:
            ms = bench(run, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, return_mode="median")
        except TypeError:  # older triton: no return_mode
            ms = bench(run, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, quantiles=[0.5])
            ms = ms[0] if isinstance(ms, (list, tuple)) else ms
        return float(ms) / 1e3
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
        timings = {w: measure(lambda w=w: launch(w), sync, device=device) for w in warp_choices(warps)}
        best = min(timings, key=lambda w: (timings[w], w))
        hit = _CACHE[key] = Tuning(best, timings)
    return hit
