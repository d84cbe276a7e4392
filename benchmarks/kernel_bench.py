"""Kernel benchmark: eager vs torch.compile (Inductor) vs symtrace.lower, in one run.

    python benchmarks/kernel_bench.py [--rounds 15] [--threads 2] [--compile-times] [--small]
    python benchmarks/kernel_bench.py --device cuda     # Triton kernels (target="cuda") on a GPU

On CUDA the sizes are 8x the CPU ones (``--scale``; enough to fill an H100's memory bandwidth),
times are taken between ``torch.cuda.synchronize()`` calls, there is no prealloc column, and the
"x copy BW" column is the fresh call's bytes over the measured device-to-device copy bandwidth.
``TRITON_INTERPRET=1 ... --device cuda --scale 0.001 --no-inductor`` runs the same path on CPU
tensors in Triton's interpreter (a smoke test: no timing meaning).

Variants run interleaved round by round (so machine noise hits all alike); the table quotes
medians (and best). "fresh" = a normal call that allocates its output; "prealloc" = the same
kernel writing into a preallocated output (eager: ``out=`` ops; symtrace: the generated kernel
called directly), which removes first-touch page faults of large outputs. Memory-bound ops are
also given as a fraction of the measured copy bandwidth. ``--compile-times`` adds cold compile
(fresh cache, new process) and cache-hit-in-a-new-process times for symtrace and Inductor.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import symtrace  # noqa: E402
from symtrace.lower import compile as lower  # noqa: E402


def chain(x, y):
    return torch.relu(x * y + 1).sigmoid() * torch.tanh(x)


def softmax(x):
    return torch.softmax(x, -1)


def layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def bias_gelu(h, b):
    return F.gelu(h + b)


def total(x):
    return x.sum()


def workloads(small: bool, scale: float = 1.0, device: str = "cpu"):
    s = 4 if small else 1
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)

    def n(rows: int) -> int:  # rows scaled, at least 1
        return max(1, int(rows * scale) // s)
    return [
        ("pointwise chain", chain, (r(n(16 * 2 ** 20)), r(n(16 * 2 ** 20))), 3),
        ("softmax", softmax, (r(n(4096), 4096),), 2),
        ("layernorm", layernorm, (r(n(8192), 1024), r(1024), r(1024)), 2),
        ("bias+gelu", bias_gelu, (r(n(4096), 4096), r(4096)), 2),
        ("sum", total, (r(n(16 * 2 ** 20)),), 1),
    ]


_SYNC = None  # torch.cuda.synchronize when timing on a GPU


def timeit(fn, n=1):
    if _SYNC is not None:
        _SYNC()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    if _SYNC is not None:
        _SYNC()
    return (time.perf_counter() - t) / n


def device_copy_bandwidth(rounds, device, scale):
    """Device-to-device copy bandwidth (read + write bytes, GB/s): median of torch ``copy_``."""
    x = torch.randn(max(1, int(64 * 2 ** 20 * scale / 8)), device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    t = statistics.median(timeit(lambda: y.copy_(x)) for _ in range(max(rounds, 20)))
    return 2 * x.numel() * x.element_size() / t / 1e9


def copy_bandwidth(rounds):
    """Copy bandwidth in GB/s, counting read + write bytes as the table's "x copy BW" column does:
    the better median of torch's ``copy_`` and a symtrace-generated C copy kernel, both into a
    preallocated (already touched) 64 MiB output with the benchmark's threads, after a warm-up
    call. (Stores to memory also cost a read for ownership, so this is below the read-only
    bandwidth, e.g. of the prealloc sum.) Also returns the read-only bandwidth of ``sum``."""
    x = torch.randn(16 * 2 ** 20)
    y = torch.empty_like(x)
    lm = lower(symtrace.symbolic_trace(_copy, example_inputs=(x,)), (x,))
    st_copy = prealloc_symtrace(lm, y)
    probes = {"torch copy_": lambda: y.copy_(x), "sum": lambda: torch.sum(x)}
    if st_copy is not None:
        probes["symtrace copy"] = lambda: st_copy((x,))
    n = max(rounds, 20)
    times = {k: [] for k in probes}
    for f in probes.values():
        f()
    for _ in range(n):
        for k, f in probes.items():
            times[k].append(timeit(f))
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = x.numel() * x.element_size()
    copy = max(2 * nbytes / med[k] / 1e9 for k in med if k != "sum")
    return copy, nbytes / med["sum"] / 1e9


def _copy(x):
    return x * 1.0  # lowers to a pure load/store kernel (multiplying by 1.0 folds away)


def prealloc_eager(name, fn, inputs, out):
    if name == "pointwise chain":
        x, y = inputs
        tmp = torch.empty_like(x)

        def run():
            torch.mul(x, y, out=tmp)
            tmp.add_(1).relu_().sigmoid_()
            torch.tanh(x, out=out)
            out.mul_(tmp)
        return run
    if name == "sum":
        return lambda: torch.sum(inputs[0], dim=0, out=out)
    if name == "bias+gelu":
        h, b = inputs
        tmp = torch.empty_like(h)
        return lambda: (torch.add(h, b, out=tmp), torch.ops.aten.gelu.out(tmp, out=out))
    if name == "softmax":
        return lambda: torch.ops.aten._softmax.out(inputs[0], -1, False, out=out)
    return None


def prealloc_symtrace(lm, out):
    """Call the lowered module's single kernel directly into ``out``."""
    lw = lm._first.lowering
    if len(lw.kernels) != 1:
        return None
    k = lw.kernels[0]
    fn = lm._first.call.__globals__[f"_{k.name}"]
    bufs = k.buffers()
    inputs = {name: i for i, (name, _) in enumerate(lw.inputs)}

    def ptrs(args):
        out_ptrs = []
        for b in bufs:
            if b.role == "input":
                out_ptrs.append(args[inputs[b.name]].data_ptr())
            elif b.role == "param":
                return None
            else:
                out_ptrs.append(out.data_ptr())
        return out_ptrs
    nt = torch.get_num_threads()
    return lambda args: fn(*ptrs(args), nt)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile-times", action="store_true")
    ap.add_argument("--small", action="store_true", help="quarter sizes (quick check)")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--scale", type=float, default=None, help="size factor (default 1 on CPU, 8 on CUDA)")
    ap.add_argument("--autotune", action="store_true", help="CUDA: lower with autotune=True")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, target = "cpu", "cpu"
    if args.device == "cuda":
        global _SYNC
        target = "cuda"
        if torch.cuda.is_available():
            device, _SYNC = "cuda", torch.cuda.synchronize
        elif os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cuda needs a CUDA GPU (or TRITON_INTERPRET=1 for a smoke test on CPU)")
    scale = args.scale if args.scale is not None else (8.0 if device == "cuda" else 1.0)
    autotune = args.autotune and target == "cuda"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device={gpu}, target={target}, threads={torch.get_num_threads()}, "
          f"rounds={args.rounds}, scale={scale}, autotune={autotune}")
    if target == "cpu":
        bw, read_bw = copy_bandwidth(args.rounds)
        print(f"copy bandwidth (16M fp32, read+write bytes, prealloc, best of torch copy_ / symtrace copy kernel): "
              f"{bw:.1f} GB/s; read-only (sum): {read_bw:.1f} GB/s")
    else:
        bw = device_copy_bandwidth(args.rounds, device, scale)
        print(f"copy bandwidth ({device}, torch copy_, read+write bytes): {bw:.1f} GB/s")
    rows = []
    for name, fn, inputs, touched in workloads(args.small, scale, device):
        gm = symtrace.symbolic_trace(fn, example_inputs=inputs)
        t = time.perf_counter()
        lm = lower(gm, inputs, target=target, autotune=autotune)
        st_compile = time.perf_counter() - t
        ind = None
        ind_compile = float("nan")
        if not args.no_inductor:
            try:
                ind = torch.compile(fn)
                t = time.perf_counter()
                with torch.no_grad():
                    ind(*inputs)
                ind_compile = time.perf_counter() - t
            except Exception as e:  # pragma: no cover - Inductor missing
                print(f"inductor failed on {name}: {e}")
                ind = None
        with torch.no_grad():
            ref = fn(*inputs)
            got = lm(*inputs)
            err = (got.double() - ref.double()).abs().max().item()
        out = torch.empty_like(ref)
        eager_pre = prealloc_eager(name, fn, inputs, out) if target == "cpu" else None
        st_pre = prealloc_symtrace(lm, torch.empty_like(ref)) if target == "cpu" else None
        variants = {"eager": lambda: fn(*inputs), "symtrace": lambda: lm(*inputs)}
        if ind is not None:
            variants["inductor"] = lambda: ind(*inputs)
        if eager_pre is not None:
            variants["eager prealloc"] = eager_pre
        if st_pre is not None:
            variants["symtrace prealloc"] = lambda: st_pre(inputs)
        times = {k: [] for k in variants}
        with torch.no_grad():
            for k, v in variants.items():
                v()
            for _ in range(args.rounds):
                for k, v in variants.items():
                    times[k].append(timeit(v))
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        nbytes = sum(x.numel() * x.element_size() for x in inputs) + ref.numel() * ref.element_size()
        rows.append((name, med, best, nbytes, st_compile, ind_compile, err))
    print()
    print("| op | eager ms | inductor ms | symtrace ms | symtrace vs eager | symtrace vs inductor | "
          "eager prealloc ms | symtrace prealloc ms | symtrace prealloc x copy BW | symtrace compile s | inductor first call s | max err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, med, best, nbytes, stc, indc, err in rows:
        e, s = med["eager"], med["symtrace"]
        i = med.get("inductor", float("nan"))
        sp = med.get("symtrace prealloc", float("nan"))
        ep = med.get("eager prealloc", float("nan"))
        t_bw = sp if target == "cpu" else s  # (no prealloc on CUDA: the fresh call)
        frac = nbytes / t_bw / 1e9 / bw if t_bw == t_bw else float("nan")
        print(f"| {name} | {e*1e3:.2f} | {i*1e3:.2f} | {s*1e3:.2f} | {e/s:.2f}x | {i/s:.2f}x | {ep*1e3:.2f} | "
              f"{sp*1e3:.2f} | {frac:.2f} | {stc:.2f} | {indc:.2f} | {err:.2g} |")
    if target == "cuda":
        print("(cuda: 'symtrace prealloc x copy BW' is the fresh call's bytes / copy bandwidth)")
    if args.compile_times:
        if target == "cpu":
            compile_times(args)
        else:
            print("(--compile-times measures the CPU target only)")


_COLD = """
import json, sys, time, torch, torch.nn.functional as F
sys.path.insert(0, {root!r})
t = time.perf_counter()
import benchmarks.kernel_bench as kb  # imports symtrace and symtrace.lower
ph = {{"import": time.perf_counter() - t}}
name = {name!r}
w = [x for x in kb.workloads({small!r}) if x[0] == name][0]
fn, inputs = w[1], w[2]
t = time.perf_counter()
if {which!r} == "symtrace":
    import symtrace
    from symtrace.lower import compile as lower
    gm = symtrace.symbolic_trace(fn, example_inputs=inputs) if {mode!r} == "example" else symtrace.symbolic_trace(fn)
    ph["trace"] = time.perf_counter() - t; t = time.perf_counter()
    lm = lower(gm, inputs)
    ph["compile"] = time.perf_counter() - t; t = time.perf_counter()
    lm(*inputs)
    ph["first call"] = time.perf_counter() - t
else:
    torch.compile(fn)(*inputs)
    ph["compile"] = time.perf_counter() - t
print(json.dumps(ph))
"""


def _run_cold(root, name, which, mode, env, small):
    code = _COLD.format(root=os.path.abspath(root), name=name, which=which, mode=mode, small=small)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"  ({which} {name} failed: {p.stderr.strip().splitlines()[-1:]})")
        return {}
    return json.loads(p.stdout.strip().splitlines()[-1])


