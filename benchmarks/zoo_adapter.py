"""Adapter for the zoo harness (a separate checkout, ``$ZOO`` below): trace with symtrace using the harness's example inputs.

Usage (from ``$ZOO``; ``$SYMTRACE`` is this repository):
    PYTHONPATH=$SYMTRACE/benchmarks ~/zooenv/bin/python run.py --tracer zoo_adapter:trace --out /tmp/zoo_symtrace.jsonl
    PYTHONPATH=$SYMTRACE/benchmarks ~/zooenv/bin/python run.py --tracer zoo_adapter:lower --timeout 400 --out /tmp/zoo_lower.jsonl

``trace`` checks tracing and replay; ``lower`` checks ``symtrace.lower.compile``'s kernels
against eager on the same models (the harness's tolerance, rtol 1e-4 / atol 1e-5, is tighter
than fp32 allows on some random-weight models whose outputs reach 1e6-1e11: compare a
``mismatch`` against eager's own error to a float64 run before calling it a bug).
"""
from __future__ import annotations

from typing import Any

import torch

import symtrace


def trace(model: torch.nn.Module, example_inputs: dict[str, Any]):
    """``symtrace.symbolic_trace`` with the harness's keyword example inputs (so shape decisions
    resolve to guards); the result is called as ``gm(**example_inputs)``."""
    return symtrace.symbolic_trace(model, example_inputs=example_inputs)


def lower(model: torch.nn.Module, example_inputs: dict[str, Any]):
    """``symtrace.lower.compile`` of the traced model for the harness's example inputs (the
    inference pipeline on, no speed check, so that the kernels are what runs): checks the
    lowering's outputs against eager on every zoo model. ``$ZOO_LOWER_LOG``: append one JSON line
    per model there (kernel count, whether it runs through torch and why)."""
    import json
    import os

    from symtrace import lower as _lower

    gm = symtrace.symbolic_trace(model, example_inputs=example_inputs)
    lm = _lower.compile(gm, example_inputs, speed_check=False)
    with torch.no_grad():
        lm(**example_inputs)   # (compiles the variant now, in the trace phase)
    log = os.environ.get("ZOO_LOWER_LOG")
    if log:
        runs_torch = lm._fast is None
        with open(log, "a") as f:
            f.write(json.dumps({"model": type(model).__name__, "kernels": len(lm.kernels),
                                "runs_torch": runs_torch, "report": lm.report()[-2000:] if runs_torch else ""}) + "\n")
    return lm
