"""symtrace.lower.toolchain: compiler discovery, flags, the OpenMP probe and the content-addressed
library cache (hits, misses, damaged entries, concurrent builders, no compiler, compile errors)."""
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from symtrace.errors import SymtraceError
from symtrace.lower import toolchain as tc

REPO = Path(__file__).resolve().parent.parent


def add_source(tag: str) -> str:
    return f"/* {tag} */\nint st_add(int a, int b) {{ return a + b; }}\n"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(root))
    tc.clear_memory_cache()
    tc.stats.reset()
    yield root
    tc.clear_memory_cache()


@pytest.fixture
def cc():
    try:
        return tc.find_compiler()
    except tc.CompilerUnavailable as e:
        pytest.skip(f"no C compiler: {e}")


def test_miss_then_memory_hit_then_disk_hit(cc, cache):
    src = add_source("hits")
    lib = tc.load_library(src)
    assert lib.st_add(2, 3) == 5
    assert (tc.stats.compiles, tc.stats.hits) == (1, 0)
    key = tc.cache_key(src)
    so = cache / key[:2] / f"{key}.so"
    assert tc.library_path(src) == so and so.is_file()
    assert (cache / key[:2] / f"{key}.c").read_text() == src  # kept for users to read
    assert (cache / key[:2] / f"{key}.sha256").read_text() == hashlib.sha256(so.read_bytes()).hexdigest()
    assert tc.load_library(src) is lib
    assert (tc.stats.compiles, tc.stats.hits, tc.stats.disk_hits) == (1, 1, 0)
    probes = tc.stats.probes
    tc.clear_memory_cache()
    assert tc.load_library(src).st_add(4, 5) == 9
    assert (tc.stats.compiles, tc.stats.hits, tc.stats.disk_hits) == (1, 2, 1)
    assert tc.stats.probes == probes  # the OpenMP answer came from disk
    assert len(tc.stats.times) == 1 and tc.stats.seconds == pytest.approx(sum(tc.stats.times))


def test_cache_dir_is_read_at_call_time(cc, tmp_path, monkeypatch):
    src = add_source("env")
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(tmp_path / "a"))
    a = tc.library_path(src)
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(tmp_path / "b"))
    assert tc.library_path(src) == tmp_path / "b" / a.relative_to(tmp_path / "a")
    monkeypatch.delenv("SYMTRACE_CACHE_DIR")
    assert tc.cache_dir() == Path.home() / ".cache" / "symtrace"


@pytest.mark.parametrize("damage", ["garbage", "garbage_with_matching_sidecar", "truncated", "sidecar_missing"])
def test_damaged_entry_is_rebuilt(cc, damage):
    src = add_source(damage)
    so = tc.library_path(src)
    so.parent.mkdir(parents=True)
    if damage == "truncated":  # a real build, cut short (the bytes no longer match the sidecar)
        tc.load_library(add_source("donor"), flags=tc.compiler_flags())
        donor = tc.library_path(add_source("donor"))
        so.write_bytes(donor.read_bytes()[:200])
        so.with_suffix(".sha256").write_text(hashlib.sha256(donor.read_bytes()).hexdigest())
        tc.stats.reset()
    elif damage == "sidecar_missing":
        so.write_bytes(b"\x7fELF not really")
    else:
        so.write_bytes(b"not a shared library")
        if damage == "garbage_with_matching_sidecar":  # only dlopen can tell
            so.with_suffix(".sha256").write_text(hashlib.sha256(b"not a shared library").hexdigest())
    assert tc.load_library(src).st_add(1, 2) == 3
    assert (tc.stats.compiles, tc.stats.rebuilds) == (1, 1)
    assert so.with_suffix(".sha256").read_text() == hashlib.sha256(so.read_bytes()).hexdigest()


