"""When a module's own ``__call__`` may be traced through instead of run as one node.

A submodule class with its own ``__call__`` (transformers <= 5.17's decoder layers) given only
tensors is traced through that ``__call__`` when doing so records everything it does: its own
frame may read state and call ``super().__call__`` (the hooks and ``forward``, traced as usual),
but must not write Python state that tracing cannot replay, since one node would run it for
real at every call. Two checks, both about the ``__call__``'s own code (``forward`` is traced
with the usual rules):

* before tracing, :func:`writes_state` reads its bytecode (and the code nested in it) for
  attribute, global and closure-cell stores and subscript stores other than into its fresh
  ``**kwargs`` dict;
* while tracing, :class:`CallWatcher` (a ``sys.setprofile`` hook, suspended inside
  ``super().__call__``) sees every call made from that frame: symtrace's own code (attribute
  reads of the shadow ``self``, traced values' operators, ``super().__call__``) and a few pure
  builtins are fine; anything else (``print``, a logger, ``list.append``, a user function) may
  have an effect: the hook raises :class:`OpaqueCallRetrace` before it runs, and the trace
  starts again with the class run as one node.
"""
from __future__ import annotations

import dis
import inspect
import sys
import types
from typing import Any, Dict, Optional

from .bytecode import code_facts

__all__ = ["writes_state", "CallWatcher", "watching", "OpaqueCallRetrace"]

_STATE_STORES = frozenset({"STORE_ATTR", "DELETE_ATTR", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_DEREF",
                           "DELETE_DEREF"})
_PURE_BUILTINS = frozenset({isinstance, issubclass, len, getattr, hasattr, callable, id})
_WRITES: Dict[Any, Optional[str]] = {}


def _call_codes(cls: type) -> list:
    """The code of every user-defined ``__call__`` in ``cls``'s method order (a subclass's
    ``super().__call__`` may reach its parent's); None for one that is not Python code."""
    out = []
    for c in cls.__mro__:
        call = c.__dict__.get("__call__")
        if call is None:
            continue
        owner = getattr(c, "__module__", "") or ""
        if owner.startswith(("torch.", "symtrace.")) or owner in ("torch", "builtins"):
            break
        out.append(getattr(inspect.unwrap(call), "__code__", None))
    return out


def writes_state(cls: type) -> Optional[str]:
    """What ``cls``'s own ``__call__`` (or a parent class's it may reach) writes that a trace
    could not replay (``"STORE_ATTR calls"``), or None. Conservative: code that cannot be read
    counts as writing."""
    for code in _call_codes(cls):
        if code is None:
            return "its __call__ is not Python code"
        hit = _WRITES.get(code, False)
        if hit is False:
            hit = _WRITES[code] = _scan(code)
        if hit is not None:
            return hit
    return None


def _scan(code: types.CodeType) -> Optional[str]:
    fresh = _var_keyword(code)
    instrs = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
    for k, ins in enumerate(instrs):
        op = ins.opname
        if op in _STATE_STORES:
            return f"{op} {ins.argval}"
        if op in ("STORE_SUBSCR", "DELETE_SUBSCR"):
            # only `kwargs[...] = ...` / `del kwargs[...]` with a constant or local key: the
            # **kwargs dict is made fresh for every call
            if not (k >= 2 and fresh and instrs[k - 2].opname == "LOAD_FAST" and instrs[k - 2].argval == fresh
                    and instrs[k - 1].opname in ("LOAD_CONST", "LOAD_FAST")):
                return f"{op} (a subscript store)"
        if op in ("STORE_FAST", "DELETE_FAST") and fresh and ins.argval == fresh:
            return f"{op} {fresh} (rebinds **{fresh})"
    for nested in code_facts(code)[2]:
        why = _scan(nested)
        if why is not None:
            return why
    return None


def _var_keyword(code: types.CodeType) -> Optional[str]:
    if not code.co_flags & inspect.CO_VARKEYWORDS:
        return None
    i = code.co_argcount + code.co_kwonlyargcount + (1 if code.co_flags & inspect.CO_VARARGS else 0)
    return code.co_varnames[i]


_FAMILIES: Dict[tuple, frozenset] = {}


def _code_family(cls: type) -> frozenset:
    """The code of ``cls``'s own ``__call__`` (and its parents') and all code nested in it."""
    codes = tuple(c for c in _call_codes(cls) if c is not None)
    family = _FAMILIES.get(codes)
    if family is None:
        out, todo = set(), list(codes)
        while todo:
            code = todo.pop()
            if code not in out:
                out.add(code)
                todo.extend(code_facts(code)[2])
        family = _FAMILIES[codes] = frozenset(out)
    return family


class OpaqueCallRetrace(BaseException):
    """Raised out of a trace to start it again with ``cls`` (a module class with its own
    ``__call__``) run as one node. A BaseException, so that user code's ``except Exception``
    cannot swallow it half way through a trace."""

    def __init__(self, cls: type, why: str):
        super().__init__(f"{cls.__name__}: {why}")
        self.cls = cls


class CallWatcher:
    """A profile hook noting the first call from the frames of ``cls``'s own ``__call__`` (and
    its parents') that may have an effect (:attr:`foreign`: what was called)."""

    #: ``_ModuleCallTraced.__call__`` (``super().__call__``) suspends the hook while it traces
    suspend_inside_super_call = True

    def __init__(self, cls: type):
        self.cls = cls
        self.codes = _code_family(cls)
        self.foreign: Optional[str] = None

    def __call__(self, frame, event: str, arg: Any) -> None:
        if event == "call":
            caller = frame.f_back
            if caller is not None and caller.f_code in self.codes and frame.f_code not in self.codes:
                name = frame.f_globals.get("__name__") or ""
                if name != "symtrace" and not name.startswith("symtrace."):
                    self._stop(f"{name}.{frame.f_code.co_qualname}")
        elif event == "c_call" and frame.f_code in self.codes and arg not in _PURE_BUILTINS:
            self._stop(getattr(arg, "__qualname__", None) or repr(arg))

    def _stop(self, what: str) -> None:
        """Raised from the hook, before the callee runs: the effect never happens while tracing."""
        self.foreign = what
        raise OpaqueCallRetrace(self.cls, f"its __call__ calls {what}, which may have an effect")


class watching:
    """``with watching(cls) as w:`` runs the block with a :class:`CallWatcher` installed (the
    previous profile hook is put back after)."""

    def __init__(self, cls: type):
        self.watcher = CallWatcher(cls)

    def __enter__(self) -> CallWatcher:
        self._prev = sys.getprofile()
        sys.setprofile(self.watcher)
        return self.watcher

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._prev)
