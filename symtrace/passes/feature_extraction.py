"""Feature extraction: a module that returns a model's intermediate values by name, in the
manner of torchvision's ``create_feature_extractor`` / ``get_graph_node_names``.

Nodes are named as torchvision names them (:mod:`.node_names`): ``layer1.0.conv1``,
``layer1.0.add``, ``layer1.0.relu_1``, ``flatten``. torch's layers and ``torchvision.ops``
modules are leaves, and so are functions marked with ``torch.fx.wrap``. A requested name may be
a prefix of names at a ``.``: ``layer1`` selects the last node whose name starts with
``layer1.``.

The model is traced twice, in training and in evaluation mode; the extractor holds both
graphs and runs the one of its current mode (``.train()``/``.eval()`` switch). Each graph is
cut after the last node a requested value needs: what the model computes later is dropped,
including its random draws, in-place writes and running-statistics updates, so a returned
value is the value its node computed (a requested value that a later kept in-place op would
overwrite is copied first).
"""
from __future__ import annotations

import contextlib
import difflib
import sys
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from torch import nn

from ..graph.effects import is_impure
from ..graph.graph import Graph
from ..graph.graph_module import GraphModule, class_name_from, resolve_attr
from ..graph.node import Node
from ..trace import Tracer, leaf_function
from .alias import AliasAnalysis
from .node_names import graph_node_names

__all__ = ["create_feature_extractor", "get_graph_node_names", "FeatureExtractor"]

ReturnNodes = Union[Sequence[str], Mapping[str, str]]


# --- tracing -----------------------------------------------------------------------------------
def _torchvision_leaves() -> Tuple[type, ...]:
    """torchvision keeps its ``torchvision.ops`` modules whole; so do we, when it is loaded."""
    tv_ops = sys.modules.get("torchvision.ops")
    if tv_ops is None:
        return ()
    return tuple(v for v in vars(tv_ops).values() if isinstance(v, type) and issubclass(v, nn.Module))


def _leaf_modules(leaf_modules: Sequence[type], tracer_kwargs: Optional[dict]) -> Tuple[type, ...]:
    extra = dict(tracer_kwargs or {})
    leaves = tuple(leaf_modules) + tuple(extra.pop("leaf_modules", ()))
    if extra:
        raise TypeError(f"tracer_kwargs {sorted(extra)} are torch.fx Tracer options symtrace does not take; only "
                        "'leaf_modules' is understood (for a function to keep as one node, decorate it with "
                        "@symtrace.leaf_function)")
    return leaves + _torchvision_leaves()


class _KeepAllTracer(Tracer):
    keep_unused = True  # unused nodes count in names (``getitem_3`` stays ``getitem_3``)


@contextlib.contextmanager
def _fx_wrapped_functions():
    """Functions a library marked with ``torch.fx.wrap`` (torchvision's Swin attention, say)
    stay one node, as torchvision's tracer keeps them: while tracing, the module globals that
    name them hold a :func:`~symtrace.leaf_function` of them (outside a trace it calls the
    function as before, in any thread)."""
    from torch.fx import _symbolic_trace as fx_trace

    patched = []
    for (_, name), globals_ in list(getattr(fx_trace, "_wrapped_fns_to_patch", {}).items()):
        fn = globals_.get(name)
        if callable(fn) and not hasattr(fn, "__symtrace_leaf__"):
            globals_[name] = leaf_function(fn)
            patched.append((globals_, name, fn))
    try:
        yield
    finally:
        for globals_, name, fn in patched:
            globals_[name] = fn


def _trace(model: nn.Module, training: bool, example_inputs: Any, concrete_args: Optional[dict],
           leaves: Tuple[type, ...]) -> Tuple[Graph, Dict[str, Any]]:
    model.train(training)
    tracer = _KeepAllTracer(leaf_modules=leaves)
    try:
        with _fx_wrapped_functions():
            graph = tracer.trace(model, example_inputs, concrete_args)
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"symtrace: while tracing {type(model).__name__} in {'training' if training else 'eval'} "
                       "mode for feature extraction")
        raise
    return graph, tracer.extra_attrs


def _traced_both(model: nn.Module, example_inputs: Any, concrete_args: Optional[dict], leaves: Tuple[type, ...]):
    """Trace in training and eval mode; the model's modes are restored afterwards."""
    modes = {m: m.training for m in model.modules()}
    try:
        return {mode: _trace(model, mode == "train", example_inputs, concrete_args, leaves)
                for mode in ("train", "eval")}
    finally:
        for m, flag in modes.items():
            m.training = flag


