"""Damaged kernel-cache entries are misses: rebuilt and rewritten, never an exception, never a
wrong kernel. Covers every reader of ``$SYMTRACE_CACHE_DIR``: the compiled libraries and their
``.sha256`` sidecars, the compiler-version and OpenMP-probe records, the lowering's record
cache (``records/``) and the Triton modules (``triton/``)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import symtrace
from symtrace.lower import compile as lower
from symtrace.lower import lowering
from symtrace.lower import toolchain as tc

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None,
                                reason="no C compiler")

# what a damaged file may hold: bytes that are not UTF-8, cut-short JSON, JSON of the wrong
# shape or types, JSON nested beyond the parser's recursion limit, nothing at all
DAMAGE = {
    "not_utf8": b"\xff\xfe\x00\x80{\"version\": \"\xc3\x28\"}",
    "truncated": b'{"key": "ab", "sha256": "0123',
    "empty": b"",
    "wrong_json_list": b"[1, 2, 3]",
    "wrong_json_string": b'"just a string"',
    "wrong_types": json.dumps({"key": 5, "sha256": [1], "payload": {"a": 1}, "version": 7,
                               "openmp_flag": ["-fopenmp"], "compiler": None}).encode(),
    "deep": b"[" * 100000 + b"]" * 100000,
    "null": b"null",
}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(root))
    _forget()
    yield root
    _forget()


def _forget():
    """Forget what this process keeps in memory, as a new process would."""
    tc.clear_memory_cache()
    tc.stats.reset()
    lowering._records.clear()
    for name in [n for n in sys.modules if n.startswith("symtrace_triton_")]:
        del sys.modules[name]


def _damage(path: Path, how) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if how == "directory":
        (path / "sub").mkdir(parents=True)
    else:
        path.write_bytes(how)


SRC_ADD = "/* add */\nint st_f(int a, int b) { return a + b; }\n"
SRC_SUB = "/* sub */\nint st_f(int a, int b) { return a - b; }\n"


def _sidecar_ok(so: Path) -> bool:
    return so.with_suffix(".sha256").read_text() == hashlib.sha256(so.read_bytes()).hexdigest()


# ------------------------------------------------------------------ libraries


@pytest.mark.parametrize("how", list(DAMAGE) + ["directory"])
def test_damaged_sidecar_is_rebuilt(how):
    so = tc.library_path(SRC_ADD)
    assert tc.load_library(SRC_ADD).st_f(2, 3) == 5
    _forget()
    _damage(so.with_suffix(".sha256"), DAMAGE.get(how, how))
    assert tc.load_library(SRC_ADD).st_f(2, 3) == 5
    assert (tc.stats.compiles, tc.stats.rebuilds) == (1, 1)
    assert _sidecar_ok(so)


@pytest.mark.parametrize("how", ["not_utf8", "truncated", "empty", "directory"])
def test_damaged_library_is_rebuilt(how):
    so = tc.library_path(SRC_ADD)
    tc.load_library(SRC_ADD)
    _forget()
    _damage(so, DAMAGE.get(how, how))
    assert tc.load_library(SRC_ADD).st_f(7, 1) == 8
    assert tc.stats.compiles == 1 and _sidecar_ok(so)


def test_library_of_another_key_is_never_loaded():
    """A consistent (library, sidecar) pair copied from another key: the SHA-256 matches, but
    the library names a different key, so it is refused before dlopen and rebuilt."""
    add, sub = tc.library_path(SRC_ADD), tc.library_path(SRC_SUB)
    assert tc.load_library(SRC_SUB).st_f(5, 3) == 2
    _forget()
    add.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sub, add)
    shutil.copyfile(sub.with_suffix(".sha256"), add.with_suffix(".sha256"))
    assert _sidecar_ok(add)
    assert tc.load_library(SRC_ADD).st_f(5, 3) == 8   # a + b, not the copied a - b
    assert (tc.stats.compiles, tc.stats.rebuilds) == (1, 1)
    assert hashlib.sha256(add.read_bytes()).digest() != hashlib.sha256(sub.read_bytes()).digest()


def test_entry_directory_replaced_by_a_file():
    so = tc.library_path(SRC_ADD)
    so.parent.parent.mkdir(parents=True, exist_ok=True)
    so.parent.write_bytes(b"\xff not a directory")
    assert tc.load_library(SRC_ADD).st_f(1, 1) == 2
    assert so.parent.is_dir() and _sidecar_ok(so)


# ------------------------------------------------------------------ JSON records


@pytest.mark.parametrize("how", list(DAMAGE) + ["directory"])
def test_damaged_compiler_and_probe_records_are_redone(cache, how):
    cc = tc.find_compiler()
    flags = tc.compiler_flags()
    records = list((cache / "compilers").glob("*.json")) + list((cache / "probes").glob("*.json"))
    assert len(records) == 2
    for r in records:
        _damage(r, DAMAGE.get(how, how))
    _forget()
    assert tc.find_compiler() == cc and tc.compiler_flags() == flags
    assert tc.load_library(SRC_ADD).st_f(2, 2) == 4
    for r in records:   # rewritten, readable again
        doc = json.loads(r.read_text())
        assert isinstance(doc, dict) and ("version" in doc or "openmp_flag" in doc)


def test_record_with_wrong_version_type_is_not_used(cache):
    cc = tc.find_compiler()
    record = next((cache / "compilers").glob("*.json"))
    for doc in ({"version": 5, "compiler": cc.realpath}, {"version": "", "compiler": cc.realpath},
                {"version": "gcc 1.0", "compiler": "/somewhere/else"}):
        record.write_text(json.dumps(doc))
        _forget()
        assert tc.find_compiler() == cc


def program(x, y):
    return torch.softmax(x * 2 + y, dim=-1), (x - y).amax(-1), x.to(torch.int32)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 33, generator=g) * 10, torch.randn(33, generator=g)


def _check_lowered(target="cpu"):
    x, y = _inputs()
    lm = lower(symtrace.symbolic_trace(program, example_inputs=(x, y)), (x, y), target=target)
    assert lm.eager_reason is None and lm.kernels
    with torch.no_grad():
        got, ref = lm(x, y), program(x, y)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert torch.allclose(g.double(), r.double(), rtol=1e-5, atol=1e-6) if r.is_floating_point() else torch.equal(g, r)


@pytest.mark.parametrize("how", list(DAMAGE) + ["directory", "other_key", "bad_payload", "wrong_payload_type"])
def test_damaged_lowering_records_are_recorded_again(cache, how):
    _check_lowered()
    records = list((cache / "records").rglob("*.json"))
    assert records, "the program's record was not cached"
    for r in records:
        key = r.stem
        if how == "other_key":    # a well-formed entry of another key
            payload = json.dumps([None])
            data = json.dumps({"key": "0" * 64, "sha256": hashlib.sha256(payload.encode()).hexdigest(),
                               "payload": payload}).encode()
        elif how == "bad_payload":   # the right key, a payload that does not match its hash
            data = json.dumps({"key": key, "sha256": "0" * 64, "payload": "[]"}).encode()
        elif how == "wrong_payload_type":   # hash and key right, the payload of the wrong shape
            for payload in ("{\"a\": 1}", "[1, 2]", json.dumps([[1, 2, 3]] * 20)):
                doc = {"key": key, "sha256": hashlib.sha256(payload.encode()).hexdigest(), "payload": payload}
                r.write_text(json.dumps(doc))
                _forget()
                _check_lowered()
            data = r.read_bytes()
        else:
            data = DAMAGE.get(how, how)
        _damage(r, data)
    _forget()
    _check_lowered()
    for r in records:   # rewritten with a good entry
        assert tc.read_cache_entry("records", r.stem) is not None


def test_cache_entry_readers_never_raise(cache):
    for name, data in DAMAGE.items():
        path = cache / "kind" / "ab" / "abcd.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        assert tc.read_cache_entry("kind", "abcd") is None, name
    surrogate = json.dumps({"key": "abcd", "sha256": "x", "payload": "\ud800"}).encode()
    path.write_bytes(surrogate)
    assert tc.read_cache_entry("kind", "abcd") is None
    assert tc.write_cache_entry("kind", "abcd", [1, 2]) and tc.read_cache_entry("kind", "abcd") == [1, 2]


# ------------------------------------------------------------------ Triton modules


@pytest.mark.parametrize("how", ["not_utf8", "truncated", "empty", "directory", "pycache"])
def test_damaged_triton_module_is_rewritten(cache, how):
    pytest.importorskip("triton", reason="triton not installed")
    from symtrace.lower import codegen_triton
    if not codegen_triton.interpreting():
        pytest.skip("runs the kernels in the interpreter")
    _check_lowered("cuda")
    modules = list((cache / "triton").glob("st_*.py"))
    assert modules
    for m in modules:
        if how == "pycache":   # stale or damaged bytecode beside it is never read
            pyc = m.parent / "__pycache__" / f"{m.stem}.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc"
            pyc.parent.mkdir(exist_ok=True)
            pyc.write_bytes(b"\x00" * 64)
        else:
            _damage(m, DAMAGE.get(how, how))
    _forget()
    _check_lowered("cuda")
    for m in modules:
        assert m.is_file() and m.read_bytes().startswith(b"# generated by symtrace.lower (Triton backend)")
