"""Per-call overheads of guarded graphs.

    python benchmarks/guard_bench.py [--quick]

1. Entry-guard check: a function with 5 tensor inputs and a trivial graph, traced with
   example inputs (4 entry guards per tensor: isinstance, dtype, device, ndim), called as
   ``gm(*xs)``, against the same graph with its guards removed (``gm.graph.guards = []``,
   ``gm.recompile()``). The difference is the guard check's cost per call. torch.fx's trace of
   the same function and the plain Python function are shown for reference.
2. ``symtrace.capture``: per-call overhead of the capture wrapper (guard-keyed cache lookup)
   against calling its captured GraphModule directly, on a trivial function and a tiny module
   (cheap bodies, so the overhead is not lost in noise); skipped if ``symtrace.capture`` is absent.
3. Entry guards of a captured model checked against the live model, per call: a Hugging Face
   Llama decoder (random weights, a tiny config of 2 and 8 layers; skipped without
   ``transformers``), its decode-step graph's guards as generated (submodules, parameters and
   buffers read from the modules' ``_modules`` / ``_parameters`` / ``_buffers`` tables), the same
   guards read as attributes (``root.model.layers...``: nn.Module answers those from a Python
   ``__getattr__``), and one eager decode step for scale.
4. Tracing with example inputs vs one eager forward on the two example models
   (``examples.models``: SmallResNet, TransformerBlock).

Per-call costs are medians (min) over interleaved timeit rounds (callables alternate, so\nbackground load hits them alike); differences are medians of per-round differences. 1 thread.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import timeit
import warnings
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", message=".*NumPy.*")
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")

import torch  # noqa: E402
import torch.fx  # noqa: E402
from tabulate import tabulate  # noqa: E402

import symtrace  # noqa: E402
from examples import models  # noqa: E402


def five(a, b, c, d, e):
    return a


def five_add(a, b, c, d, e):
    return a + b + c + d + e


def per_call_us(fns: Dict[str, Callable[[], object]], budget_s: float, repeat: int) -> Dict[str, List[float]]:
    """Microseconds per call of each callable, ``repeat`` values each. The callables are timed
    round-robin (interleaved), so load from other processes hits them alike; each timing
    covers ``number`` calls, calibrated so one round of one callable takes about ``budget_s``."""
    numbers = {}
    for k, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < 0.02:
            fn()
            n += 1
        per = (time.perf_counter() - t0) / n
        numbers[k] = max(10, int(budget_s / per))
    out: Dict[str, List[float]] = {k: [] for k in fns}
    gc.collect()
    for _ in range(repeat):
        for k, fn in fns.items():
            out[k].append(timeit.timeit(fn, number=numbers[k]) / numbers[k] * 1e6)
    return out


def paired_diff(a: List[float], b: List[float]) -> List[float]:
    """Round-by-round differences of two interleaved series."""
    return [x - y for x, y in zip(a, b)]


def med(xs: List[float]) -> float:
    return statistics.median(xs)


def fmt_us(xs: List[float]) -> str:
    return f"{med(xs):.2f} ({min(xs):.2f})"


def fmt_diff(a: List[float], b: List[float]) -> str:
    """Median of the per-round differences, and the difference of the minima (the least
    load-sensitive estimate)."""
    return f"{med(paired_diff(a, b)):.2f} ({min(a) - min(b):.2f})"


def guard_rows(budget: float, repeat: int) -> List[list]:
    rows = []
    xs = tuple(torch.randn(4) for _ in range(5))
    for fn in (five, five_add):
        gm = symtrace.symbolic_trace(fn, example_inputs=xs)
        n_guards = len(gm.graph.guards)
        bare = copy.deepcopy(gm)
        bare.graph.guards = []
        bare.recompile()
        assert "_ok" not in bare.code and "_ok" in gm.code, "guards were not removed from the code"
        fxgm = torch.fx.symbolic_trace(fn)
        t = per_call_us({"guarded": lambda: gm(*xs), "bare": lambda: bare(*xs), "fx": lambda: fxgm(*xs),
                         "py": lambda: fn(*xs)}, budget, repeat)
        diff = paired_diff(t["guarded"], t["bare"])
        name = f"{fn.__name__}: {'return a' if fn is five else 'a+b+c+d+e'}"
        rows.append([name, "symtrace gm(*xs), guarded", n_guards, fmt_us(t["guarded"]), ""])
        rows.append([name, "symtrace gm(*xs), guards removed", 0, fmt_us(t["bare"]), ""])
        rows.append([name, "=> entry guard check", n_guards, fmt_diff(t["guarded"], t["bare"]),
                     f"{med(diff) / n_guards:.3f} ({(min(t['guarded']) - min(t['bare'])) / n_guards:.3f}) us/guard"])
        rows.append([name, "torch.fx gm(*xs)", "-", fmt_us(t["fx"]), ""])
        rows.append([name, "plain Python fn(*xs)", "-", fmt_us(t["py"]), ""])
    return rows


def capture_rows(budget: float, repeat: int) -> List[list]:
    cap_fn = getattr(symtrace, "capture", None)
    if cap_fn is None:
        return [["capture", "symtrace.capture does not exist yet: skipped", "", "", ""]]
    rows = []
    xs = tuple(torch.randn(4) for _ in range(5))
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).eval()
    cases = [("five: return a (function)", five, xs), ("nn.Linear(4, 4) (module)", lin, (torch.randn(2, 4),))]
    for name, target, inputs in cases:
        try:
            cap = cap_fn(target)
            with torch.no_grad():
                ref = target(*inputs)
                out = cap(*inputs)  # first call captures
            if not torch.allclose(out, ref):
                rows.append([name, "capture: WRONG ANSWER on first call", "", "", ""])
                continue
            graphs = getattr(cap, "graphs", None)
            if not graphs:
                rows.append([name, "capture: no .graphs attribute to compare against: skipped", "", "", ""])
                continue
            gm = graphs[0]
            with torch.no_grad():
                t = per_call_us({"cap": lambda: cap(*inputs), "gm": lambda: gm(*inputs)}, budget, repeat)
            rows.append([name, "capture(f)(*xs), cached", "", fmt_us(t["cap"]), ""])
            rows.append([name, "its GraphModule gm(*xs)", len(gm.graph.guards), fmt_us(t["gm"]), ""])
            rows.append([name, "=> capture wrapper overhead", "", fmt_diff(t["cap"], t["gm"]),
                         f"{med(t['cap']) / med(t['gm']):.3f}x"])
        except Exception as e:  # capture is being written concurrently: report, don't die
            rows.append([name, f"capture failed: {type(e).__name__}: {str(e)[:80]}", "", "", ""])
    return rows


def _guard_check_function(guards) -> Callable:
    """The entry-guard test generated code runs (shared reads bound once), as a function of the
    inputs the guards read and ``root``."""
    import math
    import operator
    from symtrace.graph.guards import entry_guard_test
    names = sorted({n for g in guards for n in g.expr.inputs()})
    env = {"torch": torch, "operator": operator, "math": math, "sys": sys}
    body = entry_guard_test(guards, env, share="_gv")
    exec(compile(f"def check({', '.join(names + ['root'])}):\n    return {body}\n", "<guards>", "exec"), env)
    return env["check"], names


def decoder_guard_rows(budget: float, repeat: int) -> List[list]:
    try:
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    except ImportError:
        return [["decoder", "transformers is not installed: skipped", "", "", ""]]
    import inspect
    from symtrace.graph.guard_expr import as_attributes
    from symtrace.graph.guards import Guard
    rows = []
    for layers in (2, 8):
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        eager_forward = model.forward
        cap = symtrace.capture(model.forward)
        seen = {}

        def record(gm):
            real = gm.forward

            def forward(*a, **k):
                seen["call"] = (gm, inspect.signature(real).bind(*a, **k))
                return real(*a, **k)
            return forward
        ids = torch.randint(0, 256, (1, 8))
        with torch.no_grad():
            cache = DynamicCache(config=cfg)
            tok = cap(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            cap(input_ids=tok, past_key_values=cache, use_cache=True)       # the decode graph
            gm = cap.graphs[0]
            gm.forward = record(gm)
            cap(input_ids=tok, past_key_values=cache, use_cache=True)
            del gm.forward
        _, bound = seen["call"]
        bound.apply_defaults()
        guards = list(gm.graph.guards)
        as_attrs = [Guard(g.kind, as_attributes(g.expr), g.expected, g.check, g.source, g.reason) for g in guards]
        fns = {}
        for label, gs in (("members", guards), ("attributes", as_attrs)):
            check, names = _guard_check_function(gs)
            args = [bound.arguments[n] for n in names] + [model]
            assert check(*args), "the guards fail on the call they were recorded from"
            fns[label] = (lambda c=check, a=args: c(*a))

        def step():   # (the step appends to the cache: crop it back, so every step sees 9 positions)
            eager_forward(input_ids=tok, past_key_values=cache, use_cache=True)
            cache.crop(-1)
        with torch.no_grad():
            t = per_call_us({**fns, "eager": step}, budget, max(5, repeat // 4))
        name = f"Llama decode step, {layers} layers"
        rows.append([name, "entry guards, members read from module tables", len(guards), fmt_us(t["members"]),
                     f"{med(t['members']) / med(t['eager']):.1%} of eager"])
        rows.append([name, "the same guards read as attributes", len(guards), fmt_us(t["attributes"]),
                     f"{med(t['attributes']) / med(t['members']):.2f}x members"])
        rows.append([name, "one eager decode step", "-", fmt_us(t["eager"]), ""])
    return rows


def trace_vs_eager_rows(repeat: int) -> List[list]:
    rows = []
    for name in ("resnet", "transformer"):
        m = models.build(name)
        xs = models.example_inputs(name)
        with torch.no_grad():
            def trace():
                return symtrace.symbolic_trace(m, example_inputs=xs)

            def sym():
                return symtrace.symbolic_trace(m)

            def eager():
                return m(*xs)
            res = {}
            for label, fn in (("trace+values", trace), ("symbolic trace", sym), ("fx trace", lambda: torch.fx.symbolic_trace(m)),
                              ("eager forward", eager)):
                fn()
                ts = []
                for _ in range(repeat):
                    gc.collect()
                    t0 = time.perf_counter()
                    fn()
                    ts.append((time.perf_counter() - t0) * 1e3)
                res[label] = ts
        n = len(symtrace.symbolic_trace(m, example_inputs=xs).graph.nodes)
        for label, ts in res.items():
            ratio = med(ts) / med(res["eager forward"])
            rows.append([f"{name} ({n} nodes)", label, f"{med(ts):.3f} ({min(ts):.3f})", f"{ratio:.2f}x eager"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    budget, repeat = (0.01, 7) if args.quick else (0.02, 41)
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, 1 thread; "
          f"per call: median (min) over {repeat} interleaved rounds of ~{budget * 1e3:.0f} ms each")
    print()
    print("Entry guard check (5 tensor inputs)")
    print(tabulate(guard_rows(budget, repeat), headers=["graph", "call", "guards", "us/call", "note"],
                   disable_numparse=True))
    print()
    print("symtrace.capture overhead")
    print(tabulate(capture_rows(budget, repeat), headers=["model", "call", "guards", "us/call", "ratio"],
                   disable_numparse=True))
    print()
    print("Entry guards of a captured decoder against the live model")
    print(tabulate(decoder_guard_rows(budget, repeat), headers=["model", "call", "guards", "us/call", "note"],
                   disable_numparse=True))
    print()
    print("Tracing with example inputs vs one eager forward (examples.models, default sizes; ms median (min))")
    print(tabulate(trace_vs_eager_rows(5 if args.quick else 15), headers=["model", "what", "ms", "vs eager"],
                   disable_numparse=True))


if __name__ == "__main__":
    main()