def _warn_differences(names: Dict[str, List[str]]) -> None:
    train, eval_ = names["train"], names["eval"]
    if train == eval_:
        return
    only_train = [n for n in train if n not in set(eval_)]
    only_eval = [n for n in eval_ if n not in set(train)]
    detail = "; ".join(part for part in (
        f"only in training mode: {_some(only_train)}" if only_train else "",
        f"only in eval mode: {_some(only_eval)}" if only_eval else "") if part) or "the same names in another order"
    warnings.warn(f"the model's graph differs between training and eval mode ({detail}); to return different "
                  "nodes per mode, give train_return_nodes and eval_return_nodes", stacklevel=3)


def _some(names: List[str], k: int = 5) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def get_graph_node_names(model: nn.Module, tracer_kwargs: Optional[dict] = None, suppress_diff_warning: bool = False,
                         concrete_args: Optional[dict] = None, *, example_inputs: Any = None,
                         leaf_modules: Sequence[type] = ()) -> Tuple[List[str], List[str]]:
    """The names of ``model``'s nodes in the order they run, traced in training mode and in eval
    mode: ``(train_names, eval_names)``, named as torchvision names them (see
    :mod:`symtrace.passes.feature_extraction`).

    ``example_inputs`` (a tuple of positional or a dict of keyword arguments) lets Python
    decisions on shapes resolve, as for :func:`symtrace.symbolic_trace`; without them tracing is
    symbolic. ``leaf_modules`` (or ``tracer_kwargs={"leaf_modules": [...]}``): module types kept
    as one node. Warns when the two lists differ, unless ``suppress_diff_warning``.

    >>> train_names, eval_names = symtrace.get_graph_node_names(torchvision.models.resnet18())
    >>> eval_names[:5]
    ['x', 'conv1', 'bn1', 'relu', 'maxpool']
    """
    traced = _traced_both(model, example_inputs, concrete_args, _leaf_modules(leaf_modules, tracer_kwargs))
    names = {mode: list(graph_node_names(graph, model).values()) for mode, (graph, _) in traced.items()}
    if not suppress_diff_warning:
        _warn_differences(names)
    return names["train"], names["eval"]


# --- choosing and cutting ----------------------------------------------------------------------
def _as_mapping(spec: ReturnNodes, what: str) -> Dict[str, str]:
    if isinstance(spec, Mapping):
        out = {str(k): str(v) for k, v in spec.items()}
    elif isinstance(spec, (list, tuple)):
        out = {str(k): str(k) for k in spec}
    else:
        raise TypeError(f"{what} must be a list of node names or a dict {{node name: output name}}, "
                        f"got {type(spec).__name__}")
    seen: Dict[str, str] = {}
    for query, key in out.items():
        if key in seen:
            raise ValueError(f"{what} gives the output name {key!r} to both {seen[key]!r} and {query!r}")
        seen[key] = query
    return out


def _select(names: Dict[Node, str], queries: Dict[str, str], mode: str,
            other_names: List[str]) -> Dict[str, Node]:
    """Output name -> node, in graph order: for each query, the last node named by it or below it."""
    last: Dict[str, Node] = {}
    for node, name in names.items():
        for query in queries:
            if name == query or name.startswith(query + "."):
                last[query] = node
    for query in queries:
        if query not in last:
            raise ValueError(_unknown(query, list(names.values()), mode, other_names))
    order = {n: i for i, n in enumerate(names)}
    chosen = sorted(queries, key=lambda q: order[last[q]])
    return {queries[q]: last[q] for q in chosen}


def _unknown(query: str, names: List[str], mode: str, other_names: List[str]) -> str:
    candidates = set(names)
    for n in names:  # module prefixes are valid requests too
        parts = n.split(".")
        candidates.update(".".join(parts[:i]) for i in range(1, len(parts)))
    near = difflib.get_close_matches(query, sorted(candidates), n=5, cutoff=0.6)
    msg = f"node {query!r} is not in the model's {mode}-mode graph"
    if any(n == query or n.startswith(query + ".") for n in other_names):
        msg += (f" (it is in the {'eval' if mode == 'train' else 'training'}-mode graph: give "
                "train_return_nodes and eval_return_nodes separately)")
    if near:
        msg += "; did you mean " + ", ".join(repr(n) for n in near) + "?"
    return msg + " symtrace.get_graph_node_names(model) lists every name."


