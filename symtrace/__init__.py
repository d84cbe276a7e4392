"""symtrace: capture PyTorch programs as editable graphs and transform them."""
from .errors import (AssumedTypeAttributeError, GraphError, GuardError, NodeRunError, SpecializedDimError,
                     SymtraceError, TraceError, UninitializedModuleError)
from .graph import Graph, GraphModule, Guard, Node, TensorMeta
from .graph.interpreter import Interpreter
from .transformer import Transformer
from .graph.drawing import draw, to_dot
from .graph.tabular import print_tabular
from .graph.symbols import Dim
from .proxy import Proxy
from .trace import Tracer, leaf_function, symbolic_trace
from .capture import Captured, capture
from .explain import ExplainReport, explain
from .interop import FxConversionError, backend, from_export, from_fx, to_export, to_fx
from .serialize import SerializationError, load, register_target, save
from .passes.feature_extraction import FeatureExtractor, create_feature_extractor, get_graph_node_names

__all__ = ["symbolic_trace", "capture", "Captured", "explain", "ExplainReport", "Tracer", "Proxy", "leaf_function", "Graph", "GraphModule", "Node",
           "Guard", "TensorMeta", "Interpreter", "Transformer", "draw", "to_dot", "print_tabular", "SymtraceError", "TraceError", "AssumedTypeAttributeError", "UninitializedModuleError", "SpecializedDimError", "GraphError", "GuardError", "Dim",
           "NodeRunError", "to_fx", "from_fx", "from_export", "to_export", "backend", "FxConversionError", "save", "load",
           "register_target", "SerializationError", "create_feature_extractor", "get_graph_node_names",
           "FeatureExtractor"]
__version__ = "0.1.0"
