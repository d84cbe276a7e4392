"""Local rewrite rules applied to a fixed point: ``Rule`` and ``RuleTable``.

>>> table = RuleTable([
...     Rule("relu_of_relu", lambda x: torch.relu(torch.relu(x)), lambda m: lambda x: torch.relu(x)),
...     Rule("mul_one", lambda x: x * 1, lambda m: lambda x: x),
... ])
>>> table.apply(gm)          # {'relu_of_relu': 2, 'mul_one': 1}

Each rule remembers where it was defined; ``apply(gm, debug=True)`` (or the environment
variable ``SYMTRACE_DEBUG_RULES=1``) prints every firing: the rule, its definition site, the
node it rewrote and the user's source line that made that node.

Complexity: each round costs, per rule whose anchor (op, target) occurs in the graph, one
matcher run (O(n) positions + O(k·p) for k candidates); rules whose anchor is absent are
skipped by an index lookup. Rounds repeat until none fires (at most ``max_iterations``).
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Dict, Iterable, List, Optional

from ..errors import SymtraceError
from ..graph.graph_module import GraphModule
from ..graph.node import Node
from ..graph.source import SourceLocation
from .matcher import Match, SubgraphMatcher
from .rewrite import apply_replacements, per_match

__all__ = ["Rule", "RuleTable", "RuleLimitError"]

DEBUG_ENV = "SYMTRACE_DEBUG_RULES"


class RuleLimitError(SymtraceError, RuntimeError):
    """Rules still fired after ``max_iterations`` rounds (they probably undo each other)."""


class Rule:
    """A named local rewrite: where ``pattern`` matches, ``rewrite(match)`` returns the
    replacement (a function taking the pattern's inputs) or None to leave the match alone.

    Matching options (``literals``, ``commutative``, ``predicates``, ``alternatives``,
    ``module_match``, ``filters``) are those of :class:`SubgraphMatcher`. ``site`` is the
    ``file:line`` where the rule was constructed.
    """

    def __init__(self, name: str, pattern: Any, rewrite: Callable[[Match], Any], **match_options: Any):
        if not callable(rewrite):
            raise TypeError(f"rule {name!r}: rewrite must be a callable(match) -> replacement or None")
        self.name = name
        self.pattern = pattern
        self.rewrite = rewrite
        caller = inspect.stack(context=0)[1]
        self.site = SourceLocation(caller.filename, caller.lineno, caller.function)
        self.matcher = SubgraphMatcher(pattern, **match_options)

    @property
    def anchor_keys(self) -> List[tuple]:
        """The (op, target) pairs the rule's anchor may match; ``("call_module", None)`` for any
        module call."""
        a = self.matcher.anchor
        if a.op == "call_module":
            return [("call_module", None)]
        return list(a.allowed)

    def __repr__(self) -> str:
        return f"Rule({self.name!r} at {self.site})"


class RuleTable:
    """Rules indexed by their anchor's (op, target); :meth:`apply` runs them to a fixed point.

    Rules are tried in the order given; within a round each applicable rule rewrites all its
    non-overlapping matches before the next rule runs.
    """

    def __init__(self, rules: Iterable[Rule]):
        self.rules: List[Rule] = list(rules)
        names = [r.name for r in self.rules]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rule names must be unique; repeated: {dupes}")
        self.by_anchor: Dict[tuple, List[Rule]] = {}
        for r in self.rules:
            for key in r.anchor_keys:
                self.by_anchor.setdefault(key, []).append(r)

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self):
        return iter(self.rules)

    def applicable(self, gm: GraphModule) -> List[Rule]:
        """The rules whose anchor occurs in ``gm``'s graph (index lookups, no scan)."""
        g = gm.graph
        live = set()
        for (op, target), rules in self.by_anchor.items():
            if g.find_nodes(op=op, target=target, sort=False):
                live.update(map(id, rules))
        return [r for r in self.rules if id(r) in live]

    def apply(self, gm: GraphModule, *, max_iterations: int = 100, debug: Optional[bool] = None) -> Dict[str, int]:
        """Rewrite ``gm`` until no rule fires; returns how often each rule fired.

        ``debug`` (default: the ``SYMTRACE_DEBUG_RULES`` environment variable) prints each
        firing. Raises :class:`RuleLimitError` if rules still fire after ``max_iterations``
        rounds.
        """
        if debug is None:
            debug = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
        counts = {r.name: 0 for r in self.rules}
        for _ in range(max_iterations):
            fired = 0
            for rule in self.applicable(gm):
                matches = rule.matcher.match(gm)
                if not matches:
                    continue
                done = apply_replacements(gm, rule.matcher, matches, per_match(_Firing(rule, debug)))
                counts[rule.name] += len(done)
                fired += len(done)
            if not fired:
                return counts
        still = [r.name for r in self.applicable(gm) if r.matcher.match(gm)]
        raise RuleLimitError(f"rules still fire after {max_iterations} rounds: {still}; do some rules "
                             "undo each other?")


class _Firing:
    """Calls a rule's rewrite for one match, printing the firing when debugging."""

    __slots__ = ("rule", "debug")

    def __init__(self, rule: Rule, debug: bool):
        self.rule = rule
        self.debug = debug

    def __call__(self, match: Match) -> Any:
        repl = self.rule.rewrite(match)
        if repl is not None and self.debug:
            print(describe_firing(self.rule, match.anchor), flush=True)
        return repl


def describe_firing(rule: Rule, node: Node) -> str:
    """``rule 'name' (rules.py:12) fired on %relu = call_function[torch.relu] from
    model.py:30: y = torch.relu(x)``."""
    loc = node.meta.get("source")
    where = f" from {loc.describe()}" if loc is not None else ""
    return (f"rule {rule.name!r} ({rule.site}) fired on %{node.name} = "
            f"{node.op}[{node.format_target()}]{where}")