def _cut(graph: Graph, outputs: Dict[str, Node], module: nn.Module, with_values: bool) -> None:
    """Make ``outputs`` the graph's result and drop every node they do not need: nodes after
    the last needed one, and pure unused nodes before it (effects before it stay, so the
    program runs as the model's does up to there)."""
    out = graph.output_node()
    out.args = (dict(outputs),)
    order = {n: i for i, n in enumerate(graph.nodes)}
    keep = _closure(list(outputs.values()) + [n for n in graph.nodes if n.op == "placeholder"])
    end = max(order[n] for n in keep)
    keep = _closure(list(keep) + [n for n in graph.nodes if order[n] < end and is_impure(n, module)])
    keep.add(out)
    for node in reversed(list(graph.nodes)):
        if node not in keep:
            graph.erase_node(node)
    _copy_overwritten(graph, outputs, module, with_values)


def _closure(roots: List[Node]) -> set:
    seen = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _copy_overwritten(graph: Graph, outputs: Dict[str, Node], module: nn.Module, with_values: bool) -> None:
    """A returned tensor that a later node may write in place (``nn.ReLU(inplace=True)`` after
    a requested ``bn1``) is copied where it is made, so the caller gets the value at its node."""
    aliases = AliasAnalysis(graph, module)
    end = len(aliases.positions)
    copies: Dict[Node, Node] = {}
    for node in outputs.values():
        if node in copies or not aliases.written_between(node, aliases.positions[node], end):
            continue
        if not _may_be_tensor(node, with_values, {}):
            continue
        with graph.inserting_after(node):
            copies[node] = graph.call_method("clone", (node,), meta={
                k: v for k, v in node.meta.items() if k in ("source", "module_path", "tensor_meta")})
    if copies:
        graph.output_node().args = ({k: copies.get(n, n) for k, n in outputs.items()},)


#: what reads of these give is never a tensor
_NOT_TENSOR_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"})
_NOT_TENSOR_METHODS = frozenset({"size", "dim", "numel", "nelement", "stride", "tolist", "item", "__len__",
                                 "element_size", "is_contiguous", "is_floating_point", "data_ptr"})


def _may_be_tensor(node: Node, with_values: bool, memo: Dict[Node, bool]) -> bool:
    """Whether ``node``'s value may be a tensor (or hold tensors). Traced with example values,
    a tensor result has ``tensor_meta``; traced symbolically, shape reads and arithmetic on
    them are not tensors and anything else may be."""
    if with_values:
        return node.meta.get("tensor_meta") is not None
    hit = memo.get(node)
    if hit is not None:
        return hit
    memo[node] = True  # (cycles cannot happen; a default for the recursion)
    t, args = node.target, node.args
    if node.op == "call_method":
        answer = t not in _NOT_TENSOR_METHODS
    elif node.op != "call_function":
        answer = True
    elif t is getattr:
        answer = not (len(args) > 1 and args[1] in _NOT_TENSOR_ATTRS)
    elif t is len:
        answer = False
    elif getattr(t, "__module__", None) in ("_operator", "builtins"):
        answer = any(_may_be_tensor(n, with_values, memo) for n in node.all_input_nodes)
    else:
        answer = True
    memo[node] = answer
    return answer


# --- the module --------------------------------------------------------------------------------
class FeatureExtractor(GraphModule):
    """A :class:`GraphModule` whose graph returns a dict of a model's intermediate values.

    It holds one graph per mode, ``train_graph`` and ``eval_graph``; ``graph`` is the one of the
    current mode, and ``.train()``/``.eval()`` switch it (and, as for any module, the mode of
    the submodules it shares with the model). Edit, print and save it as any GraphModule:
    ``symtrace.save`` writes the graph of the current mode, and loads as a plain GraphModule.
    Creating it leaves the model's modes as they were."""

    #: what symtrace.save leaves out (it saves the module as a GraphModule of ``graph``)
    saved_without = ("train_graph", "eval_graph")

    def __init__(self, root: nn.Module, train_graph: Graph, eval_graph: Graph, attrs: Dict[str, Any],
                 class_name: str = "FeatureExtractor"):
        super().__init__(root, train_graph, class_name=class_name, attrs=attrs)
        self.train_graph = train_graph
        self.eval_graph = eval_graph
        self.training = root.training
        self.graph = train_graph if root.training else eval_graph

    def train(self, mode: bool = True):
        graph = self.__dict__["train_graph" if mode else "eval_graph"]
        if self.graph is not graph:
            self.graph = graph
        return super().train(mode)


