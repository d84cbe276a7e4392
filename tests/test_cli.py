"""The ``symtrace`` command line: a few end-to-end runs of ``python -m symtrace`` in a
subprocess, the rest through ``main(argv)`` in-process (fast)."""
import io
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch import nn

import symtrace
from examples import cli_models
from symtrace.cli import ExitCode, main
from symtrace.cli.loading import InputSpec, make_inputs, parse_input
from symtrace.cli.progress import Progress
from symtrace.cli.views import histogram

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = "examples.cli_models"


def run_cli(*argv):
    """``python -m symtrace argv`` in a subprocess from the repository root."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "symtrace", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def cli(capsys, *argv):
    """``main(argv)`` in-process: (exit code, stdout, stderr)."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # loading a model file may prepend its folder


@pytest.fixture
def models_file(tmp_path):
    """A user's model file: a factory, a module object, and factories that go wrong."""
    path = tmp_path / "user_models.py"
    path.write_text(textwrap.dedent("""\
        import torch
        from torch import nn

        def make():
            return nn.Sequential(nn.Linear(4, 3), nn.Tanh())

        instance = nn.Linear(4, 2)

        def broken():
            raise ValueError("weights file missing")

        def needs_width(width):
            return nn.Linear(width, width)

        def not_a_module():
            return 3
        """))
    return path


# --- end to end (subprocesses) -------------------------------------------------------------
def test_subprocess_show_histogram():
    res = run_cli("show", f"{M}:tiny_resnet", "--input", "1x3x32x32", "--as", "histogram")
    assert res.returncode == 0, res.stderr
    n_conv = sum(isinstance(m, nn.Conv2d) for m in cli_models.tiny_resnet().modules())
    assert any(line.split()[:3] == [str(n_conv), "call_module", "nn.Conv2d"] for line in res.stdout.splitlines())
    assert "\r" not in res.stderr  # stderr is a pipe here: no progress indicator


def test_subprocess_diff_exit_codes():
    res = run_cli("diff", f"{M}:mlp_relu", f"{M}:mlp_gelu", "-i", "2x16")
    assert res.returncode == ExitCode.DIFFERENT, res.stderr
    changed = [line for line in res.stdout.splitlines() if line[:1] in "+-" and line[:3] not in ("---", "+++")]
    assert len(changed) == 2 and "nn.ReLU()" in changed[0] and "nn.GELU(" in changed[1]


def test_subprocess_bad_module():
    res = run_cli("show", "no_such_package.models:make")
    assert res.returncode == ExitCode.MODEL and res.stdout == ""
    assert "cannot find module 'no_such_package'" in res.stderr and "Traceback" not in res.stderr


# --- input specs ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, shape, dtype", [
    ("1x3x32x32", (1, 3, 32, 32), torch.float32),
    ("8x128:int64", (8, 128), torch.int64),
    ("2x4:float16", (2, 4), torch.float16),
    ("scalar:float64", (), torch.float64),
    ("0x5:bool", (0, 5), torch.bool),
])
def test_parse_input(text, shape, dtype):
    assert parse_input(text) == InputSpec(shape, dtype)


@pytest.mark.parametrize("text, message", [
    ("2x?", "'?' is not a size"),
    ("2x-1", "'-1' is not a size"),
    ("float16:2x4", "the shape comes first: 2x4:float16"),
    ("2x4:floaty", "'floaty' is not a torch dtype"),
    ("2x4:", "names no dtype"),
    (":int64", "has no shape"),
])
def test_bad_input_is_a_usage_error(capsys, text, message):
    rc, _, err = cli(capsys, "show", f"{M}:mlp_relu", "--input", text)
    assert rc == ExitCode.USAGE and message in err


def test_make_inputs_dtypes_ranges_and_seed():
    specs = [parse_input("64x64:int64"), parse_input("3x3:bool"), parse_input("2x5:bfloat16")]
    ints, bools, halfs = make_inputs(specs, seed=1, int_high=5)
    assert ints.dtype == torch.int64 and 0 <= ints.min() and ints.max() < 5 and ints.unique().numel() == 5
    assert bools.dtype == torch.bool and halfs.dtype == torch.bfloat16 and halfs.shape == (2, 5)
    again = make_inputs(specs, seed=1, int_high=5)
    assert all(torch.equal(a, b) for a, b in zip((ints, bools, halfs), again))
    assert not torch.equal(make_inputs(specs, seed=2, int_high=5)[0], ints)


