"""Decompositions: graph ops -> lazy values over the primitive expression set.

Each rule takes the lowering context, the node and its arguments (tensors as
:class:`~symtrace.lower.values.LValue`, everything else as Python values) and returns a lazy
value (or a tuple of them), or raises :class:`Unsupported` with a reason; the node then runs
through torch unchanged (an *extern*). Rules cover arithmetic, comparisons, ``where``, casts,
activations (relu, gelu (erf and tanh), silu, sigmoid, tanh, ...), views (permute, transpose,
expand, slicing, reshape of strided buffers, split/chunk), reductions over the last dimension
or over everything (sum, mean, amax, amin, var, std), softmax/log_softmax, layer_norm,
rms_norm, windowed max and average pooling, and ``linear``/``conv`` as a torch call followed
by a fusible bias add.

The rules live by kind in :mod:`.decomp_pointwise` (arithmetic, unary ops, casts),
:mod:`.decomp_views` (views and indexing), :mod:`.decomp_reductions` (reductions, softmax,
norms), :mod:`.decomp_nn` (linear/conv, batch norm, modules) and :mod:`.decomp_pooling`
(windowed pooling); the tables and the helpers
they share in :mod:`.decomp_registry`. This module imports them in that order (which is the
order rules register in) and re-exports the public names.
"""
from __future__ import annotations

from .decomp_registry import (FUNCTION_RULES, METHOD_RULES, MODULE_RULES, Rule, Unsupported, elementwise,  # noqa: F401
                              promoted, rule_for)
# importing the rule modules registers their rules, in this order
from .decomp_pointwise import cast_value, copy_value, where_value  # noqa: F401
from .decomp_views import reshape_value  # noqa: F401
from .decomp_reductions import norm_value, reduce_value, softmax_value, var_value  # noqa: F401
from .decomp_nn import batch_norm_value, bias_epilogue  # noqa: F401
from .decomp_pooling import pool_value  # noqa: F401

__all__ = ["Unsupported", "FUNCTION_RULES", "METHOD_RULES", "MODULE_RULES", "rule_for"]

