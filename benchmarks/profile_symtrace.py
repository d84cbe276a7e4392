"""cProfile the hot spots of symtrace: tracing, code generation, deepcopy and pickle.

    python benchmarks/profile_symtrace.py [--workload chain10k|resnet50|transformer12] [--top 25]
                                          [--ops trace,values,recompile,deepcopy,pickle,unpickle]

Prints, per operation, the top functions by cumulative and by internal (tottime) time.
Uses the workloads of trace_bench.py. ``recompile`` clears the compiled-code cache first (so
CPython's compile() is included); ``unpickle`` loads a pickled module and builds its graph's
nodes (an unpickled graph stays packed until first use).
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pickle
import pstats
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
warnings.filterwarnings("ignore", message=".*NumPy.*")

import torch  # noqa: E402

import symtrace  # noqa: E402
from symtrace.graph.codegen import clear_code_cache  # noqa: E402
from trace_bench import workloads  # noqa: E402


def profile(label: str, fn, top: int, repeats: int) -> None:
    fn()  # warm-up
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(repeats):
        fn()
    pr.disable()
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats(key).print_stats(top)
        text = s.getvalue()
        # drop pstats' preamble down to the table header
        text = text[text.find("   ncalls"):] if "   ncalls" in text else text
        print(f"=== {label}: top {top} by {key} ({repeats} run(s)) ===")
        print(text.rstrip())
        print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="chain10k")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ops", default="trace,values,recompile,deepcopy,pickle,unpickle")
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = next(w for w in workloads(quick=False) if w.name == args.workload)
    torch.manual_seed(0)
    m = w.make()
    xs = w.inputs()
    gm = symtrace.symbolic_trace(m)
    print(f"{w.name}: {len(gm.graph.nodes)} nodes, torch {torch.__version__}")
    ops = args.ops.split(",")
    if "trace" in ops:
        profile("symbolic_trace(m)", lambda: symtrace.symbolic_trace(m), args.top, args.repeats)
    if "values" in ops:
        with torch.no_grad():
            profile("symbolic_trace(m, example_inputs=xs)",
                    lambda: symtrace.symbolic_trace(m, example_inputs=xs), args.top, args.repeats)
    if "recompile" in ops:
        def cold_recompile():
            clear_code_cache()
            return gm.recompile()
        profile("gm.recompile() (code cache cleared)", cold_recompile, args.top, args.repeats)
    if "deepcopy" in ops:
        profile("copy.deepcopy(gm)", lambda: copy.deepcopy(gm), args.top, args.repeats)
    if "pickle" in ops:
        profile("pickle.loads(pickle.dumps(gm))",
                lambda: pickle.loads(pickle.dumps(gm, protocol=pickle.HIGHEST_PROTOCOL)), args.top, args.repeats)
    if "unpickle" in ops:
        data = pickle.dumps(gm, protocol=pickle.HIGHEST_PROTOCOL)
        profile("len(pickle.loads(data).graph)  (load, then build the nodes)",
                lambda: len(pickle.loads(data).graph), args.top, args.repeats)


if __name__ == "__main__":
    main()
