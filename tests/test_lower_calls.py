"""How a lowered module runs its C kernels: which loops open an OpenMP region (and with how
many threads), how the wrapper calls the kernels, and what it does per call."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import symtrace
from symtrace.lower import codegen_c
from symtrace.lower import compile as lower

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None,
                                reason="no C compiler")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "symtrace-cache"))


def pointwise(x):
    return torch.sigmoid(x) * 2 + 1


def rows(x):
    return torch.softmax(x, -1)


def total(x):
    return (x * 2).sum()


def lowered(fn, *inputs):
    return lower(symtrace.symbolic_trace(fn, example_inputs=inputs), inputs)


# ------------------------------------------------------------------ OpenMP regions

@pytest.mark.parametrize("fn, small, large", [
    (pointwise, (1000,), (4 * codegen_c.PARALLEL_THRESHOLD,)),
    (rows, (10, 100), (400, 1000)),
    (total, (5000,), (4 * codegen_c.PARALLEL_THRESHOLD,)),
], ids=["pointwise", "row", "full"])
def test_only_kernels_above_the_threshold_open_an_openmp_region(fn, small, large):
    """A kernel with at most PARALLEL_THRESHOLD elements of work has no parallel region (an if(0)
    clause would still call into the OpenMP runtime on every call); a larger one runs its
    region on the ``nt`` threads the wrapper passes."""
    for shape, parallel in ((small, False), (large, True)):
        x = torch.randn(shape)
        lm = lowered(fn, x)
        src = "\n".join(k.source for k in lm.kernels)
        assert ("#pragma omp parallel for" in src) == parallel, src
        if parallel:
            assert "num_threads(nt)" in src and " if(" not in src
        with torch.no_grad():
            assert torch.allclose(lm(x), fn(x), rtol=1e-5, atol=1e-6)
