"""What the test files of the C lowering share: the mark that skips them without a C compiler.
(Their kernel cache is conftest's ``session_kernel_cache`` fixture.)"""
import os
import shutil

import pytest

#: skip where neither ``$CC`` (default ``cc``) nor ``gcc`` is on the PATH
needs_c_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None, reason="no C compiler")
