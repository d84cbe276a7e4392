"""Tensors the program holds from outside the trace and writes in place.

A default argument (``def f(x=torch.zeros(2))``), a global tensor or a plain object's tensor
is not an input: traced code meets the real tensor. Reading it bakes its value in as a
constant; but an in-place write (``x.add_(1)``, ``x[0] = 1``, ``out=x``) is state the next call
must see, as in eager. From its first write on, such a tensor is used through a node that reads
the very object when the graph runs, so the graph's writes persist; tracing works on a copy
and the user's tensor is left as it was. A tensor read by a trace-time computation before
being written cannot be both a constant and live state: that trace is refused.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..errors import TraceError
from ..graph.source import user_location
from ..graph.tree import tree_iter, tree_map
from ..proxy import NO_VALUE, Proxy
from .values import _no_torch_function

_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})


def written_tensors(func: Callable, args: tuple, kwargs: dict) -> list:
    """The tensors among ``func``'s arguments that calling it writes (in place or ``out=``)."""
    name = getattr(func, "__name__", "")
    out = []
    if args and isinstance(args[0], torch.Tensor) and (
            name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))):
        out.append(args[0])
    dest = kwargs.get("out")
    if isinstance(dest, torch.Tensor):
        out.append(dest)
    elif isinstance(dest, (tuple, list)):
        out.extend(t for t in dest if isinstance(t, torch.Tensor))
    return out


class OutsideTensors:
    """Tracer part: outside tensors taken over once the program writes them (see module doc)."""

    _outside: Dict[int, Tuple[torch.Tensor, Proxy]]
    _outside_reads: Dict[int, Tuple[torch.Tensor, Any]]
    _made_here: Dict[int, torch.Tensor]

    def outside_call(self, func: Callable, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        """A torch call on real tensors only: ``(args, kwargs)`` with outside tensors that are
        taken over replaced by their proxies (the call is then recorded), or None to run it now."""
        self.take_over_written(func, args, kwargs)
        if not self._outside:
            self._note_reads(args)
            return None
        return self._substitute(args, kwargs)

    def take_over_written(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """Take over the outside tensors among the ones ``func`` writes."""
        for t in written_tensors(func, args, kwargs):
            if type(t) is not Proxy:
                self._take_over(t)

    def substitute_outside(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        """``(args, kwargs)`` of a recorded call with taken-over tensors replaced by proxies."""
        if not self._outside:
            return args, kwargs
        return self._substitute(args, kwargs) or (args, kwargs)

    def outside_proxy(self, t: torch.Tensor) -> Optional[Proxy]:
        hit = self._outside.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else None

    def made_while_tracing(self, result: Any) -> Any:
        """Note a tensor a trace-time computation made: it is the program's own, not outside."""
        if isinstance(result, torch.Tensor):
            self._made_here[id(result)] = result
        return result

    def _take_over(self, t: torch.Tensor) -> None:
        if self.outside_proxy(t) is not None:
            return
        if self._made_here.get(id(t)) is t:  # made by this trace: written as the program goes
            return
        read = self._outside_reads.get(id(t))
        loc = user_location(4)
        if read is not None and read[0] is t:
            raise TraceError(
                f"the program writes, at {loc.describe() if loc else 'an unknown line'}, a tensor it holds from "
                f"outside its inputs (a default argument, a global or an object's attribute) that it already "
                f"read at {read[1].describe() if read[1] else 'an earlier line'}: the graph cannot both keep "
                "the value it read and follow the tensor's later state. Pass the tensor as an input, or make "
                "it a buffer of the module.")
        value = NO_VALUE
        if self.has_values:
            with _no_torch_function():
                value = t.detach().clone()
        p = Proxy(self._constant(t), self, value, None, torch.Tensor)
        self._outside[id(t)] = (t, p)

    def _note_reads(self, args: tuple) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and id(a) not in self._outside_reads and id(a) not in self._made_here:
                self._outside_reads[id(a)] = (a, user_location(4))

    def _substitute(self, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        found = [p for t in tree_iter((args, kwargs)) if isinstance(t, torch.Tensor) and type(t) is not Proxy
                 for p in (self.outside_proxy(t),) if p is not None]
        if not found:
            return None

        def sub(a):
            if isinstance(a, torch.Tensor) and type(a) is not Proxy:
                p = self.outside_proxy(a)
                return a if p is None else p
            return a

        return tree_map(sub, args), tree_map(sub, kwargs)
