"""Graph passes: pattern matching and rewriting, shape propagation, clean-ups, fusion.

Every pass is a plain function taking a :class:`~symtrace.graph.GraphModule`.
"""