# --- show ----------------------------------------------------------------------------------
def test_show_views(capsys):
    rc, out, _ = cli(capsys, "show", f"{M}:two_inputs", "-i", "2x8", "-i", "2x8")
    assert rc == 0 and "call_module" in out and "float32[2, 8]" in out and "cli_models.py:" in out
    rc, out, _ = cli(capsys, "show", f"{M}:two_inputs", "-i", "2x8", "-i", "2x8", "--as", "code")
    assert rc == 0 and "def forward(self, x, y):" in out
    rc, out, _ = cli(capsys, "show", f"{M}:two_inputs", "--as", "graph")  # symbolic: no inputs
    assert rc == 0 and "%relu" in out and "float32" not in out


def test_histogram_counts_and_order():
    model = cli_models.tiny_resnet()
    gm = symtrace.symbolic_trace(model, example_inputs=(torch.randn(1, 3, 32, 32),))
    rows = histogram(gm)
    counts = [c for _, _, c in rows]
    assert counts == sorted(counts, reverse=True) and sum(counts) == len(gm.graph)
    table = dict(((op, t), c) for op, t, c in rows)
    assert table[("call_module", "nn.BatchNorm2d")] == sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert table[("call_function", "operator.add")] == 6  # one residual add per BasicBlock
    assert table[("placeholder", "")] == 1


def test_symbolic_mode_with_inputs_fills_shapes(capsys):
    rc, out, _ = cli(capsys, "show", f"{M}:mlp_relu", "--trace-mode", "symbolic", "-i", "3x16")
    assert rc == 0 and "float32[3, 4]" in out


def test_int64_inputs(capsys):
    rc, out, _ = cli(capsys, "show", f"{M}:bag_of_words", "-i", "2x6:int64")
    assert rc == 0 and "int64[2, 6]" in out and "float32[2, 3]" in out


def test_model_from_file_and_module_object(capsys, models_file):
    rc, out, _ = cli(capsys, "show", f"{models_file}:make", "-i", "2x4")
    assert rc == 0 and "float32[2, 3]" in out
    rc, out, _ = cli(capsys, "show", f"{models_file}:instance", "-i", "5x4")
    assert rc == 0 and "float32[5, 2]" in out


def test_module_from_working_directory(capsys, models_file, monkeypatch):
    monkeypatch.chdir(models_file.parent)
    rc, out, _ = cli(capsys, "show", "user_models:make", "--as", "histogram")
    assert rc == 0 and "nn.Tanh" in out


def test_eval_mode_unless_train(capsys, tmp_path):
    (tmp_path / "mode_models.py").write_text(textwrap.dedent("""\
        import torch
        from torch import nn
        class M(nn.Module):
            def forward(self, x):
                return x + 1 if self.training else x - 1
        """))
    rc, out, _ = cli(capsys, "show", f"{tmp_path}/mode_models.py:M", "-i", "2", "--as", "code")
    assert rc == 0 and "sub = x - 1" in out
    rc, out, _ = cli(capsys, "show", f"{tmp_path}/mode_models.py:M", "-i", "2", "--as", "code", "--train")
    assert rc == 0 and "add = x + 1" in out


# --- model loading errors ------------------------------------------------------------------
@pytest.mark.parametrize("factory, code, fragments", [
    ("broken", ExitCode.MODEL, ["raised ValueError: weights file missing",
                                "user_models.py:10 in broken", 'raise ValueError("weights file missing")']),
    ("needs_width", ExitCode.MODEL, ["needs arguments (width)"]),
    ("not_a_module", ExitCode.MODEL, ["returned 'int', not an nn.Module"]),
    ("mkae", ExitCode.MODEL, ["has no attribute 'mkae'", "did you mean 'make'"]),
])
def test_factory_errors(capsys, models_file, factory, code, fragments):
    rc, out, err = cli(capsys, "show", f"{models_file}:{factory}")
    assert rc == code and out == ""
    for f in fragments:
        assert f in err
    assert "Traceback" not in err


