"""Adapter for the zoo harness (a separate checkout, ``$ZOO`` below): trace with symtrace using the harness's example inputs.

Usage (from ``$ZOO``; ``$SYMTRACE`` is this repository):
    PYTHONPATH=$SYMTRACE/benchmarks ~/zooenv/bin/python run.py --tracer zoo_adapter:trace --out /tmp/zoo_symtrace.jsonl
"""
from __future__ import annotations

from typing import Any

import torch

import symtrace


def trace(model: torch.nn.Module, example_inputs: dict[str, Any]):
    """``symtrace.symbolic_trace`` with the harness's keyword example inputs (so shape decisions
    resolve to guards); the result is called as ``gm(**example_inputs)``."""
    return symtrace.symbolic_trace(model, example_inputs=example_inputs)
