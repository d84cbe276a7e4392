"""Pattern matching and rewriting: symtrace against torch.fx, measured in the same run.

    python benchmarks/rewrite_bench.py           # symtrace at 2k/10k/50k, torch.fx at 2k/10k
    python benchmarks/rewrite_bench.py --full    # also torch.fx at 50k (once; ~100 s each on the chain)
    python benchmarks/rewrite_bench.py --full --shapes wide --sizes 50000 --fx-repeats 3

Graphs (built directly with each library's Graph API, ~3 nodes per block):
  chain   h = x;   per block: a = torch.add(h, y); r = torch.relu(a); m = operator.mul(r, 2.0); h = m
  wide    per block: a = torch.add(x, y); r = torch.relu(a); m = operator.mul(r, 2.0); return all m

Pattern relu(add(a, b)), replacement clamp_min(add(a, b), 0.0). Timed: median process (CPU)
time over N fresh graphs (7 at <=10k nodes, 3 at 50k; torch.fx at 50k once); graph building
not timed; torch.set_num_threads(1); gc.collect() before each run. The measurements of one
graph are interleaved (one run of each, in turn, N times), so that a slow spell of a shared
machine falls on both libraries alike:
  match           symtrace SubgraphMatcher(pattern).match(gm)  vs  torch.fx
                  SubgraphMatcher(pattern_graph, match_output=False, match_placeholder=False,
                  remove_overlapping_matches=True).match(graph)   (matchers built beforehand)
  rewrite         symtrace replace_pattern(gm, pattern, replacement)  (no code generation)
  rewrite+code    the same, then gm.recompile(), which generates the source; symtrace compiles
                  it lazily (first call or read of gm.forward), so this leaves out CPython's
                  compile(), which torch.fx's replace_pattern pays (it recompiles)
  +compile        rewrite+code, then reading gm.forward (compiles; symtrace's code-object cache is
                  cleared before each run, untimed): the same work as torch.fx's
  speedup columns: fx match / match; fx rewrite / rewrite+code; fx rewrite / +compile

Targets: match and rewrite+code >= 10x faster than torch.fx at every size (see +compile for
the comparison including compilation); 50k chain rewrite < 1 s; near-linear growth (log-log
slope ~1).
"""
from __future__ import annotations

import argparse
import gc
import math
import operator
import os
import statistics
import sys
import time
import warnings
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore", message=".*NumPy.*")

import torch  # noqa: E402
import torch.fx  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher as FxMatcher  # noqa: E402

from symtrace.graph import Graph, GraphModule  # noqa: E402
from symtrace.graph.codegen import clear_code_cache  # noqa: E402
from symtrace.passes.matcher import SubgraphMatcher  # noqa: E402
from symtrace.passes.rewrite import replace_pattern  # noqa: E402

SIZES = (2_000, 10_000, 50_000)
FX_DEFAULT_SIZES = (2_000, 10_000)


def pattern(a, b):
    return torch.relu(torch.add(a, b))


def replacement(a, b):
    return torch.clamp_min(torch.add(a, b), 0.0)


