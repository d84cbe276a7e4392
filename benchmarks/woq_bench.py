"""Weight-only int8/int4 Linear against fp32 and torch's dynamic int8, on Llama-like shapes.

    python benchmarks/woq_bench.py                       # 2 threads, all shapes, M in 1 16 128
    python benchmarks/woq_bench.py --m 1 --rounds 30     # decode only
    python benchmarks/woq_bench.py --threads 1 --shapes 4096x1024

For each (K, N) and M: ``F.linear`` in fp32 | symtrace ``woq_linear`` int8 per channel |
int4 group 128 (both on the "c" backend: AVX-512/AVX2 C kernels, exact float32 activations) |
``int8-a8`` / ``int4-a8``: the same int8 / int4 weights with ``activations="int8"`` (x rounded per block of 32, integer
products: the AVX512-VNNI or AVX2 kernels) |
``int8-a8-1stream`` / ``int4-a8-1stream`` (M = 1 only): the same with the weight read as one
sequential stream, the order before the AVX2 GEMVs read several side by side
(``KERNELS.one_stream()``; same results) |
``torch.ao.nn.quantized.dynamic.Linear`` (int8 weights, activations quantized per call) |
symtrace's own dynamic int8 (``int8_dynamic_linear`` on "c": activations quantized per call,
AVX512-VNNI integer GEMM) -- the other numerics choice: faster where compute-bound (prefill),
but the activations are rounded to 8 bits.
Variants are interleaved round-robin, medians of rounds (``symtrace.passes.quant.bench``).
Columns: median ms, speed-up over fp32 (fp32 time / variant time), the weight bytes each reads,
and ``%copy``: weight bytes / time as a share of the machine's measured copy bandwidth (bytes
copied per second by ``dst.copy_(src)`` on 256 MiB, same threads) -- at M = 1 a Linear is bound
by reading its weight once, so that share is how close a kernel is to the memory limit.

Weights are timed cold: each variant cycles through enough copies of its weight that they
span ``--working-set`` MiB (default 3x the last-level cache), so every call streams its weight
from memory, as a decoder's layers do (a single weight that fits in L3 would be timed warm and
flatter a small format).

Timings on a shared machine vary with its load: the load average is printed with the table.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

from symtrace.lower.woq_cpu import KERNELS  # noqa: E402
from symtrace.passes.quant.bench import cpu_info, time_variants  # noqa: E402
from symtrace.passes.quant.kernels import int8_dynamic_linear, woq_linear  # noqa: E402
from symtrace.passes.quant.woq import quantize_weight_only, stored_bytes  # noqa: E402

SHAPES = [(1024, 1024), (1024, 4096), (4096, 1024), (2048, 2048), (2048, 8192), (8192, 2048)]


def copy_bandwidth(mib: int = 256, rounds: int = 7) -> float:
    """Bytes copied per second by ``dst.copy_(src)`` (median of rounds)."""
    src = torch.ones(mib << 18)  # float32: mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return src.numel() * 4 / ts[len(ts) // 2]


def _torch_dynamic(lin: torch.nn.Linear):
    try:
        from torch.ao.nn.quantized.dynamic import Linear as DynLinear
        return DynLinear.from_float(_with_qconfig(lin))
    except Exception as e:  # torch builds without quantized engines
        print(f"(torch dynamic int8 unavailable: {type(e).__name__}: {e})")
        return None


def _with_qconfig(lin):
    from torch.ao.quantization import default_dynamic_qconfig
    lin.qconfig = default_dynamic_qconfig
    return lin


class _Rotate:
    """Call ``fns[i]`` in turn: each holds its own copy of a weight (a cold working set)."""

    def __init__(self, fns):
        self.fns, self.i = fns, 0

    def __call__(self, x):
        self.i = (self.i + 1) % len(self.fns)
        return self.fns[self.i](x)


def _l3_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) * (1 << 20 if text.endswith("M") else 1 << 10) if text[-1] in "MK" else int(text)
    except (OSError, ValueError, IndexError):
        return 32 << 20


def _one_stream(fn, *args, **kwargs):
    with KERNELS.one_stream():   # (around the call itself: the other variants run between)
        return fn(*args, **kwargs)


def bench_shape(k: int, n: int, ms, rounds: int, bw: float, working_set: int):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False).eval()
    w = lin.weight.detach()
    q8 = quantize_weight_only(w, 8, None)
    q4 = quantize_weight_only(w, 4, 128)
    dyn = _torch_dynamic(lin)
    ws8 = q8.scale[:, 0].contiguous()
    nbytes = {"fp32": w.numel() * 4, "int8": stored_bytes(q8), "int8-a8": stored_bytes(q8), "int4": stored_bytes(q4),
              "int4-a8": stored_bytes(q4),
              "int4-a8-1stream": stored_bytes(q4), "int8-a8-1stream": stored_bytes(q8),
              "torch-dyn-int8": w.numel() + n * 8, "ours-dyn-int8": stored_bytes(q8)}

    def copies(name):
        return max(1, -(-working_set // nbytes[name]))

    fp32 = [w.clone() for _ in range(copies("fp32"))]
    w8 = [(q8.qweight.clone(), q8.scale.clone()) for _ in range(copies("int8"))]
    w4 = [(q4.qweight.clone(), q4.scale.clone()) for _ in range(copies("int4"))]
    d8 = [(t.clone(), s.clone()) for t, s in w8[:copies("ours-dyn-int8")]]
    variants = {
        "fp32": _Rotate([lambda x, w=w: F.linear(x, w) for w in fp32]),
        "int8": _Rotate([lambda x, t=t, s=s: woq_linear(x, t, s, None, None, bits=8, group_size=None,
                                                        in_features=k, backend="c") for t, s in w8]),
        "int8-a8": _Rotate([lambda x, t=t, s=s: woq_linear(x, t, s, None, None, bits=8, group_size=None,
                                                           in_features=k, backend="c", activations="int8")
                            for t, s in w8]),
        "int4": _Rotate([lambda x, t=t, s=s: woq_linear(x, t, s, None, None, bits=4, group_size=128,
                                                        in_features=k, backend="c") for t, s in w4]),
        "int4-a8": _Rotate([lambda x, t=t, s=s: woq_linear(x, t, s, None, None, bits=4, group_size=128,
                                                           in_features=k, backend="c", activations="int8")
                            for t, s in w4]),
    }
    one_stream = {}   # M = 1 only: the same a8 GEMVs with their weights read as one stream (the old order)
    if 1 in ms and KERNELS.available():
        one_stream["int8-a8-1stream"] = _Rotate([lambda x, t=t, s=s: _one_stream(woq_linear, x, t, s, None, None, bits=8,
                                                                                group_size=None, in_features=k,
                                                                                backend="c", activations="int8")
                                               for t, s in w8])
        one_stream["int4-a8-1stream"] = _Rotate([lambda x, t=t, s=s: _one_stream(woq_linear, x, t, s, None, None, bits=4,
                                                                                group_size=128, in_features=k,
                                                                                backend="c", activations="int8")
                                               for t, s in w4])
    if dyn is not None:
        variants["torch-dyn-int8"] = _Rotate([copy.deepcopy(dyn) for _ in range(copies("torch-dyn-int8"))])
    variants["ours-dyn-int8"] = _Rotate([lambda x, t=t, s=s: int8_dynamic_linear(x, t, s[:, 0].contiguous(), None,
                                                                                  backend="c") for t, s in d8])
    # every copy called once before timing: a kernel's first call with a weight builds its plan
    # (a re-blocked copy for some kernels), and a large last-level cache means many copies
    x1 = torch.randn(1, k)
    with torch.inference_mode():
        for fn in list(variants.values()) + list(one_stream.values()):
            for f in fn.fns:
                f(x1)
    rows = []
    for m in ms:
        x = torch.randn(m, k)
        inner = 10 if m == 1 else 3 if m == 16 else 1
        res = time_variants({**variants, **one_stream} if m == 1 else variants, (x,), rounds=rounds, inner=inner,
                            budget_s=20)
        base = res["fp32"]["median_ms"]
        for name, r in res.items():
            t = r["median_ms"] / 1e3
            rows.append([f"{k}x{n}", m, name, f"{r['median_ms']:.3f}", f"{base / r['median_ms']:.2f}x",
                         f"{nbytes[name] / 2**20:.1f}", f"{100 * nbytes[name] / t / bw:.0f}%"])
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--shapes", nargs="+", default=None, help="KxN, e.g. 4096x1024")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--working-set", type=int, default=None, help="MiB each variant's weight copies span")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    from symtrace.passes.quant.registry import backend_available
    backend_available("c")  # (its self-test, outside the timed inference mode)
    if not KERNELS.available():
        print(f"the woq C kernels are not usable here ({KERNELS.reason}): int8/int4 run the torch reference")
    bw = copy_bandwidth()
    working_set = (args.working_set << 20) if args.working_set else 3 * _l3_bytes()
    info = cpu_info()
    print(f"# {info['cpu']} | isa {','.join(info['isa'])} | woq kernels: {KERNELS.isa} | threads {args.threads} "
          f"| torch {info['torch']} | load avg {info['load_avg_1m']:.2f} | copy bandwidth {bw / 1e9:.1f} GB/s "
          f"| weights cycled over {working_set >> 20} MiB per variant")
    rows = []
    for k, n in shapes:
        rows += bench_shape(k, n, args.m, args.rounds, bw, working_set)
    print(tabulate(rows, headers=["K x N", "M", "variant", "median ms", "vs fp32", "weight MiB", "%copy"]))
    print(f"# load avg at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
