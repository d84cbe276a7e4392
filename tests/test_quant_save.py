"""Quantized graphs (reference, lowered for each int8 backend, dynamic) in the safe file format:
``symtrace.save``/``symtrace.load``, ``Q.save_quantized``/``Q.load_quantized`` and the CLI;
old pickle files refused without being unpickled."""
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace.cli import ExitCode, main
from symtrace.lower import int8_onednn
from symtrace.passes import quant as Q
from symtrace.passes.quant import kernels as K
from symtrace.passes.quant import registry as R
from symtrace.passes.quant.qparams import requantize_per_tensor
from symtrace.serialize import SerializationError
from symtrace.serialize import allowlist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = [b for b in ("portable", "onednn", "c") if Q.backend_available(b)]


class Net(nn.Module):
    """conv+BN+ReLU, max/avg/adaptive pooling, a fused residual, cat, a lone ReLU, sigmoid, add, Linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 4, 1)
        self.b = nn.Conv2d(8, 4, 1)
        self.fc = nn.Linear(8 * 2 * 2, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.stem(x))), 2)
        x = F.relu(self.c2(x) + x)
        a, b = F.relu(self.a(x)), self.b(x)
        c = F.relu(F.avg_pool2d(torch.cat([a, b], 1), 2))
        s = torch.sigmoid(b) + a
        return self.fc(c.reshape(c.shape[0], -1)), F.adaptive_avg_pool2d(s, 1)


@pytest.fixture(scope="module")
def models():
    """{kind: (quantized GraphModule, example input)} for every kind a user can save."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, 8, 8)
    p = Q.prepare(symtrace.symbolic_trace(Net().eval(), example_inputs=(x[:2],)))
    Q.calibrate(p, [x])
    ref = Q.to_reference(p)
    out = {"reference": (ref, x[:4])}
    for b in BACKENDS:
        out[f"lowered-{b}"] = (Q.lower(ref, b), x[:4])
    mlp = nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 3)).eval()
    xm = torch.randn(4, 12)
    gm = symtrace.symbolic_trace(mlp, example_inputs=(xm,))
    for b in BACKENDS:
        out[f"dynamic-{b}"] = (Q.quantize_dynamic(gm, b), xm)
        out[f"weight_only-{b}"] = (Q.weight_only(bits=4, group_size=32, lm_head=True, backend=b)(gm), xm)
    return out


def _same(a, b):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and torch.equal(a, b)


