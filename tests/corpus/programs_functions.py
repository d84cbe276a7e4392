"""Programs from PyTorch's test/dynamo/test_functions.py (FunctionTests, the ``make_test``
bodies and the small ``fn`` closures), with module-level helpers they use copied alongside."""
# flake8: noqa: E731, C405, C408, E711
from __future__ import annotations

import collections
import functools
import itertools
import math
import operator
from collections.abc import MutableMapping
from typing import NamedTuple

import torch

from . import In, program, r, t

# --- module-level helpers of test_functions.py --------------------------------------------------
d = torch.ones(10, 10)
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(0)
    e = torch.nn.Linear(10, 10)
flag = True


clip01 = functools.partial(torch.clip, min=0.0, max=1.0)


class MyCls:
    a = 1


def two(shape_a=(10,), shape_b=(10,), seed=0, **kw):
    return In(r(*shape_a, seed=seed, **kw), r(*shape_b, seed=seed + 1, **kw))


# --- the programs ---------------------------------------------------------------------------------
# pytorch test/dynamo/test_functions.py::FunctionTests::test_is_not_null
@program(two(), In(r(10, seed=3), None), In(None, r(3, seed=4)))
def is_not_null(a, b):
    if a is not None and b is not None:
        return a + b


# pytorch test/dynamo/test_functions.py::FunctionTests::test_functools_partial
@program(two(), two((2, 5), (5,), seed=7))
def functools_partial(a, b):
    return clip01(a + b)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_itertools_product
@program(two(), two((3, 2), (2,), seed=9))
def itertools_product(a, b):
    v = a
    for x, i in itertools.product([a, b], [1, 2]):
        v = v + x * i
    return v


# pytorch test/dynamo/test_functions.py::FunctionTests::test_obj_eq
@program(two(), two((2, 2), (2, 2), seed=3))
def obj_eq(a, b):
    v = a + b
    if MyCls() == None:
        return -1
    if MyCls() != None:
        v = v.sin()
    if MyCls() == MyCls():
        return -2
    if MyCls() != MyCls():
        return v + 1
    return -3


# pytorch test/dynamo/test_functions.py::FunctionTests::test_cls_hasattr
@program(In(None, r(4, seed=1)), In(None, r(2, 2, seed=2)))
def cls_hasattr(self, x):
    if hasattr(MyCls, "a"):
        x = x + 1
    if hasattr(MyCls, "b"):
        x = x + 2
    return x


# pytorch test/dynamo/test_functions.py::FunctionTests::test_finfo
@program(two(), two(dtype=torch.float64, seed=3), two(dtype=torch.float16, seed=5))
def finfo(a, b):
    if torch.iinfo(torch.int32).bits == 32:
        return torch.finfo(a.dtype).min * b


# pytorch test/dynamo/test_functions.py::FunctionTests::test_is_integer
@program(In(t(1), 1.0), In(t(1), 1.5), In(t(3, 4), 2.0))
def is_integer(t, m):
    return 2 * t if m.is_integer() else t


# pytorch test/dynamo/test_functions.py::FunctionTests::test_number_method (method="bit_length", num_type=int)
@program(In(t(1), 0), In(t(1), 1), In(t(1), 2))
def number_method_bit_length(t, m):
    return 2 * t if getattr(m, "bit_length")() else t


# pytorch test/dynamo/test_functions.py::FunctionTests::test_is_fx_tracing
@program(two(), two((3,), (3,), seed=5))
def is_fx_tracing(x, y):
    if torch.fx._symbolic_trace.is_fx_tracing():
        return x - 1
    else:
        return y + 1


class _Mock:
    def __init__(self):
        self.ets = []
        self.counter = 0

    def run(self, x):
        self.ets = self.ets[-3:]
        self.ets.append(x)
        return torch.sin(x)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_list_slice
@program(In(r(4, seed=1)), In(r(4, seed=2)), In(r(4, seed=3)), In(r(4, seed=4)), factory=True)
def list_slice():
    return _Mock().run  # a bound method of a plain object that keeps a list of its inputs


# pytorch test/dynamo/test_functions.py::FunctionTests::test_deque
@program(two(), two((2,), (2,), seed=3))
def deque(a, b):
    d = collections.deque([a, b])
    d.append(a + 1)
    d.extend([a, b])
    d.insert(0, "foo")
    tmp = d.pop()

    another_deque = collections.deque([tmp])
    d.extendleft(another_deque)
    another_deque.clear()
    d.extend(another_deque)

    d[2] = "setitem"
    d = d.copy()
    d.append(d.popleft())

    empty = collections.deque()
    d.extend(empty)
    return list(d)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_range1
