"""Saving and loading GraphModules: symtrace.serialize against torch.save/torch.load of the
torch.fx GraphModule of the same model (the anchor), measured in the same run.

    python benchmarks/serialize_bench.py            # chain10k, small models and ResNet-50
    python benchmarks/serialize_bench.py --quick    # fewer repeats, no ResNet-50

Workloads
  chain10k     synthetic graph, forward loops 3333 times over
                   a = torch.add(h, y); r = torch.relu(a); h = operator.mul(r, 2.0)
               (~10k nodes, no weights; benchmarks/trace_bench.py's Chain)
  resnet       examples.models.SmallResNet (~0.7 MB of weights)
  transformer  examples.models.TransformerBlock
  resnet50     trace_bench's hand-written ResNet-50 (~100 MB of weights; not with --quick)

Operations (median (min) of N runs after one warm-up, gc.collect() before each run, gc left
enabled, torch.set_num_threads(1); files written to and read from memory (io.BytesIO))
  save           symtrace.serialize.save(gm, f)     vs  torch.save(fx_gm, f)
  load           symtrace.serialize.load(f)         vs  torch.load(f, weights_only=False)
                 (torch.fx re-runs its generated code on load; symtrace rebuilds the graph)
  round trip     save + load
Also listed: the file sizes, and pickle of the symtrace GraphModule (not a safe format) for
reference. ratio = symtrace / torch.fx (lower is better). Target: the 10k-node module saves and
loads in well under a second.
"""
from __future__ import annotations

import argparse
import gc
import io
import os
import pickle
import statistics
import sys
import time
import warnings
from typing import Callable, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

warnings.filterwarnings("ignore", message=".*NumPy.*")

import torch  # noqa: E402
import torch.fx  # noqa: E402
from tabulate import tabulate  # noqa: E402

import symtrace  # noqa: E402
from examples.models import build, example_inputs  # noqa: E402
from symtrace.serialize import load, save  # noqa: E402
from trace_bench import Chain, ResNet50  # noqa: E402


def timed(fn: Callable[[], object], repeats: int) -> Tuple[float, float]:
    fn()  # warm-up
    times: List[float] = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def fmt(t: Tuple[float, float]) -> str:
    med, lo = t
    return f"{med * 1e3:.1f} ({lo * 1e3:.1f})"


def workloads(quick: bool):
    out = [
        ("chain10k", lambda: Chain(3333), lambda: (torch.randn(4), torch.randn(4)), 3 if quick else 7),
        ("resnet", lambda: build("resnet"), lambda: example_inputs("resnet"), 5 if quick else 9),
        ("transformer", lambda: build("transformer"), lambda: example_inputs("transformer"), 5 if quick else 9),
    ]
    if not quick:
        out.append(("resnet50", lambda: ResNet50().eval(), lambda: (torch.randn(1, 3, 64, 64),), 3))
    return out


def run(quick: bool) -> None:
    torch.set_num_threads(1)
    rows = []
    for name, make, inputs, repeats in workloads(quick):
        torch.manual_seed(0)
        model = make()
        x = inputs()
        gm = symtrace.symbolic_trace(model, example_inputs=x)
        fx = torch.fx.symbolic_trace(model)
        for n in fx.graph.nodes:  # torch.fx cannot pickle modules whose forward has type annotations
            n.type = None
        fx.recompile()

        def st_save():
            buf = io.BytesIO()
            save(gm, buf)
            return buf

        def fx_save():
            buf = io.BytesIO()
            torch.save(fx, buf)
            return buf

        st_bytes, fx_bytes = st_save().getvalue(), fx_save().getvalue()
        st_load = lambda: load(io.BytesIO(st_bytes))  # noqa: E731
        fx_load = lambda: torch.load(io.BytesIO(fx_bytes), weights_only=False)  # noqa: E731
        st_rt = lambda: load(io.BytesIO(st_save().getvalue()))  # noqa: E731
        fx_rt = lambda: torch.load(io.BytesIO(fx_save().getvalue()), weights_only=False)  # noqa: E731
        pk_rt = lambda: pickle.loads(pickle.dumps(gm))  # noqa: E731

        loaded = st_load()
        torch.testing.assert_close(loaded(*x), gm(*x), rtol=0, atol=0)  # the benchmark checks what it times
        for op, a, b in (("save", st_save, fx_save), ("load", st_load, fx_load), ("round trip", st_rt, fx_rt)):
            ta, tb = timed(a, repeats), timed(b, repeats)
            rows.append([name, len(gm.graph), op, fmt(ta), fmt(tb), f"{ta[0] / tb[0]:.2f}x"])
        tp = timed(pk_rt, repeats)
        rows.append([name, len(gm.graph), "pickle round trip (unsafe, reference)", fmt(tp), "", ""])
        rows.append([name, len(gm.graph), "file size (KiB)", f"{len(st_bytes) / 1024:.0f}",
                     f"{len(fx_bytes) / 1024:.0f}", f"{len(st_bytes) / len(fx_bytes):.2f}x"])
        print(f"done: {name}", file=sys.stderr)
    print(tabulate(rows, headers=["workload", "nodes", "operation", "symtrace ms median (min)",
                                  "torch.fx ms median (min)", "ratio"]))
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs visible, torch.set_num_threads(1); "
          "timings on a shared machine are noisy")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no ResNet-50")
    run(ap.parse_args().quick)
