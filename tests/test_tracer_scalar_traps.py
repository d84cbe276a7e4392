"""torch functions whose argument parser would read a traced tensor as a number.

``torch.pow(x, 2.0)`` has an overload ``pow(Scalar self, Tensor exponent)`` that torch's parser
tries before ``pow(Tensor self, Scalar exponent)``; a proxy that answers isinstance(p, Tensor)
for its example value used to be read there as a C tensor and crash the process. Each case runs
in a subprocess so that a regression fails this test instead of killing the test run.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [
    "torch.where(a > 0, a, 0.0)",
    "torch.pow(a, 2.0)",
    "torch.remainder(a, 2.0)",
    "torch.xlogy(a, 2.0)",
    "torch.where(a > 0, 1.0, a)",
    "torch.add(a, 1.0)",
    "torch.special.xlogy(a, 2.0)",
    "torch.special.zeta(a.abs() + 1, 2.0)",
]

_SCRIPT = """
import torch, symtrace
x = torch.randn(8, 16)
f = lambda a: {expr}
gm = symtrace.symbolic_trace(f, example_inputs=(x,))
assert torch.equal(gm(x), f(x)) or torch.allclose(gm(x), f(x), equal_nan=True)
y = torch.randn(3, 5)  # the graph is general over shapes where the program is
assert torch.equal(gm(y), f(y)) or torch.allclose(gm(y), f(y), equal_nan=True)
targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
assert all(getattr(t, "__module__", None) != "symtrace.tracer" for t in targets), targets  # the real torch op
assert torch.pow is torch._C._VariableFunctions.pow  # restored after tracing
print("ok")
"""


@pytest.mark.parametrize("expr", CASES)
def test_traced_tensor_in_a_scalar_overload_position_is_recorded(expr):
    p = subprocess.run([sys.executable, "-c", _SCRIPT.format(expr=expr)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (p.returncode, p.stderr[-2000:])


def test_scalar_trap_table_lists_every_number_overload_of_this_torch():
    from symtrace.tracer import _SCALAR_TRAP_NAMES, _scan_number_overloads
    missing = {ns: sorted(set(names) - set(_SCALAR_TRAP_NAMES.get(ns, ())))
               for ns, names in _scan_number_overloads().items()}
    assert not any(missing.values()), f"add these to symtrace.tracer._SCALAR_TRAP_NAMES: {missing}"


def test_scalar_trap_table_covers_the_crashing_functions():
    from symtrace.tracer import _scalar_trap_wrappers
    import torch
    traps = _scalar_trap_wrappers()
    for name in ("where", "pow", "remainder", "xlogy"):
        assert traps[(torch, name)].__wrapped__ is getattr(torch, name)
    for name in ("xlogy", "xlog1py", "zeta"):
        assert traps[(torch.special, name)].__wrapped__ is getattr(torch.special, name)
