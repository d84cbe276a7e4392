"""The inference pipeline ``lower.compile`` runs before lowering a graph for the CPU.

On a private copy of the graph (the caller's GraphModule and model are never changed;
unchanged modules and tensors are shared):

0. ``expand_transformer_modules`` (:mod:`.transformer_modules`): eval-mode calls of torch's
   ``nn.Transformer``, its encoder and decoder and their layers, without masks, become calls of
   their parts; ``expand_multihead_attention`` (:mod:`.mha_inference`): eval-mode
   ``nn.MultiheadAttention`` calls without masks become their linear layers and
   ``F.scaled_dot_product_attention``, which the steps below and the lowering see into;
   ``drop_no_op_modules``, ``constant_rank_reads``: ``nn.Identity`` and eval-mode dropout module
   calls are removed and ``x.ndim`` reads become constants (between a layer and its batch norm
   or activation they would keep them apart);
1. ``fold_batch_norm``: eval-mode batch norms disappear into the convolution/linear before them;
2. ``constant_folding``: values computed from weights only are computed once; then
   ``fold_channel_scale``: a constant per-output-channel multiply after a convolution or linear
   layer (ConvNeXt's layer scale) folds into its weights; then ``merge_conv_branches``
   (:mod:`~symtrace.passes.merge_branches`): convolutions of one input whose results are summed,
   with batch norms of that input or the input itself (RepVGG's and MobileOne's branches, a
   position encoding's ``conv(x) + x``), become one convolution, for inputs the finite-value
   analysis below shows finite (on an infinity the merged sum may differ from eager's);
3. ``use_onednn`` (:mod:`.onednn`): 2-D convolutions and linear layers with constant fp32
   weights become oneDNN calls with weights packed once and bias, activation and residual add
   as post-ops. Activations whose oneDNN forms differ from eager only on NaN/Inf (relu, relu6,
   hardsigmoid, erf-gelu) are fused where the analysis of
   :class:`~symtrace.passes.finite_values.FiniteValues` shows their input finite whenever the
   graph's inputs are (``nan_exact="guarded"``); the lowered module then checks those inputs
   on each call (one sum per floating-point input) and runs a call whose inputs hold NaN or
   Inf through the caller's graph in torch. Results then differ from eager only where an
   intermediate overflows float32 (eager's NaN may become a number after a fused relu);
   Sibling weight-only quantized linears (``woq_linear`` calls reading one value with one
   scheme) become one call over concatenated weights (:mod:`.woq_merge`), and attention of
   a few query rows over a longer cache (a decoder's step; boolean or float masks) runs
   symtrace's kernel (:mod:`.attention_cpu`); a growing cache's ``cat`` handed back to the
   caller appends in place into spare capacity (:mod:`.kv_append`);
4. layout: a graph with packed convolutions runs channels-last (the packed convolution's
   layout); 4-D graph inputs that feed a convolution are converted once on entry, and 4-D
   outputs are returned in eager's layout (contiguous), so conversions happen only at the edges;
   a ``contiguous()`` copy whose result only reaches packed convolutions (through ``cat`` and
   channel splits: CSPNet's stage ends) is dropped (:func:`drop_layout_copies`); an attention
   call's 3-D mask is given as 4-D (:func:`sdpa_masks_as_4d`: torch's fused CPU kernel instead
   of its math path).

When it applies (:func:`prepare`; ``target="cuda"`` runs steps 1 and 2 only): every module of
the graph in eval mode, no node writes a parameter or buffer, no ``contiguous``/``reshape``/
``flatten``/``reshape_as`` of a value written after it (a view or a copy in eager depending on
its input's strides, which channels-last inside would change), and one of the steps changed
something. The folded and packed
weights are snapshots, so the lowered module checks, on each call, that the parameters and
buffers it snapshotted are still the same tensors at the same version (in-place updates such
as an optimizer step bump the version) and every module still in the mode it had (eval); if not, it runs
the original graph through torch (with a warning: compile again to use the new weights).
Switch: ``compile(..., inference=False)``, or ``InferenceOptions(...)`` for single steps.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from ..graph.effects import layout_dependent_view
from ..graph.graph_module import GraphModule
from ..graph.node import Node
from ..passes.finite_values import FiniteValues
from ..passes.module_hooks import runs_forward_hooks
from .values import dense_in_order

__all__ = ["InferenceOptions", "Prepared", "prepare", "state_check"]


@dataclass(frozen=True)
class InferenceOptions:
    """Which steps of the inference pipeline run (see the module doc)."""

    fold_batch_norm: bool = True
    fold_constants: bool = True
    #: ``layer(x) * c`` with a constant per-output-channel ``c`` (layer scale) folded into the
    #: layer's weights (:mod:`~symtrace.passes.fold_scale`)
    fold_scales: bool = True
    #: convolutions of one input whose results are summed (RepVGG's and MobileOne's branches,
    #: with batch norms of that input or the input itself) as one convolution
    #: (:mod:`~symtrace.passes.merge_branches`); where ``nan_exact`` is ``"guarded"`` only for
    #: inputs finite whenever the graph's are, ``True``: never
    merge_conv_branches: bool = True
    onednn_conv: bool = True
    onednn_linear: bool = True
    #: eval-mode ``nn.Transformer*`` module calls without masks as calls of their parts
    #: (:mod:`.transformer_modules`), and ``nn.MultiheadAttention`` calls without masks as linear
    #: layers around ``F.scaled_dot_product_attention`` (:mod:`.mha_inference`)
    expand_attention_modules: bool = True
    #: attention of a few query rows over a cache (a decoder's step) by symtrace's C kernel
    #: (:mod:`.attention_cpu`) instead of torch's
    decode_attention: bool = True
    #: a growing cache's ``torch.cat([past, new])`` handed back to the caller appends in place
    #: into spare capacity (:mod:`.kv_append`; results share storage, laid out for appending)
    kv_append: bool = True
    #: linear layers reading the same value (q, k, v) become one over concatenated weights (fp32
    #: ones in oneDNN, weight-only quantized ones in one ``woq_linear``: :mod:`.woq_merge`)
    merge_linears: bool = True
    #: where relu, relu6, hardsigmoid and erf-gelu (whose oneDNN forms map NaN to a number or
    #: Inf to NaN) are fused: ``"guarded"`` where their input is finite whenever the graph's
    #: inputs are, which are then checked per call; ``True`` nowhere; ``False`` everywhere
    nan_exact: Any = "guarded"

    def __post_init__(self):
        if self.nan_exact not in (True, False, "guarded"):
            raise ValueError(f"InferenceOptions: nan_exact must be True, False or 'guarded', got {self.nan_exact!r}")


@dataclass
class Prepared:
    """The pipeline's graph and what it did (``notes``, for the report)."""

    gm: GraphModule
    notes: List[str]
    #: positions of the inputs that must be finite for the fused activations to match eager
    #: (checked on each call; see ``nan_exact``)
    finite_inputs: Tuple[int, ...] = ()


