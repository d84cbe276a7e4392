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


def test_feature_extraction_section_prints_what_the_readme_shows(tmp_path):
    blocks = _blocks("Feature extraction")
    code, shown = blocks[0][1], blocks[1][1]
    out = _run(tmp_path, code)
    assert out.strip() == shown.strip()
