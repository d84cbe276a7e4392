"""``GraphModule``: an ``nn.Module`` that owns a graph and runs it as generated Python.

It holds the submodules, parameters and buffers the graph references (shared with the module
it was made from, as in torch.fx), recompiles lazily after edits, and deep-copies and pickles
by value — the graph itself, with its ``meta`` — without re-tracing.
"""
from __future__ import annotations

import copy
import keyword
import re
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn


from ._gc import gc_paused
from .codegen import compile_python, node_at, python_code
from .graph import Graph
from .source import one_line

__all__ = ["GraphModule", "class_name_from"]


def _is_class_name(name: Any) -> bool:
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def class_name_from(name: Any) -> str:
    """An identifier to name a GraphModule class after ``name`` (a function's ``__name__``...):
    other characters become ``_`` (``<lambda>`` gives ``_lambda_``); ``GraphModule`` when no
    identifier can be made."""
    text = re.sub(r"\W", "_", str(name))[:200]
    if text[:1].isdigit() or keyword.iskeyword(text):
        text = "_" + text
    return text if _is_class_name(text) else "GraphModule"


#: attribute names of nn.Module itself (a submodule by such a name needs torch's checks)
_MODULE_NAMES = frozenset(dir(nn.Module))


def resolve_attr(root: Any, qualified: str) -> Tuple[Any, Optional[str]]:
    """Follow the dotted name ``qualified`` from ``root``: ``(the object there, None)``, or
    ``(the last object reached, the first name missing on it)``."""
    obj = root
    for part in qualified.split("."):
        if not hasattr(obj, part):
            return obj, part
        obj = getattr(obj, part)
    return obj, None


class _Fetcher:
    """Reads qualified names below ``root`` as ``getattr`` chains would, each module prefix
    once (``layer1.0.conv1`` and ``layer1.0.bn1`` share ``layer1.0``) and submodules straight
    from their ``_modules`` dict when no attribute hides them."""

    def __init__(self, root: nn.Module):
        self.prefixes: Dict[str, Any] = {"": root}

    def __call__(self, qualified: str) -> Any:
        prefix, _, last = qualified.rpartition(".")
        return self.step(self.module(prefix), last)

    def module(self, prefix: str) -> Any:
        obj = self.prefixes.get(prefix)
        if obj is None:
            parent, _, last = prefix.rpartition(".")
            obj = self.prefixes[prefix] = self.step(self.module(parent), last)
        return obj

    @staticmethod
    def step(obj: Any, name: str) -> Any:
        d = getattr(obj, "__dict__", None)
        mods = d.get("_modules") if d is not None and isinstance(obj, nn.Module) else None
        if mods is not None and name in mods and name not in d and not hasattr(type(obj), name):
            return mods[name]
        return getattr(obj, name)


class _Installer:
    """Installs objects at qualified names below a new GraphModule, creating plain container
    modules whose ``training`` flags mirror the template's; containers are cached by prefix."""

    def __init__(self, gm: nn.Module, template: Optional[nn.Module]):
        self.containers: Dict[str, Tuple[nn.Module, Optional[nn.Module]]] = {"": (gm, template)}

    def container(self, prefix: str) -> Tuple[nn.Module, Optional[nn.Module]]:
        hit = self.containers.get(prefix)
        if hit is None:
            parent_prefix, _, part = prefix.rpartition(".")
            parent, parent_tmpl = self.container(parent_prefix)
            tmpl = getattr(parent_tmpl, part, None) if parent_tmpl is not None else None
            cur = parent._modules.get(part)
            if cur is None:
                cur = nn.Module()
                if isinstance(tmpl, nn.Module):
                    cur.training = tmpl.training
                parent.add_module(part, cur)
            hit = self.containers[prefix] = (cur, tmpl if isinstance(tmpl, nn.Module) else None)
        return hit

    def install(self, qualified: str, value: Any) -> None:
        prefix, _, last = qualified.rpartition(".")
        cur, tmpl = self.container(prefix)
        if type(cur) is nn.Module and last not in _MODULE_NAMES and last.isidentifier() \
                and last not in cur.__dict__ and last not in cur._modules and last not in cur._parameters \
                and last not in cur._buffers:
            # a plain container made here, and a name nothing else uses: what add_module /
            # register_parameter would do after their checks
            if type(value) is nn.Parameter:
                cur._parameters[last] = value
                return
            if isinstance(value, nn.Module):
                cur._modules[last] = value
                return
        if isinstance(value, nn.Parameter):
            cur.register_parameter(last, value)
        elif isinstance(value, nn.Module):
            cur.add_module(last, value)
        elif isinstance(value, torch.Tensor) and tmpl is not None and last in tmpl._buffers:
            cur.register_buffer(last, value, persistent=last not in tmpl._non_persistent_buffers_set)
        else:
            setattr(cur, last, value)


