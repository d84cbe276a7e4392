"""End-to-end benchmark: the transformer encoder block of examples/models.py as eager, torch.compile
(Inductor, CPU), ``symtrace.lower.compile`` and ``torch.compile(backend=symtrace.backend(target="cpu"))``.

    python benchmarks/transformer_bench.py [--rounds 15] [--threads 2] [--sizes example,mid,large]
        [--clock wall|thread] [--no-inductor] [--no-backend] [--no-attention] [--profile] [--report] [--warm-cache]

Sizes (B x T x C, heads):
  example  2x8x64, 4    the example's default (``examples.models.example_inputs``); a call takes
                        about 0.1-0.2 ms, so this measures per-call overhead (wrappers, guards).
  mid      16x128x256, 4  activations 2 MiB, MLP hidden 8 MiB, attention scores 4 MiB: the
                        pointwise and row kernels stream memory beyond L2, while the matmuls
                        (3.5 GFLOP) leave them a visible share of the time.
  large    8x256x512, 8   4 MiB activations, 16 MiB hidden and scores; 14 GFLOP of matmuls.

Variants run interleaved round by round (machine noise hits all alike), under ``torch.no_grad``
with ``--threads`` intra-op threads. ``--clock thread --threads 1`` times the calling thread's
CPU time instead of wall time, which a busy machine disturbs less. Each sample times enough calls
to last a few ms; the table quotes medians and the best sample. Ratios are speed-ups (> 1: that
variant is faster). "max err" is the largest absolute difference from eager on the benchmark
input; "ok": within rtol=atol=1e-4. Compile time is the first call in this process with empty
on-disk caches (a fresh ``SYMTRACE_CACHE_DIR`` per variant and ``TORCHINDUCTOR_CACHE_DIR``;
``--warm-cache`` keeps the user's), so the first size also pays one-time setup (Dynamo import,
Inductor's ISA probe). ``--profile`` prints the torch ops that take the time in each variant (C
kernels called from a wrapper count as the caller's self time), ``--report`` the lowering reports
and wrapper code. ``symtrace.lower`` rewrites the attention into
``F.scaled_dot_product_attention`` (:func:`symtrace.passes.fuse_attention`, on by default);
``--no-attention`` adds ``symtrace.lower`` without that rewrite, for comparison.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import symtrace  # noqa: E402
from examples.models import TransformerBlock, example_inputs  # noqa: E402
from symtrace.lower import compile as lower  # noqa: E402
from symtrace.passes.fuse_attention import find_attention  # noqa: E402

#: name -> (batch, tokens, dim, heads)
SIZES = {
    "example": (2, 8, 64, 4),
    "mid": (16, 128, 256, 4),
    "large": (8, 256, 512, 8),
}
VARIANTS = ("eager", "inductor", "symtrace.lower", "symtrace backend", "symtrace.lower, no attention rewrite")
RTOL = ATOL = 1e-4


def make_case(size: str):
    """The seeded model (eval mode) and input of ``size``."""
    b, t, c, h = SIZES[size]
    torch.manual_seed(0)
    model = TransformerBlock(dim=c, heads=h).eval()
    x = example_inputs("transformer")[0] if size == "example" else torch.randn(b, t, c)
    return model, x


def _fresh_symtrace_cache(root: str, name: str) -> None:
    """Point symtrace's kernel cache at an empty folder and forget the libraries it loaded."""
    os.environ["SYMTRACE_CACHE_DIR"] = os.path.join(root, "symtrace-" + name.replace(" ", "-").replace(".", "-"))
    from symtrace.lower import toolchain
    toolchain.clear_memory_cache()


def build_variants(model, x, args, cache_root):
    """``{variant: (callable, cold compile seconds, note)}``; compile = first call, timed."""
    out = {"eager": (model, 0.0, "")}
    with torch.no_grad():
        model(x)
        if not args.no_inductor:
            t = time.perf_counter()
            try:
                ind = torch.compile(model, dynamic=False)
                ind(x)
                out["inductor"] = (ind, time.perf_counter() - t, "")
            except Exception as e:  # pragma: no cover - no C++ compiler for Inductor
                print(f"inductor failed: {type(e).__name__}: {e}")
        if cache_root:
            _fresh_symtrace_cache(cache_root, "lower")
        t = time.perf_counter()
        gm = symtrace.symbolic_trace(model, example_inputs=(x,))
        n = len(find_attention(gm))
        lm = lower(gm, (x,))
        lm(x)
        out["symtrace.lower"] = (lm, time.perf_counter() - t, f"{n} attention(s) -> SDPA, {_kernels_note(lm)}")
        if not args.no_backend:
            if cache_root:
                _fresh_symtrace_cache(cache_root, "backend")
            be = symtrace.backend(target="cpu")
            t = time.perf_counter()
            fn = torch.compile(model, backend=be, dynamic=False)
            fn(x)
            kernels = sum(len(g.kernels) for g in be.lowered)
            note = f"{len(be.graphs)} graph(s), " + (f"{kernels} kernels" if kernels else _NO_KERNELS)
            out["symtrace backend"] = (fn, time.perf_counter() - t, note)
        if args.no_attention:
            if cache_root:
                _fresh_symtrace_cache(cache_root, "plain")
            t = time.perf_counter()
            lm2 = lower(model, (x,), fuse_attention=False)
            lm2(x)
            out["symtrace.lower, no attention rewrite"] = (lm2, time.perf_counter() - t, _kernels_note(lm2))
        if args.report:
            print(f"\n### symtrace.lower report ({tuple(x.shape)})\n{lm.report()}\n\n{lm.wrapper_code}")
            for i, g in enumerate(() if args.no_backend else be.lowered):
                print(f"\n### symtrace backend graph {i} report\n{g.report()}\n\n{g.wrapper_code}")
    return out


