"""Interleaving benchmark: a lowered module's kernels right after torch ops, Inductor code or
another lowered module, against the same kernels alone (issue 19's OpenMP / torch-threads effect).

    python benchmarks/interleave_bench.py [--rounds 25] [--threads 2] [--small] [--no-inductor]

One process; every round runs each sequence once, in turn, so machine noise hits all alike.
A sequence is a prelude and a timed call: "after torch matmul" runs ``a @ b``, then times the
lowered module. The table gives medians and minimums (ms) and the median's ratio to the same
call after itself ("alone"), and the median CPU time all the process's threads used during the
call (spinning included: with two threads and no contention, about twice the wall time).

Two builds of the same lowered modules:

* ``one pool``  -- as symtrace builds them: the kernels' OpenMP regions run on the pool torch's
  own ops use (torch loads its libgomp into the global symbol scope, so a kernel library's
  ``GOMP_*`` calls bind to it; the header line checks it: a library built by the toolchain reads
  the thread count ``torch.set_num_threads`` set);
* ``two pools`` -- a simulation of the failure this guards against: the same kernels linked to
  a copy of the compiler's libgomp with another SONAME and loaded with ``RTLD_DEEPBIND``, so
  they run on a second OpenMP runtime whose workers spin while torch's run, and back (what a
  clang build with libomp, or a runtime loaded privately, would give).

``block`` is 4 x (Linear -> LayerNorm -> GELU): torch's matmul and our kernel alternate.
Spinning threads compete with whatever else runs on the machine: on a shared machine the
figures move with its load (printed; compare within one run, repeat when one looks off).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from symtrace.lower import compile as lower  # noqa: E402
from symtrace.lower import toolchain  # noqa: E402


class LayerNormSoftmax(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, x):
        return torch.softmax(self.ln(x), -1)


class Block(torch.nn.Module):
    def __init__(self, d, layers=4):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.lns = torch.nn.ModuleList(torch.nn.LayerNorm(d) for _ in range(layers))

    def forward(self, x):
        for lin, ln in zip(self.lins, self.lns):
            x = F.gelu(ln(lin(x)))
        return x


def pointwise(t):
    return torch.sigmoid(t * 2) + t


def renamed_libgomp(folder: str):
    """A copy of the compiler's libgomp with SONAME ``libgom2.so.1`` (patched in place, same
    length), or None where there is none to copy."""
    cc = toolchain.find_compiler()
    out = subprocess.run([*cc.command, "-print-file-name=libgomp.so"], capture_output=True, text=True)
    src = os.path.realpath(out.stdout.strip()) if out.returncode == 0 else ""
    if not src or not os.path.isfile(src):
        return None
    data = open(src, "rb").read()
    if data.count(b"libgomp.so.1\0") != 1:
        return None
    path = os.path.join(folder, "libgom2.so.1")
    with open(path, "wb") as f:
        f.write(data.replace(b"libgomp.so.1\0", b"libgom2.so.1\0"))
    return path


def on_second_pool(lm, runtime: str, folder: str):
    """Rebuild ``lm``'s kernels against ``runtime`` and load them with RTLD_DEEPBIND (their
    GOMP_* calls then bind to it), in place of the kernels its wrapper calls; the library stays
    loaded as long as the wrapper holds its functions."""
    cc = toolchain.find_compiler()
    c = os.path.join(folder, f"two_pools_{id(lm)}.c")
    so = c[:-2] + ".so"
    with open(c, "w") as f:
        f.write(lm.source())
    cmd = [*cc.command, *toolchain.compiler_flags(), "-o", so, c, runtime, "-Xlinker", "-rpath", "-Xlinker", folder,
           "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(so, mode=os.RTLD_DEEPBIND | os.RTLD_LOCAL)
    g = lm._first.call.__globals__
    for name in [n for n in g if n.startswith(("_k", "_run")) and hasattr(g[n], "argtypes")]:
        fn = getattr(lib, name[1:])
        fn.argtypes, fn.restype = g[name].argtypes, None
        g[name] = fn
    return lib


def shares_torchs_runtime(lib=None) -> bool:
    """Whether a library (default: one the toolchain builds) reads the thread count torch sets."""
    if lib is None:
        lib = toolchain.load_library("#include <omp.h>\nint st_max_threads(void) { return omp_get_max_threads(); }\n")
    saved = torch.get_num_threads()
    try:
        seen = []
        for n in (1, 3):
            torch.set_num_threads(n)
            seen.append(lib.st_max_threads())
    finally:
        torch.set_num_threads(saved)
    return seen == [1, 3]


def timed(fn):
    """(wall ms, CPU ms of all this process's threads) of one call of ``fn``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def mapped_runtimes():
    with open("/proc/self/maps") as f:
        return sorted({ln.split()[-1] for ln in f if any(n in ln.rsplit("/", 1)[-1] for n in ("gom", "omp"))})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="quarter-size tensors (a quick run)")
    ap.add_argument("--no-inductor", action="store_true")
    args = ap.parse_args()
    if not toolchain.openmp_available():
        sys.exit("the C compiler builds no OpenMP kernels here: nothing to interleave")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = 16 if args.small else 64
    data = {"x": torch.randn(rows, 1000, 256), "h": torch.randn(rows * 32, 512), "y": torch.randn(rows * 256, 1024),
            "a": torch.randn(512, 512)}
    tmp = tempfile.mkdtemp(prefix="symtrace-interleave-")
    try:
        with torch.no_grad():
            run(args, data, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, d, tmp):
    x, h, y, a = d["x"], d["h"], d["y"], d["a"]
    model, block = LayerNormSoftmax(256).eval(), Block(512).eval()
    builds = {"one pool": (lower(model, (x,)), lower(block, (h,)))}
    runtime = renamed_libgomp(tmp)
    if runtime is not None:
        lm2, lb2 = lower(model, (x,)), lower(block, (h,))
        on_second_pool(lm2, runtime, tmp)
        on_second_pool(lb2, runtime, tmp)
        assert torch.equal(lm2(x), builds["one pool"][0](x)) and torch.equal(lb2(h), builds["one pool"][1](h))
        builds["two pools"] = (lm2, lb2)
    other = lower(pointwise, (y,))
    inductor = None if args.no_inductor else torch.compile(pointwise)
    preludes = {"after torch matmul": lambda: a @ a, "after torch pointwise": lambda: pointwise(y),
                "after another lowered module": lambda: other(y)}
    if inductor is not None:
        inductor(y)
        preludes["after Inductor"] = lambda: inductor(y)
    seqs = {("eager", "alone"): (lambda: model(x), lambda: model(x)),
            ("eager", "after torch matmul"): (lambda: a @ a, lambda: model(x))}
    for name, (lm, lb) in builds.items():
        seqs[(f"symtrace, {name}", "alone")] = (lambda lm=lm: lm(x), lambda lm=lm: lm(x))
        for label, pre in preludes.items():
            seqs[(f"symtrace, {name}", label)] = (pre, lambda lm=lm: lm(x))
        seqs[("eager", f"after symtrace, {name}")] = (lambda lm=lm: lm(x), lambda: model(x))
    seqs[("block eager", "alone")] = (lambda: block(h), lambda: block(h))
    for name, (lm, lb) in builds.items():
        seqs[(f"block symtrace, {name}", "alone")] = (lambda lb=lb: lb(h), lambda lb=lb: lb(h))
    times = {k: [] for k in seqs}
    for pre, fn in seqs.values():  # warm-up
        pre(), fn()
    for _ in range(args.rounds):
        for k, (pre, fn) in seqs.items():
            pre()
            times[k].append(timed(fn))
    report(args, d, builds, times)