def _merged_attrs(root: nn.Module, traced: Dict[str, Tuple[Graph, Dict[str, Any]]]) -> Dict[str, Any]:
    """What the eval graph needs besides what the training graph names (GraphModule installs
    that): its state and extra attributes, its tensor constants renamed where names clash."""
    train_graph, attrs = traced["train"]
    attrs = dict(attrs)
    installed = {n.target for n in train_graph.nodes if n.op in ("get_attr", "call_module")}
    eval_graph, eval_attrs = traced["eval"]
    for node in eval_graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = node.target
        if target in eval_attrs:
            value = eval_attrs[target]
            if target in attrs and attrs[target] is not value:
                node.target = target = _fresh(f"{target}_eval", attrs)
            attrs[target] = value
        elif target not in installed and target not in attrs:
            value, missing = resolve_attr(root, target)
            if missing is not None:
                raise AttributeError(f"the eval-mode graph names {target!r}, which the model does not have")
            attrs[target] = value
    for key, value in eval_attrs.items():
        attrs.setdefault(key, value)
    # a module's ``training`` read while tracing: the extractor's own flags answer it at run time
    return {k: v for k, v in attrs.items() if k.rpartition(".")[2] != "training"}


def _fresh(name: str, taken: Dict[str, Any]) -> str:
    i, base = 0, name
    while name in taken:
        i += 1
        name = f"{base}{i}"
    return name


def create_feature_extractor(model: nn.Module, return_nodes: Optional[ReturnNodes] = None,
                             train_return_nodes: Optional[ReturnNodes] = None,
                             eval_return_nodes: Optional[ReturnNodes] = None, tracer_kwargs: Optional[dict] = None,
                             suppress_diff_warning: bool = False, concrete_args: Optional[dict] = None, *,
                             example_inputs: Any = None, leaf_modules: Sequence[type] = ()) -> FeatureExtractor:
    """A module returning ``{output name: value}`` for chosen nodes of ``model`` (torchvision's
    ``create_feature_extractor``, with the names of :func:`get_graph_node_names`).

    ``return_nodes``: a list of node names, or a dict ``{node name: output name}``; a name may
    be a module path, which selects that module's last node. ``train_return_nodes`` and
    ``eval_return_nodes`` (both, instead of ``return_nodes``) choose per mode. The result is a
    :class:`FeatureExtractor` (a :class:`GraphModule`) sharing ``model``'s parameters; it runs
    only what the chosen values need. ``example_inputs``, ``concrete_args``, ``leaf_modules``
    and ``tracer_kwargs``: as for :func:`get_graph_node_names`.

    >>> body = symtrace.create_feature_extractor(resnet, {"layer1": "feat1", "layer3": "feat2"})
    >>> {k: v.shape for k, v in body(torch.rand(1, 3, 224, 224)).items()}
    {'feat1': torch.Size([1, 64, 56, 56]), 'feat2': torch.Size([1, 256, 14, 14])}
    """
    if return_nodes is None and (train_return_nodes is None or eval_return_nodes is None):
        raise ValueError("give return_nodes, or both train_return_nodes and eval_return_nodes")
    if return_nodes is not None and (train_return_nodes is not None or eval_return_nodes is not None):
        raise ValueError("give either return_nodes or train_return_nodes and eval_return_nodes, not both")
    queries = ({"train": _as_mapping(return_nodes, "return_nodes")} if return_nodes is not None else
               {"train": _as_mapping(train_return_nodes, "train_return_nodes")})
    queries["eval"] = queries["train"] if return_nodes is not None else _as_mapping(eval_return_nodes,
                                                                                     "eval_return_nodes")
    traced = _traced_both(model, example_inputs, concrete_args, _leaf_modules(leaf_modules, tracer_kwargs))
    names = {mode: graph_node_names(graph, model) for mode, (graph, _) in traced.items()}
    listed = {mode: list(n.values()) for mode, n in names.items()}
    if not suppress_diff_warning:
        _warn_differences(listed)
    modes = {m: m.training for m in model.modules()}
    try:
        for mode, (graph, _) in traced.items():
            model.train(mode == "train")  # (what a module does depends on its mode)
            other = listed["eval" if mode == "train" else "train"]
            _cut(graph, _select(names[mode], queries[mode], mode, other), model, example_inputs is not None)
            graph.created_by = "create_feature_extractor"
            graph.lint()
    finally:
        for m, flag in modes.items():
            m.training = flag
    attrs = _merged_attrs(model, traced)
    return FeatureExtractor(model, traced["train"][0], traced["eval"][0], attrs,
                            class_name=class_name_from(type(model).__name__))