@program(In(r(10, seed=1)), In(r(4, seed=2)), In(r(6, 2, seed=3)))
def range1(a):
    return torch.tensor(range(a.size(0)))


# pytorch test/dynamo/test_functions.py::FunctionTests::test_range2
@program(two(), two((3,), (3,), seed=4), two((2, 3), (3,), seed=6))
def range2(x, y):
    r = x + y
    for i in range(x.size(0) + 2):
        r = r / y
    return r


# pytorch test/dynamo/test_functions.py::FunctionTests::test_globalvar
@program(two((10, 10), (10, 10)), two((10,), (1, 10), seed=3))
def globalvar(a, b):
    return a - b + d


# pytorch test/dynamo/test_functions.py::FunctionTests::test_globalmodule
@program(In(r(10, seed=1)), In(r(3, 10, seed=2)))
def globalmodule(x):
    return e(x)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_transpose_for_scores
@program(In(r(10, 10, seed=1)), In(r(4, 10, seed=2)), In(r(1, 10, seed=3)))
def transpose_for_scores(x):
    new_x_shape = x.size()[:-1] + (2, 5)
    x = x.view(*new_x_shape)
    return x.permute(0, 2, 1)


def _set_flag(value):
    def flip():
        global flag
        flag = value
    return flip


# pytorch test/dynamo/test_functions.py::FunctionTests::test_load_global_bool
@program(In(r(10, seed=1)), In(r(3, seed=2)), flip=_set_flag(False), globals=("flag",))
def load_global_bool(x):
    if flag:
        return torch.add(x, x)
    else:
        return x


# pytorch test/dynamo/test_functions.py::FunctionTests::test_len_tensor
@program(In(r(10, seed=1)), In(r(3, seed=2)), In(r(5, 2, seed=3)))
def len_tensor(x):
    z = len(x)
    return torch.add(x, z)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_dict_setdefault3
@program(In(r(10, seed=1)), In(r(3, seed=2)))
def dict_setdefault3(x):
    d = {"a": 1, "b": 2}
    d.setdefault("c")
    if d["c"] is None:
        return x + 1
    else:
        return x - 1


class _CallableClass:
    def __call__(self):
        pass


class _NotCallableClass:
    pass


# pytorch test/dynamo/test_functions.py::FunctionTests::test_callable_class (fn2)
@program(In(r(4, seed=1), _NotCallableClass()), In(r(4, seed=1), _CallableClass()), In(r(4, seed=2), 1.1),
         In(r(4, seed=3), r(4, seed=4)))
def callable_class(x, arg):
    if callable(arg):
        return x * 2
    return x + 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_callable_list
@program(In(r(4, seed=1), [1, 2, 3]), In(r(4, seed=1), (1, 2, 3)), In(r(4, seed=2), torch.relu))
def callable_list(x, arg):
    if callable(arg):
        return x
    return x + 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_is_floating_point
@program(In(r(10, seed=1)), In(r(3, dtype=torch.int64, seed=2)))
def is_floating_point(x):
    y = x + 1
    return torch.is_floating_point(y), torch.is_floating_point(input=y)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_dtype
@program(In(r(10, seed=1)), In(r(3, dtype=torch.float64, seed=2)), In(r(3, seed=3)))
def dtype(x):
    if x.dtype == torch.float32:
        return x + 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_get_default_dtype
@program(In(r(10, seed=1)), In(r(3, dtype=torch.float64, seed=2)))
def get_default_dtype(x):
    if x.dtype == torch.get_default_dtype():
        return x + 1
    else:
        return x - 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_list_compare_polyfill
@program(In(r(10, seed=1)), In(r(3, seed=2)), In(r(3, dtype=torch.float64, seed=3)))
def list_compare_polyfill(x):
    for a, b, c in [
        [(1, 2, 3), (1, 2, 3), 7.77],
        [(1, 4, 3), (1, 2, 3), 3.33],
        [(1, 2), (1, 2, 3), 5.55],
        [(1, 2, 3), (1, 2), 11.11],
        [(1, -1, 3), (1, 2, 3), 13.33],
    ]:
        if a != b:
            x += 1 * c  # in place on the input
        if a == b:
            x += 2 * c
        if a < b:
            x += 4 * c
        if a > b:
            x += 8 * c
        if a <= b:
            x += 16 * c
        if a >= b:
            x += 32 * c
    return x


