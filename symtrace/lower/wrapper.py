"""The generated Python that runs a lowered graph: guards, allocation, kernel and torch calls.

The source is meant to be read (``LoweredModule.wrapper_code``)::

    def call(x, y):
        if not (x.shape == _shape0 and x.stride() == _stride0 and x.dtype is torch.float32 ...):
            return _miss(x, y)
        nt = _nthreads()
        buf0 = _empty((4096, 4096), (4096, 1), torch.float32)
        _k0(x.data_ptr(), y.data_ptr(), buf0.data_ptr(), nt)   # k0 (row): softmax
        return buf0

Intermediate buffers (role ``temp``) are allocated once, when the module is built, and reused
by every call (the arena): no allocation and no page faults after the first call. Buffers a
caller can see are allocated per call.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

from ..graph.node import importable_name
from .lowering import ExternStep, KernelStep, Lowering, Runtime
from .values import BufferValue

__all__ = ["WrapperSource", "generate"]


class WrapperSource:
    """The generated ``call`` source and the globals it needs."""

    def __init__(self, source: str, globals_: Dict[str, Any], kernel_names: List[str]):
        self.source = source
        self.globals = globals_
        self.kernel_names = kernel_names


class _Gen:
    def __init__(self, lw: Lowering):
        self.lw = lw
        self.g: Dict[str, Any] = {"torch": torch, "_empty": torch.empty_strided}
        self.lines: List[str] = []
        self._const_ids: Dict[int, str] = {}
        self.py: Dict[int, str] = {}   # id(buffer) -> python expression of the tensor
        self._allocated: set = set()   # output buffers already allocated

    def const(self, obj: Any, stem: str = "_c") -> str:
        key = id(obj)
        name = self._const_ids.get(key)
        if name is None:
            name = f"{stem}{len(self._const_ids)}"
            self._const_ids[key] = name
            self.g[name] = obj
        return name

    def lit(self, v: Any) -> str:
        if isinstance(v, BufferValue):
            return self.tensor(v)
        if isinstance(v, Runtime):
            return v.name
        if v is None or isinstance(v, (bool, str)) or v is Ellipsis:
            return repr(v)
        if isinstance(v, int):
            return repr(v)
        if isinstance(v, float):
            return repr(v) if math.isfinite(v) else f"float({str(v)!r})"
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, torch.Size):
            return f"torch.Size({self.lit(tuple(v))})"
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            inner = ", ".join(self.lit(x) for x in v)
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        if isinstance(v, list):
            return "[" + ", ".join(self.lit(x) for x in v) + "]"
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return "{" + ", ".join(f"{k!r}: {self.lit(x)}" for k, x in v.items()) + "}"
        if isinstance(v, slice):
            return f"slice({self.lit(v.start)}, {self.lit(v.stop)}, {self.lit(v.step)})"
        return self.const(v)

    def tensor(self, bv: BufferValue) -> str:
        base = self.py[id(bv.buffer)]
        if bv.is_whole():
            return base
        return f"{base}.as_strided({tuple(bv.shape)!r}, {tuple(bv.strides)!r}, {base}.storage_offset() + {bv.offset})"

    def w(self, text: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + text)

    def generate(self) -> WrapperSource:
        lw = self.lw
        params = [name for name, _ in lw.inputs]
        self.lines.append(f"def call({', '.join(params)}):")
        checks = []
        for name, m in lw.inputs:
            if hasattr(m, "shape"):
                checks.append(f"isinstance({name}, _Tensor) and {name}.shape == {tuple(m.shape)!r} and "
                              f"{name}.stride() == {tuple(m.stride)!r} and {name}.dtype is {m.dtype} and "
                              f"{name}.device.type == 'cpu'")
            else:
                val = m[1] if isinstance(m, tuple) and m and m[0] == "py" else m
                if val is None or isinstance(val, bool):
                    checks.append(f"{name} is {val!r}")
                elif isinstance(val, (int, float, str)):
                    checks.append(f"type({name}) is {type(val).__name__} and {name} == {self.lit(val)}")
                else:
                    checks.append(f"{name} == {self.lit(val)}")
        self.g["_Tensor"] = torch.Tensor
        if checks:
            self.w("if not (" + "\n            and ".join(checks) + "):")
            self.w(f"return _miss({', '.join(params)})", 2)
        self.w("nt = _nthreads()")
        for buf in lw.buffers:
            if buf.role == "input":
                self.py[id(buf)] = buf.name
            elif buf.role == "param":
                owner, attr = lw.param_exprs[id(buf)]
                self.w(f"{buf.name} = {self.const(owner, '_mod')}.{attr}")
                self.py[id(buf)] = buf.name
            elif buf.role == "temp":
                self.g[f"_arena_{buf.name}"] = torch.empty_strided(buf.shape, buf.strides, dtype=buf.dtype)
                self.py[id(buf)] = f"_arena_{buf.name}"
            else:
                self.py[id(buf)] = buf.name
        kernel_names = []
        for step in lw.steps:
            if isinstance(step, KernelStep):
                k = step.kernel
                for s in k.stores:
                    b = s.buffer
                    if b.role == "output" and b.name not in self._allocated:
                        self.w(f"{b.name} = _empty({tuple(b.shape)!r}, {tuple(b.strides)!r}, dtype={b.dtype})")
                        self._allocated.add(b.name)
                ptrs = ", ".join(f"{self.py[id(b)]}.data_ptr()" for b in k.buffers())
                kernel_names.append(k.name)
                nodes = ", ".join(k.nodes[:6]) + (" ..." if len(k.nodes) > 6 else "")
                self.w(f"_{k.name}({ptrs}, nt)  # {k.name} ({k.kind}): {nodes}")
            else:
                self.extern(step)
        self.w(f"return {self.lit(lw.outputs)}")
        return WrapperSource("\n".join(self.lines) + "\n", self.g, kernel_names)

    _done: set

    def extern(self, step: ExternStep) -> None:
        args = [self.lit(a) for a in step.args] + [f"{k}={self.lit(v)}" for k, v in step.kwargs.items()]
        where = step.node.meta.get("source")
        comment = f"  # {step.label or 'torch'}: {step.node.name}" + (f"  ({where})" if where else "")
        if step.kind == "function":
            name = importable_name(step.target)
            fn = name if name and name.split(".")[0] in ("torch", "operator") else self.const(step.target, "_fn")
            if name and name.startswith("operator."):
                self.g["operator"] = __import__("operator")
            call = f"{fn}({', '.join(args)})"
        elif step.kind == "method":
            call = f"{args[0]}.{step.target}({', '.join(args[1:])})"
        elif step.kind == "module":
            call = f"{self.const(step.target, '_mod')}({', '.join(args)})"
        else:  # attr
            owner, _, attr = step.target.rpartition(".")
            mod = self.lw.gm.get_submodule(owner) if owner else self.lw.gm
            call = f"{self.const(mod, '_mod')}.{attr}"
        self.w(f"{step.result} = {call}{comment}")
        for expr_name, buf in step.out_buffers:
            if expr_name != step.result:
                idx = expr_name.rsplit("_", 1)[1]
                self.w(f"{expr_name} = {step.result}[{idx}]")
            if buf.role == "extern":
                self.w(f"{expr_name} = _fix({expr_name}, {tuple(buf.shape)!r}, {tuple(buf.strides)!r})")
            self.py[id(buf)] = expr_name


def _fix(t, shape, strides):
    """Torch ops normally return the layout recorded when lowering; if one does not, copy into
    that layout (kernels index with the recorded strides)."""
    if isinstance(t, torch.Tensor) and t.stride() != strides:
        out = torch.empty_strided(shape, strides, dtype=t.dtype)
        out.copy_(t)
        return out
    return t


def generate(lw: Lowering) -> WrapperSource:
    gen = _Gen(lw)
    gen._done = set()
    src = gen.generate()
    src.globals["_fix"] = _fix
    return src
