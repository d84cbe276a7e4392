"""Post-training int8 quantization with symtrace, end to end, on scikit-learn's digits.

Run from the repository root::

    .venv/bin/python examples/quantization/quantize_digits.py            # ~1 min on a quiet 2-core CPU
    .venv/bin/python examples/quantization/quantize_digits.py --quick    # smaller model, fewer rounds

Steps (each prints what it did): train a small CNN and an MLP -> trace -> canonicalize -> fold
batch norm -> insert observers -> calibrate on 256 images -> q/dq reference (the oracle) -> lower
to fused int8 kernels -> check accuracy, agreement, SQNR, per-layer numerics -> time it ->
save, reload, re-evaluate. README.md next to this file explains each step.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
# On shared machines OpenMP threads that spin while waiting make everything slower (and
# timings meaningless); set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import symtrace  # noqa: E402
from symtrace.passes import fold_batch_norm  # noqa: E402
from symtrace.passes import quant as Q  # noqa: E402
from symtrace.passes.quant.bench import cpu_info, time_variants  # noqa: E402
from symtrace.passes.quant.numerics import format_histogram  # noqa: E402
from examples.quantization.chart import bar_chart  # noqa: E402
from examples.quantization.digits import DigitsCNN, DigitsMLP, augmented, load_digits, train  # noqa: E402
# The "c" int8 backend (loaded by name on first use; imported here only to report its ISA):
# symtrace-generated C kernels for int8 Linear (AVX512-VNNI where present), exact against the
# portable backend; convolutions still go to oneDNN. When no C compiler is found it stays
# unavailable and "auto" picks oneDNN/portable as before.
import symtrace.lower.int8_cpu  # noqa: E402,F401


def section(title: str) -> None:
    print(f"\n{'=' * 100}\n{title}\n{'=' * 100}")


def table(rows, headers="keys", floatfmt=".4g") -> None:
    print(tabulate(rows, headers=headers, floatfmt=floatfmt))


@torch.no_grad()
def logits(model, x: torch.Tensor, batch: int = 256) -> torch.Tensor:
    return torch.cat([model(x[i:i + batch]) for i in range(0, len(x), batch)])


def trained(kind: str, make, xtr, ytr, epochs: int, cache_dir: str, retrain: bool, tag: str):
    """Train (or reuse the weights cached by an earlier run with the same settings)."""
    path = os.path.join(cache_dir, f"{kind}_{tag}.pt")
    model = make()
    if os.path.exists(path) and not retrain:
        model.load_state_dict(torch.load(path, weights_only=True))
        print(f"{kind}: reusing weights trained by an earlier run ({os.path.relpath(path, ROOT)}; --retrain to redo)")
        return model.eval(), 0.0
    t0 = time.perf_counter()
    print(f"{kind}: training {epochs} epochs on {len(xtr)} images ({torch.get_num_threads()} threads)")
    train(model, xtr, ytr, epochs=epochs, batch=32, lr=6e-3)
    dt = time.perf_counter() - t0
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model.eval(), dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=32, help="image side after upsampling the 8x8 digits (default 32)")
    ap.add_argument("--width", type=int, default=32, help="CNN base width (default 32: 325k parameters)")
    ap.add_argument("--epochs", type=int, default=4, help="CNN training epochs (default 4; --quick: 5)")
    ap.add_argument("--threads", type=int, default=1, help="threads for the latency table (default 1)")
    ap.add_argument("--train-threads", type=int, default=1,
                    help="threads for training and evaluation (default 1: robust on busy 2-core machines)")
    ap.add_argument("--rounds", type=int, default=15, help="timing rounds per variant (default 15)")
    ap.add_argument("--oracle-images", type=int, default=128,
                    help="augmented images also checked against the float64 oracle (default 128)")
    ap.add_argument("--quick", action="store_true", help="16x16 images, width 16, fewer timing rounds")
    ap.add_argument("--retrain", action="store_true", help="ignore weights cached by an earlier run")
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "quantization"), help="output folder")
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.width, args.rounds = 16, 16, 6
        if "--epochs" not in (argv if argv is not None else sys.argv[1:]):
            args.epochs = 5
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(args.train_threads)
    train_threads = args.train_threads
    info = cpu_info()

    # ------------------------------------------------------------------------------------
    section("1. Data: scikit-learn's digits (bundled as data/digits.csv.gz), a seeded split, an augmented set")
    xtr, ytr, xte, yte = load_digits(args.size)
    xaug = augmented(xte)              # 10 seeded variants per test image: rotation, zoom, shift, noise
    yaug = yte.repeat_interleave(10)
    print(f"train {tuple(xtr.shape)}, test {tuple(xte.shape)}, augmented test {tuple(xaug.shape)}")

    # ------------------------------------------------------------------------------------
    section("2. Train the float models (cached under out/ for re-runs)")
    tag = f"s{args.size}_w{args.width}_e{args.epochs}"
    cnn, t_cnn = trained("digits_cnn", lambda: DigitsCNN(args.width), xtr, ytr, args.epochs, args.out,
                         args.retrain, tag)
    mlp, t_mlp = trained("digits_mlp", lambda: DigitsMLP(args.size * args.size), xtr, ytr, 8, args.out,
                         args.retrain, f"s{args.size}_e8")
    print(f"CNN: {sum(p.numel() for p in cnn.parameters()):,} parameters; MLP: "
          f"{sum(p.numel() for p in mlp.parameters()):,} parameters")

    # ------------------------------------------------------------------------------------
    section("3. trace -> canonicalize -> fold batch norm -> observe -> calibrate -> reference -> lower")
    calib = xtr[:256]
    example = xtr[:2]
    hist_rows = []

    def show(stage, gm):
        hist_rows.append((stage, format_histogram(Q.op_histogram(gm))))

    t0 = time.perf_counter()
    gm = symtrace.symbolic_trace(cnn, example_inputs=(example,))
    show("traced", gm)
    n_canon = Q.canonicalize(gm)           # in-place -> out-of-place, F.relu == nn.ReLU, view(..,-1) == flatten
    show(f"canonicalize ({n_canon} rewrites)", gm)
    folded = fold_batch_norm(gm)            # conv + bn -> conv with folded weights
    show(f"fold_batch_norm ({folded} folded)", gm)
    float_folded = copy.deepcopy(gm)        # the float graph int8 is compared against
    config = Q.QuantConfig()                # backend "x86": uint8 activations, int8 per-channel weights
    n_obs = Q.insert_observers(gm, config)
    show(f"insert_observers ({n_obs})", gm)
    Q.calibrate(gm, calib, batch_size=32)   # 256 training images; a progress bar appears on slow runs
    ref = Q.to_reference(gm)                # q/dq around float64 math: the exact oracle
    show("to_reference (q/dq oracle)", ref)
    backend = Q.default_backend()
    low = Q.lower(ref, backend)
    show(f"lower(backend={backend!r})", low)
    t_flow = time.perf_counter() - t0
    table(hist_rows, headers=["after", "op histogram"])
    fold_err = (logits(float_folded, xte) - logits(cnn, xte)).abs().max().item()
    print(f"\nfolding is exact up to float rounding: max |folded - original| logit on the test split = {fold_err:.2e}")
    print(f"\ntrace -> fold -> observe -> calibrate (256 images) -> lower: {t_flow:.2f} s "
          f"(target < 5 s); backends usable here: {', '.join(Q.available_backends())}")
    print("\nThe lowered graph (one quantize in, one dequantize out, int8 in between):\n")
    print(low.code)
    prepared = gm

    # ------------------------------------------------------------------------------------
    section("4. Observers: what calibration saw and the parameters it chose")
    rows = Q.observer_table(prepared)
    for r in rows:
        if isinstance(r["scale"], float):
            r["scale"] = f"{r['scale']:.4g}"
    table(rows)
    print("\nThe x86 backend table (declarative; see symtrace.passes.quant.config.BackendSpec):")
    table(config.spec.table(), headers=["", ""])

    # ------------------------------------------------------------------------------------
    section("5. Accuracy: fp32 vs int8 on the test split and the augmented set")
    portable = Q.lower(ref, "portable") if backend != "portable" else low
    lowered_key = f"int8 lowered ({backend})"
    variants = {"fp32": cnn, lowered_key: low}
    out_test = {k: logits(m, xte) for k, m in variants.items()}
    out_aug = {k: logits(m, xaug) for k, m in variants.items()}
    acc_rows = []
    for k in variants:
        lt, la = out_test[k], out_aug[k]
        acc_rows.append({
            "model": k, "test acc %": 100 * (lt.argmax(1) == yte).float().mean().item(),
            "aug acc %": 100 * (la.argmax(1) == yaug).float().mean().item(),
            "top-1 agree w/ fp32 (aug) %": 100 * (la.argmax(1) == out_aug["fp32"].argmax(1)).float().mean().item(),
            "logit SQNR test dB": Q.sqnr(out_test["fp32"], lt) if k != "fp32" else math.inf,
            "logit SQNR aug dB": Q.sqnr(out_aug["fp32"], la) if k != "fp32" else math.inf})
    table(acc_rows, floatfmt=".2f")

    # Exactness: everything against the float64 oracle (slow: float64 convolutions), on the
    # test split and the first augmented images. The classic fp32 q/dq model is shown too.
    ref32 = Q.to_reference(prepared, precision=torch.float32)
    out_scale = ref.graph.output_node().args[0].args[1]  # the reference's final dequantize: the output step
    oracle_x = torch.cat([xte, xaug[:args.oracle_images]])
    oracle = logits(ref, oracle_x)
    checks = []
    for name, m in (("int8 reference (q/dq, fp32)", ref32), (lowered_key, low), ("int8 lowered (portable)", portable)):
        got = logits(m, oracle_x) if m is not low else torch.cat([out_test[lowered_key],
                                                                  out_aug[lowered_key][:args.oracle_images]])
        d = (got - oracle).abs()
        checks.append({"vs the float64 oracle": name, "same argmax %": 100 * (got.argmax(1) == oracle.argmax(1))
                       .float().mean().item(), "max |diff| (output steps)": d.max().item() / out_scale,
                       "elements differing %": 100 * (d > 1e-6).float().mean().item()})
    print(f"\nExactness on {len(oracle_x)} images (test split + {args.oracle_images} augmented):")
    table(checks, floatfmt=".3f")
    a, b = acc_rows
    verdict = {"accuracy drop <= 0.5 pp": a["test acc %"] - b["test acc %"] <= 0.5,
               "agreement >= 98 %": b["top-1 agree w/ fp32 (aug) %"] >= 98.0,
               "logit SQNR >= 22 dB (aug)": b["logit SQNR aug dB"] >= 22.0,
               "lowered == oracle (argmax, <= 1 step)": all(c["same argmax %"] == 100.0
                                                            and c["max |diff| (output steps)"] <= 1.0 + 1e-3
                                                            for c in checks[1:])}
    print("\n" + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in verdict.items()))

    # ------------------------------------------------------------------------------------
    section("6. Per-layer numerics: where is the error made? (256 augmented images)")
    probe = xaug[:256]
    rows = Q.compare_numerics(float_folded, low, probe)
    wsq = Q.weight_sqnr(float_folded, low)
    layer_of = {n.meta.get("quant_of"): n.meta.get("quant_layer") for n in low.graph.nodes}
    for r in rows:
        r["weight SQNR dB"] = wsq.get(layer_of.get(r["node"]), float("nan"))
    table([{k: r[k] for k in ("node", "op", "qparams", "sqnr_db", "cosine", "max_err_steps", "weight SQNR dB")}
           for r in rows], floatfmt=".3f")
    sens = Q.sensitivity(prepared, probe[:64], float_gm=float_folded)
    print("\nSensitivity: output SQNR with one layer at a time kept in float (same calibration, 64 images):")
    table([{"kept in float": r["layer"] or "(none: all int8)", "output SQNR dB": r["sqnr_db"],
            "gain dB": r["gain_db"]} for r in sens], floatfmt=".2f")
    chart = bar_chart(os.path.join(args.out, "sqnr_per_layer"), "int8 vs fp32: output SQNR per layer (dB)",
                      [(r["node"], r["sqnr_db"]) for r in rows], good=30, ok=20)
    print(f"\nBar chart: {os.path.relpath(chart, ROOT)} "
          f"({'PNG drawn by graphviz dot' if chart.endswith('.png') else 'SVG written by hand: dot not found'})")

    # ------------------------------------------------------------------------------------
    section(f"7. Latency (median ms, {args.threads} thread(s); speed-up vs fp32 eager)")
    torch.set_num_threads(args.threads)
    bench = {"fp32 eager": cnn, "fp32 folded graph": float_folded, "int8 reference (q/dq, fp32)": ref32,
             lowered_key: low}
    if backend != "portable":
        bench["int8 lowered (portable)"] = portable
    fx_note = "torch.ao convert_fx: not available in this torch"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.ao.quantization import get_default_qconfig_mapping
            from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
            t0 = time.perf_counter()
            pfx = prepare_fx(copy.deepcopy(cnn), get_default_qconfig_mapping("x86"), (example,))
            with torch.no_grad():
                for xb in calib.split(32):
                    pfx(xb)
            bench["torch.ao convert_fx (x86)"] = convert_fx(pfx)
            fx_note = f"torch.ao prepare_fx -> calibrate -> convert_fx took {time.perf_counter() - t0:.2f} s"
    except Exception as e:  # removed in some torch versions
        fx_note = f"torch.ao convert_fx unavailable ({type(e).__name__}: {e})"
    lat = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for bs in (1, 32):
            lat[bs] = time_variants(bench, (xte[:bs],), rounds=args.rounds, inner=2 if bs == 32 else 10,
                                    warmup=2, budget_s=6.0)
    rows = []
    for k in bench:
        row = {"variant": k}
        for bs in (1, 32):
            ms = lat[bs][k]["median_ms"]
            row[f"b{bs} ms"] = ms
            row[f"b{bs} speed-up"] = lat[bs]["fp32 eager"]["median_ms"] / ms
        row["size KB"] = Q.model_size(bench[k]) / 1024 if k != "torch.ao convert_fx (x86)" else \
            _fx_size(bench[k]) / 1024
        rows.append(row)
    table(rows, floatfmt=".3f")
    print(f"\nmeasured: {info['cpu']}; ISA: {' '.join(info['isa']) or '?'}; torch {info['torch']} "
          f"(capability {info['torch_capability']}); {args.threads} thread(s) of {info['cores']} cores; "
          f"load average {info['load_avg_1m']:.1f} (shared machines make these noisy). {fx_note}.")
    fx = lat[32].get("torch.ao convert_fx (x86)")
    if fx is not None:
        print(f"lowered int8 vs convert_fx at batch 32: {fx['median_ms'] / lat[32][lowered_key]['median_ms']:.2f}x "
              "(>= 0.83 means within 20%)")

    # ------------------------------------------------------------------------------------
    section("8. Linear layers: static vs dynamic int8 on the MLP")
    torch.set_num_threads(train_threads)
    gm_mlp = symtrace.symbolic_trace(mlp, example_inputs=(example,))
    p_mlp = Q.prepare(gm_mlp)
    Q.calibrate(p_mlp, calib)
    ref_mlp = Q.to_reference(p_mlp)
    mv = {"fp32": mlp}
    for b in dict.fromkeys((backend, "onednn")):  # the default backend, and oneDNN for comparison
        if Q.backend_available(b):
            mv[f"static int8 ({b})"] = Q.lower(ref_mlp, b)
            mv[f"dynamic int8 ({b})"] = Q.quantize_dynamic(gm_mlp, b)
    mt = {k: logits(m, xte) for k, m in mv.items()}
    ma = {k: logits(m, xaug) for k, m in mv.items()}
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlat = {bs: time_variants(mv, (xte[:bs],), rounds=args.rounds, inner=10, budget_s=4.0) for bs in (1, 32)}
    table([{"model": k, "test acc %": 100 * (mt[k].argmax(1) == yte).float().mean().item(),
            "aug acc %": 100 * (ma[k].argmax(1) == yaug).float().mean().item(),
            "agree (aug) %": 100 * (ma[k].argmax(1) == ma["fp32"].argmax(1)).float().mean().item(),
            "logit SQNR aug dB": Q.sqnr(ma["fp32"], ma[k]) if k != "fp32" else math.inf,
            "b1 ms": mlat[1][k]["median_ms"], "b1 speed-up": mlat[1]["fp32"]["median_ms"] / mlat[1][k]["median_ms"],
            "b32 ms": mlat[32][k]["median_ms"],
            "b32 speed-up": mlat[32]["fp32"]["median_ms"] / mlat[32][k]["median_ms"],
            "threads": args.threads, "size KB": Q.model_size(m) / 1024} for k, m in mv.items()], floatfmt=".3f")
    print(f"({args.threads} thread(s); dynamic = activations quantized per call from their own range, "
          "no calibration; target: static and dynamic >= 2x fp32 at batch 1, >= 3x at batch 32)")
    if backend == "c":
        amx = ", where oneDNN's AMX kernels cost ~50-300 us per call at batch 1" if info["amx_int8"] else ""
        print("backend 'c': symtrace's C int8 Linear kernels "
              f"({symtrace.lower.int8_cpu.BACKEND.isa}; a few us of dispatch per layer){amx}")

    # ------------------------------------------------------------------------------------
    section("9. Save, reload, re-evaluate")
    torch.set_num_threads(train_threads)
    path = os.path.join(args.out, "digits_cnn_int8.symtrace")  # symtrace.save's safe format, no pickle
    Q.save_quantized(low, path)
    back = Q.load_quantized(path)
    again = logits(back, xte)
    print(f"saved {os.path.relpath(path, ROOT)} ({os.path.getsize(path) / 1024:.0f} KB; int8 weights + scales as "
          f"buffers, activation parameters in the graph); reloaded: test accuracy "
          f"{100 * (again.argmax(1) == yte).float().mean().item():.2f}%, identical logits: "
          f"{torch.equal(again, out_test[lowered_key])}")
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s (training {t_cnn + t_mlp:.1f} s at {train_threads} threads)")
    return 0 if all(verdict.values()) else 1


def _fx_size(m) -> int:
    """Bytes of a convert_fx model's weights (packed params are not in named_parameters)."""
    total = 0
    for v in m.state_dict().values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, tuple):
            total += sum(t.numel() * t.element_size() for t in v if isinstance(t, torch.Tensor))
    return total


if __name__ == "__main__":
    sys.exit(main())
