"""The ``lower`` subcommand: compile a traced graph with ``symtrace.lower.compile``, list its
kernels, check it against eager and time both.

``symtrace.lower`` is imported only here and only when the subcommand runs, so the rest of the
command line works without it; when it is missing the command says so and exits with
:attr:`ExitCode.LOWER_UNAVAILABLE`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
from typing import Any, Callable, List

from tabulate import tabulate

from .commands import prepare
from .errors import CliError, ExitCode, describe_exception

__all__ = ["cmd_lower", "lower_compile", "format_kernels", "time_interleaved", "quartiles", "speed_verdict"]


def lower_compile() -> Callable:
    """``symtrace.lower.compile``, or a :class:`CliError` saying why it cannot be had."""
    try:
        module = importlib.import_module("symtrace.lower")
    except ModuleNotFoundError as e:
        if e.name in ("symtrace.lower", "symtrace"):
            raise CliError(ExitCode.LOWER_UNAVAILABLE, "lowering is not available: this symtrace "
                                                       "has no symtrace.lower module") from None
        raise CliError(ExitCode.LOWER_UNAVAILABLE, "lowering is not available: importing "
                                                   f"symtrace.lower failed: {describe_exception(e)}") from None
    except Exception as e:
        raise CliError(ExitCode.LOWER_UNAVAILABLE, "lowering is not available: importing "
                                                   f"symtrace.lower failed: {describe_exception(e)}") from None
    fn = getattr(module, "compile", None)
    if not callable(fn):
        raise CliError(ExitCode.LOWER_UNAVAILABLE, "lowering is not available: symtrace.lower has "
                                                   "no compile() yet")
    return fn


def _node_names(nodes: Any) -> List[str]:
    return [getattr(n, "name", str(n)) for n in (nodes or ())]


def format_kernels(kernels: Any, width: int = 70) -> str:
    """A table of kernels: index, name, kind (when kernels have one), number of graph nodes
    and their names (clipped to ``width``)."""
    with_kind = any(hasattr(k, "kind") for k in kernels)
    rows = []
    for i, k in enumerate(kernels):
        names = _node_names(getattr(k, "nodes", None))
        text = ", ".join(names)
        if len(text) > width:
            text = text[:width - 1] + "…"
        kind = [str(getattr(k, "kind", ""))] if with_kind else []
        rows.append([i, getattr(k, "name", str(k)), *kind, len(names), text])
    headers = ["#", "kernel", *(["kind"] if with_kind else []), "nodes", "graph nodes"]
    return tabulate(rows, headers=headers, disable_numparse=True)


def time_interleaved(fns: List[Callable], inputs: tuple, repeat: int, warmup: int,
                     advance: Callable) -> List[List[float]]:
    """Seconds of each of ``fns`` over ``repeat`` rounds (after ``warmup``): every round calls
    each function once, in an order that alternates, so that load from other processes hits
    all of them alike."""
    for _ in range(warmup):
        for fn in fns:
            fn(*inputs)
            advance()
    samples: List[List[float]] = [[] for _ in fns]
    for r in range(repeat):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            t0 = time.perf_counter()
            fns[i](*inputs)
            samples[i].append(time.perf_counter() - t0)
            advance()
    return samples


def quartiles(xs: List[float]) -> tuple:
    """(first quartile, median, third quartile) of ``xs``."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def speed_verdict(eager: List[float], lowered: List[float]) -> str:
    """What the timings support: a speed-up (or slow-down) only where the interquartile ranges
    do not overlap; otherwise that no difference could be told apart from the spread."""
    e1, e2, e3 = quartiles(eager)
    l1, l2, l3 = quartiles(lowered)
    ratio = e2 / max(l2, 1e-12)
    if l3 < e1:
        return f"lowered is faster: {ratio:.2f}x eager (median)"
    if e3 < l1:
        return f"lowered is slower: {ratio:.2f}x eager (median)"
    return (f"no clear difference: the spreads overlap (median ratio {ratio:.2f}x); "
            "repeat with more --repeat or on a quieter machine")


def _check_against_eager(lowered: Any, eager: Any) -> None:
    import torch
    try:
        torch.testing.assert_close(lowered, eager)
    except (AssertionError, TypeError, ValueError) as e:
        raise CliError(ExitCode.LOWER_FAILED, "the lowered module does not compute what eager "
                                              f"PyTorch computes on these inputs:\n{e}") from None


def _text(lm: Any, attr: str) -> str:
    fn = getattr(lm, attr, None)
    if fn is None:
        return f"(the lowered module has no {attr}())"
    return str(fn() if callable(fn) else fn)


def cmd_lower(args: argparse.Namespace) -> int:
    import torch
    compile_fn = lower_compile()  # before tracing: fail fast when lowering is missing
    if not args.input:
        raise CliError(ExitCode.USAGE, "lower needs example inputs: add --input SHAPE once per "
                                       "argument of forward (e.g. --input 1x3x32x32)")
    model, inputs, gm = prepare(args, args.model)
    try:
        with args.progress(f"lowering for {args.target}"):
            lm = compile_fn(gm, inputs, target=args.target)
    except Exception as e:
        raise CliError(ExitCode.LOWER_FAILED, f"lowering {args.model} failed: "
                                              f"{describe_exception(e)}") from None
    kernels = getattr(lm, "kernels", None)
    reason = getattr(lm, "eager_reason", None)
    if reason:
        print(f"Not lowered, runs through torch: {reason}")
    if kernels is None:
        print("The lowered module does not list its kernels.")
    else:
        print(f"{len(kernels)} kernels for {args.target}:")
        if kernels:
            print(format_kernels(kernels))
    if args.report:
        print("\n" + _text(lm, "report"))
    if args.source:
        print("\n" + _text(lm, "source"))
    if not callable(lm):
        print("\nThe lowered module is not callable; not checked against eager or timed.")
        return ExitCode.OK
    with torch.no_grad():
        expected = model(*[t.clone() for t in inputs])  # clones: in-place models see fresh inputs
        try:
            got = lm(*[t.clone() for t in inputs])
        except Exception as e:
            raise CliError(ExitCode.LOWER_FAILED, "running the lowered module failed: "
                                                  f"{describe_exception(e)}") from None
        _check_against_eager(got, expected)
        print("\nmatches eager PyTorch on the example inputs")
        if args.repeat == 0:
            return ExitCode.OK
        with args.progress("timing", total=2 * (args.repeat + args.warmup)) as p:
            t_eager, t_low = time_interleaved([model, lm], inputs, args.repeat, args.warmup, p.advance)
    rows = []
    for name, ts in (("eager", t_eager), ("lowered", t_low)):
        q1, q2, q3 = quartiles(ts)
        rows.append([name, f"{q2 * 1e3:.3f}", f"{q1 * 1e3:.3f} .. {q3 * 1e3:.3f}"])
    print(tabulate(rows, headers=["", "median ms", "interquartile ms"], disable_numparse=True))
    print(speed_verdict(t_eager, t_low))
    print(f"({args.repeat} calls of each, interleaved; {torch.get_num_threads()} threads; "
          f"{_load_text()})")
    return ExitCode.OK


def _load_text() -> str:
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return "load average unknown"
    cores = os.cpu_count() or 1
    busy = "; the machine is busy, timings are noisy" if load > 0.75 * cores else ""
    return f"load average {load:.1f} on {cores} cores{busy}"
