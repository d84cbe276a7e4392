"""Tracing benchmarks: symtrace against torch.fx, measured in the same run.

    python benchmarks/trace_bench.py            # full run (~4-5 min on 2 CPU cores)
    python benchmarks/trace_bench.py --quick    # fewer repeats, smaller cases (~1 min)

Workloads
  resnet50      a hand-written ResNet-50 (bottlenecks [3, 4, 6, 3], torchvision widths, BN+ReLU)
  transformer12 12 x examples.models.TransformerBlock(dim=768, heads=12) in an nn.Sequential
  chain10k      synthetic graph: forward loops k times over
  chain50k          a = torch.add(h, y); r = torch.relu(a); h = operator.mul(r, 2.0)
                (~3 nodes per iteration, as in torch.fx's own measured study)

Operations (each timed on symtrace and torch.fx; median (min) of N runs after a warm-up (chain50k:
3 symtrace runs, 1 torch.fx run, no warm-up; real models: 3 runs for deepcopy/pickle),
torch.set_num_threads(1), gc.collect() before each run, gc left enabled)
  trace          symtrace.symbolic_trace(m)  vs  torch.fx.symbolic_trace(m)     (both symbolic)
  trace+values   symtrace.symbolic_trace(m, example_inputs=...)  vs  one eager forward m(x)
                 (real models only; the baseline column holds the eager time)
  recompile      gm.recompile(): code generation only. symtrace compiles lazily (on the first call
                 or read of gm.forward / gm.code), torch.fx's recompile() also compiles, so this row
                 leaves out a cost torch.fx's includes; the next row adds it
  recompile + compile  gm.recompile() then reading gm.forward, with symtrace's code-object cache
                 cleared first (code generation + CPython compile(): what torch.fx's recompile() does)
  recompile + compile (cached)  the same without clearing the cache: the source is generated
                 again, the code object comes from the cache (what copies and unpickled modules pay)
  deepcopy       copy.deepcopy(gm)
  pickle         pickle.loads(pickle.dumps(gm))  (torch.fx re-traces the code on load); symtrace
                 keeps an unpickled graph packed until first use: "pickle + nodes built" adds that

ratio = symtrace / baseline (lower is better). Targets (from the issue): trace <= 0.25x fx,
code generation (the recompile row) <= 0.3x fx's recompile, deepcopy and pickle round trip of
the 10k-node module < 50 ms. The "recompile + compile" row is reported without a target: the
issue asks for compilation to be lazy, and CPython compiles one statement per node at about the
same speed for either library's source (10k-node chain: torch.fx's own source 218 ms, symtrace's
207 ms: medians of 5 compile() calls), which is 40-50% of torch.fx's whole recompile; 0.3x with
compilation included would need several nodes per statement, not the one-node-per-line readable
forward the same issue asks for.
"""
from __future__ import annotations

import argparse
import copy
import gc
import operator
import os
import pickle
import statistics
import sys
import time
import warnings
from typing import Callable, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore", message=".*NumPy.*")

import torch  # noqa: E402
import torch.fx  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch import nn  # noqa: E402

import symtrace  # noqa: E402
from symtrace.graph.codegen import clear_code_cache  # noqa: E402
from examples.models import TransformerBlock  # noqa: E402


# --------------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


