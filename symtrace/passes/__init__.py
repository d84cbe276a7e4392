"""Graph passes: pattern matching and rewriting, shape propagation, clean-ups, fusion.

Every pass is a plain function taking a :class:`~symtrace.graph.GraphModule`; a pipeline is a
list of them, run by :func:`run_passes` under an optional :class:`PassContext` that lints,
times and dumps the graph after each pass.
"""
from . import quant
from .const_fold import constant_folding
from .cse import common_subexpression_elimination
from .dce import dead_code_elimination
from .fold_bn import BatchNormFoldError, fold_batch_norm
from .fuse_attention import fuse_attention
from .infra import PassContext, PassResult, graph_pass, run_passes
from .matcher import Match, SubgraphMatcher
from .partition import fuse_partitions, partition
from .rewrite import Replacement, replace_pattern
from .rules import Rule, RuleTable
from .shape_prop import ShapeProp, propagate_shapes
from .split import SplitError, split_module

__all__ = ["run_passes", "PassContext", "PassResult", "graph_pass", "propagate_shapes", "ShapeProp",
           "dead_code_elimination", "common_subexpression_elimination", "constant_folding",
           "fold_batch_norm", "BatchNormFoldError", "split_module", "SplitError", "partition",
           "fuse_partitions", "SubgraphMatcher", "Match", "replace_pattern", "Replacement", "Rule",
           "RuleTable", "quant", "fuse_attention"]