# pytorch test/dynamo/test_functions.py::FunctionTests::test_get_calculate_correct_fan
@program(In(r(10, 10, seed=1)), In(r(3, 4, seed=2)), In(r(2, 3, 2, 2, seed=3)))
def get_calculate_correct_fan(x):
    fan_in = torch.nn.init._calculate_correct_fan(x, "fan_in")
    return x + fan_in


# pytorch test/dynamo/test_functions.py::FunctionTests::test_is_complex
@program(In(r(10, seed=1)), In(torch.complex(r(3, seed=2), r(3, seed=3))))
def is_complex(x):
    if torch.is_complex(x):
        return x + 1
    else:
        return x - 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_tensor_element_size
@program(In(r(10, seed=1)), In(r(4, seed=2, dtype=torch.int8)), In(r(4, seed=3, dtype=torch.float64)))
def tensor_element_size(a):
    if a.element_size() > 1:
        return (a + a.element_size(), a - a.element_size())
    return (a - a.element_size(), a + a.element_size())


# pytorch test/dynamo/test_functions.py::FunctionTests::test_ndim
@program(In(r(10, 10, seed=1)), In(r(3, 2, seed=2)), In(r(10, seed=3)))
def ndim(x):
    if x.ndim == 2 and x.ndimension() == 2 and x.dim() == 2:
        return x + 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_shape1
@program(In(r(10, seed=1)), In(r(10, 2, seed=2)), In(r(4, seed=3)))
def shape1(x):
    if x.shape[0] == 10:
        return x + 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_chunks1
@program(In(r(10, seed=1)), In(r(10, 3, seed=2)), In(r(12, seed=3)))
def chunks1(x):
    chunk_size = 5
    assert x.shape[0] % chunk_size == 0
    assert x.shape[0] // chunk_size == 2
    return x[:chunk_size] - x[chunk_size:]


# pytorch test/dynamo/test_functions.py::FunctionTests::test_return_dict2
@program(two(), two((2, 10), (10,), seed=4))
def return_dict2(x, y):
    tmp = {"x": x}
    tmp["z"] = [x + y, y]
    tmp["y"] = y
    tmp["z"].append(False)
    return tmp


# pytorch test/dynamo/test_functions.py::FunctionTests::test_funcdef_closure
@program(two(), two((3,), (3,), seed=2))
def funcdef_closure(x, y):
    x = x + y + 1.0

    def inner(z):
        nonlocal x, y
        y = x + z + 20.0
        x = y + z + 10.0

    inner(2.0)
    inner(3.0)

    return x, y


# pytorch test/dynamo/test_functions.py::FunctionTests::test_dtype_compare
@program(two(), two(dtype=torch.float16, seed=3), two(dtype=torch.float64, seed=5))
def dtype_compare(a, b):
    if a.dtype == torch.float16:
        return a + 10
    if a.dtype == torch.float32:
        return a - b * 32


# pytorch test/dynamo/test_functions.py::FunctionTests::test_build_list_unpack
@program(two(), two((2, 3), (2, 3), seed=3))
def build_list_unpack(a, b):
    it1 = (x + 1 for x in (a, b))
    it2 = (x - 1 for x in (a, b))
    return torch.cat([*it1, *it2], dim=-1)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_tensor_len
@program(two(), two((3, 2), (3, 2), seed=3), two((4,), (1,), seed=5))
def tensor_len(a, b):
    return a + b + len(a) + b.__len__()


# pytorch test/dynamo/test_functions.py::FunctionTests::test_list_index_with_constant_tensor
@program(two(), two((3,), (3,), seed=2))
def list_index_with_constant_tensor(a, b):
    l1 = [a, b, a + 1, b + 1]
    return l1[torch.as_tensor(2)]


# pytorch test/dynamo/test_functions.py::FunctionTests::test_dict_ops
@program(two(), two((3,), (3,), seed=2))
def dict_ops(a, b):
    tmp = {"a": a + 1, "b": b + 2}
    assert tmp.get("zzz") is None
    v = tmp.pop("b") + tmp.get("a") + tmp.get("missing", 3) + tmp.pop("missing", 4)
    tmp.update({"d": 3})
    tmp["c"] = v + tmp["d"]
    if "c" in tmp and "missing" not in tmp:
        return tmp["c"] - tmp["a"] + len(tmp)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_zip_longest
@program(In(r(10, seed=1)), In(r(3, seed=2)))
def zip_longest(x):
    list1 = [1, 2, 3]
    list2 = ["a", "b"]
    list3 = [True, False, True, False]
    return torch.sin(x + 1), list(itertools.zip_longest(list1, list2, list3, fillvalue=None))


