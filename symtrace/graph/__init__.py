"""The graph IR: nodes, graphs, code generation, GraphModule, interpreter, printing, drawing."""
from .graph import Graph
from .graph_module import GraphModule
from .guards import Guard
from .node import OPCODES, Node, TensorMeta, map_aggregate, map_arg
from .source import SourceLocation

__all__ = ["Graph", "GraphModule", "Guard", "Node", "OPCODES", "TensorMeta", "SourceLocation",
           "map_arg", "map_aggregate"]
