"""Quantization-aware training recovers what post-training quantization loses.

A small MobileNet-like CNN (depthwise-separable blocks, batch norm, ReLU) on scikit-learn's
digits at 16x16, with weights quantized to fewer than 8 bits (per-channel, stored as int8 and
run by the same int8 kernels): 4-bit (levels -7..7) and 3-bit (-3..3). For each: the fp32
model, post-training quantization (prepare -> calibrate -> convert) and quantization-aware
training (prepare_qat -> a short fine-tune -> convert), on the clean test split and on the
harder augmented set. A control row fine-tunes the fp32 model for the same steps, so the
QAT gain is not just "more training". Run from the repository root::

    .venv/bin/python examples/quantization/qat_mobilenet.py            # ~30 s on one core
    .venv/bin/python examples/quantization/qat_mobilenet.py --steps 3 --epochs 1   # a smoke run

Everything is seeded; the int8 models are the lowered ones (portable backend: exact int8
arithmetic, the same results on any CPU). One thread by default: on a busy 2-core machine a
second OpenMP thread mostly waits (``--threads 2`` to compare).
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import symtrace  # noqa: E402
from symtrace.passes import quant as Q  # noqa: E402
from examples.quantization.digits import accuracy, augmented, load_digits, random_affine, train  # noqa: E402


class DepthwiseSeparable(nn.Module):
    """depthwise 3x3 -> BN -> ReLU -> pointwise 1x1 -> BN -> ReLU (MobileNet v1's block)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.dw = nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False)
        self.bn1 = nn.BatchNorm2d(cin)
        self.pw = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu(self.bn1(self.dw(x)))
        return F.relu(self.bn2(self.pw(x)))


class TinyMobileNet(nn.Module):
    """stem conv 3x3 (1->w) -> four depthwise-separable blocks (two of stride 2) -> global
    average pool -> Linear."""

    def __init__(self, w: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(1, w, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(w)
        self.blocks = nn.Sequential(DepthwiseSeparable(w, 2 * w), DepthwiseSeparable(2 * w, 2 * w, 2),
                                    DepthwiseSeparable(2 * w, 4 * w, 2), DepthwiseSeparable(4 * w, 4 * w))
        self.fc = nn.Linear(4 * w, classes)

    def forward(self, x):
        x = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def qat_finetune(qat: nn.Module, x, y, steps: int, batch: int = 64, lr: float = 1e-3, seed: int = 0):
    """``steps`` AdamW steps on the fake-quantized model; the last quarter with observers and
    batch-norm statistics frozen (the int8 model's folded layers, trained directly)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(qat.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    qat.train()
    for step in range(steps):
        if step == (3 * steps) // 4:
            Q.freeze_observers(qat)
            Q.freeze_bn_stats(qat)
        idx = torch.randint(len(x), (batch,), generator=g)
        xb = random_affine(x[idx], g, rotate=15.0, scale=0.1, shift=0.1, noise=0.1)
        loss = F.cross_entropy(qat(xb), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return qat.eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=12, help="fp32 training epochs")
    ap.add_argument("--steps", type=int, default=150, help="QAT fine-tuning steps per setting")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    xtr, ytr, xte, yte = load_digits(16)
    xaug, yaug = augmented(xte), yte.repeat_interleave(10)
    torch.manual_seed(0)
    model = train(TinyMobileNet(), xtr, ytr, epochs=args.epochs, lr=5e-3, log=None)
    print(f"fp32 TinyMobileNet trained: {sum(p.numel() for p in model.parameters())} parameters, "
          f"{args.epochs} epochs ({time.perf_counter() - t0:.1f} s)")
    example = (xtr[:8],)
    calib = list(xtr[:256].split(32))

    def scores(m):
        return 100 * accuracy(m, xte, yte), 100 * accuracy(m, xaug, yaug)

    rows = [("fp32", "", *scores(model), "")]
    t1 = time.perf_counter()
    tuned = qat_finetune(copy.deepcopy(model), xtr, ytr, args.steps)
    rows.append(("fp32", f"+{args.steps} steps", *scores(tuned), f"{time.perf_counter() - t1:.1f}"))
    for bits in (4, 3):
        name = f"{bits}-bit per-channel"
        config = Q.QuantConfig(weight=functools.partial(Q.PerChannelSymmetricObserver, bits=bits))
        # post-training: eval-mode trace -> fold BN -> observe -> calibrate -> int8
        t1 = time.perf_counter()
        prepared = Q.prepare(symtrace.symbolic_trace(copy.deepcopy(model).eval(), example_inputs=example), config)
        Q.calibrate(prepared, calib)
        ptq = Q.convert(prepared, backend="portable")
        rows.append((name, "PTQ", *scores(ptq), f"{time.perf_counter() - t1:.1f}"))
        # quantization-aware: train-mode trace -> fake quantization -> fine-tune -> int8
        t1 = time.perf_counter()
        qat = Q.prepare_qat(symtrace.symbolic_trace(copy.deepcopy(model).train(), example_inputs=example), config)
        qat_finetune(qat, xtr, ytr, args.steps)
        q = Q.convert(qat, backend="portable")
        rows.append((name, f"QAT {args.steps} steps", *scores(q), f"{time.perf_counter() - t1:.1f}"))
        same = [(n.op, getattr(n.target, "__name__", n.target)) for n in ptq.graph.nodes] == \
               [(n.op, getattr(n.target, "__name__", n.target)) for n in q.graph.nodes]
        print(f"{name}: QAT's int8 graph is {'the same as' if same else 'DIFFERENT from'} PTQ's "
              f"({len(q.graph.nodes)} nodes: {Q.op_histogram(q)})")

    print(f"\n{'weights':<28}{'method':<18}{'test %':>8}{'augmented %':>13}{'time s':>8}")
    for name, how, a, b, t in rows:
        print(f"{name:<28}{how:<18}{a:>8.2f}{b:>13.2f}{t:>8}")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s, {torch.get_num_threads()} threads, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
