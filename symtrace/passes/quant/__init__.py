"""Post-training int8 quantization of traced graphs.

The flow, each step a plain function of a :class:`~symtrace.graph.GraphModule`::

    gm = symtrace.symbolic_trace(model.eval(), example_inputs=(x,))
    prepared = prepare(gm, QuantConfig())        # canonicalize, fold BN, insert observers
    calibrate(prepared, calibration_images)       # run it: observers record ranges
    ref = to_reference(prepared)                  # q/dq around float ops: the oracle
    q = lower(ref)                                # fused int8 kernels (oneDNN or portable)
    compare_numerics(prepared, q, x)              # per-node SQNR / cosine table

Quantization-aware training (:mod:`~symtrace.passes.quant.qat`): ``prepare_qat(gm_train,
QuantConfig())`` -> train -> ``convert``; the same int8 graph, batch norm folded at the end.

``weight_only(bits=8 | 4, group_size=...)`` is a pass (``capture(model, passes=[...])``) that
makes Linear layers weight-only quantized: int8 or group-wise int4 weights, float activations
(the kernels: :mod:`symtrace.lower.woq_cpu`). ``quantize_dynamic(gm)`` makes Linear layers dynamic int8 (weights int8, activations
quantized per call). A quantized module saves in symtrace's safe format: ``symtrace.save``/
``symtrace.load``, or ``save_quantized``/``load_quantized`` (the same, plus a backend choice on load).

Quantized values are plain ``torch.uint8``/``torch.int8`` tensors with explicit scale and zero
point (never ``torch.quint8``-style dtypes); parameters live in node arguments,
``node.meta["tensor_meta"].qparams`` and int8/float buffers.
"""
from ...graph.graph_module import GraphModule
from .backend import Int8Backend
from .canonicalize import canonicalize, op_kind
from .config import BACKEND_SPECS, BackendSpec, Plan, QuantConfig, annotate
from .lower import lower, quantize_dynamic
from .numerics import compare_numerics, op_histogram, model_size, observer_table, sensitivity, weight_sqnr
from .observers import (FixedQParamsObserver, HistogramObserver, MinMaxObserver, MovingAverageMinMaxObserver,
                        Observer, PercentileObserver, PerChannelSymmetricObserver, PerTensorSymmetricObserver)
from .prepare import calibrate, insert_observers, observers_of, prepare
from .qat import FakeQuantize, QATLayer, fake_quantize, freeze_bn_stats, freeze_observers, prepare_qat
from .qparams import QParams, choose_qparams, dequantize_per_tensor, quantize_per_tensor, sqnr
from .reference import to_reference
from .registry import (BUILTIN_CLASSES, available_backends, backend_available, builtin_class, default_backend,
                       get_backend, register_backend)
from .save import load_quantized, save_quantized
from .weight_only import WeightOnly, weight_only

__all__ = [
    "prepare", "calibrate", "insert_observers", "to_reference", "lower", "quantize_dynamic", "convert",
    "prepare_qat", "freeze_observers", "freeze_bn_stats", "FakeQuantize", "QATLayer", "fake_quantize",
    "canonicalize", "op_kind", "annotate", "QuantConfig", "BackendSpec", "BACKEND_SPECS", "Plan",
    "Observer", "MinMaxObserver", "MovingAverageMinMaxObserver", "PerChannelSymmetricObserver",
    "PerTensorSymmetricObserver", "HistogramObserver", "PercentileObserver", "FixedQParamsObserver",
    "QParams", "choose_qparams", "quantize_per_tensor", "dequantize_per_tensor", "sqnr",
    "Int8Backend", "OneDNNBackend", "PortableBackend", "register_backend", "get_backend", "backend_available",
    "available_backends", "default_backend",
    "compare_numerics", "sensitivity", "observer_table", "weight_sqnr", "op_histogram", "model_size",
    "save_quantized", "load_quantized", "weight_only", "WeightOnly",
]


def __getattr__(name: str):
    """``PortableBackend`` and ``OneDNNBackend``: kernel code in :mod:`symtrace.lower`, imported
    (through the registry) when first asked for."""
    if name in BUILTIN_CLASSES:
        return builtin_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def convert(prepared, backend: str = "auto", **kwargs):
    """``lower(to_reference(prepared), backend)``: a calibrated prepared module, or a trained
    :func:`prepare_qat` one (batch norm folded first), -> int8 module."""
    if not isinstance(prepared, GraphModule) or not observers_of(prepared):
        raise ValueError("convert needs a module from prepare(...) (then calibrate(...)) or prepare_qat(...) "
                         "(then training); this one has no observers or fake quantization")
    return lower(to_reference(prepared, **kwargs), backend=backend)