def test_import_errors_name_the_users_line(capsys, tmp_path):
    (tmp_path / "syntax.py").write_text("import torch\ndef make(:\n")
    (tmp_path / "imports.py").write_text("import torch\nimport not_a_package_xyz\n")
    rc, _, err = cli(capsys, "show", f"{tmp_path}/syntax.py:make")
    assert rc == ExitCode.MODEL and "SyntaxError" in err and "syntax.py:2" in err
    rc, _, err = cli(capsys, "show", f"{tmp_path}/imports.py:make")
    assert rc == ExitCode.MODEL and "not_a_package_xyz" in err and "imports.py:2 in <module>" in err
    rc, _, err = cli(capsys, "show", f"{tmp_path}/missing.py:make")
    assert rc == ExitCode.MODEL and "cannot find the file" in err


@pytest.mark.parametrize("spec", [M, f"{M}:", "not a module:make", f"{M}:1x"])
def test_malformed_model_specs(capsys, spec):
    rc, _, err = cli(capsys, "show", spec)
    assert rc == ExitCode.USAGE and "symtrace: error:" in err


# --- tracing errors ------------------------------------------------------------------------
def test_trace_errors(capsys):
    rc, _, err = cli(capsys, "show", f"{M}:branchy")  # symbolic: `if` on a traced value
    assert rc == ExitCode.TRACE and "if y.sum() > 0" in err and "cli_models.py:" in err
    rc, _, err = cli(capsys, "show", f"{M}:mlp_relu", "-i", "2x5")  # wrong size: the model raises
    assert rc == ExitCode.TRACE and "RuntimeError" in err and "check the --input" in err
    assert "cli_models.py:" in err and "self.fc2(self.act(self.fc1(x)))" in err
    rc, _, err = cli(capsys, "show", f"{M}:mlp_relu", "--trace-mode", "example")
    assert rc == ExitCode.USAGE and "needs the input shapes" in err


# --- draw ----------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot program is not installed")
def test_draw_svg(capsys, tmp_path):
    out_file = tmp_path / "g.svg"
    rc, out, _ = cli(capsys, "draw", f"{M}:mlp_relu", "-i", "2x16", "-o", str(out_file))
    assert rc == 0 and f"wrote {out_file}" in out
    assert "<svg" in out_file.read_text() and "fc1" in out_file.read_text()