def report(args, d, builds, times):
    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    print(f"OpenMP runtimes mapped: {', '.join(mapped_runtimes())}; OS threads: {len(os.listdir('/proc/self/task'))}")
    print(f"toolchain libraries run on torch's OpenMP runtime: {shares_torchs_runtime()}")
    if "two pools" not in builds:
        print("(no libgomp to copy: the two-pools simulation is left out)")
    x, h = d["x"], d["h"]
    print(f"\nlayernorm+softmax on {tuple(x.shape)}; block = 4 x (Linear {h.shape[1]} -> LayerNorm -> GELU) on "
          f"{tuple(h.shape)}\n")
    print(f"{'what':28s} {'sequence':32s} {'median ms':>10s} {'min ms':>8s} {'vs alone':>9s} {'CPU ms':>8s}")
    for (what, label), v in med.items():
        base = med.get((what, "alone"))
        print(f"{what:28s} {label:32s} {v:10.2f} {min(w for w, _ in times[(what, label)]):8.2f} "
              f"{(f'{v / base:8.2f}x' if base else ''):>9s} {cpu[(what, label)]:8.2f}")
    eager_block = med[("block eager", "alone")]
    print("\nblock, eager time / symtrace time: " + ", ".join(
        f"{name} {eager_block / med[(f'block symtrace, {name}', 'alone')]:.2f}x" for name in builds))


if __name__ == "__main__":
    main()
