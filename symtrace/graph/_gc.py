"""Pausing Python's cyclic garbage collector around bulk graph work.

Building or copying tens of thousands of small objects triggers repeated full collections
that scan every live object, which makes graph construction super-linear. Pausing the
collector for the duration of such bulk operations keeps them linear.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Disable the cyclic GC inside the block (restoring its previous state afterwards)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
