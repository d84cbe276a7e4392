"""The module hierarchy as a flat list of module records.

A record holds the module's class (by allow-listed name), ``training``, its parameters and
buffers (tensor references), which buffers are non-persistent, its children (record indices;
a module used twice is one record), and its plain attributes (numbers, strings, tuples, lists,
dicts, dtypes, devices, tensors, allow-listed functions...). A GraphModule record also holds
its graph, class name and ``meta``. Loading rebuilds each module with ``cls.__new__`` and
``nn.Module.__init__`` and restores that state: no ``__init__`` of the saved class runs.
"""
from __future__ import annotations

import keyword
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..graph.graph_module import GraphModule
from .allowlist import how_to_register, import_helper_modules, module_class_name, resolve_module_class
from .errors import SerializationError
from .graphcodec import check_targets, decode_graph, encode_graph
from .values import Decoder, Encoder, Unencodable

__all__ = ["ModuleWriter", "ModuleReader"]

_INTERNAL = frozenset(vars(nn.Module()))
_HOOKS = tuple(sorted(k for k in _INTERNAL if "hook" in k and k != "_is_full_backward_hook"))
_GM_OWN = frozenset({"_graph", "_code", "forward", "_guard_root", "_class_name", "meta"})
# attributes derived from others, rebuilt on load instead of saved: {name: owner class}
_DERIVED = {"_flat_weight_refs": nn.RNNBase}
MAX_MODULES = 1_000_000


def _describe(m: nn.Module, path: str) -> str:
    return f"module {path or '<root>'!r} ({type(m).__name__})"


class ModuleWriter:
    """Collects the module tree below a GraphModule into records."""

    def __init__(self, tensors, dropped_node_meta: Dict[str, int], dropped_module_meta: List[str]):
        self.tensors = tensors
        self.records: List[Optional[dict]] = []
        self._ids: Dict[int, int] = {}
        self._keep: List[nn.Module] = []
        self.dropped_node_meta = dropped_node_meta
        self.dropped_module_meta = dropped_module_meta

    def add(self, m: nn.Module, path: str) -> int:
        hit = self._ids.get(id(m))
        if hit is not None:
            return hit
        where = _describe(m, path)
        cls_name = module_class_name(type(m))
        if cls_name is None:
            raise SerializationError(
                f"cannot save {where}: its class {type(m).__module__}.{type(m).__qualname__} is neither a "
                f"torch.nn layer nor registered; {how_to_register(type(m))} (it is rebuilt from its "
                "parameters, buffers and plain attributes without calling __init__)")
        idx = len(self.records)
        self._ids[id(m)] = idx
        self._keep.append(m)
        self.records.append(None)
        d = m.__dict__
        busy = [k for k in _HOOKS if d.get(k)]
        if busy:
            raise SerializationError(f"cannot save {where}: it has hooks registered ({', '.join(busy)}); hooks "
                                     "are code and are not saved. Remove them before saving")
        enc = Encoder(self.tensors, None)
        rec: Dict[str, Any] = {"class": cls_name, "training": bool(m.training)}
        rec["parameters"] = {k: (None if p is None else self._tensor(p, f"{where} parameter {k!r}", param=True))
                             for k, p in d["_parameters"].items()}
        rec["buffers"] = {k: (None if b is None else self._tensor(b, f"{where} buffer {k!r}"))
                          for k, b in d["_buffers"].items()}
        rec["non_persistent"] = sorted(d["_non_persistent_buffers_set"])
        is_gm = isinstance(m, GraphModule)
        own = _GM_OWN | frozenset(getattr(type(m), "saved_without", ())) if is_gm else ()
        attrs = {}
        for k, v in d.items():
            if k in _INTERNAL or k in own:
                continue
            if k == "forward" or k.startswith("__"):
                raise SerializationError(f"cannot save {where}: its instance attribute {k!r} replaces a method "
                                         "(code is not saved)")
            owner = _DERIVED.get(k)
            if owner is not None and isinstance(m, owner):
                continue
            try:
                attrs[k] = enc(v, f"attribute {k!r}")
            except Unencodable as e:
                raise SerializationError(f"cannot save {where}: {e}") from None
        rec["attributes"] = attrs
        rec["modules"] = {k: (None if c is None else self.add(c, f"{path}.{k}" if path else k))
                          for k, c in d["_modules"].items()}
        if is_gm:
            rec["class_name"] = str(d.get("_class_name", "GraphModule"))
            rec["graph"] = encode_graph(m.graph, self.tensors, self.dropped_node_meta)
            meta = {}
            for k, v in m.meta.items():
                try:
                    if type(k) is not str:
                        raise Unencodable("non-string key")
                    meta[k] = enc(v, f"meta[{k!r}]")
                except Unencodable:
                    self.dropped_module_meta.append(f"{path or '<root>'}.meta[{k!r}]")
            rec["meta"] = meta
            guard_root = d.get("_guard_root")
            if guard_root is not None:  # where its entry guards read module state (split_module, capture)
                try:
                    rec["guard_root"] = self.add(guard_root, f"{path}.guard_root" if path else "guard_root")
                except SerializationError as e:
                    raise SerializationError(
                        f"cannot save {where}: its entry guards read module state from guard_root, which cannot "
                        f"be saved ({e}); set guard_root = None first if the module's own state is meant") from None
        self.records[idx] = rec
        return idx

    def _tensor(self, t: Any, where: str, param: bool = False) -> int:
        if not isinstance(t, nn.Parameter if param else torch.Tensor):
            raise SerializationError(f"cannot save {where}: it is a {type(t).__name__}, not a "
                                     f"{'Parameter' if param else 'tensor'}")
        return self.tensors.add(t, f"cannot save {where}")


