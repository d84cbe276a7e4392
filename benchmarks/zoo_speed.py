"""Lowering speed on the model zoo: eager vs ``symtrace.lower.compile`` (speed check on, as users
get it) on every zoo model, at the harness's example inputs (small images, batch 1-2).

What it measures is the guarantee "lowering never makes a model slower than eager" on models
nobody here tuned for, and how much the others gain. Each model runs in a fresh forked process
(``torch.set_num_threads(--threads)``); eager and lowered calls are interleaved, ``--rounds``
rounds of ``--calls`` calls each, medians. Runs in the zoo environment (see
``/work/shared/zoo/README.md``)::

    PYTHONPATH=.:benchmarks ~/zooenv/bin/python benchmarks/zoo_speed.py [--only REGEX] [--limit N]

Prints one row per model (ms per call, the ratio eager / lowered, whether the speed check sent
the model through torch, the compile seconds) and a summary: geometric mean, how many models are
slower than eager (below 0.97x, the noise floor of this kind of machine). Not a test.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import re
import statistics
import sys
import time
import warnings

ZOO = os.environ.get("ZOO", "/work/shared/zoo")


def _measure(name: str, threads: int, rounds: int, calls: int, conn) -> None:
    warnings.filterwarnings("ignore")
    try:
        import torch
        sys.path.insert(0, ZOO)
        import zoo
        from symtrace import lower
        torch.set_num_threads(threads)
        case = next(c for c in zoo.cases("all") if c.name == name)
        model, inputs = case.make()
        with torch.no_grad():
            t0 = time.perf_counter()
            lm = lower.compile(model, inputs)
            compile_s = time.perf_counter() - t0
            runners = {"eager": lambda: model(**inputs), "lowered": lambda: lm(**inputs)}
            for run in runners.values():
                run()
                run()
            times = {k: [] for k in runners}
            for _ in range(rounds):
                for key, run in runners.items():
                    t = time.perf_counter()
                    for _ in range(calls):
                        run()
                    times[key].append((time.perf_counter() - t) / calls)
        conn.send(dict(name=name, eager=statistics.median(times["eager"]) * 1e3,
                       lowered=statistics.median(times["lowered"]) * 1e3, compile_s=compile_s,
                       torch=lm.torch_reason is not None, kernels=len(lm.kernels)))
    except BaseException as e:  # noqa: BLE001 - every failure is a row
        conn.send(dict(name=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="regex over case names (family/model)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many cases")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args(argv)
    sys.path.insert(0, ZOO)
    import zoo
    names = [c.name for c in zoo.cases("all") if a.only is None or re.search(a.only, c.name)]
    if a.limit:
        names = names[:a.limit]
    ctx = mp.get_context("fork")
    rows = []
    for name in names:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_measure, args=(name, a.threads, a.rounds, a.calls, child))
        p.start()
        row = parent.recv() if parent.poll(a.timeout) else dict(name=name, error=f"timeout ({a.timeout:g} s)")
        p.join(5)
        if p.is_alive():
            p.kill()
        rows.append(row)
        if "error" in row:
            print(f"{name:55s} error  {row['error']}", flush=True)
        else:
            ratio = row["eager"] / row["lowered"]
            row["ratio"] = ratio
            print(f"{name:55s} eager {row['eager']:8.2f} ms  lowered {row['lowered']:8.2f} ms  {ratio:5.2f}x"
                  f"{'  (speed check: torch)' if row['torch'] else ''}  compile {row['compile_s']:.1f} s", flush=True)
    done = [r for r in rows if "ratio" in r]
    if done:
        geo = math.exp(sum(math.log(r["ratio"]) for r in done) / len(done))
        slow = [r for r in done if r["ratio"] < 0.97]
        slow_text = ", ".join(f"{r['name']} {r['ratio']:.2f}x" for r in slow) or "none"
        print(f"\n{len(done)} models measured ({len(rows) - len(done)} failed), {a.threads} threads: geomean "
              f"{geo:.2f}x eager, median {statistics.median(r['ratio'] for r in done):.2f}x; "
              f"{sum(r['torch'] for r in done)} sent through torch by the speed check; "
              f"{len(slow)} below 0.97x eager: {slow_text}")


if __name__ == "__main__":
    main()
