"""The raw-bytecode scan that tracing uses to find a function's globals agrees with ``dis``."""
import argparse
import dis
import inspect
import json
import types

import torch

import symtrace
from symtrace.trace.bytecode import code_facts


def _reference(code):
    """The same four answers read through ``dis.get_instructions`` (the slow, obvious way)."""
    loads, attrs, stores = set(), set(), set()
    just_loaded = None
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op in ("LOAD_ATTR", "LOAD_METHOD") and just_loaded is not None:
            attrs.add((just_loaded, ins.argval))
        elif op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            stores.add(ins.argval)
        just_loaded = ins.argval if op == "LOAD_GLOBAL" else None
        if just_loaded is not None:
            loads.add(just_loaded)
    nested = tuple(c for c in code.co_consts if isinstance(c, types.CodeType))
    return tuple(sorted(loads)), tuple(sorted(attrs)), nested, tuple(sorted(stores))


def _all_code(modules):
    seen, stack = set(), []
    for m in modules:
        for _, obj in inspect.getmembers(m):
            fns = [obj] if inspect.isfunction(obj) else \
                [f for f in vars(obj).values() if inspect.isfunction(f)] if inspect.isclass(obj) else []
            stack.extend(f.__code__ for f in fns)
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return seen


def test_agrees_with_dis_on_library_code():
    import symtrace.trace.modules as tm
    import symtrace.lower.lowering as lowering
    import torch.nn.modules.activation as act
    import torch.nn.functional as F
    codes = _all_code([json.decoder, argparse, inspect, F, act, tm, lowering, symtrace.passes])
    assert len(codes) > 500
    for c in codes:
        assert code_facts(c) == _reference(c), c


COUNT = 0


def _rebinds():
    global COUNT
    COUNT += 1
    del COUNT


def _reads():
    return torch.nn.functional.relu(json.loads("1")) + torch.pi


def test_globals_attributes_and_rebinds():
    loads, attrs, nested, stores = code_facts(_rebinds.__code__)
    assert "COUNT" in loads and stores == ("COUNT",)
    loads, attrs, nested, stores = code_facts(_reads.__code__)
    assert {"torch", "json"} <= set(loads)
    assert ("torch", "nn") in attrs and ("json", "loads") in attrs and ("torch", "pi") in attrs
    assert stores == ()


def test_long_functions_with_extended_arguments():
    # over 256 names: LOAD_GLOBAL's argument needs EXTENDED_ARG
    names = [f"g{i}" for i in range(300)]
    src = "def f():\n    return [" + ", ".join(f"{n}.attr" for n in names) + "]\n"
    ns = {}
    exec(compile(src, "<test>", "exec"), ns)
    code = ns["f"].__code__
    loads, attrs, _, _ = code_facts(code)
    assert set(loads) == set(names)
    assert code_facts(code) == _reference(code)
    # (the global read right after an EXTENDED_ARG still pairs with its attribute)
    assert ("g299", "attr") in attrs