class ModuleReader:
    """Rebuilds modules from their records (each record once; cycles are refused)."""

    def __init__(self, records: Any, tensors, version: int = 2):
        if not isinstance(records, list) or not records or len(records) > MAX_MODULES:
            raise SerializationError("the module table must be a non-empty list")
        self.version = version
        import_helper_modules()  # symtrace's own graph helpers resolve even if nothing imported them yet
        self.records = records
        self.tensors = tensors
        self._built: Dict[int, nn.Module] = {}
        self._busy: set = set()
        self._guard_roots: List[tuple] = []

    def build_root(self, idx: Any) -> nn.Module:
        """Build the root module, then attach guard roots (which may point anywhere in the tree)."""
        root = self.build(idx)
        while self._guard_roots:
            gm, ref = self._guard_roots.pop()
            gm.guard_root = self.build(ref, "guard_root")
        return root

    def build(self, idx: Any, path: str = "") -> nn.Module:
        if type(idx) is not int or not 0 <= idx < len(self.records):
            raise SerializationError(f"module {path or '<root>'!r}: module reference {idx!r} is out of range")
        hit = self._built.get(idx)
        if hit is not None:
            return hit
        if idx in self._busy:
            raise SerializationError(f"module {path!r}: the module tree contains a cycle")
        self._busy.add(idx)
        m = self._build(self.records[idx], path)
        self._busy.discard(idx)
        self._built[idx] = m
        return m

    def _build(self, rec: Any, path: str) -> nn.Module:
        where = f"module {path or '<root>'!r}"
        if not isinstance(rec, dict):
            raise SerializationError(f"{where}: the record is not an object")
        cls = resolve_module_class(rec.get("class"))
        where = f"{where} ({cls.__name__})"
        training = rec.get("training", True)
        params, buffers, modules, attrs = (rec.get(k, {}) for k in ("parameters", "buffers", "modules", "attributes"))
        non_persistent = rec.get("non_persistent", [])
        if type(training) is not bool or not all(isinstance(x, dict) for x in (params, buffers, modules, attrs)) \
                or not isinstance(non_persistent, list):
            raise SerializationError(f"{where}: malformed module record")
        for table in (params, buffers, modules):
            for k in table:
                if not k or "." in k or k.startswith("__"):
                    raise SerializationError(f"{where}: {k!r} is not a valid member name")
        own = _GM_OWN if issubclass(cls, GraphModule) else {"forward"}
        for k in attrs:
            if not k or k.startswith("__") or k in _INTERNAL or k in own:
                raise SerializationError(f"{where}: {k!r} is not a valid attribute name")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.training = training
        d = m.__dict__
        for k, ref in params.items():
            p = None if ref is None else self.tensors.get(ref, f"{where} parameter {k!r}")
            if p is not None and not isinstance(p, nn.Parameter):
                raise SerializationError(f"{where}: parameter {k!r} is not saved as a Parameter")
            d["_parameters"][k] = p
        for k, ref in buffers.items():
            d["_buffers"][k] = None if ref is None else self.tensors.get(ref, f"{where} buffer {k!r}")
        if not all(isinstance(k, str) and k in buffers for k in non_persistent):
            raise SerializationError(f"{where}: non_persistent names a buffer it does not have")
        d["_non_persistent_buffers_set"] = set(non_persistent)
        dec = Decoder(self.tensors, None)
        for k, v in attrs.items():
            d[k] = dec(v, f"{where} attribute {k!r}")
        for k, ref in modules.items():
            d["_modules"][k] = None if ref is None else self.build(ref, f"{path}.{k}" if path else k)
        if isinstance(m, nn.RNNBase) and isinstance(d.get("_flat_weights"), list):
            d["_flat_weight_refs"] = [weakref.ref(w) if w is not None else None for w in d["_flat_weights"]]
        if cls is GraphModule or isinstance(m, GraphModule):
            self._graph_module(m, rec, where)
        elif "graph" in rec:
            raise SerializationError(f"{where}: only GraphModules hold a graph")
        return m

    def _graph_module(self, m: GraphModule, rec: dict, where: str) -> None:
        class_name, meta = rec.get("class_name", "GraphModule"), rec.get("meta", {})
        if not isinstance(class_name, str) or not isinstance(meta, dict):
            raise SerializationError(f"{where}: class_name must be a string and meta an object")
        if not (class_name.isidentifier() and not keyword.iskeyword(class_name)):
            raise SerializationError(f"{where}: the class name {class_name[:60]!r} is not a Python identifier")
        graph = decode_graph(rec.get("graph"), self.tensors, where, self.version)
        check_targets(graph, m, where)
        dec = Decoder(self.tensors, None)
        d = m.__dict__
        d["_class_name"] = class_name
        d["meta"] = {k: dec(v, f"{where} meta[{k!r}]") for k, v in meta.items()}
        d["_graph"] = None
        d["_code"] = None
        m.graph = graph
        if "guard_root" in rec:
            self._guard_roots.append((m, rec["guard_root"]))
