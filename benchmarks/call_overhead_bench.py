"""Call overhead of a lowered module: what a call costs beyond its kernels' work, per kernel.

    python benchmarks/call_overhead_bench.py [--sizes 1 8 32] [--rounds 15] [--no-inductor]

Graphs of N tiny kernels on one-element tensors (the kernels' own work is a few ns each):

* ``outputs``    -- N pointwise results returned: N kernels, N fresh output tensors;
* ``reductions`` -- N chained whole-tensor sums: N kernels writing arena buffers, one output;
* ``externs``    -- N (1x1 matmul -> pointwise) pairs: a torch call before every kernel.

For each graph and N: the time of a call through ``LoweredModule`` (``module``) and of the
generated wrapper alone (``wrapper``: no nn.Module dispatch, no grad checks), the same wrapper
built with one ctypes call per kernel (``per-kernel``: ``wrapper.MAX_ENTRY_ARGS = 1``, i.e.
no entry points running several kernels), eager, and Inductor (``torch.compile``, default
mode) on the same function. "per kernel" is the slope
(t(N_max) - t(N_min)) / (N_max - N_min): what each added kernel costs, guards and module
dispatch excluded; for ``externs`` it includes the torch matmul each kernel comes with, so
compare it with eager's slope there. ``kernels`` is the C work of all N kernels of the wrapper's
calls (the entry points called with the same arguments, minus an empty C function taking as
many). Medians of ``--rounds`` rounds, each timing many calls; one thread (torch.set_num_threads(1)).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from symtrace.lower import compile as lower  # noqa: E402
from symtrace.lower import toolchain, wrapper  # noqa: E402


def outputs(n):
    def f(x):
        return tuple(x * (i + 1) + 1 for i in range(n))
    return f


def reductions(n):
    def f(x):
        for _ in range(n):
            x = (x + 1) * x.sum()
        return x
    return f


def externs(n):
    def f(x, w):
        for _ in range(n):
            x = torch.relu(x @ w + 1)
        return x
    return f


GRAPHS = {"outputs": (outputs, 1), "reductions": (reductions, 1), "externs": (externs, 2)}


def per_call_us(fn, args, min_time=0.02) -> float:
    """Microseconds per call: the loop count is chosen to take about ``min_time`` seconds."""
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        dt = time.perf_counter() - t0
        if dt >= min_time:
            return dt / n * 1e6
        n *= 4 if dt < min_time / 8 else 2


def kernel_work_us(lm, args) -> float | None:
    """C work of the wrapper's kernel calls for ``args``: each C function it calls, called
    through ctypes with the addresses of preallocated buffers, minus an empty C function with
    the same parameters. None when the module has no kernels."""
    variant = lm._first
    if variant is None or not variant.kernels:
        return None
    g = variant.call.__globals__
    empty_src = "".join(f"void st_empty{n}({', '.join(['void *p%d' % i for i in range(n)] + ['int nt'])}) "
                        f"{{ (void)nt; }}\n" for n in range(1, 129))
    empties = toolchain.load_library(empty_src)
    scratch = torch.zeros(64)
    total = 0.0
    names = [name for name in g if name.startswith(("_k", "_run")) and hasattr(g[name], "argtypes")]
    for name in names:
        fn = g[name]
        nargs = len(fn.argtypes) - 1
        empty = getattr(empties, f"st_empty{nargs}")
        empty.argtypes, empty.restype = fn.argtypes, None
        ptrs = [scratch.data_ptr()] * nargs + [1]   # one-element kernels: any float buffer will do
        total += per_call_us(fn, ptrs) - per_call_us(empty, ptrs)
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-inductor", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sizes = sorted(args.sizes)
    rows = []
    with torch.no_grad():
        for gname, (make, nin) in GRAPHS.items():
            inputs = (torch.randn(1),) if nin == 1 else (torch.randn(1, 1), torch.randn(1, 1))
            results = {}
            for n in sizes:
                fn = make(n)
                lm = lower(fn, inputs)
                variants = {"module": lm, "wrapper": lm._first.call}
                if hasattr(wrapper, "MAX_ENTRY_ARGS"):
                    saved, wrapper.MAX_ENTRY_ARGS = wrapper.MAX_ENTRY_ARGS, 1
                    try:
                        variants["per-kernel"] = lower(fn, inputs)._first.call
                    finally:
                        wrapper.MAX_ENTRY_ARGS = saved
                variants["eager"] = fn
                if not args.no_inductor:
                    comp = torch.compile(fn)
                    comp(*inputs)
                    variants["Inductor"] = comp
                for v in variants.values():
                    v(*inputs)
                times = {k: [] for k in variants}
                for _ in range(args.rounds):
                    for k, v in variants.items():
                        times[k].append(per_call_us(v, inputs))
                med = {k: statistics.median(t) for k, t in times.items()}
                med["kernels"] = kernel_work_us(lm, inputs)
                med["n_kernels"] = len(lm.kernels)
                results[n] = med
                print(f"  {gname} N={n} done", file=sys.stderr, flush=True)   # (Inductor compiles take minutes)
            rows.append((gname, results))
    print(f"torch {torch.__version__}, 1 thread, {args.rounds} rounds, medians in microseconds per call; "
          f"load average {os.getloadavg()[0]:.2f}")
    cols = [c for c in ("module", "wrapper", "per-kernel", "eager", "Inductor") if c in rows[0][1][sizes[0]]]
    print(f"\n{'graph':12s} {'N':>4s} {'kernels':>8s} " + " ".join(f"{c:>10s}" for c in cols) + f" {'C work':>8s}")
    for gname, results in rows:
        for n, med in results.items():
            work = f"{med['kernels']:8.2f}" if med["kernels"] is not None else f"{'-':>8s}"
            print(f"{gname:12s} {n:4d} {med['n_kernels']:8d} " + " ".join(f"{med[c]:10.2f}" for c in cols) + f" {work}")
    lo, hi = sizes[0], sizes[-1]
    if hi > lo:
        print(f"\nper kernel (slope from N={lo} to N={hi}, us):")
        print(f"{'graph':12s} " + " ".join(f"{c:>10s}" for c in cols) + f" {'wrapper-C':>10s}")
        for gname, results in rows:
            dn = results[hi]["n_kernels"] - results[lo]["n_kernels"]
            if dn <= 0:
                continue
            slope = {c: (results[hi][c] - results[lo][c]) / dn for c in cols}
            work = [results[n]["kernels"] for n in (lo, hi)]
            net = (f"{slope['wrapper'] - (work[1] - work[0]) / dn:10.2f}" if None not in work else f"{'-':>10s}")
            print(f"{gname:12s} " + " ".join(f"{slope[c]:10.2f}" for c in cols) + f" {net}")


if __name__ == "__main__":
    main()