def options_from(inference: Any) -> Optional[InferenceOptions]:
    """``compile``'s ``inference`` argument as options (None: the pipeline is off)."""
    if inference is None or inference is True:
        return InferenceOptions()
    if inference is False:
        return None
    if isinstance(inference, InferenceOptions):
        return inference
    raise TypeError(f"symtrace.lower.compile: inference must be True, False or an InferenceOptions, "
                    f"got {type(inference).__name__}")


def why_not(gm: GraphModule) -> Optional[str]:
    """Why the pipeline cannot run on ``gm`` (None: it can)."""
    if gm.training:
        return "the graph module is in training mode"
    for n in gm.graph.find_nodes(op="call_module"):
        try:
            m = gm.get_submodule(n.target)
        except AttributeError:
            return f"module {n.target!r} is missing"
        if any(x.training for x in m.modules()):
            return f"module {n.target!r} is in training mode"
    from ..passes.alias import AliasAnalysis
    alias = AliasAnalysis(gm.graph, gm)
    for n in gm.graph.find_nodes(op="get_attr"):
        if alias.is_written(n):
            return f"the graph writes {n.target!r}"
    n = _layout_dependent_alias_written(gm, alias)
    if n is not None:
        return (f"{n.name} ({n.target if isinstance(n.target, str) else n.target.__name__}: a view or a copy "
                "depending on its input's layout) shares memory with a value written later, and the pipeline's "
                "channels-last layout could turn eager's view into a copy or its copy into a view")
    return None


