"""Acceptance corpus: programs no one here wrote (PyTorch's own test programs, tests/corpus/).

Every program of ``tests/corpus/programs_*.py`` runs, in process, under

* ``eager`` -- the program against itself: the harness must call that ``ok`` (a self-check:
  deterministic programs, globals reset between runs, RNG state carried);
* ``capture`` -- ``symtrace.capture(model)`` must give eager's answer on every input set and
  after the state flip: outcome ``ok``; or, only for programs marked ``refused=`` (by design,
  with the reason, in the corpus), a ``TraceError`` while capturing;
* ``strict`` (``symbolic_trace`` with the first input set as example inputs) and ``symbolic``
  (without example inputs) -- never ``wrong``, never ``crash``: eager's answer, or a loud
  refusal (``TraceError`` at trace time, ``GuardError`` at a call).

Outcomes and how they are judged: tests/corpus/runner.py. Known current failures are strict
xfails in XFAIL below, one line each, so that fixing one shows up as an XPASS (then drop its
row). ``python benchmarks/soundness_bench.py`` compares the same corpus across tools.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus import load_programs  # noqa: E402
from corpus.runner import CRASH, OK, REFUSED, WRONG, run_program  # noqa: E402

PROGRAMS = load_programs()
_BY_NAME = {p.name: p for p in PROGRAMS}

# ---------------------------------------------------------------------------------------------
# known current failures: {(program, mode): reason}
# ---------------------------------------------------------------------------------------------
_ALL = "capture strict symbolic"
_KNOWN = [
    # --- capture refuses (TraceError) instead of answering -------------------------------------
    ("refused: deepcopy of a module inside forward ('a module object cannot be a graph value')",
     {"PartialMaml": "capture"}),
]
XFAIL: dict = {(name, mode): reason for reason, rows in _KNOWN for name, modes in rows.items()
               for mode in modes.split()}


def _params(mode: str):
    out = []
    for p in PROGRAMS:
        reason = XFAIL.get((p.name, mode))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(p, id=p.name, marks=marks))
    return out


def _check(ok: bool, res, mode: str) -> None:
    """Fail with the runner's one-line verdict; a known failure is reported as an xfail (an
    imperative xfail keeps pytest from formatting the deep traceback of a raised one)."""
    if ok:
        return
    msg = f"{res.outcome}: {res.reason}"
    if (res.program, mode) in XFAIL:
        pytest.xfail(msg)
    pytest.fail(msg, pytrace=False)


def test_xfail_table_names_real_programs():
    unknown = [k for k in XFAIL if k[0] not in _BY_NAME or k[1] not in ("capture", "strict", "symbolic")]
    assert not unknown, f"XFAIL rows for unknown programs/modes: {unknown}"


def test_corpus_size_and_origins():
    assert 150 <= len(PROGRAMS) <= 250, len(PROGRAMS)
    for p in PROGRAMS:
        assert p.origin.startswith("test/") and "::" in p.origin, (p.name, p.origin)
        assert 1 <= len(p.inputs) <= 5, p.name


@pytest.mark.parametrize("prog", _params("eager"))
def test_eager_self_check(prog):
    res = run_program(prog, "eager")
    _check(res.outcome == OK, res, "eager")


@pytest.mark.parametrize("prog", _params("capture"))
def test_capture(prog):
    res = run_program(prog, "capture")
    refused_by_design = prog.refused is not None and res.outcome == REFUSED and res.exc_type == "TraceError"
    _check(res.outcome == OK or refused_by_design, res, "capture")


@pytest.mark.parametrize("prog", _params("strict"))
def test_strict(prog):
    res = run_program(prog, "strict")
    _check(res.outcome not in (WRONG, CRASH), res, "strict")


@pytest.mark.parametrize("prog", _params("symbolic"))
def test_symbolic(prog):
    res = run_program(prog, "symbolic")
    _check(res.outcome not in (WRONG, CRASH), res, "symbolic")
