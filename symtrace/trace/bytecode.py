"""What a code object names, read from its raw instructions.

Tracing a program asks, for every user function it meets (hundreds in a transformers model),
which globals the function loads, which ``global.attribute`` pairs it reads, which code is
nested in it and which globals it rebinds. :func:`code_facts` answers all four in one pass over
``co_code``, cached per code object. ``dis.get_instructions`` gives the same answers but builds
an object per instruction (with positions and argument text); on GPT-2 that was 0.36 s of a
2.4 s compile, this is a few milliseconds.
"""
from __future__ import annotations

import dis
import sys
import types
from typing import Any, Dict, Tuple

__all__ = ["code_facts", "CodeFacts"]

#: (globals loaded, (global, attribute) pairs read, nested code objects, globals rebound or deleted)
CodeFacts = Tuple[Tuple[str, ...], Tuple[Tuple[str, str], ...], Tuple[Any, ...], Tuple[str, ...]]

_OP = dis.opmap
_EXTENDED_ARG = _OP["EXTENDED_ARG"]
_CACHE = _OP.get("CACHE", -1)          # inline cache entries (3.11+): not instructions
_LOAD_GLOBAL = _OP["LOAD_GLOBAL"]
_ATTR_READS = frozenset(_OP[n] for n in ("LOAD_ATTR", "LOAD_METHOD") if n in _OP)
_GLOBAL_WRITES = frozenset((_OP["STORE_GLOBAL"], _OP["DELETE_GLOBAL"]))
# Where the name's index sits in the argument: 3.11 moved LOAD_GLOBAL's up a bit (the low bit
# says "push NULL"), 3.12 did the same for LOAD_ATTR (the low bit says "method").
_GLOBAL_SHIFT = 1 if sys.version_info >= (3, 11) else 0
_ATTR_SHIFT = 1 if sys.version_info >= (3, 12) else 0

_FACTS: Dict[Any, CodeFacts] = {}


def code_facts(code: types.CodeType) -> CodeFacts:
    """The globals ``code`` loads, the ``(global, attribute)`` pairs it reads right after
    loading the global, the code objects nested in it, and the globals it rebinds or deletes
    (``global n; n += 1``); each sorted, the nested code in constant order."""
    hit = _FACTS.get(code)
    if hit is None:
        hit = _FACTS[code] = _scan(code)
    return hit


def _scan(code: types.CodeType) -> CodeFacts:
    raw, names = code.co_code, code.co_names
    loads, attrs, stores = set(), set(), set()
    just_loaded = None   # the global the previous instruction loaded
    ext = 0
    for i in range(0, len(raw), 2):
        op = raw[i]
        if op == _CACHE:
            continue
        arg = raw[i + 1] | ext
        if op == _EXTENDED_ARG:
            ext = arg << 8
            just_loaded = None
            continue
        ext = 0
        if op == _LOAD_GLOBAL:
            just_loaded = names[arg >> _GLOBAL_SHIFT]
            loads.add(just_loaded)
            continue
        if op in _ATTR_READS:
            if just_loaded is not None:
                attrs.add((just_loaded, names[arg >> _ATTR_SHIFT]))
        elif op in _GLOBAL_WRITES:
            stores.add(names[arg])
        just_loaded = None
    nested = tuple(c for c in code.co_consts if isinstance(c, types.CodeType))
    return tuple(sorted(loads)), tuple(sorted(attrs)), nested, tuple(sorted(stores))
