import os
import sys
import warnings

import pytest

# lower.compile's compile-time timing against eager (speed_guard.py) is off in tests: on a busy
# machine it could send a test's graph through torch and the test would check torch, not our
# kernels (tests of the guard turn it on explicitly)
os.environ.setdefault("SYMTRACE_SPEED_CHECK", "0")
# the same for the compile-time choice of MKL over oneDNN for small linear layers (onednn.py):
# tests of that choice set it explicitly
os.environ.setdefault("SYMTRACE_MKL_LINEAR", "0")
# Triton kernels run on CPU tensors in Triton's interpreter (must be set before triton is imported)
os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


@pytest.fixture
def session_kernel_cache(tmp_path_factory, monkeypatch):
    """``$SYMTRACE_CACHE_DIR`` in this session's temporary directory, shared by every test that
    uses it (compiled kernels are reused across tests, never written to the user's cache)."""
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "symtrace-cache"))
