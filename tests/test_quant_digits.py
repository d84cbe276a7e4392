"""The example's accuracy targets, on a small DigitsCNN trained once per session (seeded):
accuracy drop <= 0.5 pp on the test split, >= 98% top-1 agreement with fp32 and logit SQNR
>= 22 dB on the augmented set, lowered int8 == reference (same argmax, <= 1 step). Speed is
only sanity-checked (int8 faster than fp32 at batch 32 when oneDNN is usable)."""
import pytest
import torch

import symtrace
from symtrace.passes import quant as Q
from symtrace.passes.quant.bench import time_variants
from examples.quantization import chart
from examples.quantization.digits import DigitsCNN, DigitsMLP, augmented, load_digits, train

BACKENDS = ["portable"] + [b for b in ("onednn", "c") if Q.backend_available(b)]


@pytest.fixture(scope="module")
def digits():
    # one thread: on a busy 2-core machine two spinning OpenMP threads are ~10x slower
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    xtr, ytr, xte, yte = load_digits(16)
    xaug = augmented(xte, copies=3)
    model = train(DigitsCNN(width=8), xtr, ytr, epochs=4, lr=6e-3, log=None)
    gm = symtrace.symbolic_trace(model, example_inputs=(xtr[:2],))
    prepared = Q.prepare(gm)
    Q.calibrate(prepared, xtr[:256])
    ref = Q.to_reference(prepared)
    yield dict(model=model, prepared=prepared, ref=ref, xtr=xtr, ytr=ytr, xte=xte, yte=yte, xaug=xaug)
    torch.set_num_threads(saved)


@torch.no_grad()
def _logits(m, x):
    return torch.cat([m(b) for b in x.split(256)])


def test_data_file_is_the_bundled_digits():
    xtr, ytr, xte, yte = load_digits(8)
    assert len(xtr) + len(xte) == 1797 and xtr.shape[1:] == (1, 8, 8)
    assert xtr.min() >= -1 and xtr.max() <= 1
    assert sorted(torch.cat([ytr, yte]).bincount().tolist())[0] >= 170  # ten balanced classes


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_meets_accuracy_targets(digits, backend):
    d = digits
    low = Q.lower(d["ref"], backend)
    f_te, q_te = _logits(d["model"], d["xte"]), _logits(low, d["xte"])
    f_aug, q_aug = _logits(d["model"], d["xaug"]), _logits(low, d["xaug"])
    acc_f = (f_te.argmax(1) == d["yte"]).float().mean().item()
    acc_q = (q_te.argmax(1) == d["yte"]).float().mean().item()
    assert acc_f > 0.9  # the model learned something
    assert acc_f - acc_q <= 0.005
    assert (q_aug.argmax(1) == f_aug.argmax(1)).float().mean().item() >= 0.98
    assert Q.sqnr(f_aug, q_aug) >= 22.0
    assert Q.sqnr(f_te, q_te) >= 30.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_lowered_equals_reference_within_one_step(digits, backend):
    d = digits
    low = Q.lower(d["ref"], backend)
    x = torch.cat([d["xte"], d["xaug"][:300]])  # the float64 oracle is slow: a subset
    r, q = _logits(d["ref"], x), _logits(low, x)
    step = d["ref"].graph.output_node().args[0].args[1]  # the final dequantize (lowered: folded into a Linear)
    assert (r - q).abs().max().item() <= step * 1.001
    assert torch.equal(r.argmax(1), q.argmax(1))
    if backend == "portable":
        assert torch.equal(r, q)


def test_weights_and_layers_numerics(digits):
    d = digits
    low = Q.lower(d["ref"], Q.default_backend())
    ws = Q.weight_sqnr(d["prepared"], low)
    assert len(ws) == 8 and min(ws.values()) >= 38.0
    rows = Q.compare_numerics(d["prepared"], low, d["xaug"][:128])
    assert rows[-1]["sqnr_db"] >= 22.0


def test_mlp_static_and_dynamic(digits):
    d = digits
    torch.manual_seed(0)
    mlp = train(DigitsMLP(256, hidden=(128, 64)), d["xtr"], d["ytr"], epochs=3, log=None)
    gm = symtrace.symbolic_trace(mlp, example_inputs=(d["xtr"][:2],))
    p = Q.prepare(gm)
    Q.calibrate(p, d["xtr"][:256])
    static = Q.convert(p)
    dynamic = Q.quantize_dynamic(gm)
    f = _logits(mlp, d["xaug"])
    for m, min_db in ((static, 22.0), (dynamic, 30.0)):
        q = _logits(m, d["xaug"])
        assert Q.sqnr(f, q) >= min_db
        assert (q.argmax(1) == f.argmax(1)).float().mean().item() >= 0.98


@pytest.mark.skipif(not Q.backend_available("onednn"), reason="speed sanity needs the oneDNN backend")
def test_int8_is_faster_than_fp32_at_batch_32(digits):
    d = digits
    low = Q.lower(d["ref"], "onednn")
    t = time_variants({"fp32": d["model"], "int8": low}, (d["xte"][:32],), rounds=7, inner=3, budget_s=5)
    assert t["int8"]["median_ms"] < t["fp32"]["median_ms"]


@pytest.mark.skipif(not Q.backend_available("c"), reason="needs the C int8 backend (a C compiler)")
def test_int8_mlp_is_faster_than_fp32_at_batch_1():
    """Loose sanity only (the latency table is the example's/benchmark's job): the example's MLP
    shape, random weights, static and dynamic int8 on the "c" backend vs fp32 at batch 1."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        mlp = DigitsMLP(256).eval()
        x = torch.randn(1, 1, 16, 16)
        gm = symtrace.symbolic_trace(mlp, example_inputs=(x,))
        p = Q.prepare(gm)
        Q.calibrate(p, torch.randn(64, 1, 16, 16))
        v = {"fp32": mlp, "static": Q.lower(Q.to_reference(p), "c"), "dynamic": Q.quantize_dynamic(gm, "c")}
        t = time_variants(v, (x,), rounds=9, inner=5, budget_s=5)
        assert t["static"]["median_ms"] < t["fp32"]["median_ms"]
        assert t["dynamic"]["median_ms"] < t["fp32"]["median_ms"]
    finally:
        torch.set_num_threads(saved)


def test_bar_chart_png_or_svg(tmp_path, monkeypatch):
    rows = [("x", 48.7), ("relu_1", 31.2), ("fc", 19.0), ("output", float("inf"))]
    out = chart.bar_chart(str(tmp_path / "c"), "SQNR", rows)
    assert out.endswith((".png", ".svg")) and (tmp_path / out.rsplit("/", 1)[1]).stat().st_size > 100
    if out.endswith(".png"):
        assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr(chart.shutil, "which", lambda name: None)  # no graphviz: hand-written SVG
    svg = chart.bar_chart(str(tmp_path / "d"), "SQNR", rows)
    text = open(svg).read()
    assert svg.endswith(".svg") and text.startswith("<svg") and "relu_1" in text and "31.2 dB" in text
