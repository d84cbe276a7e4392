"""Dynamic shapes: one compile for every size (issue 20), against Inductor's automatic dynamic.

(a) A layernorm-scale-softmax function and ``examples.models.TransformerBlock`` are called over
    many distinct sequence lengths in 1..2048 (the same order for both): compilations, calls
    that ran through torch, total compile time. symtrace: ``lower.compile(..., dynamic="auto")``
    (static first, one size-generic variant once a size changes; ``lm.compiles``,
    ``lm.torch_calls``, the first ``compile`` call's wall time + ``lm.compile_seconds``).
    Inductor: ``torch.compile(fn, dynamic=None)`` (automatic dynamic), graphs counted by
    ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``, compile time = the wall time
    of the calls that compiled, less a steady-state call.
(b) At one large size, the size-generic kernels vs our static kernels vs Inductor's dynamic
    kernel (compiled at another size first): medians of interleaved rounds, ratios.
(c) With torchvision (the zoo environment): CNNs at many image sizes (H and W varying apart,
    strided convolutions and pooling: sizes are floor divisions), with the inference pipeline
    (``lower.compile`` defaults), against Inductor with freezing and automatic dynamic:
    compilations, calls through torch, compile time; then at one size the generic variant vs a
    module lowered statically for that size vs Inductor.

Run: ``python benchmarks/dynamic_bench.py [--quick] [--warm]``; by default both compilers'
on-disk caches start empty (a fresh directory for each), so compile times are cold ones. Timings depend on the machine's load:
report it with the numbers. The bench passes ``speed_check=False`` (the compile-time
"never slower than eager" measurement would add up to 1 s per module and could route calls
through torch on a loaded machine, which would hide what this measures).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from examples.models import TransformerBlock  # noqa: E402
from symtrace import lower  # noqa: E402

C = 256


def ln_scale_softmax(x, w, b):
    return torch.softmax(F.layer_norm(x, (x.shape[-1],), w, b) * 0.125, dim=-1)


def lengths(n: int):
    """``n`` distinct lengths in 1..2048, in a fixed shuffled order (1 last: it specialises)."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randperm(2047, generator=g)[: n - 1] + 2
    return [int(t) for t in pool] + [1]


def ours(make_fn, make_args, lens):
    fn = make_fn()
    t0 = time.perf_counter()
    lm = lower.compile(fn, make_args(lens[0]), speed_check=False)
    first = time.perf_counter() - t0
    seconds0 = lm.compile_seconds
    with torch.no_grad():
        for t in lens:
            out = lm(*make_args(t))
            assert not isinstance(t, int) or out.shape[1] == t
    return lm.compiles, lm.torch_calls, first + lm.compile_seconds - seconds0


def inductor(make_fn, make_args, lens):
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    fn = make_fn()
    cfn = torch.compile(fn, dynamic=None)
    compile_s = 0.0
    steady = []
    with torch.no_grad():
        for t in lens:
            args = make_args(t)
            before = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            cfn(*args)
            dt = time.perf_counter() - t0
            if counters["stats"]["unique_graphs"] != before:
                compile_s += dt
            else:
                steady.append(dt)
    # (the calls that compiled also ran once: take a steady call off each)
    graphs = counters["stats"]["unique_graphs"]
    compile_s -= graphs * (statistics.median(steady) if steady else 0.0)
    return graphs, 0, compile_s


def part_a(n_lens: int):
    lens = lengths(n_lens)
    w, b = torch.randn(C), torch.randn(C)
    torch.manual_seed(0)
    block = TransformerBlock(C, 4).eval()
    cases = {
        "ln-scale-softmax (4, T, 256)": (lambda: ln_scale_softmax, lambda t: (torch.randn(4, t, C), w, b)),
        "TransformerBlock(256, 4) (1, T, 256)": (lambda: block, lambda t: (torch.randn(1, t, C),)),
    }
    print(f"(a) {len(lens)} distinct lengths in 1..2048 (1 last)")
    print(f"{'graph':40s} {'who':10s} {'compiles':>8s} {'via torch':>9s} {'compile s':>9s}")
    for name, (make_fn, make_args) in cases.items():
        rows = {"symtrace": ours(make_fn, make_args, lens), "inductor": inductor(make_fn, make_args, lens)}
        for who, (n, via, secs) in rows.items():
            print(f"{name:40s} {who:10s} {n:8d} {via:9d} {secs:9.2f}")
        print(f"{'':40s} compile time ours/inductor: {rows['symtrace'][2] / max(rows['inductor'][2], 1e-9):.3f}")