# pytorch test/dynamo/test_functions.py::FunctionTests::test_torch_size_as_dict_key
@program(In(r(2, 3, seed=1), {}), In(r(2, 3, seed=2), {torch.Size([2, 3]): r(2, 3, seed=5)}),
         In(r(3, 3, seed=3), {torch.Size([2, 3]): r(2, 3, seed=6)}))
def torch_size_as_dict_key(x, cached):
    if x.shape not in cached:
        cached[x.shape] = x
    return x + cached[x.shape]


a_param = torch.nn.Parameter(torch.ones([4, 4]))


# pytorch test/dynamo/test_functions.py::FunctionTests::test_dict_param_keys
@program(In(r(4, 4, seed=1)), In(r(4, seed=2)))
def dict_param_keys(a):
    tmp = {"a": a, a_param: 3}
    return tmp["a"] + tmp[a_param]


class TensorDict(MutableMapping):
    def __init__(self) -> None:
        self._dict = {}

    def add(self, key, value):
        self._dict[key] = value

    def items(self):
        return self._dict.items()

    def __delitem__(self, key):
        del self._dict[key]

    def __getitem__(self, key):
        return self._dict[key]

    def __iter__(self):
        return iter(self._dict)

    def __len__(self):
        return len(self._dict)

    def __setitem__(self, key, value):
        self._dict[key] = value


tensor_dict = TensorDict()
tensor_dict.add("a", torch.ones(4) * 2)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_dict_mutable_map
@program(In(r(4, seed=1)), In(r(3, 4, seed=2)))
def dict_mutable_map(x):
    copy_tensordict = dict(tensor_dict)
    return x * copy_tensordict["a"]


def _gn(x, a=1):
    return x * a


# pytorch test/dynamo/test_functions.py::FunctionTests::test_unpack_mutable_map
@program(In(r(4, seed=1)), In(r(2, 4, seed=2)))
def unpack_mutable_map(x):
    return _gn(x, **tensor_dict)


dd = collections.defaultdict(dict)
_dd_param = torch.nn.Parameter(torch.ones([2, 2]))


# pytorch test/dynamo/test_functions.py::FunctionTests::test_default_dict_dict
@program(In(r(10, 10, seed=1)), In(r(2, 2, seed=2)), globals=("dd",))
def default_dict_dict(x):
    dd["a"] = x + 1
    dd[_dd_param] = 123
    dd["c"] = x * 2
    return dd["b"], dd


# pytorch test/dynamo/test_functions.py::FunctionTests::test_default_dict_constr
@program(In(r(10, 10, seed=1)), In(r(3, seed=2)))
def default_dict_constr(x):
    dd = collections.defaultdict(lambda: dict())
    dd["a"] = x + 1
    dd[_dd_param] = 123
    dd["c"] = x * 2
    dd.update({"b": x * 3})
    dd.update([["d", x - 2], ("e", x + 2)])
    dd.update(zip("ab", [x + 3, x + 4]))
    return dd["b"], dict(dd)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_dict_tuple_lazy_guard
@program(In(r(3, seed=1), {1: 1, 2: 2}), In(r(3, seed=2), {1: 5, 2: 3}), In(r(3, seed=3), (1, 2, 3)),
         In(r(3, seed=4), (11, 7, 13)))
def dict_tuple_lazy_guard(x, y):
    return torch.sin(x) * y[1]


# pytorch test/dynamo/test_functions.py::FunctionTests::test_call_dict2
@program(In(r(10, seed=1)), In(r(3, seed=2)))
def call_dict2(x):
    d1 = dict()
    d1["x"] = x
    d2 = collections.OrderedDict(d1)
    if isinstance(d2, collections.OrderedDict):
        return x + 1
    else:
        return x - 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_min_max
@program(In(t(0.2, 0.3), t(0.1, 0.1)), In(t(2.0, 3.0), t(-1.0, -4.0)), In(t(-2.0, 0.5), t(0.3, 0.4)))
def min_max(a, b):
    c = a + b
    a = a.sum()
    b = b.sum()
    a = min(max(a, 0), 1)
    b = max(0, min(1, b))
    return max(a, b) - min(a, b) + c


# pytorch test/dynamo/test_functions.py::FunctionTests::test_symbool_to_int
@program(In(r(10, seed=1)), In(r(2, 3, seed=2)), In(r(0, 3, seed=2)))
def symbool_to_int(x):
    # this is roughly the pattern found in einops.unpack()
    if sum(s == -1 for s in x.size()) == 0:
        return x + 1
    else:
        return x - 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_map_sum
