"""Python decisions on traced values: entry guards, data guards, and the concrete answers
(``bool``, ``int``, ``len``, iteration, ``str``, ``hash``) a program's Python needs."""
from __future__ import annotations

import dis
import operator
import sys
from typing import Any, Callable, Optional

import torch

from ..errors import TraceError
from ..graph.guard_expr import Call, GExpr, Input
from ..graph.guards import Guard, check_data_guard
from ..graph.source import SourceLocation, _is_internal, user_location
from ..proxy import NO_VALUE, Attribute, Proxy
from .values import _guard_kind, _no_torch_function


class Decisions:
    """The part of :class:`~symtrace.trace.tracer.Tracer` that answers Python's questions
    about traced values and records each answer as a guard."""

    # --- guards --------------------------------------------------------------------------
    def add_entry_guard(self, expr: GExpr, expected: Any, check: str, reason: str,
                        kind: Optional[str] = None, source: Optional[SourceLocation] = None) -> None:
        key = (expr, check, repr(expected))
        known = self._guard_keys.get(key)
        if known is not None:
            if source is not None and known.source == self._input_loc and source != self._input_loc:
                known.source, known.reason = source, reason  # a decision in the user's code relies on it
            return
        guard = Guard(kind or _guard_kind(expr), expr, expected, check, source, reason)
        self._guard_keys[key] = guard
        self.graph.guards.append(guard)

    def class_read(self, proxy: Proxy, cls: type) -> None:
        """Python code read ``x.__class__`` of a traced tensor: an input's exact class is then
        guarded (a Parameter and a plain tensor answer differently)."""
        expr = object.__getattribute__(proxy, "expr")
        if expr is None and proxy.node.op == "placeholder":  # (symbolic mode: an input's class is unknown)
            expr = Input(proxy.node.name)
        if expr is not None:
            self.add_entry_guard(Call("type", (expr,)), cls, "is", "reading .__class__ of a traced tensor",
                                 kind="type", source=user_location(3))

    def module_class_read(self, path: str, cls: type) -> None:
        """Python code read ``.__class__`` of the submodule at ``path``: its class is guarded
        (see :meth:`settle_class_guards` for where)."""
        self.add_entry_guard(Call("type", (self.state_path(path),)), cls, "is", "reading .__class__ of a submodule",
                             kind="type", source=user_location(3))
        guard = self._guard_keys.get((Call("type", (self.state_path(path),)), "is", repr(cls)))
        if guard is not None:
            self._class_guards.append((path, guard))

    def settle_class_guards(self, graph) -> None:
        """A submodule the graph calls (``call_module``) is held by the GraphModule as it is, so
        its class guard is checked on every call (swapping it for another class refuses). One it
        traced through is not held, or only as a plain container: its class guard is checked only
        against the live model (``capture``)."""
        called = {n.target for n in graph.nodes if n.op == "call_module"}
        for path, guard in self._class_guards:
            if path not in called:
                guard.kind = "structure"

    def add_guard(self, proxy: Proxy, check: str, expected: Any, reason: str) -> None:
        """Record that tracing relied on ``proxy`` having this value: at entry when it depends only
        on input metadata and module state, else as a data-guard node right after it."""
        loc = user_location(2)
        entry_check = {"bool": "bool", "int": "eq", "float": "eq", "eq": "eq", "is": "is"}.get(check)
        if proxy.expr is not None and entry_check is not None:
            self.add_entry_guard(proxy.expr, expected, entry_check, reason, source=loc)
            return
        key = (proxy.node, check)
        if key in self._data_guarded:
            return
        self._data_guarded.add(key)
        text = loc.line() if loc is not None else ""
        desc = f"{proxy.node.name}" + (f" (from `{text}`)" if text else "")
        guard = Guard("data", desc, expected, check, loc, reason)
        node = self.graph.create_node("call_function", check_data_guard, (proxy.node, guard),
                                      name=f"guard_{proxy.node.name}",
                                      meta={"source": loc} if loc is not None else {})
        del node

    def force(self, proxy: Proxy, kind: str) -> Any:
        """A Python-level decision needs the concrete value of ``proxy``: return it and guard it."""
        reason = {"bool": "bool() of a traced value (an `if`, `while`, `and`/`or` or `assert`)",
                  "int": "int() or indexing with a traced value",
                  "float": "float() of a traced value"}[kind]
        value = proxy.value
        if value is NO_VALUE:
            loc = user_location(2)
            where = loc.describe() if loc is not None else "an unknown line"
            raise TraceError(
                f"{reason} needs a concrete value at {where}, but the tracer has only a symbol "
                f"({proxy.node.name}) there. Pass example inputs (symbolic_trace(model, "
                "example_inputs=(...))) so the decision is taken and guarded, use concrete_args "
                "for a Python argument, or make the code a leaf (symtrace.leaf_function).")
        with _no_torch_function():
            result = {"bool": bool, "int": operator.index if not isinstance(value, (float, torch.Tensor)) else int,
                      "float": float}[kind](value)
        self.add_guard(proxy, kind, result, reason)
        return result

    def _concrete(self, proxy: Proxy, reason: str) -> Any:
        value = proxy.value
        self.add_guard(proxy, "is" if isinstance(value, (torch.dtype, bool)) or value is None else "eq",
                       value, reason)
        return value

    def proxy_text(self, proxy: Proxy, to_text: Callable[[Any], str]) -> str:
        """``str()``/``format()`` of a traced value. A Python value (a size, an ``.item()``)
        is specialised and guarded, since the text may steer the program (dict keys, names);
        a tensor's text is only for printing and is not guarded (noted for ``explain``)."""
        value = proxy.value
        if value is NO_VALUE:
            guess = proxy.guess
            name = proxy.attr if type(proxy) is Attribute else proxy.node.name
            if guess is None or not issubclass(guess, torch.Tensor):  # a size, dtype, number...: text steers
                loc = user_location(3)
                raise TraceError(
                    f"str() or format() of the traced value {name} needs its concrete value at "
                    f"{loc.describe() if loc is not None else 'an unknown line'}, but without example "
                    "inputs the tracer has only a symbol. Pass example_inputs=(...) to symbolic_trace, "
                    "so the text is computed and guarded.")
            self.note("text", f"str() of the traced tensor {name} gives a placeholder text without example "
                      "inputs", user_location(3))
            return f"Proxy({name})"
        if isinstance(value, torch.Tensor):
            self.note("text", f"str() of the traced tensor {proxy.node.name} shows the example value "
                      "(not guarded)", user_location(3))
        else:
            self.add_guard(proxy, "eq", value, "str() or format() of a traced value")
        with _no_torch_function():
            return to_text(value)

    def proxy_hash(self, proxy: Proxy) -> int:
        """``hash()`` of a traced value: identity for tensors (as for real tensors); a Python
        value is specialised and guarded, so ``n in {2, 4}`` and dict lookups work."""
        value = proxy.value
        if value is NO_VALUE:
            guess = proxy.guess
            if guess is None or not issubclass(guess, torch.Tensor):  # a size or number: equality matters
                loc = user_location(3)
                raise TraceError(
                    f"hashing the traced value {proxy.node.name} (a set or dict lookup) needs its concrete "
                    f"value at {loc.describe() if loc is not None else 'an unknown line'}, but without "
                    "example inputs the tracer has only a symbol. Pass example_inputs=(...) to "
                    "symbolic_trace.")
            return object.__hash__(proxy)
        if isinstance(value, torch.Tensor):
            return object.__hash__(proxy)
        self.add_guard(proxy, "eq", value, "hashing a traced value (a set or dict lookup)")
        return hash(value)

    def proxy_len(self, proxy: Proxy) -> int:
        if proxy.value is NO_VALUE:
            return self.force(self.call_function(len, (proxy,)), "int")
        return self.force(self.call_function(len, (proxy,)), "int")

    def proxy_iter(self, proxy: Proxy):
        if proxy.value is NO_VALUE:
            n = _unpack_count(sys._getframe(2))
            if n is None:
                loc = user_location(2)
                raise TraceError(
                    f"iterating over the traced value {proxy.node.name!r} at "
                    f"{loc.describe() if loc else 'an unknown line'} needs its length, which is unknown "
                    "without example inputs. Pass example_inputs=... to symbolic_trace.")
            self.add_guard(self.call_function(len, (proxy,)), "eq", n, "unpacking a traced value")
            return iter([self.call_function(operator.getitem, (proxy, i)) for i in range(n)])
        n = self.force(self.call_function(len, (proxy,)), "int")
        value = proxy.value
        if isinstance(value, dict):
            return iter(list(value.keys()))
        return iter([self.call_function(operator.getitem, (proxy, i)) for i in range(n)])


def _unpack_count(frame) -> Optional[int]:
    """If ``frame`` is executing ``a, b = value``, how many names it unpacks into."""
    while frame is not None and _is_internal(frame.f_code):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code.co_code
    i = frame.f_lasti
    if i + 1 < len(code) and dis.opname[code[i]] == "UNPACK_SEQUENCE":
        return code[i + 1]
    return None