def _time(fns, args, rounds: int, inner: int):
    """Interleaved rounds, the order reversed every other round (what ran just before a call
    changes its cache state); per function the median of per-call times."""
    samples = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():
            f(*args)
        for r in range(rounds):
            for k, f in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
                t0 = time.perf_counter()
                for _ in range(inner):
                    f(*args)
                samples[k].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def part_b(rounds: int):
    import torch._dynamo
    w, b = torch.randn(C), torch.randn(C)
    torch.manual_seed(0)
    block = TransformerBlock(C, 4).eval()
    cases = {
        "ln-scale-softmax": (ln_scale_softmax, (64, 1000, C), lambda s: (torch.randn(*s), w, b)),
        "TransformerBlock": (block, (4, 1000, C), lambda s: (torch.randn(*s),)),
    }
    print(f"\n(b) one large size: size-generic vs static kernels vs Inductor dynamic (median of {rounds} rounds)")
    print(f"{'graph':18s} {'shape':16s} {'generic ms':>10s} {'static ms':>10s} {'inductor ms':>11s} "
          f"{'gen/static':>10s} {'gen/ind':>8s}")
    for name, (fn, shape, make) in cases.items():
        args = make(shape)
        small = make((shape[0], 37, shape[2]))
        with torch.no_grad():
            generic = lower.compile(fn, small, speed_check=False)   # static, then generic once a size changes
            generic(*make((shape[0], 38, shape[2])))
            static = lower.compile(fn, args, speed_check=False, dynamic=False)
            assert generic._generic, generic.report()
            torch._dynamo.reset()
            ind = torch.compile(fn, dynamic=True)
            ind(*small)
            torch.testing.assert_close(generic(*args), static(*args), rtol=1e-4, atol=1e-4)
        t = _time({"generic": generic, "static": static, "inductor": ind}, args, rounds, 3)
        # speed is static/generic time: >= 1 means the generic kernels are at least as fast
        print(f"{name:18s} {str(shape):16s} {t['generic'] * 1e3:10.3f} {t['static'] * 1e3:10.3f} "
              f"{t['inductor'] * 1e3:11.3f} {t['static'] / t['generic']:10.3f} {t['inductor'] / t['generic']:8.3f}")
    print("(gen/static, gen/ind: speed of the generic kernels relative to the other; >= 1: as fast or faster)")


def image_sizes(n: int):
    """``n`` distinct (H, W) in 64..320, H and W apart, in a fixed order."""
    g = torch.Generator().manual_seed(1)
    hw = torch.randint(64, 321, (n, 2), generator=g)
    return [(int(h), int(w)) for h, w in hw]


def part_c(n_sizes: int, rounds: int):
    try:
        import torchvision
    except ImportError:
        print("\n(c) skipped: torchvision is not installed (run in the zoo environment)")
        return
    import torch._dynamo
    import torch._inductor.config as icfg
    sizes = image_sizes(n_sizes)
    print(f"\n(c) CNNs at {len(sizes)} image sizes in 64..320 (batch 1), then at one size (288, 240)")
    print(f"{'model':20s} {'who':10s} {'compiles':>8s} {'via torch':>9s} {'compile s':>9s}")
    for name in ("resnet50", "mobilenet_v3_large"):
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None).eval()
        make = (lambda hw: (torch.randn(1, 3, *hw),))
        rows = {"symtrace": ours(lambda: model, make, [(224, 224)] + sizes)}
        with icfg.patch(freezing=True):
            rows["inductor"] = inductor(lambda: model, make, [(224, 224)] + sizes)
        for who, (n, via, secs) in rows.items():
            print(f"{name:20s} {who:10s} {n:8d} {via:9d} {secs:9.2f}")
        print(f"{'':20s} compile time ours/inductor: {rows['symtrace'][2] / max(rows['inductor'][2], 1e-9):.3f}")
        args = make((288, 240))
        with torch.no_grad():
            generic = lower.compile(model, make((224, 224)), speed_check=False)
            generic(*make((256, 256)))
            generic(*make((200, 180)))
            static = lower.compile(model, args, speed_check=False, dynamic=False)
            torch._dynamo.reset()
            with icfg.patch(freezing=True):
                ind = torch.compile(model, dynamic=True)
                ind(*make((224, 224)))
                ind(*args)
        t = _time({"generic": generic, "static": static, "inductor": ind}, args, rounds, 1)
        print(f"{'':20s} at (288, 240): generic {t['generic'] * 1e3:.1f} ms, static {t['static'] * 1e3:.1f} ms, "
              f"Inductor dynamic {t['inductor'] * 1e3:.1f} ms; gen/static {t['static'] / t['generic']:.3f}, "
              f"gen/ind {t['inductor'] / t['generic']:.3f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer lengths and rounds")
    p.add_argument("--warm", action="store_true", help="keep the on-disk compile caches (default: both cold)")
    a = p.parse_args()
    if not a.warm:   # symtrace's kernel/record cache and Inductor's caches start empty, in one run
        import tempfile
        root = tempfile.mkdtemp(prefix="dynamic_bench_")
        os.environ["SYMTRACE_CACHE_DIR"] = os.path.join(root, "symtrace")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f} (a loaded machine slows every column alike, not the ratios' sense)")
    part_a(12 if a.quick else 42)
    part_b(5 if a.quick else 15)
    part_c(8 if a.quick else 20, 5 if a.quick else 11)


if __name__ == "__main__":
    main()