@program(In(r(3, seed=1), r(3, seed=2), r(3, seed=3), r(3, seed=4)),
         In(r(2, 3, seed=1), r(3, seed=2), r(1, 3, seed=3), r(3, seed=4)))
def map_sum(a, b, c, d):
    return sum(map(lambda x: x + 1, [a, b, c, d]))


# pytorch test/dynamo/test_functions.py::FunctionTests::test_set_difference
@program(two(), two((2, 2), (2,), seed=4))
def set_difference(a, b):
    set1 = {"apple", "banana", "cherry"}
    set2 = {"google", "microsoft", "apple"}
    difference_set = set1.difference(set2)
    if "apple" in difference_set:
        x = a + b
    else:
        x = a - b
    if "banana" in difference_set:
        y = a + b
    else:
        y = a - b
    return x, y


_const_set = set([1, 2])


def _grow_set():
    _const_set.add(3)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_constant_set
@program(In(r(4, seed=1)), In(r(2, seed=2)), flip=_grow_set, globals=("_const_set",))
def constant_set(x):
    return torch.cos(x) * len(_const_set)


_add_set = set([1, 2])


# pytorch test/dynamo/test_functions.py::FunctionTests::test_set_add
@program(In(r(4, seed=1)), In(r(2, seed=2)), globals=("_add_set",))
def set_add(x):
    _add_set.add(3)
    return torch.cos(x) * len(x)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_list_sorted2
@program(In(r(10, seed=1)), In(r(3, seed=2)))
def list_sorted2(x):
    y = [("john", "A", 8), ("jane", "B", 5), ("dave", "B", 10)]
    return (
        x + 1,
        sorted(y),
        sorted(y, key=lambda student: student[2]),
        sorted(y, key=lambda student: student[2], reverse=True),
    )


# pytorch test/dynamo/test_functions.py::FunctionTests::test_dict_hasattr
@program(In({"a": r(3, seed=1)}), In(r(4, seed=2)), In({"a": r(2, seed=3)}))
def dict_hasattr(x):
    if hasattr(x, "to"):
        return x.to("cpu")
    if hasattr(x, "items"):
        return torch.cos(x["a"])
    return x


# pytorch test/dynamo/test_functions.py::FunctionTests::test_namedtuple_defaults
@program(two(), two((3,), (3,), seed=2))
def namedtuple_defaults(a, b):
    mytuple = collections.namedtuple("mytuple", ["x", "y", "xy"], defaults=(None, 1, None))
    tmp = mytuple(a, xy=b)
    return tuple(mytuple(tmp.x, tmp[1], tmp.xy + b))  # a class made per call: compared as a tuple


