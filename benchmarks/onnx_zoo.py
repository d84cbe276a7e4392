"""symtrace graphs of zoo models -> ONNX (symtrace.interop.onnx.export) -> onnxruntime, against eager.

Run in the zoo environment (torchvision, timm; onnx, onnxscript, onnxruntime installed there):

    PYTHONPATH=. ~/zooenv/bin/python benchmarks/onnx_zoo.py [--models resnet18,mobilenet_v3_small,vit_tiny]

For each model (random seeded weights, eval mode): trace with symtrace at batch 2, export to ONNX
with a dynamic batch dimension, run the file with onnxruntime at batch 1 and 3 and compare with
eager PyTorch (max abs and max relative error); also time eager vs onnxruntime at batch 1
(medians, one thread each; on a loaded machine the ratio is the number to read). The other
direction too: torch.export.export of the model -> symtrace.from_export, compared with eager at
batch 3 (``from_export_err``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.export import Dim

import symtrace
from symtrace.interop import onnx as sonnx


def _model(name: str) -> torch.nn.Module:
    if name == "vit_tiny":
        import timm
        return timm.create_model("vit_tiny_patch16_224", pretrained=False)
    import torchvision
    return getattr(torchvision.models, name)(weights=None)


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(name: str, reps: int, tmp: str) -> dict:
    import onnxruntime as ort
    torch.manual_seed(0)
    model = _model(name).eval()
    x = torch.randn(2, 3, 224, 224)
    row: dict = {"model": name}
    t = time.perf_counter()
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    row["trace_s"] = time.perf_counter() - t
    arg = gm.graph.placeholders()[0].name  # the image (timm's ViT also takes attn_mask=None)
    t = time.perf_counter()
    path = sonnx.export(gm, (x,), os.path.join(tmp, f"{name}.onnx"), dynamic_shapes={arg: {0: Dim("batch")}})
    row["onnx_export_s"] = time.perf_counter() - t
    row["onnx_mb"] = os.path.getsize(path) / 2**20
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    iname = sess.get_inputs()[0].name
    abs_err = rel_err = 0.0
    with torch.no_grad():
        for b in (1, 3):
            xb = torch.randn(b, 3, 224, 224)
            ref = model(xb)
            (out,) = sess.run(None, {iname: xb.numpy()})
            diff = (torch.from_numpy(out) - ref).abs().max().item()
            abs_err = max(abs_err, diff)
            rel_err = max(rel_err, diff / max(ref.abs().max().item(), 1e-12))
        x1 = torch.randn(1, 3, 224, 224)
        torch.set_num_threads(1)
        eager = _median_s(lambda: model(x1), reps)
        onnx = _median_s(lambda: sess.run(None, {iname: x1.numpy()}), reps)
        torch.set_num_threads(os.cpu_count() or 1)
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: Dim("batch")},))
        back = symtrace.from_export(ep)
        x3 = torch.randn(3, 3, 224, 224)
        back_err = (back(x3) - model(x3)).abs().max().item()
    row.update(max_abs_err=abs_err, max_rel_err=rel_err, eager_ms=eager * 1e3, ort_ms=onnx * 1e3,
               ort_over_eager=onnx / eager, from_export_err=back_err)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,mobilenet_v3_small,vit_tiny")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    missing = sonnx.missing_packages()
    if missing:
        print(f"needs {' '.join(missing)} (and onnxruntime): pip install onnx onnxscript onnxruntime")
        return 2
    print(f"torch {torch.__version__}; one thread; medians of {args.reps}")
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            try:
                rows.append(run(name, args.reps, tmp))
            except Exception as e:  # report and go on with the next model
                failed += 1
                print(f"{name}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    cols = ["model", "trace_s", "onnx_export_s", "onnx_mb", "max_abs_err", "max_rel_err", "eager_ms", "ort_ms",
            "ort_over_eager", "from_export_err"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
