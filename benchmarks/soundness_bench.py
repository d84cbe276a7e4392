"""Soundness on programs no one here wrote: the acceptance corpus (tests/corpus, extracted from
PyTorch's own test suites) run under symtrace and under other capture tools.

    python benchmarks/soundness_bench.py [--workers 2] [--tools capture,strict,...]
                                         [--programs name,name] [--timeout 300] [--json out.json]

Tools (one row each): symtrace ``capture``, ``strict`` (``symbolic_trace`` with the first input
set as example inputs), ``symbolic`` (without example inputs), ``fx`` (``torch.fx.symbolic_trace``),
``jit_trace`` (``torch.jit.trace`` on the first input set), ``dynamo_fullgraph`` and ``dynamo``
(``torch.compile(backend="eager", fullgraph=True/False)``, ``torch._dynamo.reset()`` before each).

Each program runs in a process of its own (forked from a server that has imported torch,
Dynamo, symtrace and the corpus), all tools one after another; if the process dies or hangs
(``--timeout`` seconds per program), the tool it was running counts as ``crash`` and the
remaining tools run in a fresh process. ``--workers`` processes run at a time.

Outcomes (tests/corpus/runner.py): ``ok`` eager's answer on every input set and after the
state flip (outputs, inputs mutated in place, globals, module state); ``refused`` a loud
refusal -- symtrace's TraceError/GuardError (GuardError counts here even for capture, which
must not raise it; the test suite holds capture to ``ok``), any exception while building an
fx/jit trace, a Dynamo Unsupported-style error; ``wrong`` a different answer with no error;
``crash`` any other exception or a dead process. Note that Dynamo answers
``torch.compiler.is_compiling()`` with True on purpose (program ``is_compiling``).

This is a benchmark, not a test: pytest never runs it.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
for p in (ROOT, TESTS):
    if p not in sys.path:
        sys.path.insert(0, p)

TOOLS = ("capture", "strict", "symbolic", "fx", "jit_trace", "dynamo_fullgraph", "dynamo")
OUTCOMES = ("ok", "refused", "wrong", "crash")
_PRELOAD = ["torch", "torch.fx", "torch._dynamo", "symtrace", "corpus", "corpus.runner",
            "corpus.programs_functions", "corpus.programs_misc", "corpus.programs_repros",
            "corpus.programs_modules", "corpus.programs_fx"]


# ---------------------------------------------------------------------------------------------
# the child: one program, the given tools in order, one message per tool
# ---------------------------------------------------------------------------------------------
def _child(conn, name: str, tools: List[str]) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)  # Dynamo's graph-break logs, jit warnings, prints
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    import logging
    import warnings

    import torch
    warnings.simplefilter("ignore")
    try:
        torch._logging.set_logs(dynamo=logging.CRITICAL, graph_breaks=False, recompiles=False)
    except Exception:  # noqa: BLE001 - older/newer logging API
        pass
    torch.set_num_threads(1)
    from corpus import load_programs
    from corpus.runner import run_program

    prog = {p.name: p for p in load_programs()}[name]
    for tool in tools:
        conn.send(("start", tool))
        try:
            res = run_program(prog, tool)
            msg = {"outcome": res.outcome, "reason": res.reason, "exc_type": res.exc_type}
        except BaseException as e:  # noqa: BLE001 - a harness error still belongs to this tool
            msg = {"outcome": "crash", "reason": f"harness: {type(e).__name__}: {e}"[:300],
                   "exc_type": type(e).__name__, "trace": traceback.format_exc()[-2000:]}
        conn.send(("done", tool, msg))
    conn.close()


def _run_isolated(ctx, name: str, tools: List[str], timeout: float) -> Dict[str, dict]:
    """All tools on one program, in child processes; restart after a death or a hang."""
    results: Dict[str, dict] = {}
    todo = list(tools)
    while todo:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(child, name, todo), daemon=True)
        proc.start()
        child.close()
        current: Optional[str] = None
        deadline = time.monotonic() + timeout
        dead_reason = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                dead_reason = f"timeout after {timeout:.0f}s"
                proc.kill()
                break
            try:
                if parent.poll(min(left, 1.0)):
                    msg = parent.recv()
                    if msg[0] == "start":
                        current = msg[1]
                    else:
                        results[msg[1]] = msg[2]
                        current = None
                        if len(results) == len(tools):
                            break
                    continue
            except (EOFError, OSError):
                pass
            if not proc.is_alive() and not parent.poll(0):
                dead_reason = f"the process died (exit code {proc.exitcode})"
                break
        proc.join(5)
        parent.close()
        todo = [t for t in tools if t not in results]
        if todo and dead_reason is not None:
            victim = current or todo[0]
            results[victim] = {"outcome": "crash", "reason": dead_reason, "exc_type": ""}
            todo = [t for t in todo if t != victim]
        elif todo:  # the child exited without reporting them: count them as crashes
            for t in todo:
                results[t] = {"outcome": "crash", "reason": "no result from the process", "exc_type": ""}
            todo = []
    return results


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
def _table(results: Dict[str, Dict[str, dict]], tools: List[str]) -> str:
    from tabulate import tabulate
    rows = []
    n = len(results)
    for tool in tools:
        c = collections.Counter(r[tool]["outcome"] for r in results.values() if tool in r)
        rows.append([tool] + [c.get(o, 0) for o in OUTCOMES] + [f"{100.0 * c.get('ok', 0) / max(n, 1):.1f}%"])
    return tabulate(rows, headers=["tool"] + list(OUTCOMES) + ["% ok"], tablefmt="github")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--programs", default="", help="comma-separated program names (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per program process")
    ap.add_argument("--json", default="", help="write every result here")
    args = ap.parse_args(argv)

    tools = [t for t in args.tools.split(",") if t]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        ap.error(f"unknown tools {unknown}; choose from {TOOLS}")
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from corpus import load_programs
    programs = load_programs()
    if args.programs:
        wanted = set(args.programs.split(","))
        programs = [p for p in programs if p.name in wanted]
    origins = collections.Counter(p.origin.split("::")[0] for p in programs)

    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
    except ValueError:  # no forkserver on this platform
        ctx = mp.get_context("spawn")

    t0 = time.monotonic()
    results: Dict[str, Dict[str, dict]] = {}
    done = 0

    def one(p):
        return p.name, _run_isolated(ctx, p.name, tools, args.timeout)

    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        for name, res in pool.map(one, programs):
            results[name] = res
            done += 1
            if done % 25 == 0 or done == len(programs):
                print(f"  {done}/{len(programs)} programs, {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)

    print(f"\nSoundness on {len(programs)} programs from PyTorch's test suites "
          f"({', '.join(f'{k}: {v}' for k, v in sorted(origins.items()))}); "
          f"{time.monotonic() - t0:.0f}s with {args.workers} workers\n")
    print(_table(results, tools))
    for tool in [t for t in ("capture", "strict", "symbolic") if t in tools]:
        bad = [(n, r[tool]) for n, r in results.items() if r[tool]["outcome"] != "ok"]
        if tool != "capture":
            bad = [(n, r) for n, r in bad if r["outcome"] in ("wrong", "crash")]
        what = "not ok" if tool == "capture" else "wrong or crash"
        print(f"\nsymtrace {tool}: {len(bad)} programs {what}")
        for n, r in sorted(bad, key=lambda x: (x[1]["outcome"], x[0])):
            print(f"  {n:45s} {r['outcome']:8s} {r['reason'][:150]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tools": tools, "results": results}, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