def test_draw_without_dot_falls_back_to_dot_text(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` program here
    rc, out, _ = cli(capsys, "draw", f"{M}:mlp_relu", "-o", str(tmp_path / "g.png"))
    assert rc == 0 and "`dot` program was not found" in out and str(tmp_path / "g.dot") in out
    assert (tmp_path / "g.dot").read_text().startswith("digraph") and not (tmp_path / "g.png").exists()


def test_draw_dot_text_and_output_errors(capsys, tmp_path):
    rc, out, _ = cli(capsys, "draw", f"{M}:mlp_relu")
    assert rc == 0 and out.startswith("digraph") and "fc1" in out
    rc, _, err = cli(capsys, "draw", f"{M}:mlp_relu", "-o", str(tmp_path / "nope" / "g.dot"))
    assert rc == ExitCode.OUTPUT and "does not exist" in err
    rc, _, err = cli(capsys, "draw", f"{M}:mlp_relu", "-o", str(tmp_path))
    assert rc == ExitCode.USAGE and "give -o a file ending in" in err
    rc, _, err = cli(capsys, "draw", f"{M}:mlp_relu", "-o", str(tmp_path / "g.txt"))
    assert rc == ExitCode.USAGE and ".svg" in err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_draw_read_only_folder(capsys, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        rc, _, err = cli(capsys, "draw", f"{M}:mlp_relu", "-o", str(folder / "g.dot"))
    finally:
        folder.chmod(0o700)
    assert rc == ExitCode.OUTPUT and "permission denied" in err


# --- explain -------------------------------------------------------------------------------
def test_explain(capsys):
    rc, out, _ = cli(capsys, "explain", f"{M}:branchy", "-i", "4x8")
    assert rc == 0 and "data-dependent guards" in out
    assert any(line.startswith("data") and "if y.sum() > 0" in line for line in out.splitlines())
    rc, out, _ = cli(capsys, "explain", f"{M}:branchy")  # symbolic: the `if` cannot be traced
    assert rc == ExitCode.TRACE and "Tracing FAILED" in out and "if y.sum() > 0" in out
    rc, out, _ = cli(capsys, "explain", f"{M}:mlp_relu")
    assert rc == 0 and "Traced symbolically (no example inputs) into 5 nodes" in out
    assert "x.dtype is torch.float32" not in out
    rc, out, _ = cli(capsys, "explain", f"{M}:mlp_relu", "-i", "2x16", "--trace-mode", "symbolic")
    assert rc == 0 and "Traced symbolically" in out
    rc, out, _ = cli(capsys, "explain", f"{M}:mlp_relu", "-i", "2x16")  # on the inputs: specialised
    assert rc == 0 and "Traced into 5 nodes" in out and "x.dtype is torch.float32" in out


# --- diff ----------------------------------------------------------------------------------
def test_diff_same_and_histogram(capsys):
    rc, out, _ = cli(capsys, "diff", f"{M}:mlp_relu", f"{M}:mlp_relu", "-i", "2x16")
    assert rc == 0 and "no differences" in out
    rc, out, _ = cli(capsys, "diff", f"{M}:mlp_relu", f"{M}:mlp_gelu", "--by", "histogram")
    assert rc == ExitCode.DIFFERENT
    rows = {tuple(line.split()[:2]): line.split()[-1] for line in out.splitlines()[2:]}
    assert rows == {("call_module", "nn.GELU"): "+1", ("call_module", "nn.ReLU"): "-1"}
    rc, out, _ = cli(capsys, "diff", f"{M}:mlp_relu", f"{M}:mlp_gelu", "--by", "code")
    assert rc == 0  # same code: the difference is in the submodule, not the graph


def test_diff_shapes(capsys):
    rc, out, _ = cli(capsys, "diff", f"{M}:mlp_relu", f"{M}:mlp_gelu", "-i", "3x16", "--by", "graph")
    assert rc == 0
    rc, out, _ = cli(capsys, "diff", f"{M}:two_inputs", f"{M}:mlp_relu")
    assert rc == ExitCode.DIFFERENT
    removed = {line.split()[1] for line in out.splitlines() if line.startswith("-") and not line.startswith("---")}
    added = {line.split()[1] for line in out.splitlines() if line.startswith("+") and not line.startswith("+++")}
    assert removed == {"y", "proj", "add", "relu", "output"}  # x is the same placeholder in both
    assert added == {"fc1", "act", "fc2", "output"}


def _save(model_factory, path, x=(torch.randn(2, 16),)):
    symtrace.save(symtrace.symbolic_trace(model_factory(), example_inputs=x), path)
    return str(path)


def test_diff_saved_graphs(capsys, tmp_path):
    relu, gelu = _save(cli_models.mlp_relu, tmp_path / "relu.symtrace"), _save(cli_models.mlp_gelu, tmp_path / "gelu.symtrace")
    rc, out, _ = cli(capsys, "diff", relu, f"{M}:mlp_relu", "-i", "2x16")
    assert rc == 0, out
    rc, out, _ = cli(capsys, "diff", relu, gelu)
    assert rc == ExitCode.DIFFERENT and "nn.GELU" in out
    other = tmp_path / "graph.bin"  # any existing file without :factory is a saved graph
    other.write_bytes((tmp_path / "relu.symtrace").read_bytes())
    rc, out, _ = cli(capsys, "diff", str(other), relu)
    assert rc == 0, out
    rc, _, err = cli(capsys, "explain", relu)
    assert rc == ExitCode.USAGE and "needs a model factory" in err


class _Boom:
    """Unpickling this runs ``open(path, 'w')``: a file that would run code if unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_saved_pickles_are_refused_without_unpickling(capsys, tmp_path):
    marker = tmp_path / "ran"
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump(_Boom(str(marker)), f)
    torch.save({"w": _Boom(str(marker))}, tmp_path / "evil.pt")
    torch.save(symtrace.symbolic_trace(cli_models.mlp_relu()), tmp_path / "graph.pth")
    for name, kind in [("evil.pkl", "is a pickle"), ("evil.pt", "is a torch.save file"),
                       ("graph.pth", "is a torch.save file")]:
        rc, out, err = cli(capsys, "show", str(tmp_path / name))
        assert rc == ExitCode.MODEL and out == "", err
        assert kind in err and "symtrace.save(gm, 'model.symtrace')" in err and "Traceback" not in err
    assert not marker.exists()


def test_saved_graph_errors(capsys, tmp_path):
    rc, _, err = cli(capsys, "show", str(tmp_path / "missing.symtrace"))
    assert rc == ExitCode.MODEL and "cannot find the saved graph" in err
    good = (tmp_path / "ok.symtrace")
    _save(cli_models.mlp_relu, good)
    (tmp_path / "cut.symtrace").write_bytes(good.read_bytes()[:-200])
    (tmp_path / "text.pt").write_text("hello")
    for name in ("cut.symtrace", "text.pt"):
        rc, out, err = cli(capsys, "show", str(tmp_path / name))
        assert rc == ExitCode.MODEL and out == "" and "cannot load" in err and "written by symtrace.save" in err, err
        assert "Traceback" not in err
    hidden = tmp_path / "locked.symtrace"
    hidden.write_bytes(good.read_bytes())
    hidden.chmod(0)
    try:
        if not os.access(hidden, os.R_OK):  # (root reads anything)
            rc, _, err = cli(capsys, "show", str(hidden))
            assert rc == ExitCode.MODEL and "Permission denied" in err
    finally:
        hidden.chmod(0o600)


def test_subprocess_saved_graph(tmp_path):
    path = _save(cli_models.mlp_gelu, tmp_path / "gelu.symtrace")
    res = run_cli("show", path, "--as", "histogram")
    assert res.returncode == 0, res.stderr
    assert any(line.split()[:3] == ["1", "call_module", "nn.GELU"] for line in res.stdout.splitlines())


# --- lower ---------------------------------------------------------------------------------
class _FakeKernel:
    def __init__(self, name, nodes):
        self.name, self.nodes, self.kind = name, nodes, "pointwise"


class _FakeLowered:
    def __init__(self, gm, wrong):
        self.gm, self.wrong = gm, wrong
        self.kernels = [_FakeKernel(f"kernel_{n.name}", [n]) for n in gm.graph.nodes if n.op == "call_module"]

    def source(self):
        return "void kernel_fc1(const float* x) {}"

    def report(self):
        return "lowered 3 of 3 modules"

    def __call__(self, *inputs):
        out = self.gm(*inputs)
        return out + 1 if self.wrong else out


def _fake_lower(monkeypatch, wrong=False, with_compile=True):
    mod = types.ModuleType("symtrace.lower")
    calls = []
    if with_compile:
        def compile(gm, example_inputs, target="cpu"):
            calls.append((gm, example_inputs, target))
            return _FakeLowered(gm, wrong)
        mod.compile = compile
    monkeypatch.setitem(sys.modules, "symtrace.lower", mod)
    return calls


def test_lower_with_a_stand_in_compiler(capsys, monkeypatch):
    calls = _fake_lower(monkeypatch)
    rc, out, _ = cli(capsys, "lower", f"{M}:mlp_relu", "-i", "2x16", "--repeat", "3", "--warmup", "1",
                     "--report", "--source")
    assert rc == 0, out
    (gm, inputs, target), = calls
    assert isinstance(gm, symtrace.GraphModule) and inputs[0].shape == (2, 16) and target == "cpu"
    assert "3 kernels for cpu" in out
    rows = [line.split() for line in out.splitlines() if line.split()[1:2] == ["kernel_act"]]
    assert rows == [["1", "kernel_act", "pointwise", "1", "act"]]
    assert "lowered 3 of 3 modules" in out and "void kernel_fc1" in out
    assert "matches eager" in out and "3 calls of each, interleaved" in out
    assert "interquartile ms" in out and "load average" in out


def test_lower_wrong_answer_is_an_error(capsys, monkeypatch):
    _fake_lower(monkeypatch, wrong=True)
    rc, out, err = cli(capsys, "lower", f"{M}:mlp_relu", "-i", "2x16")
    assert rc == ExitCode.LOWER_FAILED and "does not compute what eager" in err and "median" not in out


def test_lower_headlines_a_speed_up_only_where_the_spread_supports_it():
    from symtrace.cli.lowering import quartiles, speed_verdict
    assert quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (2.0, 3.0, 4.0)
    eager = [10.0, 10.2, 9.9, 9.8, 10.1]
    assert speed_verdict(eager, [5.0, 5.1, 4.9, 5.2, 4.8]).startswith("lowered is faster: 2.00x")
    assert speed_verdict(eager, [20.0, 20.5, 19.8, 20.1, 19.9]).startswith("lowered is slower: 0.50x")
    noisy = [9.0, 12.0, 8.0, 11.0, 9.5]   # median 9.5 < 10.0, but the ranges overlap
    verdict = speed_verdict(eager, noisy)
    assert verdict.startswith("no clear difference") and "faster" not in verdict


def test_lower_times_eager_and_lowered_interleaved():
    from symtrace.cli.lowering import time_interleaved
    order = []
    fns = [lambda: order.append("a"), lambda: order.append("b")]
    samples = time_interleaved(fns, (), repeat=4, warmup=1, advance=lambda: None)
    assert [len(s) for s in samples] == [4, 4]
    assert order == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_cli_errors_name_cli_flags(capsys):
    rc, _, err = cli(capsys, "show", f"{M}:mlp_relu", "-i", "2x16", "-i", "3")
    assert rc == ExitCode.USAGE
    assert "--input was given 2 time(s)" in err and "forward takes 1 input(s) (x)" in err
    assert "example_inputs" not in err
    rc, _, err = cli(capsys, "lower", f"{M}:mlp_relu", "-i", "2x16", "--target", "gpu")
    assert rc == ExitCode.USAGE and "--target" in err and "'cpu', 'cuda'" in err


def test_explain_help_lists_only_the_models_it_accepts(capsys):
    rc, out, _ = cli(capsys, "explain", "--help")
    assert rc == 0 and "package.module:factory" in out and "saved.symtrace" not in out
    rc, out, _ = cli(capsys, "lower", "--help")
    assert rc == 0 and "saved.symtrace" in out


def test_lower_unavailable(capsys, monkeypatch):
    _fake_lower(monkeypatch, with_compile=False)
    rc, _, err = cli(capsys, "lower", f"{M}:mlp_relu", "-i", "2x16")
    assert rc == ExitCode.LOWER_UNAVAILABLE and "no compile()" in err
    monkeypatch.setitem(sys.modules, "symtrace.lower", None)  # the import itself fails
    rc, _, err = cli(capsys, "lower", f"{M}:mlp_relu", "-i", "2x16")
    assert rc == ExitCode.LOWER_UNAVAILABLE and "lowering is not available" in err


def test_lower_needs_inputs(capsys, monkeypatch):
    _fake_lower(monkeypatch)
    rc, _, err = cli(capsys, "lower", f"{M}:mlp_relu")
    assert rc == ExitCode.USAGE and "needs example inputs" in err


def test_lower_real_compiler(capsys):
    try:
        import symtrace.lower as lower
    except ImportError:
        pytest.skip("symtrace.lower is not written yet")
    if not callable(getattr(lower, "compile", None)):
        pytest.skip("symtrace.lower has no compile() yet")
    rc, out, err = cli(capsys, "lower", f"{M}:mlp_relu", "-i", "2x16", "--repeat", "2", "--warmup", "1")
    assert rc == 0, err
    assert "kernels" in out and "matches eager" in out


# --- progress and the parser ---------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_only_on_a_terminal():
    term = _Terminal()
    with Progress("timing", total=4, stream=term, delay=0) as p:
        p.advance(2)
        assert "timing [" in term.getvalue() and "2/4" in term.getvalue()
    assert term.getvalue().endswith("\r\x1b[K")  # the line is cleared at the end
    pipe = io.StringIO()
    with Progress("timing", total=4, stream=pipe, delay=0) as p:
        p.advance(4)
    assert pipe.getvalue() == ""
    term = _Terminal()
    with Progress("tracing", stream=term, enabled=False, delay=0) as p:
        p.advance()
    assert term.getvalue() == ""


def test_progress_spinner_for_unknown_length():
    term = _Terminal()
    with Progress("tracing big", stream=term, delay=0, interval=0.01):
        import time
        time.sleep(0.1)
    assert "tracing big" in term.getvalue() and "s\x1b[K" in term.getvalue()


def test_parser_help_and_usage(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("show", "draw", "explain", "lower", "diff", "SHAPE[:DTYPE]", "Exit codes"):
        assert word in out
    for sub in ("show", "draw", "explain", "lower", "diff"):
        assert main([sub, "--help"]) == 0
        assert "MODEL" in capsys.readouterr().out
    assert main([]) == ExitCode.USAGE
    assert main(["show"]) == ExitCode.USAGE
    assert main(["show", f"{M}:mlp_relu", "--as", "pie"]) == ExitCode.USAGE
    assert "invalid choice" in capsys.readouterr().err
    assert main(["show", f"{M}:bag_of_words", "-i", "2x3:int64", "--int-high", "0"]) == ExitCode.USAGE
    assert "'0' is not a whole number >= 1" in capsys.readouterr().err
