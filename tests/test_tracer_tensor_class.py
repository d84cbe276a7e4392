"""A traced tensor is an instance of ``torch.Tensor`` for Python code, never for torch's C code.

``torch.pow(x, 2.0)`` has an overload ``pow(Scalar self, Tensor exponent)`` that torch's
argument parser tries first; it asks the same ``isinstance(obj, torch.Tensor)`` question as
Python code and, when the answer is yes, reads the object as a C tensor. A proxy that answered
yes through its ``__class__`` crashed the process there (or read garbage), however the function
was reached (``from torch import pow`` bound before tracing included). The tracer now answers
Python's ``isinstance`` for proxies while it runs, and the proxy's ``__class__`` never claims a
tensor class. The crash cases run in subprocesses so that a regression fails a test instead of
killing the test run.
"""
import builtins
import os
import subprocess
import sys

import pytest
import torch

import symtrace
from symtrace.errors import TraceError

_BUILTIN_ISINSTANCE = builtins.isinstance
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
    # called through names bound before tracing (`from torch import pow`)
    "pow(a, 2.0) + where(a > 0, a, 0.0)",
    "xlogy(a, 2.0) + remainder(a, 3.0)",
    # a real tensor's method with a traced argument in a number position
    "C.pow(a)",
    "C.mul(a.sum())",
    "torch.ones(8, 16).clamp(min=a.sum())",
]

_SCRIPT = """
import sys, torch, symtrace
from torch import pow, where, xlogy, remainder
C = torch.tensor(2.0)
with_values = sys.argv[1] == "values"
for expr in sys.argv[2:]:
    print("case", expr, flush=True)
    f = eval("lambda a: " + expr)
    x = torch.randn(8, 16)
    gm = symtrace.symbolic_trace(f, example_inputs=(x,)) if with_values else symtrace.symbolic_trace(f)
    for v in (x, torch.randn(8, 16)):
        assert torch.allclose(gm(v), f(v), equal_nan=True), expr
    assert torch.pow is torch._C._VariableFunctions.pow
print("ok")
"""


