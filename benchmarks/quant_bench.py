"""int8 latency: symtrace's lowered int8 graphs against fp32 eager and torch.ao convert_fx.

    python benchmarks/quant_bench.py                 # DigitsCNN 32x32 w32 + digits MLP, 1 thread
    python benchmarks/quant_bench.py --threads 1 2 --rounds 30   # one table per thread count
    python benchmarks/quant_bench.py --mlp-only --threads 1 2
    python benchmarks/quant_bench.py --size 16 --width 16    # the example's --quick model

Models have random weights (latency does not depend on them; accuracy is the example's job),
batch-norm statistics set to non-trivial values, calibrated on 256 random images. Timed with
``torch.inference_mode()``, variants interleaved round-robin, median of rounds
(symtrace.passes.quant.bench.time_variants); OMP_WAIT_POLICY=PASSIVE is recommended on shared
machines. Variants:

  CNN  fp32 eager | int8 reference (q/dq, float64 oracle) | int8 lowered on the default backend
       ("c" when symtrace.lower.int8_cpu builds: its C Linear + oneDNN convolutions) | onednn |
       portable | torch.ao convert_fx (x86 qconfig), when torch still ships it
  MLP  fp32 eager | static int8 and dynamic int8 on the default backend ("c": symtrace's C
       kernels) and on onednn | convert_fx dynamic

Targets on an AMX-INT8 CPU at 1 thread (see examples/quantization/README.md): CNN lowered
>= 5x fp32 at batch 32 and >= 1.8x at batch 1, within 20% of convert_fx at batch 32; MLP
static/dynamic >= 2x (b1) and >= 3x (b32); trace -> ... -> lower < 5 s.
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
from tabulate import tabulate  # noqa: E402

import symtrace  # noqa: E402
from symtrace.passes import quant as Q  # noqa: E402
from symtrace.passes.quant.bench import cpu_info, time_variants  # noqa: E402
from examples.quantization.digits import DigitsCNN, DigitsMLP  # noqa: E402


def _fx(model, example, calib, dynamic=False):
    try:
        from torch.ao.quantization import QConfigMapping, default_dynamic_qconfig, get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
    except ImportError:
        return None
    mapping = QConfigMapping().set_global(default_dynamic_qconfig) if dynamic else get_default_qconfig_mapping("x86")
    p = prepare_fx(copy.deepcopy(model), mapping, (example,))
    with torch.no_grad():
        for xb in calib.split(32):
            p(xb)
    return convert_fx(p)


def _rows(variants, lat, base):
    rows = []
    for k in variants:
        r = {"variant": k}
        for bs in sorted(lat):
            ms = lat[bs][k]["median_ms"]
            r[f"b{bs} ms"] = ms
            r[f"b{bs} x fp32"] = lat[bs][base]["median_ms"] / ms
        rows.append(r)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="thread counts (one table each)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--no-fx", action="store_true", help="skip the torch.ao convert_fx rows")
    ap.add_argument("--mlp-only", action="store_true", help="only the MLP tables")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    s = args.size
    calib = torch.randn(256, 1, s, s)
    x1, x32 = torch.randn(1, 1, s, s), torch.randn(32, 1, s, s)
    backend = Q.default_backend()
    info = cpu_info()
    if not args.mlp_only:
        _cnn(args, calib, x1, x32, backend)
    _mlp(args, calib, x1, x32, backend)
    print(f"\n{info['cpu']}; ISA {' '.join(info['isa'])}; torch {info['torch']}; {info['cores']} cores; "
          f"int8 backends {', '.join(Q.available_backends())}; load average {info['load_avg_1m']:.1f} "
          "(timings on shared machines are noisy)")
    return 0


def _cnn(args, calib, x1, x32, backend):
    s = args.size
    cnn = DigitsCNN(args.width).eval()
    with torch.no_grad():
        for m in cnn.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 2.0)
    t0 = time.perf_counter()
    gm = symtrace.symbolic_trace(cnn, example_inputs=(x1,))
    prepared = Q.prepare(gm)
    Q.calibrate(prepared, calib)
    ref = Q.to_reference(prepared)
    low = Q.lower(ref, backend)
    t_flow = time.perf_counter() - t0
    variants = {"fp32 eager": cnn, "int8 reference (q/dq)": ref, f"int8 lowered ({backend})": low}
    for other in ("onednn", "portable"):
        if other != backend and Q.backend_available(other):
            variants[f"int8 lowered ({other})"] = Q.lower(ref, other)
    t_fx = None
    if not args.no_fx:
        t0 = time.perf_counter()
        fx = _fx(cnn, x1, calib)
        t_fx = time.perf_counter() - t0
        if fx is not None:
            variants["torch.ao convert_fx (x86)"] = fx
    for threads in args.threads:
        torch.set_num_threads(threads)
        lat = {bs: time_variants(variants, (x,), rounds=args.rounds, inner=10 if bs == 1 else 3, budget_s=20)
               for bs, x in ((1, x1), (32, x32))}
        print(f"# DigitsCNN {s}x{s} width {args.width} ({sum(p.numel() for p in cnn.parameters()):,} params), "
              f"{threads} thread(s)")
        print(tabulate(_rows(variants, lat, "fp32 eager"), headers="keys", floatfmt=".3f"))
        fxk = "torch.ao convert_fx (x86)"
        if fxk in variants:
            print(f"lowered / convert_fx latency at b32: "
                  f"{lat[32][f'int8 lowered ({backend})']['median_ms'] / lat[32][fxk]['median_ms']:.2f} "
                  f"(<= 1.2 is within 20%); convert_fx flow {t_fx:.2f} s")
        print()
    print(f"trace -> canonicalize -> fold -> observe -> calibrate(256) -> reference -> lower: {t_flow:.2f} s\n")


def _mlp(args, calib, x1, x32, backend):
    s = args.size
    mlp = DigitsMLP(s * s).eval()
    gm = symtrace.symbolic_trace(mlp, example_inputs=(x1,))
    p = Q.prepare(gm)
    Q.calibrate(p, calib)
    ref = Q.to_reference(p)
    mv = {"fp32 eager": mlp}
    for b in dict.fromkeys((backend, "onednn")):
        if Q.backend_available(b):
            mv[f"static int8 ({b})"] = Q.lower(ref, b)
            if b == backend:  # what folding the input quantize / output dequantize into the Linears gains
                mv[f"static int8 ({b}, edges unfused)"] = Q.lower(ref, b, fuse_edges=False)
            mv[f"dynamic int8 ({b})"] = Q.quantize_dynamic(gm, b)
    if not args.no_fx:
        fxd = _fx(mlp, x1, calib, dynamic=True)
        if fxd is not None:
            mv["torch.ao convert_fx dynamic"] = fxd
    for threads in args.threads:
        torch.set_num_threads(threads)
        mlat = {bs: time_variants(mv, (x,), rounds=args.rounds, inner=10, budget_s=10)
                for bs, x in ((1, x1), (32, x32))}
        print(f"# DigitsMLP {s * s}-1024-1024-512-10 ({sum(p.numel() for p in mlp.parameters()):,} params), "
              f"{threads} thread(s)")
        print(tabulate(_rows(mv, mlat, "fp32 eager"), headers="keys", floatfmt=".3f"))
        print()


if __name__ == "__main__":
    sys.exit(main())
