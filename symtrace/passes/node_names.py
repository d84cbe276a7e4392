"""torchvision's names for the nodes of a traced graph (:func:`graph_node_names`), the names
:func:`~symtrace.passes.feature_extraction.create_feature_extractor` takes.

A ``call_module`` node is its module's path (``layer1.0.conv1``); any other node is the path of
the module whose ``forward`` made it plus its operation as torch.fx spells a node
(``layer1.0.add``, ``flatten``, ``encoder.encoder_pos_embedding`` for a parameter read); a name
seen before gets ``_1``, ``_2``... (``layer1.0.relu_1``). Only what torch.fx would record is
named (see :func:`graph_node_names`).
"""
from __future__ import annotations

import operator
import re
from typing import Any, Dict, Optional

from torch import nn

from ..graph.graph import Graph
from ..graph.graph_module import resolve_attr
from ..graph.node import Node

__all__ = ["graph_node_names"]

_CAMEL = re.compile(r"(?<=[a-z])([A-Z])")
_NOT_IDENT = re.compile(r"[^0-9a-zA-Z_]+")
_NUMBERED = re.compile(r".+_[0-9]+$")
#: ``x += y`` records ``operator.iadd``; torch.fx (so torchvision) names it ``add``
_INPLACE_OPERATORS = {getattr(operator, f"i{op}"): op for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
    "rshift")}


def _op_name(node: Node) -> str:
    """The operation's part of a node's name, spelt as torch.fx names the node (snake case, an
    identifier) before it adds a counter."""
    t = node.target
    if node.op == "call_function":
        text = _INPLACE_OPERATORS.get(t) if _hashable(t) else None
        text = text or getattr(t, "__name__", None) or type(t).__name__
    else:
        text = str(t)
        if node.op == "call_method" and text.startswith("__") and text.endswith("__"):
            text = text[2:-2]
    text = _CAMEL.sub(r"_\1", text).lower()
    if not re.fullmatch(r"[a-zA-Z_][0-9a-zA-Z_]*", text):
        text = _NOT_IDENT.sub("_", text) or "_unnamed"
        if text[0].isdigit():
            text = "_" + text
    return text


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _named(node: Node, root: Optional[nn.Module]) -> bool:
    """Whether a node is one of the model's own operations (what torchvision names): not the
    output, a read of anything but a parameter (torch.fx makes buffers and tensor attributes
    constants), a data guard or replayed side effect, the construction of a container the
    program returned (a namedtuple, a dataclass), ``len`` (torch.fx cannot record it), or an
    attribute read nothing uses (``x.device`` read and dropped)."""
    op = node.op
    if op == "output":
        return False
    if op == "get_attr":
        if "module_path" not in node.meta:  # (constants the tracer made)
            return False
        return root is None or isinstance(resolve_attr(root, node.target)[0], nn.Parameter)
    if op == "call_function":
        t = node.target
        if t is getattr and not node.users:  # torch.fx makes an attribute read a node when used
            return False
        return not (isinstance(t, type) or t is len  # (len: how the tracer unpacks a traced tuple)
                    or (getattr(t, "__module__", None) or "").startswith("symtrace."))
    return True


def graph_node_names(graph: Graph, root: Optional[nn.Module] = None) -> Dict[Node, str]:
    """The torchvision-style name of each nameable node of ``graph`` (a graph traced by
    symtrace, whose nodes carry ``meta["module_path"]``), in graph order. With the module that
    ``get_attr`` targets name (``root``), reads of buffers are not named, and a module held under
    several names is named by the first (``named_modules()``'s), as in torchvision.

    Only what torch.fx would record is named: inputs, parameter reads, module calls, and
    operations on at least one of those or their results (torch.fx computes an operation on
    buffers and constants alone, ``self.index.view(-1)`` or ``torch.arange(n)``, while tracing)."""
    names: Dict[Node, str] = {}
    counts: Dict[str, int] = {}
    paths = _Paths(root)
    for node in graph.nodes:
        if not _named(node, root):
            continue
        if node.op in ("call_function", "call_method") and not any(n in names for n in node.all_input_nodes):
            continue
        path = paths(node.meta.get("module_path") or "")
        if node.op == "call_module":
            name = path or str(node.target)
        else:
            name = f"{path}.{_op_name(node)}" if path else _op_name(node)
        if _NUMBERED.match(name):  # torchvision drops one trailing _<digits> (torch.fx's counter)
            name = name.rsplit("_", 1)[0]
        seen = counts.get(name)
        counts[name] = 0 if seen is None else seen + 1
        names[node] = name if seen is None else f"{name}_{seen + 1}"
    return names


class _Paths:
    """A module's name for naming: the first of its paths below ``root`` (torch.fx's
    ``path_of_module``), for a module reached by another (a block shared by two stages)."""

    def __init__(self, root: Optional[nn.Module]):
        self.root = root
        self.first: Optional[Dict[int, str]] = None
        self.cache: Dict[str, str] = {}

    def __call__(self, path: str) -> str:
        if not path or self.root is None:
            return path
        hit = self.cache.get(path)
        if hit is None:
            if self.first is None:
                self.first = {}
                for name, m in self.root.named_modules(remove_duplicate=False):
                    self.first.setdefault(id(m), name)
            try:
                hit = self.first.get(id(self.root.get_submodule(path)), path)
            except AttributeError:
                hit = path
            self.cache[path] = hit
        return hit
