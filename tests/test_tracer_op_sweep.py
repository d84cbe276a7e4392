"""Every public torch function, special/functional function and Tensor method that takes a simple
argument form (a tensor, numbers, a traced 0-dim tensor, an int read from a shape) traces (with example values and symbolically) to a module that gives eager's
answer, or raises; it never crashes the process or answers differently (``op_sweep.py``)."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.mark.parametrize("mode,dtype", [("values", "float32"), ("symbolic", "float32"), ("values", "int64")])
def test_op_sweep_traces_like_eager_without_crashing(mode, dtype):
    p = subprocess.run([sys.executable, os.path.join(HERE, "op_sweep.py"), mode, dtype], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    lines = p.stdout.splitlines()
    last = [line for line in lines if line.startswith("try ")][-1:]
    assert p.returncode == 0, f"the process died (exit {p.returncode}) at {last}: {p.stderr[-1500:]}"
    results = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):])
    assert len(results) > 1000, f"only {len(results)} programs ran: the sweep lost its candidates"
    wrong = sorted(k for k, v in results.items() if v == "mismatch")
    assert not wrong, f"traced modules answer differently from eager: {wrong}"
    ok = sum(v == "ok" for v in results.values())
    assert ok >= 0.99 * len(results), {k: v for k, v in results.items() if v != "ok"}