class MyNamedTuple(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor

    def add(self) -> torch.Tensor:
        return self.first + self.second

    @staticmethod
    def static_method() -> int:
        return 1

    @classmethod
    def class_method(cls) -> str:
        return cls.__name__


# pytorch test/dynamo/test_functions.py::FunctionTests::test_namedtuple_user_methods
@program(two(), two((2, 3), (3,), seed=2))
def namedtuple_user_methods(a, b):
    mytuple = MyNamedTuple(a, b)
    return mytuple.add(), mytuple.static_method(), mytuple.class_method()


# pytorch test/dynamo/test_functions.py::FunctionTests::test_namedtuple_hasattr
@program(two(), two((3,), (3,), seed=2))
def namedtuple_hasattr(a, b):
    mytuple = MyNamedTuple(a, b)

    def isinstance_namedtuple(obj) -> bool:
        return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")

    if isinstance_namedtuple(mytuple):
        return a + b
    else:
        return a - b


# pytorch test/dynamo/test_functions.py::FunctionTests::test_torch_size_hasattr
@program(In(r(10, seed=1)), In(r(3, 2, seed=2)))
def torch_size_hasattr(x):
    if hasattr(x.shape, "_fields"):
        return x + 1
    else:
        return x - 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_fstrings2
@program(In(r(10, seed=1)), In(r(10, 2, seed=2)), In(r(3, seed=3)), In(r(100, seed=4)))
def fstrings2(x):
    tmp = f"{x.shape[0]} bar"
    if tmp.startswith("10"):
        return x + 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_fstrings3
@program(In(r(10, seed=1)), In(torch.nn.Parameter(r(3, seed=2))))
def fstrings3(x):
    tmp = f"{x.__class__.__name__} foo"
    if tmp.startswith("Tensor"):
        return x + 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_fstrings6
@program(In(r(10, 10, seed=1)), In(r(5, 15, seed=2)), In(r(3, 4, seed=3)))
def fstrings6(x):
    tmp = f"{x.shape[0] + x.shape[1]}"
    if "20" in tmp:
        return x + 1


# pytorch test/dynamo/test_functions.py::FunctionTests::test_is_contiguous_frame_counts
@program(In(r(10, seed=1)), In(r(2, 3, 4, 4, seed=2)),
         In(r(2, 3, 4, 4, seed=3).contiguous(memory_format=torch.channels_last)), In(r(10, seed=4)[::2]),
         In(r(2, 3, 6, 6, seed=5)[:, :, 2:-2, 1:-1]))
def is_contiguous_frame_counts(x):
    if x.is_contiguous():
        return x + 1
    elif x.is_contiguous(memory_format=torch.channels_last):
        return x + 2
    else:
        return x + 3


# pytorch test/dynamo/test_functions.py::FunctionTests::test_torch_distributions_functions
@program(In(r(10, seed=1)), In(r(3, 4, seed=2)))
def torch_distributions_functions(x):
    normal = torch.distributions.Normal(x, torch.tensor(1))
    independent = torch.distributions.Independent(normal, 1)
    return independent.log_prob(x)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_context_wrapping_nested_functions_no_closure
@program(In(r(10, seed=1, requires_grad=True)), In(r(3, seed=2)), In(r(3, seed=3, requires_grad=True)).no_grad())
def context_wrapping_nested_functions_no_closure(x):
    @torch.no_grad()
    def augment(x: torch.Tensor) -> torch.Tensor:
        return (x + 1) * 2

    return augment(x)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_math_radians
@program(In(r(10, seed=1), 12), In(r(10, seed=2), 90), In(r(3, seed=3), 12.5))
def math_radians(x, a):
    return x + math.radians(a)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_torch_from_numpy
@program(In(r(10, seed=1)), In(r(1, seed=2)), In(r(1, 3, seed=3)))
def torch_from_numpy(x):
    a = x.numpy()
    b = torch.from_numpy(a)
    if b.size(0) == 1:
        return torch.tensor(True)
    else:
        return torch.tensor(False)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_mean_sum_np
@program(In(r(10, 10, seed=1)), In(r(3, 2, seed=2)))
def mean_sum_np(x: torch.Tensor):
    import numpy as np

    x_mean = np.mean(x.numpy(), 1)
    x_sum = np.sum(x_mean)
    x_sum_array = np.asarray(x_sum)
    return torch.from_numpy(x_sum_array)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_list_add_then_mutate
@program(In(r(10, seed=1)), In(r(3, seed=2)))
def list_add_then_mutate(x):
    my_list = [1, x]
    y = x / 4.0
    my_list = my_list + [x / 2.0, 4]
    my_list.append(y)
    return sum(my_list)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_in_not_in
@program(In(r(10, seed=1)), In(t(3.0, 1.0)), In(t(6.0, 6.0)))
def in_not_in(x):
    mylist = [1, 2, 3, 4, 5, x]
    myotherlist = [1, 2, 3, 4, 5]
    assert 3 in mylist
    assert 6 not in myotherlist
    return sum(mylist)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_partials_lambda
@program(In(r(10, seed=1)), In(r(2, 2, seed=2)))
def partials_lambda(x):
    multiply = lambda x, y: x * y
    triple = functools.partial(multiply, y=3)
    return triple(x)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_partials_hasattr (attr="__code__" and "args")
@program(In(r(3, 4, seed=1)), In(r(2, seed=2)))
def partials_hasattr(t):
    f = lambda x, y: torch.sin(x) + torch.cos(y)
    p = functools.partial(f, y=t)
    if hasattr(p, "__code__"):
        return p(t)
    elif hasattr(p, "args"):
        return p(t) * 2
    else:
        return torch.zeros_like(t)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_filter
@program(In([torch.arange(2, dtype=torch.bfloat16), torch.arange(2, dtype=torch.bfloat16).requires_grad_(True)]),
         In([torch.arange(2, dtype=torch.bfloat16), torch.arange(2, dtype=torch.bfloat16)]),
         In([r(3, seed=1, requires_grad=True), r(3, seed=2), r(3, seed=3, requires_grad=True)]))
def filter_requires_grad(inputs):
    out = inputs[0]
    for inp in filter(lambda x: (x.requires_grad), inputs):
        out = out * inp
    return out


# pytorch test/dynamo/test_functions.py::FunctionTests::test_filter_fallback
@program(In([torch.ones(2, dtype=torch.bfloat16), torch.arange(2, dtype=torch.bfloat16)]),
         In([torch.arange(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)]),
         In([t(1.0, 5.0), t(2.0, 3.0), t(1.0, 1.0)]))
def filter_fallback(inputs):
    out = inputs[0]
    for inp in filter(lambda x: x[0] == 1, inputs):
        out = out * inp
    return out


# pytorch test/dynamo/test_functions.py::FunctionTests::test_pow_int
@program(In(torch.ones(2, 2) * 3, 2), In(torch.ones(2, 2) * 3, 3), In(r(3, seed=1).abs(), 0.5))
def pow_int(a, b):
    return torch.pow(a, b)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_tensor_size_indexed_by_symint
@program(In(r(10, 2, seed=1), r(10, 8, 6, seed=2)), In(r(10, 1, seed=3), r(10, 8, 6, seed=4)),
         In(r(3, 2, seed=5), r(4, 5, 7, seed=6)))
def tensor_size_indexed_by_symint(x, y):
    index = x.shape[-1]
    return x + y.shape[index]


def udf_mul(x, y):
    return x * y


def udf_mul2(x, y, z):
    return x * y * z


def udf_add(x, y):
    return x + y


_multiply = lambda x, y: x * y
_P0 = functools.partial(udf_mul, y=r(2, 2, seed=10))
_P1 = functools.partial(udf_mul, y=r(2, 2, seed=11))
_P3 = functools.partial(_multiply, y=r(3, 3, seed=12))


# pytorch test/dynamo/test_functions.py::FunctionTests::test_partials_recompilation
@program(In(_P0, _P1, r(2, 2, seed=1)), In(_P1, _P0, r(2, 2, seed=2)), In(_P3, _P3, r(3, 3, seed=3)),
         In(udf_add.__get__(1.0), _P0, r(2, 2, seed=4)))
def partials_recompilation(f0, f1, x):
    return f0(x) * f1(x)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_partials_graph_break_reconstruct_args_and_kwargs
@program(In(udf_mul2, r(2, 2, seed=1)), In(udf_mul2, r(3, seed=2)),
         In(lambda x, y, z: x + y + z, r(2, 2, seed=3)))
def partials_graph_break_reconstruct_args_and_kwargs(udf_mul_0, x):
    lambda0 = functools.partial(udf_mul_0, x, 4, z=x)
    lambda1 = functools.partial(udf_mul_0, 4, z=x)
    return torch.mul(lambda0(), lambda1(5))


# pytorch test/dynamo/test_functions.py::FunctionTests::test_manual_seed
@program(In(), In(), random=True)
def manual_seed():
    torch.manual_seed(3)
    return torch.randint(0, 5, (5,))


# pytorch test/dynamo/test_functions.py::FunctionTests::test_no_recompile_inner_function
@program(In(r(2, seed=1)), In(r(2, seed=1)), In(r(3, seed=2)), random=True)
def no_recompile_inner_function(inp):
    def g(y):
        return inp + y

    return g(torch.rand([1]))


# pytorch test/dynamo/test_functions.py::FunctionTests::test_non_inlined_closure
@program(In(r(1, seed=1), r(1, seed=2)), In(r(3, seed=3), r(3, seed=4)))
def non_inlined_closure(x, y):
    one = lambda x, y: x + y

    def inner():
        return one(x, y)

    res = inner()
    one = lambda x, y: x - y
    res += inner()
    return res


# pytorch test/dynamo/test_functions.py::FunctionTests::test_compare_constant_and_tensor (op=operator.is_not, operator.lt)
@program(In(r(10, seed=1)), In(r(3, seed=2) - 20))
def compare_constant_and_tensor(x):
    return operator.is_not(-10, x), operator.lt(-10, x)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_pos
@program(In(torch.ones(4), 1), In(1, torch.ones(4)), In(-1.1, 1.1), In(torch.ones(4, dtype=torch.float32), 1.1))
def pos(x, y):
    return operator.pos(x) * +y


# pytorch test/dynamo/test_functions.py::FunctionTests::test_truth
@program(In(torch.ones(1), 1), In(torch.zeros(1), 1), In(torch.ones(1), torch.ones(1)), In(torch.ones(1), torch.zeros(1)))
def truth(x, y):
    return operator.truth(x) and bool(y)


# pytorch test/dynamo/test_functions.py::FunctionTests::test_rand_inlined (returns what it built)
@program(In(), In(), In(), random=True)
def rand_inlined():
    import random

    idx_size = [10]
    idx_size[random.randint(0, 0)] = random.randint(1, 8)
    t = tuple(idx_size)
    src_size = [random.randint(1, 5) + s for s in idx_size]
    idx = torch.empty(t)
    return idx.shape, src_size


# pytorch test/dynamo/test_functions.py::FunctionTests::test_rand_tensor_partial (smaller shapes)
@program(In(), In(), random=True)
def rand_tensor_partial():
    from functools import partial

    SdpaShape = collections.namedtuple("Sdpa_Shape", ["batch", "num_heads", "seq_len", "head_dim"])
    make_tensor = partial(torch.rand, device="cpu", dtype=torch.float16, requires_grad=True)
    bsz, num_heads, seq_len_q, seq_len_kv, head_dim = (2, 2, 4, 4, 3)
    make_q_tensor = partial(make_tensor, SdpaShape(bsz, num_heads, seq_len_q, head_dim))
    make_kv_tensor = partial(make_tensor, SdpaShape(bsz, num_heads, seq_len_kv, head_dim))
    t1 = make_q_tensor()
    t2 = make_kv_tensor()
    return t1 + t2


# pytorch test/dynamo/test_functions.py::DefaultsTests::test_func_default_tensor_args
@program(In(), In(), In(), factory=True)
def func_default_tensor_args():
    def global_func_with_default_tensor_args(x=torch.zeros((2, 2)), *, kw_x=torch.zeros((1, 2))):
        x.add_(1)
        kw_x.add_(1)
        return x, kw_x

    def func():
        return global_func_with_default_tensor_args()

    return func


# pytorch test/dynamo/test_functions.py::DefaultsTests::test_meth_default_tensor_args
@program(In(), In(), In(), factory=True)
def meth_default_tensor_args():
    class ModuleWithDefaultTensorArgsMethod(torch.nn.Module):
        def forward(self, x=torch.zeros((2, 2)), *, kw_x=torch.zeros((1, 2))):
            x.add_(1)
            kw_x.add_(1)
            return x, kw_x

    class WrapperModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = ModuleWithDefaultTensorArgsMethod()

        def forward(self):
            return self.m()

    return WrapperModule()


# pytorch test/dynamo/test_functions.py::DefaultsTests::test_func_default_torch_args
@program(In(), In())
def func_default_torch_args():
    def func_with_default_torch_args(dt=torch.float16, ds=torch.Size((1, 2, 3)), dd=torch.device("cpu")):
        return torch.ones(ds, dtype=dt, device=dd)

    return func_with_default_torch_args()


from dataclasses import dataclass, field  # noqa: E402
from typing import Dict, List  # noqa: E402


@dataclass
class Output:
    scalar: int = 2
    named_tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    lists: List[torch.Tensor] = field(default_factory=list)

    def scale(self):
        return self.scalar * 2


# pytorch test/dynamo/test_functions.py::DefaultsTests::test_dataclass_factory
@program(In(r(4, seed=1)), In(r(2, 3, seed=2)))
def dataclass_factory(x):
    a = Output(1)
    scaled_value = a.scale()
    b = Output(5, named_tensors={"x": x})
    c = Output()
    if isinstance(a.named_tensors, dict):
        x = torch.sin(x)
    c.scalar = 6
    c.named_tensors["x"] = x
    return c, torch.cos(x) * scaled_value + b.named_tensors["x"] + c.scalar


# pytorch test/dynamo/test_functions.py::DefaultsTests::test_listlike_of_tensors_contains_constant (listlike=list)
@program(In(t(0.0)), In(t(5.0)), In(t(0.0, 1.0)))
def listlike_of_tensors_contains_constant(x):
    x.add_(1)
    s = list([x])
    res = 1 in s
    return res


# pytorch test/dynamo/test_functions.py::DefaultsTests::test_cast_tensor_single_elem (t=float)
@program(In(t(1.0)), In(t(2.5)), In(t(1.0, 2.0)))
def cast_tensor_single_elem(x):
    x = x + 1
    return float(x)


# pytorch test/dynamo/test_functions.py::DefaultsTests::test_set_construction
@program(In(r(4, seed=1)), In(r(2, seed=2)))
def set_construction(x):
    y = x.add_(1)
    s = set({x})
    s.add(y)
    return len(s)


_fs_d = {frozenset(): r(4, seed=20)}


# pytorch test/dynamo/test_functions.py::DefaultsTests::test_frozenset_reconstruction
@program(In(r(4, seed=1)), In(r(3, 4, seed=2)))
def frozenset_reconstruction(x):
    k = frozenset()
    return _fs_d[k] * x
