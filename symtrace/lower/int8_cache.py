"""The cache of what int8 backends derive from a weight (packed forms, per-call-site
constants): kept per weight tensor while it lives and is not written, never saved."""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Tuple

import torch

__all__ = ["weight_cached", "forget_weights"]

_CACHE: Dict[Tuple, Tuple[Any, int, Any]] = {}
_LOCK = threading.Lock()


def weight_cached(w: torch.Tensor, key: Tuple, make: Callable[[], Any]) -> Any:
    """``make()`` cached per (weight tensor, ``key``); recomputed when the weight is written.
    Backends use it for packed weights and per-site constants (``key`` must be hashable and
    should start with the backend's name)."""
    k = (id(w),) + key
    version = -1 if w.is_inference() else w._version  # (inference tensors keep no counter)
    hit = _CACHE.get(k)
    if hit is not None and hit[0]() is w and hit[1] == version:
        return hit[2]
    value = make()
    with _LOCK:
        if len(_CACHE) > 4096:  # e.g. many input shapes: start over rather than grow
            _CACHE.clear()
        ref = weakref.ref(w, lambda _r, k=k, cache=_CACHE: cache.pop(k, None))
        _CACHE[k] = (ref, version, value)
    return value


def forget_weights() -> None:
    """Drop every cached entry (a backend's self-test does, after its trial weights)."""
    _CACHE.clear()
