"""Run every public torch function, ``torch.special``/``torch.nn.functional`` function and Tensor
method that accepts one of a few simple argument forms (``f(x)``, ``f(x, 2.0)``, ``f(2.0, x)``,
``f(x, x)``, ...) eagerly and through a traced module, and print what differs as JSON.

Used by ``test_tracer_op_sweep.py`` in a subprocess: a crash of the process (torch's C code
reading a proxy as a tensor) fails the test instead of the test run.

    python tests/op_sweep.py values|symbolic [float32|int64]
"""
from __future__ import annotations

import json
import sys
import types
import warnings

import torch

import symtrace

#: results that differ between two eager runs too (uninitialised or packed memory)
UNDEFINED = {"torch.empty_like", "torch.fbgemm_pack_gemm_matrix_fp16", "Tensor.new_empty",
             "Tensor.new_empty_strided", "torch.empty_strided", "Tensor.new", "torch.resize_as_",
             "Tensor.resize_", "Tensor.resize_as_"}
#: "x" the traced tensor, "s" a traced 0-dim tensor (x.sum()), "n" an int read from its shape
FORMS = [("x",), ("x", 2.0), ("x", 2), ("x", "x"), (2.0, "x"), ("x", "x", 0.5), ("x", 1), ("x", "s"), ("s", "x"),
         ("x", "n")]


def candidates() -> list:
    def public(ns, pred):
        return sorted(n for n in dir(ns) if not n.startswith("_") and pred(getattr(ns, n, None)))

    names = ["torch." + n for n in public(torch, lambda f: isinstance(f, types.BuiltinFunctionType))]
    names += ["Tensor." + n for n in public(torch.Tensor, callable)]
    names += ["torch.special." + n for n in public(torch.special, callable)]
    names += ["torch.nn.functional." + n for n in public(torch.nn.functional, callable)]
    return names


def program(name: str, form: tuple):
    ns, _, attr = name.rpartition(".")

    def args(a, form):
        return [a if v == "x" else a.sum() if v == "s" else a.shape[-1] if v == "n" else v for v in form]

    if ns == "Tensor":
        if form[0] != "x":
            return None
        return lambda a: getattr(a, attr)(*args(a, form[1:]))
    fn = getattr(sys.modules[ns], attr)  # bound before tracing, as `from torch import pow` does
    return lambda a: fn(*args(a, form))


def run(mode: str, dtype: str = "float32") -> dict:
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g) if dtype == "float32" else torch.randint(-5, 6, (3, 4), generator=g)
    results = {}
    for name in candidates():
        if name in UNDEFINED:
            continue
        for form in FORMS:
            f = program(name, form)
            if f is None:
                continue
            try:  # every form eager accepts
                torch.manual_seed(0)
                with torch.no_grad():
                    ref = f(x.clone())
            except Exception:
                continue
            if type(ref) is not torch.Tensor or ref.dtype.is_complex or ref.layout is not torch.strided:
                continue
            key = f"{name}{form}"
            print("try", key, flush=True)  # the last line names the culprit if the process dies
            try:
                gm = symtrace.symbolic_trace(f, example_inputs=(x.clone(),)) if mode == "values" \
                    else symtrace.symbolic_trace(f)
                torch.manual_seed(0)
                got = gm(x.clone())
                same = type(got) is torch.Tensor and got.shape == ref.shape and got.dtype == ref.dtype \
                    and torch.allclose(got.double(), ref.double(), equal_nan=True, atol=1e-6)
                results[key] = "ok" if same else "mismatch"
            except Exception as e:  # a clear error is acceptable; a wrong answer is not
                results[key] = f"error: {type(e).__name__}"
    return results


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(*sys.argv[1:3])))