class ResNet50(nn.Module):
    """torchvision's resnet50 layout, written out (no torchvision dependency)."""

    def __init__(self, layers=(3, 4, 6, 3), num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


class TransformerStack(nn.Module):
    """``depth`` x examples.models.TransformerBlock in an nn.Sequential (torch.fx traces it:
    the blocks' ``mask`` argument keeps its Python default None inside the root's forward)."""

    def __init__(self, depth: int = 12, dim: int = 768, heads: int = 12):
        super().__init__()
        self.blocks = nn.Sequential(*[TransformerBlock(dim=dim, heads=heads) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(x)


class Chain(nn.Module):
    """Synthetic ``3 * k``-op chain (torch.fx's measured study)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, h, y):
        for _ in range(self.k):
            a = torch.add(h, y)
            r = torch.relu(a)
            h = operator.mul(r, 2.0)
        return h


class Workload:
    def __init__(self, name: str, make: Callable[[], nn.Module], inputs: Callable[[], tuple],
                 repeats: int, fx_repeats: int, real: bool, warmup: bool = True):
        self.name, self.make, self.inputs = name, make, inputs
        self.repeats, self.fx_repeats, self.real, self.warmup = repeats, fx_repeats, real, warmup


def workloads(quick: bool) -> List[Workload]:
    # Note: `torch.manual_seed` keeps the models identical across runs.
    if quick:
        return [
            Workload("resnet50", lambda: ResNet50().eval(), lambda: (torch.randn(1, 3, 112, 112),), 3, 3, True),
            Workload("transformer12", lambda: TransformerStack().eval(), lambda: (torch.randn(1, 16, 768),),
                     3, 3, True),
            Workload("chain10k", lambda: Chain(3333), lambda: (torch.randn(4), torch.randn(4)), 3, 2, False),
        ]
    return [
        Workload("resnet50", lambda: ResNet50().eval(), lambda: (torch.randn(1, 3, 224, 224),), 7, 7, True),
        Workload("transformer12", lambda: TransformerStack().eval(), lambda: (torch.randn(1, 128, 768),),
                 7, 7, True),
        Workload("chain10k", lambda: Chain(3333), lambda: (torch.randn(4), torch.randn(4)), 7, 5, False),
        # torch.fx takes ~5-20 s per operation here: one run each, no warm-up
        Workload("chain50k", lambda: Chain(16667), lambda: (torch.randn(4), torch.randn(4)), 3, 1, False,
                 warmup=False),
    ]


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], repeats: int, warmup: bool = True, keep: Optional[list] = None) -> List[float]:
    """Wall-clock seconds of ``repeats`` calls (after one untimed warm-up call). The last
    result is appended to ``keep`` if given."""
    if warmup:
        fn()
    out = []
    res = None
    for _ in range(repeats):
        res = None
        gc.collect()
        t0 = time.perf_counter()
        res = fn()
        out.append(time.perf_counter() - t0)
    if keep is not None:
        keep.append(res)
    return out


def fmt_s(xs: List[float]) -> str:
    med = statistics.median(xs)
    return f"{med:.4f} (n=1)" if len(xs) < 2 else f"{med:.4f} ({min(xs):.4f})"


def _check_same(a, b, what: str) -> None:
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
        raise SystemExit(f"{what}: outputs differ (max abs diff {(a - b).abs().max().item():.3g})")


def pickle_roundtrip(gm):
    return pickle.loads(pickle.dumps(gm, protocol=pickle.HIGHEST_PROTOCOL))


TARGETS = {"trace": ("ratio", 0.25), "recompile": ("ratio", 0.30)}
ABS_TARGETS = {("chain10k", "deepcopy"): 0.050, ("chain10k", "pickle"): 0.050}


def run(quick: bool, only: Optional[str]) -> List[list]:
    rows: List[list] = []
    for w in workloads(quick):
        if only and only not in w.name:
            continue
        torch.manual_seed(0)
        m = w.make()
        xs = w.inputs()
        print(f"[{w.name}] ...", file=sys.stderr, flush=True)

        warm = w.warmup
        # (a) symbolic tracing (the last traced modules are used below)
        kept: list = []
        st = timed(lambda: symtrace.symbolic_trace(m), w.repeats, warm, kept)
        fx = timed(lambda: torch.fx.symbolic_trace(m), w.fx_repeats, warm, kept)
        st_gm, fx_gm = kept
        # sanity: both traces reproduce eager (untimed)
        with torch.no_grad():
            ref = m(*xs)
            _check_same(st_gm(*xs), ref, f"{w.name} symtrace")
            _check_same(fx_gm(*xs), ref, f"{w.name} torch.fx")
        nodes = f"{len(st_gm.graph.nodes)}/{len(fx_gm.graph.nodes)}"

        def add(op: str, st: List[float], base: List[float], base_label: str = "") -> None:
            ratio = statistics.median(st) / statistics.median(base)
            target = ""
            if op in TARGETS:
                target = f"<= {TARGETS[op][1]}x: {'ok' if ratio <= TARGETS[op][1] else 'MISS'}"
            abs_t = ABS_TARGETS.get((w.name, op))
            if abs_t is not None:
                ok = statistics.median(st) < abs_t
                target = (target + "; " if target else "") + f"< {abs_t * 1e3:.0f} ms: {'ok' if ok else 'MISS'}"
            rows.append([w.name, nodes, op, fmt_s(st), fmt_s(base) + base_label, f"{ratio:.3f}", target])

        add("trace", st, fx)
        if w.real:
            with torch.no_grad():
                st = timed(lambda: symtrace.symbolic_trace(m, example_inputs=xs), w.repeats, warm)
                eager = timed(lambda: m(*xs), w.repeats, warm)
            add("trace+values / eager", st, eager, " [eager]")

        # (b) code generation; symtrace compiles lazily, so the compile is timed separately
        def cold_recompile():
            clear_code_cache()
            return st_gm.recompile()

        def cached_recompile_compile():
            st_gm.recompile()
            return st_gm.forward  # the first read compiles (or takes the cached code object)

        def cold_recompile_compile():
            clear_code_cache()
            return cached_recompile_compile()

        fx = timed(fx_gm.recompile, w.fx_repeats, warm)
        add("recompile", timed(cold_recompile, w.repeats, warm), fx)
        add("recompile + compile", timed(cold_recompile_compile, w.repeats, warm), fx)
        add("recompile + compile (cached)", timed(cached_recompile_compile, w.repeats, warm), fx)

        # (c) deepcopy; the real models' copies are dominated by their ~100-350 MB of
        # parameters (copied by both), so they get fewer repeats
        rc, fxc = (min(w.repeats, 3), min(w.fx_repeats, 3)) if w.real else (w.repeats, w.fx_repeats)
        st = timed(lambda: copy.deepcopy(st_gm), rc, warm)
        fx = timed(lambda: copy.deepcopy(fx_gm), fxc, warm)
        add("deepcopy", st, fx)

        # (d) pickle round trip; symtrace builds an unpickled graph's nodes on first use, so
        # the second row also pays for that (len(graph) builds them)
        st = timed(lambda: pickle_roundtrip(st_gm), rc, warm)
        fx = timed(lambda: pickle_roundtrip(fx_gm), fxc, warm)
        add("pickle", st, fx)
        add("pickle + nodes built", timed(lambda: len(pickle_roundtrip(st_gm).graph), rc, warm), fx)

        # sanity: copies still compute the same (untimed)
        with torch.no_grad():
            _check_same(copy.deepcopy(st_gm)(*xs), ref, f"{w.name} symtrace deepcopy")
            _check_same(pickle_roundtrip(st_gm)(*xs), ref, f"{w.name} symtrace pickle")
        del st_gm, fx_gm, m
        gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller cases, no 50k chain")
    ap.add_argument("--only", help="run only workloads whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    t0 = time.perf_counter()
    rows = run(args.quick, args.only)
    print(f"torch {torch.__version__}, symtrace {symtrace.__version__}, python {sys.version.split()[0]}, "
          f"1 thread; seconds as median (min); ratio = symtrace / baseline (median)")
    print(tabulate(rows, headers=["workload", "nodes st/fx", "op", "symtrace s", "torch.fx s", "ratio",
                                  "target"], disable_numparse=True))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