def _forward_unbound(self, *args, **kwargs):
    """``GraphModule.forward`` read from the class: compiles for ``self`` and runs."""
    return self._compiled_forward()(*args, **kwargs)


class _LazyForward:
    """``GraphModule.forward``: reading it from a module compiles the generated code (once) and
    stores the bound function in the instance, which later reads find first (this is a
    non-data descriptor)."""

    def __get__(self, obj, cls=None):
        if obj is None:
            return _forward_unbound
        return obj._compiled_forward()


class GraphModule(nn.Module):
    """A module whose ``forward`` is generated from ``graph``.

    ``root`` supplies what ``get_attr`` and ``call_module`` nodes name: an ``nn.Module``
    (objects are shared, not copied) or a dict from qualified name to object. Module
    attributes that entry guards read are copied too. After editing ``gm.graph``, the code is
    regenerated on the next call (or on reading :attr:`code`); :meth:`recompile` forces it.

    Compilation is lazy: :meth:`recompile` only generates the source; CPython compiles it (the
    larger cost: ~20 us per node, for its statement and the ``del`` after it) the first time
    ``forward`` is called or read, so edits made by several passes in a row compile once.
    """

    @property
    def guard_root(self) -> Optional[nn.Module]:
        """Where entry guards read module state (default None: this module itself).
        ``capture`` points it at the live model, so its state changes are seen."""
        return self.__dict__.get("_guard_root")

    @guard_root.setter
    def guard_root(self, module: Optional[nn.Module]) -> None:
        self.__dict__["_guard_root"] = module

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "guard_root":  # not a submodule: keep nn.Module from registering it
            self.__dict__["_guard_root"] = value
        else:
            super().__setattr__(name, value)

    def __init__(self, root: Union[nn.Module, Dict[str, Any]], graph: Graph,
                 class_name: str = "GraphModule", attrs: Optional[Dict[str, Any]] = None):
        if not _is_class_name(class_name):
            raise ValueError(f"class_name must be a Python identifier (it names the class in print_readable), "
                             f"got {class_name!r}; symtrace.graph.graph_module.class_name_from makes one from "
                             "any name")
        super().__init__()
        self._class_name = class_name
        #: free-form annotations of the module (e.g. ``trace_notes`` from the tracer)
        self.meta: Dict[str, Any] = {}
        if isinstance(root, nn.Module):
            self.training = root.training
            template = root
            fetch = _Fetcher(root)
        else:
            template = None
            fetch = root.__getitem__
        attrs = attrs or {}
        done = set(attrs)
        installer = _Installer(self, template)
        for node in graph.nodes:
            if node.op in ("get_attr", "call_module") and node.target not in done:
                done.add(node.target)
                try:
                    value = fetch(node.target)
                except (AttributeError, KeyError):
                    raise AttributeError(
                        f"node {node.name!r} ({node.op}) names {node.target!r}, which the root "
                        "module does not have") from None
                installer.install(node.target, value)
        for path, value in attrs.items():
            installer.install(path, value)
        self._graph = None
        self.graph = graph

    # --- the graph and its code ----------------------------------------------------------
    @property
    def graph(self) -> Graph:
        return self._graph

    @graph.setter
    def graph(self, g: Graph) -> None:
        old = self.__dict__.get("_graph")
        if old is not None:
            old._clean.discard(self._invalidate)
        self.__dict__["_graph"] = g
        self._invalidate()

    def _invalidate(self) -> None:
        self.__dict__.pop("forward", None)
        self.__dict__["_code"] = None
        self._graph._clean.discard(self._invalidate)

    def recompile(self):
        """Generate the source of ``forward`` from the graph now; returns the generated code
        (a :class:`~symtrace.graph.codegen.PythonCode`).

        The source is not compiled here: that happens once, on the first call of the module or
        read of ``forward`` (compiled code objects are also cached by source
        text, so an unchanged program compiles once per process)."""
        with gc_paused():
            code = python_code(self._graph)
        d = self.__dict__
        d.pop("forward", None)
        d["_code"] = code
        self._graph._clean.add(self._invalidate)
        return code

    def _compiled_forward(self):
        """The compiled ``forward`` bound to this module (generating and compiling it first if
        needed); stored in the instance so later reads and calls find it directly."""
        d = self.__dict__
        fwd = d.get("forward")
        if fwd is None:
            code = d.get("_code")
            if code is None:
                code = self.recompile()
            with gc_paused():
                fn = compile_python(code)
            fwd = d["forward"] = fn.__get__(self)
        return fwd

    forward = _LazyForward()

    def __call__(self, *args, **kwargs):
        grad = torch.is_grad_enabled()
        try:
            return super().__call__(*args, **kwargs)
        except Exception as e:
            # as a `with torch.no_grad():` block in eager code, a graph that switched grad mode
            # and then raised (a failing guard inside the block) leaves grad mode as it found it
            if torch.is_grad_enabled() != grad:
                torch.set_grad_enabled(grad)
            _annotate_with_node(e, self)
            raise

    @property
    def code(self) -> str:
        """The generated Python source of ``forward``."""
        code = self.__dict__.get("_code")
        if code is None:
            code = self.recompile()
        return code.src

    def print_readable(self, print_output: bool = True) -> str:
        """The module as Python: a class with the generated ``forward``."""
        body = "\n".join("    " + line if line else line for line in self.code.splitlines())
        text = f"class {self._class_name}(torch.nn.Module):\n{body}\n"
        if self._graph.created_by:
            text = f"# made by {one_line(self._graph.created_by)}\n" + text
        if print_output:
            print(text)
        return text

    def print_tabular(self, **kwargs) -> None:
        """Print the graph as a table (opcode, name, target, args, tensor, source)."""
        self._graph.print_tabular(**kwargs)

    def to_dot(self) -> str:
        """The graph as graphviz DOT text (see :func:`symtrace.graph.drawing.to_dot`)."""
        from .drawing import to_dot
        return to_dot(self)

    def draw(self, path: str) -> str:
        """Draw the graph to ``path`` (.svg/.png/.pdf, or DOT text when graphviz's ``dot`` is
        missing); returns the path written."""
        from .drawing import draw
        return draw(self, path)

    def __str__(self) -> str:
        return self.print_readable(print_output=False)

    # --- copying and pickling ------------------------------------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("forward", None)
        state["_code"] = None
        return state

    def __setstate__(self, state):
        graph = state.pop("_graph")
        self.__dict__.update(state)
        self.__dict__["_graph"] = None
        self.graph = graph

    def __deepcopy__(self, memo):
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        state = self.__getstate__()
        with gc_paused():
            new.__setstate__(copy.deepcopy(state, memo))
        return new

    def __copy__(self):
        new = type(self).__new__(type(self))
        state = self.__getstate__()
        state["_graph"] = copy.deepcopy(self._graph)
        new.__setstate__(state)
        return new


def _annotate_with_node(e: BaseException, gm: GraphModule) -> None:
    """Add a note to an exception raised inside generated code: which node, which user line."""
    if getattr(e, "_symtrace_annotated", False):
        return
    tb = e.__traceback__
    node = None
    while tb is not None:
        fn = tb.tb_frame.f_globals.get("forward")
        if tb.tb_frame.f_code.co_filename.startswith("<symtrace-") and fn is not None:
            node = node_at(fn, tb.tb_lineno, tb.tb_lasti, tb.tb_frame.f_code) or node
        tb = tb.tb_next
    if node is None:
        return
    loc = node.meta.get("source")
    where = f" (traced from {loc.describe()})" if loc is not None else ""
    msg = f"while running node {node.name!r} = {node.op}[{node.format_target()}] of a GraphModule{where}"
    try:
        e._symtrace_annotated = True
        e.add_note(msg)
    except AttributeError:  # Python < 3.11, or an exception without __dict__
        pass