def _max_diff(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


KINDS = ["reference"] + [f"{s}-{b}" for s in ("lowered", "dynamic", "weight_only") for b in BACKENDS]


@pytest.mark.parametrize("kind", KINDS)
def test_symtrace_save_load_round_trip(models, tmp_path, kind):
    gm, x = models[kind]
    path = tmp_path / "q.symtrace"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left out
        symtrace.save(gm, path)
    back = symtrace.load(path)
    assert _same(back(x), gm(x))  # bit-identical
    assert Q.op_histogram(back) == Q.op_histogram(gm)
    for k in ("quant_stage", "quant_backend", "quant_lowering", "quant_precision"):
        assert back.meta.get(k) == gm.meta.get(k)
    assert {k: v.dtype for k, v in back.state_dict().items()} == {k: v.dtype for k, v in gm.state_dict().items()}
    qp = [n.meta["tensor_meta"].qparams for n in back.graph.nodes if n.target is Q.quantize_per_tensor]
    assert qp == [n.meta["tensor_meta"].qparams for n in gm.graph.nodes if n.target is Q.quantize_per_tensor]


def test_the_graphs_use_every_admitted_quant_helper_and_nothing_else(models):
    admitted = {allowlist.resolve(n) for n in allowlist._HELPERS if n.startswith("symtrace.passes.quant.")}
    used = {n.target for gm, _ in models.values() for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("symtrace.")}
    assert used <= admitted
    # requantize_per_tensor only appears for q(dq(x)) with other parameters
    assert admitted - used <= {requantize_per_tensor}
    for fn in admitted:
        assert allowlist.name_of(fn) == f"{fn.__module__}.{fn.__name__}"


@pytest.mark.parametrize("kind", KINDS)
def test_save_quantized_load_quantized(models, tmp_path, kind):
    gm, x = models[kind]
    path = tmp_path / "q.symtrace"
    Q.save_quantized(gm, path)
    assert _same(Q.load_quantized(path)(x), gm(x))
    if kind.startswith(("lowered", "dynamic")):
        back = Q.load_quantized(path, backend="portable")  # the same int8 weights on another backend
        assert back.meta["quant_backend"] == "portable"
        assert {n.kwargs["backend"] for n in back.graph.nodes if "backend" in n.kwargs} == {"portable"}
        tol = 0.0 if kind in ("lowered-portable", "dynamic-portable", "dynamic-c") else 0.2  # (C Linear: exact)
        assert _max_diff(back(x), gm(x)) <= tol
    with pytest.raises(ValueError, match="unknown int8 backend"):
        Q.load_quantized(path, backend="no-such-backend")


def test_saved_backend_missing_here_switches_with_a_warning(models, tmp_path):
    gm, x = models["lowered-portable"]
    path = tmp_path / "q.symtrace"
    symtrace.save(gm, path)
    elsewhere = symtrace.load(path)  # as saved on a machine with a backend this one lacks
    for n in elsewhere.graph.nodes:
        if "backend" in n.kwargs:
            n.kwargs = dict(n.kwargs, backend="gone")
    elsewhere.meta["quant_backend"] = "gone"
    elsewhere.recompile()
    symtrace.save(elsewhere, path)
    with pytest.warns(UserWarning, match="'gone', which is not usable here"):
        back = Q.load_quantized(path)
    assert back.meta["quant_backend"] == K.default_backend()
    assert _max_diff(back(x), gm(x)) <= 0.2


class _Boom:
    """Unpickling this runs ``open(path, 'w')``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_old_pickle_files_are_refused_without_unpickling(models, tmp_path):
    canary = tmp_path / "ran"
    old = tmp_path / "old.pt"  # what the pickle-based save_quantized wrote, with a payload
    torch.save({"format": "symtrace.quant/1", "module": _Boom(str(canary))}, old)
    raw = tmp_path / "old.pkl"
    raw.write_bytes(pickle.dumps(_Boom(str(canary))))
    legacy = tmp_path / "legacy.pt"
    torch.save({"module": _Boom(str(canary))}, legacy, _use_new_zipfile_serialization=False)
    for path, kind in ((old, "a torch.save file"), (raw, "a pickle"), (legacy, "a pickle")):
        with pytest.raises(SerializationError, match="does not unpickle") as e:
            Q.load_quantized(path)
        assert kind in str(e.value) and "save_quantized(gm, path)" in str(e.value)
        with pytest.raises(SerializationError):
            symtrace.load(path)
    assert not canary.exists()
    text = tmp_path / "q.symtrace"
    text.write_text("hello")
    with pytest.raises(SerializationError, match="cannot load"):
        Q.load_quantized(text)
    with pytest.raises(TypeError, match="GraphModule"):
        Q.save_quantized(nn.Linear(2, 2), tmp_path / "x.symtrace")


def test_cli_opens_a_saved_quantized_model(models, tmp_path, capsys):
    for kind in ("lowered-portable", "dynamic-portable"):
        gm, x = models[kind]
        path = str(tmp_path / f"{kind}.symtrace")
        Q.save_quantized(gm, path)
        rc = main(["show", path, "--as", "histogram"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert "symtrace.passes.quant.kernels.int8_" in out
        shape = "x".join(map(str, x.shape))
        rc = main(["show", path, "-i", shape])  # runs the loaded graph (shapes)
        out, err = capsys.readouterr()
        assert rc == 0 and "int8" in out, err
        rc = main(["draw", path, "-o", str(tmp_path / f"{kind}.dot")])
        _, err = capsys.readouterr()
        assert rc == 0, err
        assert "int8_" in (tmp_path / f"{kind}.dot").read_text()
        # the int8 calls run as they are inside the lowered program (as calls, not C kernels)
        rc = main(["lower", path, "-i", shape, "--repeat", "1", "--warmup", "0"])
        out, err = capsys.readouterr()
        assert rc == 0 and "matches eager" in out, err
    rc = main(["diff", str(tmp_path / "lowered-portable.symtrace"), str(tmp_path / "lowered-portable.symtrace")])
    capsys.readouterr()
    assert rc == 0


def test_fresh_process_loads_and_runs_a_c_backend_model(models, tmp_path):
    """``python -m symtrace show`` on the file, and ``symtrace.load`` in a process where the quant
    modules and the "c" backend are not imported: they are imported by symtrace's own code."""
    kind = "dynamic-c" if "c" in BACKENDS else "dynamic-portable"
    gm, x = models[kind]
    path = tmp_path / "q.symtrace"
    symtrace.save(gm, path)
    torch.save(x, tmp_path / "x.pt")  # (inputs for the check below; read with weights_only=True)
    torch.save(gm(x), tmp_path / "want.pt")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = textwrap.dedent(f"""\
        import sys, torch, symtrace
        for m in [m for m in sys.modules if m.startswith(("symtrace.passes", "symtrace.lower"))]:
            del sys.modules[m]
        gm = symtrace.load({str(path)!r})
        x = torch.load({str(tmp_path / 'x.pt')!r}, weights_only=True)
        want = torch.load({str(tmp_path / 'want.pt')!r}, weights_only=True)
        assert torch.equal(gm(x), want)
        print("ok", ("symtrace.lower.int8_cpu" in sys.modules))
        """)
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.split()[0] == "ok", res.stderr
    if kind == "dynamic-c":
        assert res.stdout.split()[1] == "True"
    res = subprocess.run([sys.executable, "-m", "symtrace", "show", str(path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "int8_dynamic_linear" in res.stdout


def test_backend_names_only_pick_registered_or_symtrace_backends():
    with pytest.raises(ValueError, match="unknown int8 backend"):
        K.get_backend("os.system")
    with pytest.raises(ValueError, match="unknown int8 backend"):
        K.get_backend(["c"])
    assert not K.backend_available("symtrace.lower.int8_cpu")
    assert K.get_backend("c") is sys.modules["symtrace.lower.int8_cpu"].BACKEND


@pytest.mark.skipif(not Q.backend_available("onednn"), reason="oneDNN int8 ops not usable here")
def test_onednn_gets_only_operands_it_reads_safely():
    """A loaded graph's int8 calls take their tensors from the file: oneDNN trusts sizes and
    dtypes (a short scale or a float16 bias is read past its end, a zero stride divides by
    zero), so such operands go to the portable backend, whose torch ops check them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (1, 4, 5, 5), generator=gen).to(torch.uint8)
    w = torch.randint(-127, 128, (6, 4, 3, 3), generator=gen).to(torch.int8)
    conv = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, x_scale=0.05, x_zp=120, out_scale=0.4,
                out_zp=100, backend="onednn")
    with pytest.raises(RuntimeError, match="size"):
        K.int8_conv2d(x, w, torch.rand(2), None, **conv)  # 2 scales for 6 channels
    bias16 = torch.randn(6, generator=gen)
    got = K.int8_conv2d(x, w, torch.rand(6, generator=gen) + 0.01, bias16.half(), **conv)
    assert got.shape == (1, 6, 5, 5)
    xl = torch.randint(0, 256, (3, 16), generator=gen).to(torch.uint8)
    wl = torch.randint(-127, 128, (5, 16), generator=gen).to(torch.int8)
    with pytest.raises(RuntimeError, match="size"):
        K.int8_linear(xl, wl, torch.rand(2), None, x_scale=0.1, x_zp=3, out_scale=0.2, out_zp=1, backend="onednn")
    assert int8_onednn._conv_params_ok(x, w, (1, 1), (1, 1), (1, 1), 1)
    for stride, padding, dilation, groups in [((0, 1), (1, 1), (1, 1), 1), ((1,), (1, 1), (1, 1), 1),
                                              ((1, 1), (-1, 0), (1, 1), 1), ((1, 1), (1, 1), (0, 1), 1),
                                              ((1, 1), (1, 1), (1, 1), 0), ((1, 1), (1, 1), (1, 1), 3)]:
        assert not int8_onednn._conv_params_ok(x, w, stride, padding, dilation, groups)
    with pytest.raises(RuntimeError, match="step"):
        K.int8_conv2d(x, w, torch.rand(6), None, **dict(conv, stride=(0, 0)))
