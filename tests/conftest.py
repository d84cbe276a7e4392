import os
import sys
import warnings

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