# --- graphs ----------------------------------------------------------------------------------
def build(graph, shape: str, nodes: int):
    """Fill ``graph`` (a symtrace or torch.fx Graph: same building API) with ~``nodes`` nodes."""
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    h = x
    outs = []
    for _ in range(max(1, (nodes - 3) // 3)):
        a = graph.call_function(torch.add, (h if shape == "chain" else x, y))
        r = graph.call_function(torch.relu, (a,))
        m = graph.call_function(operator.mul, (r, 2.0))
        if shape == "chain":
            h = m
        else:
            outs.append(m)
    graph.output(h if shape == "chain" else tuple(outs))
    return graph


def symtrace_module(shape: str, nodes: int) -> GraphModule:
    return GraphModule(torch.nn.Module(), build(Graph(), shape, nodes))


def fx_module(shape: str, nodes: int) -> torch.fx.GraphModule:
    return torch.fx.GraphModule(torch.nn.Module(), build(torch.fx.Graph(), shape, nodes))


# --- timing ----------------------------------------------------------------------------------
def timed(cases: dict, repeats: int) -> dict:
    """``{name: (make, run)}`` -> ``{name: median CPU seconds of run(make())}`` over fresh
    inputs, the cases taking turns (process time: the machine may be shared, and CPU time is
    what the code costs)."""
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (make, run) in cases.items():
            obj = make()
            gc.collect()
            t0 = time.process_time()
            run(obj)
            times[name].append(time.process_time() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def slope(sizes, times) -> float:
    """Least-squares slope of log(time) over log(size)."""
    xs = [math.log(s) for s in sizes]
    ys = [math.log(t) for t in times]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def histogram(graph) -> Counter:
    return Counter((n.op, getattr(n.target, "__name__", n.target)) for n in graph.nodes)


def check_same_numbers() -> None:
    """Both rewriters, on small chain and wide graphs, give the eager numbers and the same ops."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for shape in ("chain", "wide"):
        st, fx = symtrace_module(shape, 60), fx_module(shape, 60)
        ref = st(x, y)
        n_st = len(replace_pattern(st, pattern, replacement))
        n_fx = len(torch.fx.subgraph_rewriter.replace_pattern(fx, pattern, replacement))
        st.graph.lint()
        out_st, out_fx = st(x, y), fx(x, y)
        flat = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
        same = all(torch.equal(a, b) for a, b in zip(flat(out_st), flat(out_fx)))
        eager = all(torch.equal(a, b) for a, b in zip(flat(out_st), flat(ref)))
        hist_st = {k: v for k, v in histogram(st.graph).items() if k[0] == "call_function"}
        hist_fx = {k: v for k, v in histogram(fx.graph).items() if k[0] == "call_function"}
        if not (same and eager and n_st == n_fx and hist_st == hist_fx):
            raise SystemExit(f"{shape}: results differ (symtrace {n_st} matches, fx {n_fx}; "
                             f"same numbers: {same}, equal to eager: {eager}, ops {hist_st} vs {hist_fx})")
        print(f"check {shape}: {n_st} replacements each, same numbers as torch.fx and as before the rewrite")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="also run torch.fx at 50k nodes (once, slow)")
    ap.add_argument("--fx-repeats", type=int, default=1,
                    help="with --full: runs of torch.fx at 50k, taking turns with symtrace's")
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    ap.add_argument("--shapes", nargs="*", default=["chain", "wide"], choices=["chain", "wide"])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    check_same_numbers()

    st_matcher = SubgraphMatcher(pattern)
    fx_pattern = torch.fx.symbolic_trace(pattern).graph
    fx_matcher = FxMatcher(fx_pattern, match_output=False, match_placeholder=False,
                           remove_overlapping_matches=True)

    def st_match(gm):
        return st_matcher.match(gm)

    def st_rewrite(gm):
        replace_pattern(gm, pattern, replacement)

    def st_rewrite_code(gm):
        replace_pattern(gm, pattern, replacement)
        gm.recompile()

    def st_rewrite_compile(gm):
        st_rewrite_code(gm)
        gm.forward  # noqa: B018 - the first read compiles

    def fx_match(gm):
        return fx_matcher.match(gm.graph)

    def fx_rewrite(gm):
        torch.fx.subgraph_rewriter.replace_pattern(gm, pattern, replacement)

    rows, series = [], {}
    fmt = lambda t: f"{t * 1e3:,.1f}" if t is not None else "skipped"  # noqa: E731
    ratio = lambda a, b: (f"{a / b:,.1f}x" if a / b < 100 else f"{a / b:,.0f}x") if a is not None else "-"  # noqa: E731
    for shape in args.shapes:
        for n in args.sizes:
            reps = args.repeats if n <= 10_000 else max(1, args.repeats // 2)
            make_st = lambda: symtrace_module(shape, n)  # noqa: E731
            make_fx = lambda: fx_module(shape, n)  # noqa: E731
            # symtrace caches code objects by source text: clear it, or every run after the
            # first would reuse the first run's compiled code
            make_st_cold = lambda: (clear_code_cache(), make_st())[1]  # noqa: E731
            n_nodes = len(make_st().graph)
            n_matches = len(st_match(make_st()))
            run_fx = n in FX_DEFAULT_SIZES or (args.full and n <= 50_000)
            cases = {"match": (make_st, st_match), "rewrite": (make_st, st_rewrite),
                     "rewrite+code": (make_st, st_rewrite_code), "+compile": (make_st_cold, st_rewrite_compile)}
            fx_cases = {"fx match": (make_fx, fx_match), "fx rewrite": (make_fx, fx_rewrite)}
            if run_fx:
                fx_found = len(fx_match(make_fx()))
                if fx_found != n_matches:
                    raise SystemExit(f"{shape} {n}: torch.fx finds {fx_found} matches, symtrace {n_matches}")
                if n in FX_DEFAULT_SIZES or args.fx_repeats >= reps:  # taking turns with symtrace
                    cases.update(fx_cases)
            t = timed(cases, reps)
            if run_fx and "fx match" not in t:  # torch.fx at 50k: fewer runs (~100 s each on the chain)
                t.update(timed(fx_cases, args.fx_repeats))
            m_st, r_st, rc_st, rcc_st = t["match"], t["rewrite"], t["rewrite+code"], t["+compile"]
            m_fx, r_fx = t.get("fx match"), t.get("fx rewrite")
            series.setdefault(shape, []).append((n_nodes, m_st, r_st, rc_st, rcc_st))
            rows.append([shape, f"{n_nodes:,}", f"{n_matches:,}", fmt(m_st), fmt(m_fx), ratio(m_fx, m_st),
                         fmt(r_st), fmt(rc_st), fmt(rcc_st), fmt(r_fx), ratio(r_fx, rc_st), ratio(r_fx, rcc_st)])
            print(f"  done {shape} {n}", file=sys.stderr, flush=True)
    print()
    print(tabulate(rows, headers=["graph", "nodes", "matches", "match ms", "fx match ms", "speedup",
                                  "rewrite ms", "rewrite+code ms", "+compile ms", "fx rewrite ms",
                                  "speedup", "speedup +compile"],
                   colalign=("left",) + ("right",) * 11))
    print()
    if len(args.sizes) < 2:  # (no growth to fit)
        return
    growth = []
    for shape, pts in series.items():
        sizes = [p[0] for p in pts]
        growth.append([shape] + [f"{slope(sizes, [p[i] for p in pts]):.2f}" for i in (1, 2, 3, 4)])
    print("growth exponents of symtrace (log-log slope over sizes; 1.0 = linear)")
    print(tabulate(growth, headers=["graph", "match", "rewrite", "rewrite+code", "+compile"]))


if __name__ == "__main__":
    main()