def compile_times(args):
    """Cold compile (empty caches) and a cache hit, each in a new process after ``import torch``.

    symtrace's phases are timed separately: ``import symtrace``, tracing (with the example
    inputs, which runs the program once on them, or symbolically), ``lower.compile`` and the
    first call. "hit total" = trace + compile + first call (import excluded); Inductor's number
    is ``torch.compile(fn)(*inputs)`` (Dynamo's tracing included)."""
    root = os.path.join(os.path.dirname(__file__), "..")
    nan = float("nan")
    print("\ncompile latency in a new process (after `import torch`; seconds)")
    print("| op | symtrace cold (trace+compile+call) | hit: import symtrace (not in totals) | hit: trace (example inputs) | "
          "hit: compile | hit: first call | hit total | hit total, symbolic trace | inductor cold | inductor hit | "
          "cold ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, *_ in workloads(args.small):
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, SYMTRACE_CACHE_DIR=os.path.join(d, "st"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "ind"), TMPDIR=d,
                       PYTHONPYCACHEPREFIX=os.path.join(d, "pyc"))
            env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a user's install: imports read .pyc files
            cold = _run_cold(root, name, "symtrace", "example", env, args.small)
            hit = _run_cold(root, name, "symtrace", "example", env, args.small)
            sym = _run_cold(root, name, "symtrace", "symbolic", env, args.small)
            if args.no_inductor:
                icold = ihit = {}
            else:
                icold = _run_cold(root, name, "inductor", "", env, args.small)
                ihit = _run_cold(root, name, "inductor", "", env, args.small)
        tot = lambda r: sum(r.get(k, nan) for k in ("trace", "compile", "first call"))  # noqa: E731
        ic, ih = icold.get("compile", nan), ihit.get("compile", nan)
        print(f"| {name} | {tot(cold):.3f} | {hit.get('import', nan):.3f} | {hit.get('trace', nan):.3f} | "
              f"{hit.get('compile', nan):.4f} | {hit.get('first call', nan):.3f} | {tot(hit):.3f} | {tot(sym):.3f} | "
              f"{ic:.2f} | {ih:.2f} | {tot(cold) / ic:.3f} |")


if __name__ == "__main__":
    main()