def _layout_dependent_alias_written(gm: GraphModule, alias) -> Optional[Node]:
    """A ``contiguous``/``reshape``/``flatten``/``reshape_as`` call whose input's memory
    something writes after it; None if there is none. Whether eager's call is a view or a copy
    depends on its input's strides, and the pipeline stores values between convolutions
    channels-last: the write could then reach both names where eager's reaches one, or one
    where eager's reaches both."""
    positions = alias.positions
    end = len(positions)
    for n in gm.graph.nodes:
        if layout_dependent_view(n) and alias.written_between(n.args[0], positions[n], end):
            return n
    return None


def private_copy(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` with its own graph and its own container modules (the plain
    ``nn.Module`` s a GraphModule makes to hold submodules and tensors), so passes may add and
    remove attributes; the user's modules and tensors are shared."""
    new = copy.copy(gm)
    new.__dict__["_modules"] = dict(gm._modules)
    new.__dict__["_parameters"] = dict(gm._parameters)
    new.__dict__["_buffers"] = dict(gm._buffers)
    new.__dict__["_non_persistent_buffers_set"] = set(gm._non_persistent_buffers_set)

    def own(parent: nn.Module) -> None:
        for name, m in list(parent._modules.items()):
            if type(m) is nn.Module:   # a container made by the GraphModule
                c = nn.Module.__new__(nn.Module)
                c.__dict__.update(m.__dict__)
                c.__dict__["_modules"] = dict(m._modules)
                c.__dict__["_parameters"] = dict(m._parameters)
                c.__dict__["_buffers"] = dict(m._buffers)
                c.__dict__["_non_persistent_buffers_set"] = set(m._non_persistent_buffers_set)
                parent._modules[name] = c
                own(c)
    own(new)
    return new


#: torch layers whose forward does not read ``self.training``: their mode needs no check
_MODE_FREE = tuple(c for c in (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear,
    nn.Bilinear, nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
    nn.SiLU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Softmax,
    nn.LogSoftmax, nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", None), nn.Embedding, nn.MaxPool1d,
    nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Flatten, nn.Unflatten, nn.Upsample, nn.PixelShuffle, nn.Sequential, nn.ModuleList, nn.ModuleDict)
    if c is not None)


def state_check(gm: GraphModule, also: Optional[nn.Module] = None) -> Callable[[], bool]:
    """A function answering whether every parameter and buffer of ``gm`` (and of ``also``: the
    pipeline's own copy, whose merged weights lowered kernels read), and every plain tensor
    attribute their graphs read, is still the tensor it is now, at its current version, and every module of ``gm`` whose mode can matter still in the
    mode it is in now. (Made after the lowering's recording run, which may restore buffers in place:
    a new version, same values.) It runs before every call and touches each object it checks,
    cold after a model call (0.4 ms for resnet50's 450), so it leaves out what cannot change an
    inference result: the mode of torch layers that never read it (exactly those classes), and
    a batch norm's ``num_batches_tracked`` (read only in training mode, which is checked).
    Modes the traced code read are guarded in the graph and checked here too."""
    tensors: List[Tuple[dict, str, torch.Tensor]] = []
    seen: set = set()
    for mod in list(gm.modules()) + (list(also.modules()) if also is not None else []):
        batch_norm = isinstance(mod, nn.modules.batchnorm._BatchNorm)
        for d in (mod._parameters, mod._buffers):
            for name, t in d.items():
                if isinstance(t, torch.Tensor) and not (batch_norm and name == "num_batches_tracked") \
                        and (id(d), name) not in seen:
                    seen.add((id(d), name))
                    tensors.append((d, name, t))
    for owner, name, t in _plain_tensor_reads(gm) + (_plain_tensor_reads(also) if isinstance(also, GraphModule) else []):
        d = owner.__dict__
        if (id(d), name) not in seen:   # (an attribute, not a parameter or buffer: the graph reads it
            seen.add((id(d), name))     # with get_attr, and a folded or packed copy would not follow it)
            tensors.append((d, name, t))
    read = _modes_read(gm)
    modules = [m for m in gm.modules() if type(m) is not nn.Module and
               (type(m) not in _MODE_FREE or id(m) in read)]
    g: dict = {}
    terms = []
    for i, (d, name, t) in enumerate(tensors):   # (names as globals: never text in the source)
        g[f"d{i}"], g[f"n{i}"], g[f"t{i}"] = d, name, t
        try:
            version = t._version
        except RuntimeError:   # an inference tensor: no version counter (identity only)
            terms.append(f"d{i}.get(n{i}) is t{i}")
            continue
        terms.append(f"d{i}.get(n{i}) is t{i} and t{i}._version == {int(version)}")
    for i, m in enumerate(modules):
        g[f"m{i}"] = m
        terms.append(f"m{i}.training is {bool(m.training)}")
    src = "def check():\n    return (" + "\n            and ".join(terms or ["True"]) + ")\n"
    exec(compile(src, "<symtrace-inference-state-check>", "exec"), g)
    return g["check"]


def _plain_tensor_reads(gm: GraphModule) -> List[Tuple[nn.Module, str, torch.Tensor]]:
    """The tensors ``gm``'s graph reads with ``get_attr`` that are plain attributes of their
    module (neither a parameter nor a buffer): a program may reassign them (``self.state =
    ...``), and the pipeline's constant folding would keep the value it saw."""
    out = []
    for n in gm.graph.find_nodes(op="get_attr"):
        owner_path, _, name = n.target.rpartition(".")
        try:
            owner = gm.get_submodule(owner_path)
        except AttributeError:
            continue
        t = owner.__dict__.get(name)
        if isinstance(t, torch.Tensor) and name not in owner._parameters and name not in owner._buffers:
            out.append((owner, name, t))
    return out


def _modes_read(gm: GraphModule) -> set:
    """ids of the modules whose ``training`` flag the graph's guards read (``root.a.b.training``,
    ``root.layers.0.training``: a chain of attributes from the root)."""
    out = set()
    for g in gm.graph.guards:
        chain = g.expr.root_chain() if hasattr(g.expr, "root_chain") else None
        if not chain or chain[-1] != "training":
            continue
        try:
            out.add(id(gm.get_submodule(".".join(chain[:-1]))))
        except AttributeError:
            pass
    return out


def prepare(gm: GraphModule, options: InferenceOptions) -> Tuple[Optional[Prepared], str]:
    """Run the pipeline on a private copy of ``gm``: ``(Prepared, "")``, or ``(None, reason)``
    when it does not apply or changed nothing."""
    reason = why_not(gm)
    if reason is not None:
        return None, reason
    from ..passes.const_fold import constant_folding
    from ..passes.fold_bn import fold_batch_norm
    from ..passes.fold_scale import fold_channel_scale
    from ..passes.merge_branches import merge_conv_branches
    from . import onednn
    from .attention_cpu import decode_attention
    from .kv_append import kv_append
    from .mha_inference import expand_multihead_attention
    from .transformer_modules import expand_transformer_modules
    from .woq_merge import merge_sibling_woq
    new = private_copy(gm)
    notes: List[str] = []
    if options.expand_attention_modules:   # (first: what they expand to has dropouts)
        expanded = expand_transformer_modules(new)
        if expanded:
            notes.append(f"{len(expanded)} transformer module call(s) as calls of their parts: "
                         + _first(expanded))
        expanded = expand_multihead_attention(new)
        if expanded:
            notes.append(f"{len(expanded)} nn.MultiheadAttention call(s) as linear layers and SDPA: "
                         + _first(expanded))
    k = drop_no_op_modules(new) + constant_rank_reads(new)
    if k:
        notes.append(f"{k} identity/eval-mode dropout call(s) and rank reads (x.ndim) removed")
    if options.fold_batch_norm:
        k = fold_batch_norm(new)
        if k:
            notes.append(f"{k} batch norm(s) folded into the layer before them")
    if options.fold_constants and constant_folding(new, stored_in_state=True):   # (the state check guards it)
        notes.append("weight-only values computed once (constant folding)")
    if options.fold_scales:
        k = fold_channel_scale(new)
        if k:
            notes.append(f"{k} constant per-channel scale(s) (layer scale) folded into the layer before them")
    if options.kv_append:   # (first: the attention calls still have torch's schema, which says they write nothing)
        appended = kv_append(new)
        if appended:
            notes.append(f"{len(appended)} growing-cache cat(s) append in place into spare capacity: "
                         + _first(appended))
    reshaped = sdpa_masks_as_4d(new)
    if reshaped:
        notes.append(f"{len(reshaped)} attention call(s) with a 3-D mask given it as 4-D (torch's fused kernel "
                     "instead of its math path): " + _first(reshaped))
    if options.decode_attention:
        rewritten = decode_attention(new)
        if rewritten:
            notes.append(f"{len(rewritten)} decode-step attention call(s) (a few query rows) through symtrace's kernel: "
                         + _first(rewritten))
    if options.merge_linears:
        merged = merge_sibling_woq(new)
        if merged:
            notes.append(f"{len(merged)} group(s) of sibling weight-only linears merged into one call each: "
                         + _first(merged))
    finite_inputs: Tuple[int, ...] = ()
    finite = FiniteValues(new, extra=onednn.packed_finite) if options.nan_exact == "guarded" else None
    if options.merge_conv_branches and options.nan_exact is not True:
        merged = merge_conv_branches(new, None if finite is None else finite.holds)
        if merged:
            notes.append(f"{len(merged)} sum(s) of parallel convolution branches merged into one convolution each: "
                         + _first(merged))
    if options.onednn_conv or options.onednn_linear:
        done = onednn.use_onednn(new, nan_exact=options.nan_exact, conv=options.onednn_conv,
                                 linear=options.onednn_linear, merge_linears=options.merge_linears, finite=finite)
        if done:
            notes.append(f"{len(done)} convolution/linear layer(s) through oneDNN with packed weights: "
                         + _first(done, 6))
            shuffled = channel_shuffles(new)
            if shuffled:
                notes.append(f"{shuffled} channel shuffle(s) (view, transpose, contiguous, view) as torch.channel_shuffle, "
                             "channels-last like the convolutions around them")
                joined = shuffle_cats(new)
                if joined:
                    notes.append(f"{joined} cat + channel shuffle pair(s) in one pass of symtrace's kernel")
            dropped = drop_layout_copies(new)
            if dropped:
                notes.append(f"{dropped} contiguous() copies before convolutions dropped (the values are the same; "
                             "they stay channels-last)")
            summed = onednn.accumulate_residuals_in_place(new)
            if summed:
                notes.append(f"{len(summed)} residual add(s) accumulate into the other operand's fresh buffer: "
                             + _first(summed))
            notes.extend(plan_layout(new))
    if finite is not None and finite.inputs_relied_on:
        names = {n.name for n in finite.inputs_relied_on}
        placeholders = list(new.graph.find_nodes(op="placeholder"))
        finite_inputs = tuple(i for i, n in enumerate(placeholders) if n.name in names)
        notes.append("activations fused (or branches merged) where inputs are finite: a call whose input(s) "
                     + ", ".join(n.name for n in placeholders if n.name in names)
                     + " hold NaN or Inf runs through torch")
    if not notes:
        return None, "nothing to fold or pack"
    new.graph.lint()
    return Prepared(new, notes, finite_inputs), ""


def sdpa_masks_as_4d(gm: GraphModule) -> List[str]:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=m)`` with 4-D ``q`` and a 3-D mask
    (TinyViT's ``(heads, N, N)`` bias) gets ``m.unsqueeze(0)``: the same broadcast, but torch's
    CPU SDPA takes its math path (a softmax that checks every row for -inf) for a 3-D mask and
    its fused kernel for a 4-D one (64 x 5 heads of 49 x 49: 3.7-4.5 ms against 1.1 ms).
    Returns the names of the calls changed."""
    done = []
    for n in gm.graph.find_nodes(op="call_function", target=torch.nn.functional.scaled_dot_product_attention):
        q = n.args[0] if n.args else n.kwargs.get("query")
        in_args = len(n.args) > 3
        m = n.args[3] if in_args else n.kwargs.get("attn_mask")
        qm = q.meta.get("tensor_meta") if type(q) is Node else None
        mm = m.meta.get("tensor_meta") if type(m) is Node else None
        if not (hasattr(qm, "shape") and hasattr(mm, "shape") and len(qm.shape) == 4 and len(mm.shape) == 3):
            continue
        with gm.graph.inserting_before(n):
            m4 = gm.graph.call_method("unsqueeze", (m, 0))
        stride = tuple(mm.stride)
        m4.meta["tensor_meta"] = dataclasses.replace(
            mm, shape=(1,) + tuple(mm.shape),
            stride=((stride[0] * mm.shape[0] if stride else 1),) + stride)   # (what unsqueeze(0) gives)
        if in_args:
            n.args = n.args[:3] + (m4,) + n.args[4:]
        else:
            n.kwargs = dict(n.kwargs, attn_mask=m4)
        done.append(n.name)
    return done


def _first(names: List[str], limit: int = 3) -> str:
    """``names`` for a report note: the first ``limit``, then "..." if there are more."""
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


_NO_OP_MODULES = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                  nn.FeatureAlphaDropout)


def drop_no_op_modules(gm: GraphModule) -> int:
    """Remove calls of ``nn.Identity`` and eval-mode dropout modules (exactly these classes, no
    hooks): their result is their input, and in between they would keep a layer and the
    activation after it (timm's ``BatchNormAct2d``: norm, ``drop``, ``act``) from fusing."""
    graph = gm.graph
    k = 0
    for n in list(graph.find_nodes(op="call_module")):
        try:
            m = gm.get_submodule(n.target)
        except AttributeError:
            continue
        if type(m) not in _NO_OP_MODULES or m.training or runs_forward_hooks(m) \
                or len(n.args) != 1 or n.kwargs or type(n.args[0]) is not Node:
            continue
        n.replace_all_uses_with(n.args[0])
        graph.erase_node(n)
        k += 1
    return k


def constant_rank_reads(gm: GraphModule) -> int:
    """``x.ndim`` and ``x.dim()`` of a tensor with recorded metadata become the constant they
    are (a graph's tensors have fixed ranks): such a read between a layer and its batch norm or
    activation (timm's ``_assert(x.ndim == 4)``) would keep them from folding and fusing."""
    from ..graph.guards import check_data_guard
    from ..graph.node import map_arg
    graph = gm.graph
    k = 0
    for n in list(graph.nodes):
        is_read = (n.op == "call_function" and n.target is getattr and len(n.args) == 2 and n.args[1] == "ndim") \
            or (n.op == "call_method" and n.target == "dim" and len(n.args) == 1 and not n.kwargs)
        if not is_read or type(n.args[0]) is not Node:
            continue
        m = n.args[0].meta.get("tensor_meta")
        if not hasattr(m, "shape"):
            continue
        rank = len(m.shape)
        for u in list(n.users):
            u.args = map_arg(u.args, lambda a: rank if a is n else a)
            u.kwargs = map_arg(u.kwargs, lambda a: rank if a is n else a)
            if u.op == "call_function" and u.target is check_data_guard and not u.users \
                    and not any(type(a) is Node for a in u.args):
                try:   # a guard on the now-constant rank that holds: checked once, here
                    check_data_guard(*u.args, **u.kwargs)
                except Exception:
                    continue   # (it fails on every call, as it did)
                graph.erase_node(u)
        graph.erase_node(n)
        k += 1
    return k


_LAYOUT_FREE_METHODS = frozenset(("chunk", "split"))


def _uses_end_in_convs(node: Node, through_cat: bool) -> Optional[List[Node]]:
    """The nodes on the way (``node`` first) when every use of ``node`` ends in a packed
    convolution, through channel chunks/splits and their items (and ``torch.cat`` where
    ``through_cat``; else a ``cat``, or ``len`` of a chunk's tuple, ends a use too): ops whose
    results do not depend on their input's layout. None when some use is anything else (a
    view, an output)."""
    from .onednn import PackedConv
    ends = () if through_cat else (torch.cat, len)
    walked = (torch.chunk, torch.split, operator.getitem) + ((torch.cat,) if through_cat else ())
    stack, seen = [node], {node: None}
    while stack:
        for u in stack.pop().users:
            if u in seen:
                continue
            seen[u] = None
            if u.op == "call_function" and (isinstance(u.target, PackedConv) or u.target in ends):
                continue
            if u.op == "call_method" and u.target in _LAYOUT_FREE_METHODS or u.op == "call_function" and u.target in walked:
                stack.append(u)
                continue
            return None
    return list(seen)


def channel_shuffles(gm: GraphModule) -> int:
    """ShuffleNet's ``x.view(b, g, c // g, h, w).transpose(1, 2).contiguous().view(b, -1, h, w)``
    becomes ``torch.channel_shuffle(x, g)`` (the same values) where the result only feeds packed
    convolutions, ``cat`` and channel chunks: ``contiguous()`` turned the channels-last tensor
    into NCHW, and every convolution after it reordered its input back."""
    graph = gm.graph
    k = 0

    def method(n, names):
        return type(n) is Node and n.op == "call_method" and n.target in names and len(n.users) == 1

    for last in list(graph.nodes):
        if last._erased or last.op != "call_method" or last.target not in ("view", "reshape") or not last.args:
            continue
        cont = last.args[0]
        if not method(cont, ("contiguous",)) or cont.kwargs or len(cont.args) != 1:
            continue
        tr = cont.args[0]
        is_transpose = method(tr, ("transpose",)) or (type(tr) is Node and tr.op == "call_function"
                                                      and tr.target is torch.transpose and len(tr.users) == 1)
        if not is_transpose or tr.kwargs or tuple(tr.args[1:]) not in ((1, 2), (2, 1)):
            continue
        first = tr.args[0]
        if not method(first, ("view", "reshape")) or type(first.args[0]) is not Node:
            continue
        x = first.args[0]
        xm, fm, lm = (n.meta.get("tensor_meta") for n in (x, first, last))
        if not all(hasattr(m, "shape") for m in (xm, fm, lm)) or len(xm.shape) != 4 or len(fm.shape) != 5:
            continue
        b, c, h, w = xm.shape
        g = fm.shape[1]
        if tuple(lm.shape) != tuple(xm.shape) or tuple(fm.shape) != (b, g, c // g, h, w) or \
                not isinstance(g, int) or g < 1 or c % g:
            continue
        if _uses_end_in_convs(last, through_cat=False) is None:
            continue
        from .layout_ops import ChannelShuffle
        with graph.inserting_before(last):
            shuffle = graph.call_function(ChannelShuffle(g), (x,))
        shuffle.meta.update({key: v for key, v in last.meta.items() if key in ("source", "module_path")})
        shuffle.meta["tensor_meta"] = lm
        last.replace_all_uses_with(shuffle)
        for n in (last, cont, tr, first):
            graph.erase_node(n)
        k += 1
    return k


def drop_layout_copies(gm: GraphModule) -> int:
    """``x.contiguous()`` whose result only reaches packed convolutions (through ``cat`` and
    channel splits: CSPNet's ``cat([xs, conv(xb).contiguous()])``) is ``x``: the copy would turn
    a channels-last tensor into NCHW, the ``cat`` would then transpose its other inputs too, and
    the convolution after it reorder its input back. Values are the same."""
    from ..passes.alias import AliasAnalysis
    graph = gm.graph
    k = 0
    alias = None
    for n in list(graph.find_nodes(op="call_method", target="contiguous")):
        if n.kwargs or len(n.args) != 1 or type(n.args[0]) is not Node:
            continue
        reached = _uses_end_in_convs(n, through_cat=True)
        if reached is None:
            continue
        # (the copy is a snapshot: x must not be written before the last read it stands for)
        alias = alias or AliasAnalysis(graph, gm)
        if alias.written_across(n.args[0], reached):
            continue
        n.replace_all_uses_with(n.args[0])
        graph.erase_node(n)
        k += 1
    return k


def shuffle_cats(gm: GraphModule) -> int:
    """A ``ChannelShuffle(g)`` of a ``torch.cat`` along channels of ``g`` parts of one shape, the
    cat used by nothing else (but shape reads), becomes one :class:`~.layout_ops.ShuffleCat` call (ShuffleNet's unit
    ends: the kernel interleaves the parts' channels in one pass)."""
    from .layout_ops import ChannelShuffle, ShuffleCat
    graph = gm.graph
    k = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, ChannelShuffle) or len(node.args) != 1:
            continue
        cat = node.args[0]
        if type(cat) is not Node or cat.op != "call_function" or cat.target is not torch.cat:
            continue
        others = [u for u in cat.users if u is not node]
        if not all(u.op == "call_method" and u.target in ("size", "dim") for u in others):
            continue   # (shape reads, as channel_shuffle's ``x.size()``, read the result instead)
        parts = cat.args[0] if cat.args else cat.kwargs.get("tensors")
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if set(cat.kwargs) - {"tensors", "dim"} or not isinstance(parts, (list, tuple)) \
                or len(parts) != node.target.groups or not all(type(p) is Node for p in parts):
            continue
        metas = [p.meta.get("tensor_meta") for p in parts]
        shapes = [tuple(getattr(m, "shape", ())) for m in metas]
        if len(shapes[0]) != 4 or dim not in (1, -3) or any(sh != shapes[0] for sh in shapes):
            continue
        with graph.inserting_after(cat):
            joined = graph.call_function(ShuffleCat(node.target.groups), tuple(parts))
        joined.meta.update(node.meta)
        node.replace_all_uses_with(joined)
        for u in others:
            u.replace_input_with(cat, joined)
        graph.erase_node(node)
        graph.erase_node(cat)
        k += 1
    return k


# --------------------------------------------------------------------------- layout

def _feeds_conv(node: Node) -> bool:
    from .onednn import PackedConv
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "call_function" and isinstance(u.target, PackedConv):
                return True
            if u not in seen and u.op != "output":
                seen.add(u)
                stack.append(u)
    return False


def plan_layout(gm: GraphModule) -> List[str]:
    """Channels-last at the edges of a graph with packed convolutions: 4-D inputs feeding a
    convolution are converted on entry; 4-D outputs that eager returns contiguous are made
    contiguous before they leave (inside, packed convolutions produce channels-last)."""
    graph = gm.graph
    notes = []
    for ph in list(graph.find_nodes(op="placeholder")):
        m = ph.meta.get("tensor_meta")
        if m is None or not hasattr(m, "shape") or len(m.shape) != 4 or not _feeds_conv(ph):
            continue
        users = list(ph.users)
        nxt = ph.next
        while nxt.op == "placeholder":
            nxt = nxt.next
        with graph.inserting_before(nxt):
            cl = graph.call_method("contiguous", (ph,), {"memory_format": torch.channels_last})
        for u in users:
            u.replace_input_with(ph, cl)
        notes.append(f"input {ph.name} converted to channels-last on entry")
    from .kv_append import AppendCat
    out = next(iter(graph.find_nodes(op="output")))
    made = []

    def fix(a):
        if type(a) is not Node:
            return a
        m = a.meta.get("tensor_meta")
        if m is None or not hasattr(m, "shape") or len(m.shape) != 4 or not m.stride \
                or isinstance(a.target, AppendCat):   # (laid out for appending: see .kv_append)
            return a
        with graph.inserting_before(out):
            c = graph.call_method("contiguous", (a,), {"memory_format": _format_of(m)})
        made.append(a.name)
        return c
    from ..graph.node import map_arg
    out.args = (map_arg(out.args[0], fix),)
    if made:
        notes.append("4-D output(s) returned in eager's layout: " + ", ".join(made))
    return notes


def _format_of(m) -> torch.memory_format:
    """channels_last when eager's result is laid out so (and not also contiguous), else contiguous."""
    cl = dense_in_order(m.shape, m.stride, (1, 3, 2, 0))
    return torch.channels_last if cl and not dense_in_order(m.shape, m.stride, (3, 2, 1, 0)) \
        else torch.contiguous_format
