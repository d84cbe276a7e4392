"""The one walker over nested values (symtrace.graph.tree) and the helpers built on it."""
import collections

import pytest
import torch

from symtrace.graph import Graph
from symtrace.graph import tree
from symtrace.graph.node import iter_nodes, map_aggregate, map_arg, remap_args
from symtrace.graph.tree import register_container, tree_children, tree_depth, tree_iter, tree_map

Point = collections.namedtuple("Point", "x y")


def _deep_list(n, leaf):
    v = leaf
    for _ in range(n):
        v = [v]
    return v


def test_containers_are_walked_and_copied():
    value = (1, [2, {"a": 3, "b": (4,)}], slice(5, None, 6))
    out = tree_map(lambda x: x * 10 if type(x) is int else x, value)
    assert out == (10, [20, {"a": 30, "b": (40,)}], slice(50, None, 60))
    assert out[1] is not value[1] and out[1][1] is not value[1][1]
    assert list(tree_iter(value)) == [1, 2, 3, 4, 5, None, 6]


def test_leaves_include_none_and_other_classes():
    size = torch.Size([2, 3])
    od = collections.OrderedDict(a=1)
    assert list(tree_iter((None, size, od, "ab"))) == [None, size, od, "ab"]
    assert tree_map(lambda x: x, [size])[0] is size  # torch.Size is a leaf, not rebuilt as a tuple
    assert tree_children(size) is None and tree_children(od) is None and tree_children(3) is None


def test_subclasses_only_where_asked():
    od = collections.OrderedDict(a=1, b=[2])
    value = (od, torch.Size([3, 4]))
    assert list(tree_iter(value)) == [od, torch.Size([3, 4])]
    assert list(tree_iter(value, subclasses=True)) == [1, 2, 3, 4]


def test_namedtuples_keep_their_class():
    p = Point(1, [2])
    out = tree_map(lambda x: x + 1, p)
    assert type(out) is Point and out == Point(2, [3])
    assert list(tree_iter([p])) == [1, 2]
    assert list(tree_children(p)) == [1, [2]]


def test_slices_walk_start_stop_step():
    s = slice(1, None, 2)
    assert list(tree_children(s)) == [1, None, 2]
    assert tree_map(str, s) == slice("1", "None", "2")


def test_dict_order_and_keys_are_kept():
    d = {"z": 1, "a": 2, 3: 4}
    out = tree_map(lambda x: -x, d)
    assert list(out) == ["z", "a", 3] and list(out.values()) == [-1, -2, -4]
    assert list(tree_iter(d)) == [1, 2, 4]


def test_only_maps_one_class():
    value = [1, "a", (2.0, 3)]
    assert tree_map(lambda x: x * 2, value, only=int) == [2, "a", (2.0, 6)]
    assert list(tree_iter(value, only=int)) == [1, 3]


def test_is_leaf_keeps_a_container_whole():
    value = [Point(1, 2), (3, 4), {"k": 5}]
    out = tree_map(lambda x: ("leaf", x), value, is_leaf=lambda c: type(c) in (Point, dict))
    assert out == [("leaf", Point(1, 2)), (("leaf", 3), ("leaf", 4)), ("leaf", {"k": 5})]
    # plain tuples and lists are always walked
    assert tree_map(lambda x: -x, ([1], (2,)), is_leaf=lambda c: True) == ([-1], (-2,))


class _Cache:
    """A container symtrace does not know: two lists of tensors and a length that is not a child."""

    def __init__(self, keys, values, length):
        self.keys, self.values, self.length = keys, values, length


def test_registering_a_container(monkeypatch):
    monkeypatch.setattr(tree, "_CONTAINERS", dict(tree._CONTAINERS))  # undone after the test
    register_container(_Cache, lambda c: (c.keys, c.values),
                       lambda c, children: _Cache(children[0], children[1], c.length))
    cache = _Cache([1, 2], [3], length=7)
    out = tree_map(lambda x: x * 10, {"cache": cache})
    assert type(out["cache"]) is _Cache and out["cache"].keys == [10, 20] and out["cache"].values == [30]
    assert out["cache"].length == 7
    assert list(tree_iter((cache, 4))) == [1, 2, 3, 4]
    assert tree_depth(cache, 10) == 2
    with pytest.raises(TypeError):
        register_container("not a class", iter, lambda v, c: v)


def test_unregistered_class_is_a_leaf():
    cache = _Cache([1], [2], 0)
    assert list(tree_iter([cache])) == [cache]
    assert tree_map(lambda x: x, [cache])[0] is cache


@pytest.mark.parametrize("depth", [150, 500, 3000])
def test_deep_nesting_never_raises_recursion_error(depth):
    value = _deep_list(depth, 1)
    out = tree_map(lambda x: x + 1, value)
    assert list(tree_iter(out)) == [2]
    assert tree_depth(out, depth + 5) == depth
    assert tree_depth(out, 100) == 100
    # the recursive walk and the explicit-stack one give the same result
    mixed = _deep_list(depth, (1, {"a": [2, Point(3, slice(4, 5, None))]}))
    assert list(tree_iter(tree_map(lambda x: x * 2, mixed, only=int))) == [2, 4, 6, 8, 10, None]


def test_deep_nesting_with_is_leaf():
    value = _deep_list(300, Point(1, 2))
    out = tree_map(lambda x: "kept", value, is_leaf=lambda c: type(c) is Point)
    assert list(tree_iter(out)) == ["kept"]


def test_node_helpers_walk_the_same_containers():
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    args = ([x, 1], {"k": Point(y, slice(x, None, None))}, "s")
    assert list(iter_nodes(args)) == [x, y, x]
    assert list(iter_nodes(x)) == [x]
    swapped = map_arg(args, lambda n: y if n is x else x)
    assert list(iter_nodes(swapped)) == [y, x, y] and type(swapped[1]["k"]) is Point
    assert remap_args(args, lambda n: n.name) == (["x", 1], {"k": Point("y", slice("x", None, None))}, "s")
    assert map_aggregate(args, lambda v: 0) == ([0, 0], {"k": Point(0, slice(0, 0, 0))}, 0)


def test_node_with_deeply_nested_arguments():
    g = Graph()
    x = g.placeholder("x")
    node = g.call_function(torch.cat, (_deep_list(500, x),))
    assert node.all_input_nodes == [x]
    copy = g.node_copy(node, lambda n: n)
    assert copy.all_input_nodes == [x]
