"""One-query-row attention over a KV cache: torch's SDPA against symtrace's decode kernel.

    python benchmarks/decode_attention_bench.py [--threads 2] [--rounds 30]
        [--shapes 32x8x64 16x4x64 12x12x64 32x8x128] [--lengths 80 512 2048]
        [--layouts contiguous append]

Shapes are ``H x Hkv x D`` (query heads, key-value heads, head size), batch 1, one query row,
``enable_gqa=True`` where ``H != Hkv``: a decoder's step as Hugging Face calls it
(``symtrace.lower.attention_cpu``; the inference pipeline puts the kernel in place of such
calls). ``append`` lays the cache out as the lowered decode step's in-place append does
(``symtrace.lower.kv_append``: positions outermost, spare capacity), ``contiguous`` as Hugging
Face's ``torch.cat`` does. Variants are interleaved round by round; the table gives median microseconds and the
speed-up over torch (``symtrace.passes.quant.bench.time_variants``), and the largest absolute
difference between the two results. The load average is printed: rerun on a busy machine.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

from symtrace.lower.attention_cpu import KERNEL, DecodeAttention  # noqa: E402
from symtrace.lower.kv_append import AppendCat  # noqa: E402
from symtrace.passes.quant.bench import time_variants  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--shapes", nargs="+", default=["32x8x64", "16x4x64", "12x12x64", "32x8x128"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[80, 512, 2048])
    ap.add_argument("--layouts", nargs="+", default=["contiguous", "append"], choices=["contiguous", "append"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not KERNEL.available():
        print(f"the decode attention kernel is not usable here ({KERNEL.reason}): both columns run torch")
    rows = []
    cases = [(shape, n, layout) for shape in args.shapes for n in args.lengths for layout in args.layouts]
    for shape, n, layout in cases:
        h, hkv, d = (int(v) for v in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, 1, d, generator=g), torch.randn(1, hkv, n, d, generator=g),
                   torch.randn(1, hkv, n, d, generator=g))
        if layout == "append":
            k, v = AppendCat(-2)(torch.empty(0), k), AppendCat(-2)(torch.empty(0), v)
        gqa = h != hkv
        ours = DecodeAttention(None, gqa)
        variants = {"torch": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
                    "symtrace": ours}
        res = time_variants(variants, (q, k, v), rounds=args.rounds, inner=10, budget_s=10)
        t_torch, t_ours = res["torch"]["median_ms"] * 1e3, res["symtrace"]["median_ms"] * 1e3
        err = (ours(q, k, v) - F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)).abs().max().item()
        rows.append([shape, n, layout, f"{t_torch:.1f}", f"{t_ours:.1f}", f"{t_torch / t_ours:.2f}x", f"{err:.1e}"])
    print(f"# {args.threads} threads | torch {torch.__version__} | load avg {os.getloadavg()[0]:.2f}")
    print(tabulate(rows, headers=["H x Hkv x D", "positions", "cache layout", "torch us", "symtrace us", "speed-up", "max |diff|"]))


if __name__ == "__main__":
    main()
