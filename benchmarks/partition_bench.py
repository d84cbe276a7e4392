"""Capability-based partitioning: symtrace.passes.partition against torch.fx's
CapabilityBasedPartitioner.propose_partitions, on the same synthetic graphs.

    python benchmarks/partition_bench.py            # fx up to 10k nodes
    python benchmarks/partition_bench.py --full     # fx on 50k nodes too (very slow)
    python benchmarks/partition_bench.py --quick    # 2k and 10k only, one repeat

Graphs (n call nodes, built directly, no tracing; x is the one input)
  chain   h = op(h) n times
  wide    a grid 64 values wide: node (layer l, column j) = op(prev[j], prev[(j + 1) % 64]),
          so every value feeds two nodes of the next layer
Support patterns
  alt     every other node supported (supported: torch.relu / torch.add, others torch.neg / torch.sub)
  all     every node supported

Timing: median of --repeat runs (symtrace) after one warm-up; torch.fx runs once per case in a
child process and is stopped after --fx-timeout seconds (shown as "> T"). Only the partition
proposal is timed (no fusing). torch.set_num_threads(1). The growth exponent k is the slope
of log(time) against log(n) (time ~ n^k), fitted over the sizes measured.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
from torch import nn  # noqa: E402

WIDTH = 64
SUPPORTED_FNS = (torch.relu, torch.add)


def _ops(kind: str, i: int, pattern: str, two: bool):
    sup = pattern == "all" or i % 2 == 0
    if two:
        return torch.add if sup else torch.sub
    return torch.relu if sup else torch.neg


def build_symtrace(kind: str, pattern: str, n: int):
    from symtrace.graph import Graph, GraphModule
    g = Graph()
    x = g.placeholder("x")
    if kind == "chain":
        h = x
        for i in range(n):
            h = g.call_function(_ops(kind, i, pattern, False), (h,))
        g.output(h)
    else:
        prev = [g.call_function(_ops(kind, j, pattern, False), (x,)) for j in range(WIDTH)]
        i = WIDTH
        while i < n:
            cur = []
            for j in range(WIDTH):
                cur.append(g.call_function(_ops(kind, i, pattern, True), (prev[j], prev[(j + 1) % WIDTH])))
                i += 1
            prev = cur
        g.output(tuple(prev))
    return GraphModule(nn.Module(), g)


def build_fx(kind: str, pattern: str, n: int):
    import torch.fx as fx
    g = fx.Graph()
    x = g.placeholder("x")
    if kind == "chain":
        h = x
        for i in range(n):
            h = g.call_function(_ops(kind, i, pattern, False), (h,))
        g.output(h)
    else:
        prev = [g.call_function(_ops(kind, j, pattern, False), (x,)) for j in range(WIDTH)]
        i = WIDTH
        while i < n:
            cur = []
            for j in range(WIDTH):
                cur.append(g.call_function(_ops(kind, i, pattern, True), (prev[j], prev[(j + 1) % WIDTH])))
                i += 1
            prev = cur
        g.output(tuple(prev))
    return fx.GraphModule(nn.Module(), g)


def time_symtrace(kind, pattern, n, repeat):
    from symtrace.passes.partition import partition
    gm = build_symtrace(kind, pattern, n)
    sup = lambda node: node.target in SUPPORTED_FNS  # noqa: E731
    parts = partition(gm, sup)  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        parts = partition(gm, sup)
        times.append(time.perf_counter() - t)
    return statistics.median(times), len(parts), sum(len(p) for p in parts)


def _fx_child(kind, pattern, n, q):
    torch.set_num_threads(1)
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    class Support(OperatorSupportBase):
        def is_node_supported(self, submodules, node):
            return node.op == "call_function" and node.target in SUPPORTED_FNS

    gm = build_fx(kind, pattern, n)
    t = time.perf_counter()
    parts = CapabilityBasedPartitioner(gm, Support()).propose_partitions()
    q.put((time.perf_counter() - t, len(parts), sum(len(p.nodes) for p in parts)))


def time_fx(kind, pattern, n, timeout):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_fx_child, args=(kind, pattern, n, q))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.terminate()
        p.join()
        return None
    return q.get() if not q.empty() else None


def slope(points):
    pts = [(math.log(n), math.log(t)) for n, t in points if t and t > 0]
    if len(pts) < 2:
        return float("nan")
    mx = sum(a for a, _ in pts) / len(pts)
    my = sum(b for _, b in pts) / len(pts)
    num = sum((a - mx) * (b - my) for a, b in pts)
    den = sum((a - mx) ** 2 for a, _ in pts)
    return num / den


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="run torch.fx on 50k-node graphs too")
    ap.add_argument("--quick", action="store_true", help="2k and 10k only, one repeat")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fx-timeout", type=float, default=120.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [2000, 10000] if args.quick else [2000, 10000, 50000]
    repeat = 1 if args.quick else args.repeat
    fx_max = 50000 if args.full else 10000

    print(f"{'graph':<12} {'nodes':>6} | {'symtrace s':>10} {'parts':>6} {'in parts':>8} | "
          f"{'torch.fx s':>10} {'parts':>6} {'in parts':>8} | {'fx/sym':>8}")
    print("-" * 90)
    fits = []
    for kind in ("chain", "wide"):
        for pattern in ("alt", "all"):
            sym_pts, fx_pts = [], []
            fx_dead = False
            for n in sizes:
                ts, np_, nn_ = time_symtrace(kind, pattern, n, repeat)
                sym_pts.append((n, ts))
                fx_txt = f"{'-':>10} {'':>6} {'':>8} | {'':>8}"
                if n <= fx_max and not fx_dead:
                    r = time_fx(kind, pattern, n, args.fx_timeout)
                    if r is None:
                        fx_dead = True
                        fx_txt = f"{'> %.0f' % args.fx_timeout:>10} {'':>6} {'':>8} | {'> %.0fx' % (args.fx_timeout / ts):>8}"
                    else:
                        tf, fp, fn_ = r
                        fx_pts.append((n, tf))
                        fx_txt = f"{tf:>10.3f} {fp:>6} {fn_:>8} | {tf / ts:>7.0f}x"
                print(f"{kind + '/' + pattern:<12} {n:>6} | {ts:>10.3f} {np_:>6} {nn_:>8} | {fx_txt}", flush=True)
            fits.append((f"{kind}/{pattern}", slope(sym_pts), slope(fx_pts)))
    print()
    print("growth exponent k (time ~ n^k):")
    for name, ks, kf in fits:
        fx_k = "n/a (timed out)" if math.isnan(kf) else f"{kf:.2f}"
        print(f"  {name:<12} symtrace k = {ks:.2f}   torch.fx k = {fx_k}")
    worst = max(t for kind in ("chain", "wide") for pattern in ("alt", "all")
                for t in [time_symtrace(kind, pattern, sizes[-1], 1)[0]])
    print(f"\nslowest symtrace case at {sizes[-1]} nodes: {worst:.3f} s (target < 1 s)")


if __name__ == "__main__":
    main()
