"""The cache of what int8 backends derive from a weight (packed forms, per-call-site
constants): kept per weight tensor while it lives and is not written, never saved."""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Tuple

import torch

__all__ = ["weight_cached", "forget_weights", "tensor_version"]

_CACHE: Dict[Tuple, Tuple[Any, int, Any]] = {}
_LOCK = threading.Lock()


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (how often it was written in place); -1 for an inference tensor,
    which keeps none."""
    return -1 if t.is_inference() else t._version


def weight_cached(w: torch.Tensor, key: Tuple, make: Callable[[], Any]) -> Any:
    """``make()`` cached per (weight tensor, ``key``); recomputed when the weight is written.
    Backends use it for packed weights and per-site constants (``key`` must be hashable and
    should start with the backend's name)."""
    k = (id(w),) + key
    version = tensor_version(w)
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
