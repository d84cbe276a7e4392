"""The README's printed output is real: run its tour snippets and compare with what it shows."""
import os
import re
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def _blocks(section: str):
    """(language, text) of each fenced block in the README section titled ``section``."""
    start = README.index(f"## {section}\n")
    end = README.find("\n## ", start + 1)
    body = README[start:end if end >= 0 else None]
    return re.findall(r"```(\w*)\n(.*?)```", body, flags=re.S)


def _run(tmp_path, code: str) -> str:
    path = tmp_path / "tour.py"  # the README's source column says tour.py:<line>
    path.write_text(code)
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_tour_prints_what_the_readme_shows(tmp_path):
    blocks = _blocks("A five-minute tour")
    code, table, generated = blocks[0][1], blocks[1][1], blocks[2][1]
    out = _run(tmp_path, code + "print('=====')\nprint(gm.code)\n")
    shown_table, shown_code = out.split("=====\n")
    assert shown_table.strip() == table.strip()
    assert shown_code.strip() == generated.strip()


def test_lowering_section_prints_what_the_readme_shows(tmp_path):
    blocks = _blocks("Lowering to fused kernels")
    code, report, wrapper = blocks[0][1], blocks[1][1], blocks[2][1]
    code = "\n".join(ln for ln in code.splitlines() if "lm.source()" not in ln and "lm.draw(" not in ln)
    code = code.replace("print(lm.wrapper_code)", "print('====='); print(lm.wrapper_code)")
    out = _run(tmp_path, code + "\n")
    shown_report, shown_wrapper = out.split("=====\n")
    assert shown_report.strip() == report.strip()
    assert shown_wrapper.strip() == wrapper.strip()


#: sections whose snippets a test of their own runs (they need optional packages)
_OWN_TEST = {"torch.export and ONNX"}


def _sections_with_python():
    """(title, code) for each README section with ```python blocks: its blocks joined in order."""
    out = []
    for m in re.finditer(r"^## (.+)$", README, flags=re.M):
        code = "\n".join(text for lang, text in _blocks(m.group(1)) if lang == "python")
        if code:
            out.append((m.group(1), code))
    return out


def test_every_python_snippet_runs_as_pasted_from_any_directory(tmp_path):
    # Each section's snippets, pasted in order into one file, run in an empty folder where only
    # the symtrace package is importable (not the repository's examples/ or tests/).
    pkgs = tmp_path / "site"
    pkgs.mkdir()
    (pkgs / "symtrace").symlink_to(os.path.join(ROOT, "symtrace"))
    sections = _sections_with_python()
    assert {"A five-minute tour", "Passes", "Lowering to fused kernels", "Quantization"} <= {t for t, _ in sections}
    for title, code in sections:
        if title in _OWN_TEST:
            continue
        work = tmp_path / title.replace(" ", "_").replace(".", "")
        work.mkdir()
        (work / "snippet.py").write_text(code)
        # packages installed beside the interpreter's own (PYTHONPATH entries outside the
        # repository) stay importable
        kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.realpath(p) != os.path.realpath(ROOT)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkgs)] + kept), SYMTRACE_SPEED_CHECK="0")
        p = subprocess.run([sys.executable, "snippet.py"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, f"README section {title!r}:\n{p.stderr}"
        if title == "Quantization":   # the op histograms it shows are what it prints
            shown = [text.splitlines()[0] for lang, text in _blocks(title) if not lang and text.startswith("{")]
            printed = [line for line in p.stdout.splitlines() if line.startswith("{'quantize_per_tensor'")]
            assert printed == shown and len(shown) == 2


def test_export_and_onnx_section_runs_as_pasted(tmp_path, monkeypatch, capsys):
    import importlib.util
    missing = [m for m in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        import pytest
        pytest.skip(f"the README's ONNX snippet needs {', '.join(missing)}")
    code = "\n".join(text for lang, text in _blocks("torch.export and ONNX") if lang == "python")
    monkeypatch.chdir(tmp_path)  # in this process (torch.export is warm): writes net.onnx here
    env: dict = {"__name__": "readme"}
    exec(compile(code, str(tmp_path / "readme.py"), "exec"), env)
    assert capsys.readouterr().out.splitlines() == ["True"]
    assert sorted(env["out"]) == ["norms", "y"] and env["out"]["y"].shape == (8, 4)
    assert env["y"].shape == (5, 4) and env["norms_x"].shape == (5,)
    assert (tmp_path / "net.onnx").exists()


def test_dynamic_shapes_section_prints_what_the_readme_shows(tmp_path):
    blocks = _blocks("Dynamic shapes")
    code, table = blocks[0][1], blocks[1][1]
    out = _run(tmp_path, code + "print(gm(torch.randn(2, 11, 16), torch.randn(16, 16)).shape)\n")
    shown_table, _, shape = out.rpartition("torch.Size")
    assert shown_table.strip() == table.strip()
    assert shape.strip() == "([22, 11])"


def test_feature_extraction_section_prints_what_the_readme_shows(tmp_path):
    blocks = _blocks("Feature extraction")
    code, shown = blocks[0][1], blocks[1][1]
    out = _run(tmp_path, code)
    assert out.strip() == shown.strip()