def test_entry_damaged_after_a_build_is_rebuilt(cc):
    src = add_source("later")
    tc.load_library(src)
    so = tc.library_path(src)
    good = so.read_bytes()
    so.unlink()  # (never overwrite a loaded .so in place)
    so.write_bytes(good[: len(good) // 2])
    tc.clear_memory_cache()
    assert tc.load_library(src).st_add(3, 4) == 7
    assert (tc.stats.compiles, tc.stats.rebuilds) == (2, 1)
    assert hashlib.sha256(so.read_bytes()).hexdigest() == so.with_suffix(".sha256").read_text()


def test_threads_share_one_build(cc):
    src = add_source("threads")
    libs, errors = [], []
    barrier = threading.Barrier(4)

    def work():
        try:
            barrier.wait()
            libs.append(tc.load_library(src))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(libs) == 4 and all(lib is libs[0] for lib in libs)
    assert tc.stats.compiles == 1


# The children load the toolchain without importing torch (symtrace's package __init__ does), so
# that three of them start quickly on a busy machine; the module itself needs only the stdlib.
_CHILD = """
import json, os, sys, time, types
t0 = time.perf_counter()
for name, sub in (("symtrace", ""), ("symtrace.lower", "lower")):
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.join(os.getcwd(), "symtrace", sub)]
    sys.modules[name] = pkg
from symtrace.lower import toolchain as tc
t1 = time.perf_counter()
ready, go, src = sys.argv[1:4]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.002)
t2 = time.perf_counter()
lib = tc.load_library(open(src).read())
r = lib.st_add(20, 22)
t3 = time.perf_counter()
assert "torch" not in sys.modules
print(json.dumps({"result": r, "compiles": tc.stats.compiles, "import_toolchain": t1 - t0, "load": t3 - t2}))
"""


def _spawn(tmp_path, name, src_file, cache, go):
    env = dict(os.environ, SYMTRACE_CACHE_DIR=str(cache))
    ready = tmp_path / f"{name}.ready"
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(ready), str(go), str(src_file)], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, ready


def _wait_ready(procs, timeout=180):
    end = time.monotonic() + timeout
    for p, ready in procs:
        while not ready.exists():
            assert p.poll() is None, f"child died: {p.communicate()[1][-2000:]}"
            assert time.monotonic() < end, "child did not start"
            time.sleep(0.01)


def _result(p):
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def test_two_processes_compile_the_same_key_at_once(cc, cache, tmp_path):
    src_file = tmp_path / "src.c"
    src_file.write_text(add_source("concurrent"))
    go, go_later = tmp_path / "go", tmp_path / "go-later"
    procs = [_spawn(tmp_path, f"p{i}", src_file, cache, go) for i in range(2)]
    later = _spawn(tmp_path, "later", src_file, cache, go_later)  # imports now, looks up the cache at the end
    _wait_ready(procs + [later])
    go.touch()  # both are past their imports: they look up the cache together
    outs = [_result(p) for p, _ in procs]
    assert [o["result"] for o in outs] == [42, 42]
    assert sum(o["compiles"] for o in outs) >= 1
    so = tc.library_path(src_file.read_text())
    assert hashlib.sha256(so.read_bytes()).hexdigest() == so.with_suffix(".sha256").read_text()
    assert not list(so.parent.glob("*.tmp")), "temporary files left behind"
    # a third process finds the entry: no compile, and the lookup + dlopen is cheap
    go_later.touch()
    hit = _result(later[0])
    assert hit["result"] == 42 and hit["compiles"] == 0
    assert hit["load"] < 0.5, f"cache hit in a new process took {hit['load'] * 1e3:.1f} ms"
    print(f"\nnew-process cache hit: load {hit['load'] * 1e3:.1f} ms, import toolchain "
          f"{hit['import_toolchain'] * 1e3:.1f} ms; concurrent builders compiled {[o['compiles'] for o in outs]} times")


def test_missing_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(tc.CompilerUnavailable, match=r"\$CC is set to .*no-such-cc"):
        tc.find_compiler()
    with pytest.raises(tc.CompilerUnavailable):
        tc.load_library(add_source("nocc"))
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # a directory without any compiler
    with pytest.raises(tc.CompilerUnavailable, match="no C compiler found on PATH") as info:
        tc.load_library(add_source("nocc"))
    assert isinstance(info.value, tc.ToolchainError) and isinstance(info.value, SymtraceError)


def test_compiler_version_is_remembered_on_disk(cc, cache, monkeypatch):
    tc.clear_memory_cache()
    assert tc.find_compiler() == cc and list((cache / "compilers").glob("*.json"))

    def no_subprocess(*a, **k):
        raise AssertionError("ran the compiler")

    tc.clear_memory_cache()
    monkeypatch.setattr(tc.subprocess, "run", no_subprocess)
    assert tc.find_compiler() == cc


def test_broken_compiler_is_unavailable(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(tc.CompilerUnavailable, match="failed on --version"):
        tc.find_compiler()


def test_compiler_that_cannot_build_libraries_is_unavailable(monkeypatch, tmp_path):
    fake = tmp_path / "fakecc"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "fakecc 1.0"; exit 0; fi\n'
                    'echo "fakecc: error: cannot link" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert tc.find_compiler().version == "fakecc 1.0"
    with pytest.raises(tc.CompilerUnavailable, match="cannot build a shared library(.|\n)*cannot link"):
        tc.load_library(add_source("fake"))


def test_unwritable_cache_dir_is_reported(cc, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(tc.CompilerUnavailable, match="SYMTRACE_CACHE_DIR"):
        tc.load_library(add_source("ro"))


def test_compile_error_reports_stderr_and_source(cc):
    src = "int st_broken(int a) { return a +; }\n"
    with pytest.raises(tc.CompileError) as info:
        tc.load_library(src)
    e = info.value
    assert "error" in e.stderr.lower() and e.stderr[:200] in str(e)
    assert str(e.c_path) in str(e) and e.c_path.read_text() == src
    assert not tc.library_path(src).exists() and not list(e.c_path.parent.glob("*.tmp"))
    with pytest.raises(tc.CompileError):  # a failure is not cached as a success
        tc.load_library(src)
    assert tc.stats.compiles == 2


def test_flags_compiler_and_cpu_enter_the_key(cc, monkeypatch):
    src = add_source("keys")
    default = tc.compiler_flags()
    other = tuple("-O2" if f == "-O3" else f for f in default)
    a, b = tc.library_path(src), tc.library_path(src, flags=other)
    assert a != b
    assert tc.load_library(src).st_add(1, 1) == 2 and tc.load_library(src, flags=other).st_add(2, 2) == 4
    assert a.is_file() and b.is_file() and tc.stats.compiles == 2
    newer = dataclasses.replace(cc, version=cc.version + " (patched)")
    assert tc.cache_key(src, default, newer) != tc.cache_key(src, default, cc)
    monkeypatch.setattr(tc, "_cpu_sig", ["x86_64|some other cpu"])
    assert tc.library_path(src) != a


def test_default_flags(cc):
    flags = tc.compiler_flags()
    assert flags[: len(tc.BASE_FLAGS)] == tc.BASE_FLAGS
    assert not any("fast-math" in f or "finite-math" in f for f in flags)
    assert ("-mprefer-vector-width=512" in flags) == ("avx512f" in tc.cpu_signature().split("|", 1)[-1].split())
    assert tc.openmp_available() == ("-fopenmp" in flags)


def test_openmp_probe_runs_once_and_is_kept_on_disk(cc, cache):
    flags = tc.compiler_flags()
    assert tc.stats.probes >= 1
    records = list((cache / "probes").glob("*.json"))
    assert len(records) == 1
    tc.clear_memory_cache()
    tc.stats.reset()
    assert tc.compiler_flags() == flags and tc.stats.probes == 0
    # the answer really comes from the record
    records[0].write_text(json.dumps({"openmp_flag": ""}))
    tc.clear_memory_cache()
    assert not any(f.startswith("-fopenmp") for f in tc.compiler_flags()) and tc.stats.probes == 0
    records[0].write_text("{damaged")  # an unreadable record is probed again
    tc.clear_memory_cache()
    assert tc.compiler_flags() == flags and tc.stats.probes >= 1


def test_openmp_kernel_runs(cc):
    if not tc.openmp_available():
        pytest.skip("the compiler has no OpenMP")
    src = ("#include <omp.h>\nint st_threads(int n) {\n  int s = 0;\n#pragma omp parallel for num_threads(2) "
           "reduction(+:s)\n  for (int i = 0; i < n; i++) s += 1;\n  return s * 100 + omp_get_max_threads();\n}\n")
    r = tc.load_library(src).st_threads(1000)
    assert r // 100 == 1000 and r % 100 >= 1


def test_prelude_source_is_the_header():
    text = tc.prelude_source()
    assert text == tc.PRELUDE_PATH.read_text() and "SYMTRACE_PRELUDE_H" in text and "st_expf" in text


def _unit_source(n: int, head: str = "#include <stdint.h>\nstatic int st_twice(int a) { return 2 * a; }\n") -> str:
    """A source of ``n`` units after a shared head: function i returns twice i plus its argument,
    and an entry ``st_sum`` calls all of them (across parts: it needs the prototypes)."""
    protos = "".join(f"int st_f{i}(int a);\n" for i in range(n))
    units = [f"int st_f{i}(int a) {{ return st_twice({i}) + a; }}" for i in range(n)]
    entry = "int st_sum(int a) { return " + " + ".join(f"st_f{i}(a)" for i in range(n)) + "; }"
    return tc.UNIT_BREAK.join([head + protos] + units + [entry]) + "\n"


def test_a_large_source_is_compiled_in_parallel_parts_and_linked(cc, cache, monkeypatch):
    monkeypatch.setattr(tc, "PARALLEL_COMPILE_MIN_BYTES", 0)
    monkeypatch.setattr(tc, "_compile_workers", lambda: 3)
    commands = []
    run = tc.subprocess.run

    def record(cmd, *a, **k):
        commands.append(list(cmd))
        return run(cmd, *a, **k)

    monkeypatch.setattr(tc.subprocess, "run", record)
    src = _unit_source(10)
    lib = tc.load_library(src)
    assert lib.st_sum(1) == sum(2 * i + 1 for i in range(10)) and lib.st_f7(5) == 19
    objects = [c for c in commands if "-c" in c]
    assert len(objects) == 3 and all("-shared" not in c for c in objects)
    key = tc.cache_key(src)
    assert (cache / key[:2] / f"{key}.c").read_text() == src     # the whole source is kept to read
    assert sorted(p.name for p in (cache / key[:2]).iterdir()) == sorted(f"{key}{s}" for s in (".c", ".so", ".sha256"))
    tc.clear_memory_cache()
    assert tc.load_library(src).st_sum(2) == sum(2 * i + 2 for i in range(10))   # a disk hit, as usual


def test_split_units_keep_the_head_and_the_order(cc):
    src = _unit_source(7)
    head, *units = src.split(tc.UNIT_BREAK)
    parts = tc._split_units(src, 3)
    assert len(parts) == 3 and all(p.startswith(head + tc.UNIT_BREAK) for p in parts)
    assert [u for p in parts for u in p.split(tc.UNIT_BREAK)[1:]] == units
    assert tc._split_units(src, 1) == [] and tc._split_units("int a;\n", 4) == []
    assert len(tc._split_units(_unit_source(1), 8)) == 2      # (a unit and the entry)


def test_a_compile_error_in_one_part_names_the_whole_source(cc, monkeypatch):
    monkeypatch.setattr(tc, "PARALLEL_COMPILE_MIN_BYTES", 0)
    monkeypatch.setattr(tc, "_compile_workers", lambda: 2)
    src = _unit_source(4).replace("st_twice(3) + a", "st_twice(3) +")
    with pytest.raises(tc.CompileError) as info:
        tc.load_library(src)
    assert "error" in info.value.stderr.lower() and info.value.c_path.read_text() == src   # the whole source
    broken = next(i for i, line in enumerate(src.splitlines(), 1) if "st_twice(3) +" in line)
    assert f"{info.value.c_path}:{broken}:" in info.value.stderr    # (#line: the kept file's own numbering)
    assert not tc.library_path(src).exists()
    left = [p.name for p in tc.library_path(src).parent.iterdir()]
    assert not [n for n in left if ".part" in n or n.endswith(".tmp")]