_NO_KERNELS = "NO kernels: ran through torch (see the warning above)"


def _kernels_note(lm) -> str:
    n = len(lm.kernels)
    if not n:
        return _NO_KERNELS
    return f"{n} kernels, {_torch_calls(lm)} torch calls"


def _torch_calls(lm) -> int:
    """How many torch calls the lowered module's wrapper makes (matmuls, SDPA, linears, ops
    without a lowering rule): assignments in its code that are not kernels or helpers."""
    return len(re.findall(r"^\s+\w+ = (?:torch|operator)\.", lm.wrapper_code, flags=re.M))


#: What samples are timed with: wall-clock time, or the CPU time of the calling thread (with one
#: intra-op thread all the work runs on it, so time the OS gives to other processes is not counted).
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
_clock = time.perf_counter


def _timeit(fn, x, n):
    t = _clock()
    for _ in range(n):
        fn(x)
    return (_clock() - t) / n


def measure(variants, x, rounds):
    """Median seconds per call of each variant, rounds interleaved."""
    eager = variants["eager"][0]
    with torch.no_grad():
        once = min(_timeit(eager, x, 1) for _ in range(3))
        n = max(1, min(200, int(0.005 / max(once, 1e-7))))
        times = {k: [] for k in variants}
        for k, (fn, _, _) in variants.items():
            _timeit(fn, x, n)
        for _ in range(rounds):
            for k, (fn, _, _) in variants.items():
                times[k].append(_timeit(fn, x, n))
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}, n


def errors(variants, x):
    """Max abs error against eager and whether it is within tolerance, per variant."""
    with torch.no_grad():
        ref = variants["eager"][0](x)
        out = {}
        for k, (fn, _, _) in variants.items():
            got = fn(x)
            out[k] = ((got.double() - ref.double()).abs().max().item(),
                      torch.allclose(got, ref, rtol=RTOL, atol=ATOL))
    return out


def profile(variants, x, top=12):
    """Print the top torch ops (self CPU time) of each variant over a few calls."""
    from torch.profiler import ProfilerActivity, profile as prof
    with torch.no_grad():
        for k, (fn, _, _) in variants.items():
            fn(x)
            with prof(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(10):
                    fn(x)
            print(f"\n### profile: {k} (10 calls)")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def fmt_ms(s):
    return "n/a" if s != s else f"{s * 1e3:.3f}"


def ratio(a, b):
    return "n/a" if a != a or b != b else f"{a / b:.2f}x"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="example,mid,large", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--no-backend", action="store_true", help="leave out torch.compile(backend=symtrace.backend())")
    ap.add_argument("--profile", action="store_true", help="print the top ops of each variant")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall time (default), or the calling thread's CPU time (needs --threads 1; "
                         "steadier on a busy machine)")
    ap.add_argument("--no-attention", action="store_true",
                    help="also run symtrace.lower without the attention -> SDPA rewrite (fuse_attention=False)")
    ap.add_argument("--report", action="store_true", help="print the lowering reports and wrapper code")
    ap.add_argument("--warm-cache", action="store_true", help="keep the on-disk compile caches (default: empty ones)")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"unknown size {bad[0]!r}; choose from {', '.join(SIZES)}")
    if args.clock == "thread" and args.threads != 1:
        ap.error("--clock thread counts only the calling thread: use it with --threads 1")
    global _clock
    _clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    tmp = None if args.warm_cache else tempfile.TemporaryDirectory(prefix="transformer-bench-")
    if tmp is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp.name, "inductor")
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, clock={args.clock}, rounds={args.rounds}, "
          f"caches {'warm' if args.warm_cache else 'empty'}")
    rows = []
    for size in sizes:
        model, x = make_case(size)
        if hasattr(torch, "_dynamo"):
            torch._dynamo.reset()  # each size compiles from scratch, never as a dynamic-shape recompile
        variants = build_variants(model, x, args, tmp.name if tmp else None)
        err = errors(variants, x)
        med, n = measure(variants, x, args.rounds)
        rows.append((size, x, variants, med, err, n))
        if args.profile:
            profile(variants, x)
    print()
    print("| size (BxTxC, heads) | variant | ms / call (median) | best ms | vs eager | vs inductor | "
          "max err vs eager | ok | cold compile s | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size, x, variants, med, err, n in rows:
        b, t, c, h = SIZES[size]
        label = f"{size} {b}x{t}x{c}, {h}"
        e, i = med["eager"][0], med.get("inductor", (float("nan"),))[0]
        for k in VARIANTS:
            if k not in variants:
                continue
            s, best = med[k]
            _, compile_s, note = variants[k]
            print(f"| {label} | {k} | {fmt_ms(s)} | {fmt_ms(best)} | {ratio(e, s)} | {ratio(i, s)} | "
                  f"{err[k][0]:.2g} | {'yes' if err[k][1] else 'NO'} | {compile_s:.2f} | {note} |")
    print(f"\nmedians of {args.rounds} interleaved rounds; calls per sample: "
          + ", ".join(f"{size} {n}" for size, _, _, _, _, n in rows))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
