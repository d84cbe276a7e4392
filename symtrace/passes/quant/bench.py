"""Small, honest latency measurement for quantized modules.

:func:`time_variants` times several callables on the same inputs *interleaved* (round-robin,
so a burst of load from a neighbour hits every variant alike) and reports medians.
:func:`cpu_info` says what the numbers were measured on (CPU model, int8-relevant ISA flags,
threads).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["time_variants", "cpu_info"]


def time_variants(variants: Dict[str, Callable[..., Any]], args: tuple, *, rounds: int = 20, inner: int = 5,
                  warmup: int = 3, budget_s: Optional[float] = None) -> Dict[str, Dict[str, float]]:
    """``{name: {"median_ms", "min_ms"}}`` for each callable run on ``args``. Each round calls
    every variant ``inner`` times (timing the mean of those); rounds alternate the variant
    order. ``budget_s`` stops early (after at least 3 rounds) when the time is spent."""
    names = list(variants)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for n in names:
            for _ in range(warmup):
                variants[n](*args)
        t_start = time.perf_counter()
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for n in order:
                fn = variants[n]
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn(*args)
                samples[n].append((time.perf_counter() - t0) / inner * 1e3)
            if budget_s is not None and r >= 2 and time.perf_counter() - t_start > budget_s:
                break
    return {n: {"median_ms": statistics.median(v), "min_ms": min(v)} for n, v in samples.items()}


def cpu_info() -> Dict[str, Any]:
    """CPU model, the int8-relevant ISA flags found in ``/proc/cpuinfo``, torch's CPU
    capability, thread count and load average."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
           if f in flags]
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        cap = "?"
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {"cpu": model, "isa": isa, "torch_capability": cap, "threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "load_avg_1m": load, "torch": torch.__version__,
            "amx_int8": "amx_int8" in flags}