@pytest.mark.parametrize("mode", ["values", "symbolic"])
def test_traced_tensor_in_a_number_position_is_recorded_not_read_as_a_c_tensor(mode):
    p = subprocess.run([sys.executable, "-c", _SCRIPT, mode, *CASES], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    last = [line for line in p.stdout.splitlines() if line.startswith("case")][-1:]
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (p.returncode, last, p.stderr[-2000:])


class _Checks(torch.nn.Module):
    def forward(self, x):
        n = x.shape[0]
        if isinstance(x, torch.Tensor) and torch.is_tensor(x) and isinstance(x, (int, torch.Tensor)):
            x = x + 1
        if not isinstance(x, (list, tuple)):
            x = x * 2
        return x, isinstance(n, int)


@pytest.mark.parametrize("with_values", [True, False])
def test_isinstance_answers_for_the_traced_value_inside_forward(with_values):
    x = torch.randn(3, 4)
    gm = symtrace.symbolic_trace(_Checks(), example_inputs=(x,)) if with_values else symtrace.symbolic_trace(_Checks())
    out, n_is_int = gm(x)
    assert torch.equal(out, (x + 1) * 2)
    # with values, x.shape[0] is an int; symbolically it is a traced value of unknown type
    assert n_is_int is with_values
    assert builtins.isinstance is _BUILTIN_ISINSTANCE  # restored after tracing


def test_isinstance_is_restored_when_tracing_fails():
    def bad(x):
        if x.sum() > 0:  # needs a value
            return x
        return -x

    with pytest.raises(TraceError):
        symtrace.symbolic_trace(bad)
    assert builtins.isinstance is _BUILTIN_ISINSTANCE


def test_a_traced_tensor_does_not_claim_a_tensor_class_to_c_code():
    seen = {}

    from symtrace.trace.patches import _REAL_ISINSTANCE

    def f(x):
        seen["class"] = x.__class__  # Python code reading the attribute: a real tensor's answer
        seen["c_isinstance"] = _REAL_ISINSTANCE(x, torch.Tensor)  # C code asking: not a C tensor
        seen["name"] = f"{x.__class__.__name__}"
        seen["value_class"] = x.shape[0].__class__
        return x + 1

    gm = symtrace.symbolic_trace(f, example_inputs=(torch.randn(2, 3),))
    assert seen == {}  # tracing leaves the closure's dict alone; running the graph fills it
    gm(torch.randn(2, 3))
    assert seen["class"] is torch.Tensor and seen["name"] == "Tensor"
    assert seen["c_isinstance"] is False  # what torch's C checks read
    assert seen["value_class"] is int  # a number's class is safe to claim


def test_transformer_handlers_see_traced_tensors_as_tensors_and_can_call_number_overloads():
    from torch import pow as bound_pow

    seen = []

    class SquareRelu(symtrace.Transformer):
        def call_function(self, target, args, kwargs):
            seen.append(isinstance(args[0], torch.Tensor))
            if target is torch.relu:
                return bound_pow(args[0], 2.0)  # a number overload, reached without torch.pow
            return super().call_function(target, args, kwargs)

    gm = symtrace.symbolic_trace(lambda x: torch.relu(x) + 1)
    out = SquareRelu(gm).transform()
    x = torch.randn(5)
    assert torch.equal(out(x), x ** 2 + 1)
    assert seen == [True, True]
    assert builtins.isinstance is _BUILTIN_ISINSTANCE


def test_isinstance_holds_while_another_thread_finishes_its_trace():
    import threading

    entered, go, answers = threading.Event(), threading.Event(), []

    def slow(x):
        entered.set()
        go.wait(30)
        answers.append(isinstance(x, torch.Tensor))  # after the other thread's trace ended
        return x + 1

    traced = []
    t = threading.Thread(target=lambda: traced.append(symtrace.symbolic_trace(slow, example_inputs=(torch.randn(2),))))
    t.start()
    assert entered.wait(30)
    symtrace.symbolic_trace(lambda y: y * 2, example_inputs=(torch.randn(2),))
    go.set()
    t.join(30)
    assert answers == []  # the trace left the closure's list alone; the graph appends what it saw
    traced[0](torch.randn(2))
    assert answers == [True]
    assert builtins.isinstance is _BUILTIN_ISINSTANCE


def test_another_threads_eager_factory_calls_are_not_recorded_into_a_trace():
    import threading

    entered, go, other = threading.Event(), threading.Event(), {}

    def slow(x):
        entered.set()
        go.wait(30)
        # after another thread's trace has ended: this thread still traces, with its patches
        return x + torch.zeros(x.shape[0])  # a traced size: recorded symbolically

    def eager_worker():
        other["value"] = torch.randn(3)  # another thread, not tracing: a real tensor
        other["grad"] = torch.is_grad_enabled()  # not a guard of the other thread's trace

    holder = {}
    t = threading.Thread(target=lambda: holder.update(gm=symtrace.symbolic_trace(slow, example_inputs=(torch.randn(2),))))
    t.start()
    assert entered.wait(30)
    w = threading.Thread(target=eager_worker)
    w.start()
    w.join(30)
    symtrace.symbolic_trace(lambda y: y * 2, example_inputs=(torch.randn(2),))  # a trace that ends first
    go.set()
    t.join(30)
    assert type(other["value"]) is torch.Tensor and other["value"].shape == (3,)
    assert other["grad"] is True
    gm = holder["gm"]
    zeros = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._VariableFunctions.zeros]
    assert len(zeros) == 1 and any(type(a) is symtrace.Node for a in zeros[0].args[0]), gm.code
    assert "randn" not in gm.code and not any("grad" in str(g.expr) for g in gm.graph.guards), gm.code
    x = torch.randn(5)
    assert torch.equal(gm(x), x)  # general over the size
    assert torch.zeros is torch._C._VariableFunctions.zeros
    assert torch.is_grad_enabled is torch._C.is_grad_enabled
