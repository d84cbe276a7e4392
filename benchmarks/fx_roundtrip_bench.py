"""Conversion cost of symtrace <-> torch.fx, next to tracing, on the bundled models and on a long
chain graph built with the Graph API.

    python benchmarks/fx_roundtrip_bench.py

Timed: median process (CPU) time over 5 runs after one warm-up; torch.set_num_threads(1):
  trace      symtrace.symbolic_trace(model, example_inputs)   (models only)
  fx trace   torch.fx.symbolic_trace(model)                   (models only)
  to_fx      symtrace.interop.fx.to_fx(gm)   (builds the FX graph and module, generates its code)
  from_fx    symtrace.interop.fx.from_fx(fx_gm)   (code generated lazily, on the first call)
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore", message=".*NumPy.*")

import torch  # noqa: E402
import torch.fx  # noqa: E402
from tabulate import tabulate  # noqa: E402

import symtrace  # noqa: E402
from examples.models import build, example_inputs  # noqa: E402
from symtrace.graph import Graph, GraphModule  # noqa: E402
from symtrace.interop.fx import from_fx, to_fx  # noqa: E402


def _time(fn, runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        gc.collect()
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


def _chain(n: int) -> GraphModule:
    g = Graph()
    h = x = g.placeholder("x")
    for _ in range(n // 3):
        h = g.call_function(torch.relu, (g.call_function(torch.add, (h, x)),))
        h = g.call_method("mul", (h, 2.0))
    g.output(h)
    return GraphModule(torch.nn.Module(), g)


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for name in ("resnet", "transformer"):
        model, x = build(name), example_inputs(name)
        gm = symtrace.symbolic_trace(model, example_inputs=x)
        fx_gm = to_fx(gm)
        rows.append([name, len(gm.graph),
                     _time(lambda: symtrace.symbolic_trace(model, example_inputs=x)) * 1e3,
                     _time(lambda: torch.fx.symbolic_trace(model)) * 1e3,
                     _time(lambda: to_fx(gm)) * 1e3, _time(lambda: from_fx(fx_gm)) * 1e3])
    for n in (3_000, 30_000):
        gm = _chain(n)
        fx_gm = to_fx(gm)
        rows.append([f"chain {n}", len(gm.graph), None, None, _time(lambda: to_fx(gm), 3) * 1e3,
                     _time(lambda: from_fx(fx_gm), 3) * 1e3])
    print(tabulate(rows, headers=["graph", "nodes", "trace ms", "fx trace ms", "to_fx ms", "from_fx ms"],
                   floatfmt=".1f", missingval="-"))


if __name__ == "__main__":
    main()
