"""The example's accuracy targets, on a small DigitsCNN trained once per session (seeded):
accuracy drop <= 0.5 pp on the test split with its augmented copies, >= 98% top-1 agreement with fp32 and logit SQNR
>= 22 dB on the augmented set, lowered int8 == reference (same argmax, <= 1 step), and every
layer of the lowered model runs in integers. Speed is the example's and the benchmarks' job."""
import pytest
import torch

import symtrace
from symtrace.passes import quant as Q
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
    # The drop is measured over the test split and its augmented copies (1436 images): on the
    # 359 test images alone one image is 0.28 pp, and the seeded training rounds differently on
    # AVX2 and AVX-512 CPUs (an AMD AVX2 machine: 2 images, 0.56 pp, on the split; -0.09 pp on
    # the augmented copies).
    y_all = torch.cat([d["yte"], d["yte"].repeat_interleave(len(d["xaug"]) // len(d["xte"]))])
    f_all, q_all = torch.cat([f_te, f_aug]), torch.cat([q_te, q_aug])
    drop = ((f_all.argmax(1) == y_all).float().mean() - (q_all.argmax(1) == y_all).float().mean()).item()
    assert drop <= 0.005
    assert acc_f - acc_q <= 0.01   # (and no more than 3 images of the split alone)
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


def _float_compute(gm):
    """The float convolutions, linears and dequantizes left in a lowered graph."""
    from torch import nn
    mods = dict(gm.named_modules())
    left = []
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(mods[n.target], (nn.Conv2d, nn.Linear)):
            left.append(n.name)
        elif n.op == "call_function" and (getattr(n.target, "__name__", "") in ("conv2d", "linear")
                                          or getattr(n.target, "__name__", "").startswith(("dequantize", "reference_"))):
            left.append(n.name)
    return left


@pytest.mark.parametrize("backend", BACKENDS)
def test_lowered_int8_runs_every_layer_in_integers(digits, backend):
    # what makes int8 pay: after lowering, every convolution and linear is an int8 kernel call and
    # no dequantize sits between them (speed itself is the example's and benchmarks' job: timings
    # stay out of tests)
    low = Q.lower(digits["ref"], backend)
    assert _float_compute(digits["ref"]) and _float_compute(low) == []
    stats = low.meta["quant_lowering"]
    layers = sum(isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) for m in digits["model"].modules())
    assert sum(v for k, v in stats.items() if k.startswith(("int8_conv2d", "int8_linear"))) == layers > 0


def test_int8_mlp_lowers_to_integer_linears_static_and_dynamic():
    torch.manual_seed(0)
    mlp = DigitsMLP(256).eval()
    x = torch.randn(1, 1, 16, 16)
    gm = symtrace.symbolic_trace(mlp, example_inputs=(x,))
    p = Q.prepare(gm)
    Q.calibrate(p, torch.randn(64, 1, 16, 16))
    linears = sum(isinstance(m, torch.nn.Linear) for m in mlp.modules())
    backend = "c" if Q.backend_available("c") else "portable"
    static = Q.lower(Q.to_reference(p), backend)
    dynamic = Q.quantize_dynamic(gm, backend)
    assert _float_compute(static) == [] and _float_compute(dynamic) == []
    assert static.meta["quant_lowering"].get("int8_linear", 0) + sum(
        v for k, v in static.meta["quant_lowering"].items() if k.startswith("int8_linear+")) == linears
    assert dynamic.meta["quant_lowering"] == {"int8_dynamic_linear": linears}
    torch.testing.assert_close(static(x), mlp(x), atol=0.5, rtol=0.1)


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
