"""Programs from PyTorch's test/dynamo/test_misc.py (MiscTests): the ``fn`` bodies the tests
compile, with user classes and closures they define. Tests that build closures over their own
locals become factories (``factory=True``), so the eager run and the tool's run each get
their own cells."""
# ruff: noqa: F841
from __future__ import annotations

import dataclasses
import typing

import torch

from . import Fresh, In, program, r, t

T = typing.TypeVar("T")
GLOBAL_INT = 1


# pytorch test/dynamo/test_misc.py::MiscTests::test_boolarg
@program(In(r(10, 10, seed=1), r(10, 10, seed=2), True), In(r(10, 10, seed=1), r(10, 10, seed=2), False),
         In(r(10, 10, seed=1), r(10, 10, seed=2), None), In(r(3, seed=3), r(3, seed=4), 1))
def boolarg(aa, bb, flag):
    if flag:
        return aa - bb
    else:
        return bb - aa


# pytorch test/dynamo/test_misc.py::MiscTests::test_check_raises_at_runtime_when_predicate_false_and_message_has_no_closure
@program(In(r(4, seed=1)), In(r(5, seed=2)), In(r(3, seed=3)))
def check_predicate_message_no_closure(x):
    torch._check(x.shape[0] > 3, lambda: "Shape is not greater than 3")
    return x + 1


# pytorch test/dynamo/test_misc.py::MiscTests::test_check_raises_at_runtime_when_predicate_false_and_message_has_global
@program(In(r(4, seed=1)), In(r(3, seed=3)), flip=lambda: globals().__setitem__("GLOBAL_INT", 7),
         globals=("GLOBAL_INT",))
def check_predicate_message_global(x):
    torch._check(x.shape[0] > 3, lambda: f"{GLOBAL_INT} is not greater than 3")
    return x + GLOBAL_INT


# pytorch test/dynamo/test_misc.py::MiscTests::test_assert (fn2)
@program(In(r(10, seed=1)), In(r(2, 3, seed=2)))
def assert_shape_eq(x):
    assert x.shape == x.shape  # noqa: S101
    return x.abs()


class Cfg:
    def __init__(self, val=0.5, count=3) -> None:
        self.val = val
        self.count = count


# pytorch test/dynamo/test_misc.py::MiscTests::test_config_obj
@program(In(torch.zeros(1), Cfg(1.0)), In(torch.zeros(1), Cfg()), In(torch.zeros(1), Cfg(count=1)),
         In(torch.zeros(1), Cfg(2.0, 1)))
def config_obj(x, cfg):
    for i in range(cfg.count):
        x = x + cfg.val
    return x


class _Add7Cfg(Cfg):
    def __init__(self):
        super().__init__(0.5, 10)
        self.just_add_7 = True


# pytorch test/dynamo/test_misc.py::MiscTests::test_config_getattr_default
@program(In(torch.zeros(1), Cfg(0.5, 10)), In(torch.zeros(1), _Add7Cfg()), In(torch.zeros(2), Cfg(0.5, 10)))
def config_getattr_default(x, cfg):
    if getattr(cfg, "just_add_7", False):
        return x + 7
    for i in range(cfg.count):
        x = x + cfg.val
    return x


# pytorch test/dynamo/test_misc.py::MiscTests::test_size_input
@program(In(torch.zeros(10, 20), torch.Size([10, 20])), In(torch.zeros(10, 20), (10, 20)),
         In(torch.zeros(10, 20), [10, 20]), In(torch.zeros(10, 20), (3, 1)))
def size_input(x, s):
    a, b = s
    return x + (a - b)


# pytorch test/dynamo/test_misc.py::MiscTests::test_cell_output1
@program(In(t(100.0), t(100.0)), In(t(1.0, 2.0), t(3.0)), factory=True)
def cell_output1():
    out = None

    def fn(a, b):
        nonlocal out
        out = a + b * 10

    return fn


# pytorch test/dynamo/test_misc.py::MiscTests::test_tensor_dict3
@program(In({"a": t(100.0), "b": t(200.0)}, {"b": t(100.0), "c": t(200.0)}),
         In({"a": t(1.0)}, {"a": t(2.0), "d": t(3.0)}))
def tensor_dict3(inputs_a, inputs_b):
    total = torch.zeros(1)
    input_keys = inputs_a.keys() | inputs_b.keys()
    for k in input_keys:
        if k in inputs_a:
            total += inputs_a[k]
        if k in inputs_b:
            total += inputs_b[k]
    return total


# pytorch test/dynamo/test_misc.py::MiscTests::test_dictcomp
@program(In({"a": t(100.0), "b": t(200.0)}), In({"b": t(1.0), "a": t(2.0), "c": t(3.0)}))
def dictcomp(inputs):
    return {k: v + 1 for k, v in inputs.items()}


# pytorch test/dynamo/test_misc.py::MiscTests::test_is_tensor2
@program(In({"input": r(2, 3, seed=1)}), In(r(2, 3, seed=2)), In(None))
def is_tensor2(x):
    if torch.is_tensor(x):
        return x + 1
    else:
        return torch.ones([2, 3])


# pytorch test/dynamo/test_misc.py::MiscTests::test_is_floating_point
@program(In(r(10, seed=1), r(10, seed=2)), In(r(10, seed=3), r(10, seed=4, dtype=torch.int64)))
def is_floating_point_arg(a, b):
    x = a + 1.0
    if torch.is_floating_point(b):
        x = x + b
    return x + 2.0


# pytorch test/dynamo/test_misc.py::MiscTests::test_numel
@program(In(r(10, seed=1)), In(r(3, 4, seed=2)), In(r(0, 2, seed=3)))
def numel(a):
    return (a + a.numel() + torch.numel(a), a + a.nelement())


# pytorch test/dynamo/test_misc.py::MiscTests::test_pair
@program(In(r(10, 10, seed=1)), In(r(2, 3, seed=2)))
def pair(a):
    return (
        torch.zeros(torch.nn.modules.utils._pair(a.size()))
        + a
        + torch.ones(torch.nn.modules.utils._ntuple(3)(3)).sum()
    )


# pytorch test/dynamo/test_misc.py::MiscTests::test_type_copy
@program(In([r(10, seed=1), r(10, seed=2)]), In((r(10, seed=3), r(10, seed=4))), In([r(2, seed=5), r(2, seed=6)]))
def type_copy(seq):
    a, b = seq
    return type(seq)([a + 1, b + 2, a + b])


class MyObj:  # noqa: B903
    def __init__(self, a, b):
        self.a = a
        self.b = b


# pytorch test/dynamo/test_misc.py::MiscTests::test_setattr_mutation1
@program(In(MyObj(r(10, seed=1), r(10, seed=2))), In(MyObj(r(3, seed=3), r(3, seed=4))))
def setattr_mutation1(obj):
    obj.c = obj.a * obj.b + 1
    obj.b = obj.a * obj.c + 2
    obj.a = obj.b * obj.c + 3
    obj.c = obj.a * obj.b + 4
    obj.b = obj.a * obj.c + 5
    obj.a = obj.b * obj.c + 6
    return obj


class MyObj2:
    def __init__(self, x):
        self.a = x + 1
        self.b = x + 2


# pytorch test/dynamo/test_misc.py::MiscTests::test_setattr_mutation2
@program(In(r(10, seed=1)), In(r(2, 2, seed=2)))
def setattr_mutation2(x):
    x = x / 3.0
    obj = MyObj2(x)
    obj.c = obj.a * obj.b + 1
    obj.b = obj.a * obj.c + 2
    obj.a = obj.b * obj.c + 3
    return obj


@dataclasses.dataclass(frozen=True)
class D:
    x: torch.Tensor

    def __post_init__(self):
        object.__setattr__(self, "y", self.x + 2)


# pytorch test/dynamo/test_misc.py::MiscTests::test_object_setattr (fn4)
@program(In(r(10, seed=1)), In(r(3, seed=2)))
def object_setattr(x):
    d = D(x)
    return d


class MyClassFoo:
    pass


# pytorch test/dynamo/test_misc.py::MiscTests::test_user_defined_class_name
@program(In(r(10, seed=1), r(10, seed=2), r(10, seed=3)), In(r(3, seed=4), r(3, seed=5), r(3, seed=6)))
def user_defined_class_name(a, b, c):
    tmp = MyClassFoo()
    if tmp.__class__.__name__ == "MyClassFoo":
        return a - b / c


class BaseClass:
    def __init__(self, x):
        self.x = x


class DerivedClass(BaseClass):
    def __init__(self, x):
        super().__init__(x)
        self.y = x * 2


# pytorch test/dynamo/test_misc.py::MiscTests::test_class_reassignment_graph_break
@program(In(torch.ones(1)), In(r(3, seed=1)))
def class_reassignment_graph_break(x):
    obj = BaseClass(5)
    obj.__class__ = DerivedClass
    is_derived = isinstance(obj, DerivedClass)
    has_y = hasattr(obj, "y")
    return x + 1, is_derived, has_y


class ExampleMeta(type):
    pass


class MetaClass1(metaclass=ExampleMeta):
    coeff = 4

    @classmethod
    def add(cls, x):
        return x + 1


class MetaClass2(MetaClass1):
    @classmethod
    def add(cls, x):
        return x + super().add(x) + super().coeff


# pytorch test/dynamo/test_misc.py::MiscTests::test_super_calling_with_metaclass
@program(In(r(3, seed=1), MetaClass2()), In(r(3, seed=2), MetaClass1()))
def super_calling_with_metaclass(x, obj):
    return x + obj.add(x)


class Foo:
    def __init__(self, val):
        super().__init__()
        self.val = val

    def __add__(self, other):
        return Foo(self.val + other.val)

    def __mul__(self, other):
        return Foo(self.val * other.val)

    def __truediv__(self, other):
        return Foo(self.val / other.val)

    def __sub__(self, other):
        return Foo(self.val - other.val)


# pytorch test/dynamo/test_misc.py::MiscTests::test_dunder_methods
@program(In(r(10, seed=1), r(10, seed=2), r(10, seed=3)), In(r(2, seed=1), 2.0, r(2, seed=3)))
def dunder_methods(a, b, c):
    return Foo(a) + Foo(b) * Foo(c) / Foo(a) - Foo(b)


# pytorch test/dynamo/test_misc.py::MiscTests::test_nested_closure_mutation
@program(In(), In(), In(), factory=True)
def nested_closure_mutation():
    def fn1():
        v1 = r(10, seed=1)

        def fn2():
            v2 = r(10, seed=2)

            def fn3():
                nonlocal v1, v2
                v1 += 1
                v2 += 2
                return v1 + v2

            return fn3

        rv = fn2()
        rv()
        rv()
        return rv

    return fn1()


# pytorch test/dynamo/test_misc.py::MiscTests::test_write_to_closures_in_inlining
@program(In(), In(), factory=True)
def write_to_closures_in_inlining():
    def make_counter():
        x = r(10, seed=3)

        def counter():
            nonlocal x
            x = x + 1
            return x

        return counter

    counter = make_counter()

    def fn():
        return counter() + counter()

    return fn


# pytorch test/dynamo/test_misc.py::MiscTests::test_closure_out_of_scope_cell_with_mutation
@program(In(), In(), In(), factory=True)
def closure_out_of_scope_cell_with_mutation():
    cell1 = 0.25
    cell2 = r(3, 3, seed=4)

    def indirect():
        return direct()

    def direct():
        def inner():
            nonlocal cell1, cell2
            x = cell2 + 1
            cell1 += 1
            cell2 += 10
            x = x + cell2
            return cell1, cell2, x

        return inner()

    return indirect


# pytorch test/dynamo/test_misc.py::MiscTests::test_closure_with_mutation_and_graph_break
@program(In(), In())
def closure_with_mutation_and_graph_break():
    x = torch.zeros(1)

    def subfunc():
        x[0] = backup

    if x[0] >= -1e5:
        pass

    backup = 1
    subfunc()
    return x


# pytorch test/dynamo/test_misc.py::MiscTests::test_closure_write_across_functions
@program(In(r(1, seed=1)), In(r(3, seed=2)), factory=True)
def closure_write_across_functions():
    z = 1
    k = 2

    def create_fn():
        def fn(x):
            nonlocal k, z
            k = z

        return fn

    def update_z_and_run_fn(fn, x):
        nonlocal z
        z = 3
        fn(x)
        return x.cos()

    def foo(x):
        fn = create_fn()
        return update_z_and_run_fn(fn, x)

    return foo


# pytorch test/dynamo/test_misc.py::MiscTests::test_free_var_and_local_name_collision
@program(In(torch.ones(1)), In(r(3, seed=1)), factory=True)
def free_var_and_local_name_collision():
    x = 10

    def make_func():
        def func():
            return x

        return func

    def root(t):
        x = 0
        func = make_func()
        res = func()
        return t + 1, x, res

    return root


# pytorch test/dynamo/test_misc.py::MiscTests::test_writes_to_cells_across_frames1
@program(In(torch.zeros(1)), In(torch.zeros(1)), In(r(2, seed=1)), factory=True)
def writes_to_cells_across_frames1():
    x = 0

    def inc_x():
        nonlocal x
        x += 1

    class MyObj:
        def inc_x_then_return_x(self, fn):
            fn()
            return x

    def root(t):
        obj = MyObj()
        res = obj.inc_x_then_return_x(inc_x)
        return t + 1, res

    return root


# pytorch test/dynamo/test_misc.py::MiscTests::test_write_to_cells_with_name_shadowing
@program(In(torch.ones(1)), In(r(3, seed=1)), factory=True)
def write_to_cells_with_name_shadowing():
    x = 0
    y = x

    def make_x_get_set():
        # NOTE: this `x` is a different cell object than the outer `x`.
        x = y

        def set_x(v):
            nonlocal x
            x = v

        def get_x():
            return x

        return get_x, set_x

    get_x, set_x = make_x_get_set()

    def fn(t):
        set_x(42)  # This sets the `x` created within `make_x_get_set`
        res = t + x  # This uses the `x` outside `make_x_get_set`.
        return res, get_x()

    return fn


# pytorch test/dynamo/test_misc.py::MiscTests::test_top_package_import
@program(In(r(4, 5, seed=1)), In(r(2, seed=2)))
def top_package_import(x):
    import torch.fx

    assert not isinstance(x, torch.fx.Proxy)  # noqa: S101
    return torch.sin(x)


# pytorch test/dynamo/test_misc.py::MiscTests::test_typing_typevar
@program(In(r(3, seed=1)), In(r(2, 2, seed=2)))
def typing_typevar(x):
    def sumt(y: torch.Tensor) -> torch.Tensor:
        return torch.sum(y)

    def foo(c: typing.Callable[[T], T], y: T) -> T:
        return c(y)

    return foo(sumt, x)


# pytorch test/dynamo/test_misc.py::MiscTests::test_typing_union_and_optional
@program(In(r(3, seed=1)), In(r(2, 2, seed=2)))
def typing_union_and_optional(x):
    a = torch.jit.annotate(typing.Dict[str, typing.Optional[torch.Tensor]], {})
    b = torch.jit.annotate(typing.Dict[str, typing.Union[torch.Tensor, None]], {})
    return a, b, x + 1


# pytorch test/dynamo/test_misc.py::MiscTests::test_variable_tracker_recursively_contains
@program(In(r(4, seed=1)), In(r(2, 2, seed=2)))
def variable_tracker_recursively_contains(x):
    data = [[None] * 3] * 3
    for i in range(3):
        if i == 0:
            data[0][i] = x
        else:
            data[0][i] = data[0][i - 1] + 1
    return data[0][-1]


# pytorch test/dynamo/test_misc.py::MiscTests::test_is_compiling (f3)
@program(In(), In())
def is_compiling():
    if torch.compiler.is_compiling():
        return torch.ones(2, 2)
    else:
        return torch.zeros(2, 2)


# pytorch test/dynamo/test_misc.py::MiscTests::test_torch_generator_set_state
@program(In(), In(), In(), random=True)
def torch_generator_set_state():
    default_state = torch.default_generator.get_state()
    x = torch.rand([2, 3])
    if default_state.dtype != "float32":
        x = x * 2
    torch.default_generator.set_state(default_state)
    y = torch.rand([2, 3])
    return x, y


# pytorch test/dynamo/test_misc.py::MiscTests::test_torch_distributions_lazy_property
@program(In(r(4, 4, seed=1).abs()), In(r(2, 3, seed=2).abs()))
def torch_distributions_lazy_property(x):
    return torch.distributions.Categorical(probs=x).entropy()


# pytorch test/dynamo/test_misc.py::MiscTests::test_guard_failure_fn_shape_control
@program(In(r(2, 2, seed=1), r(2, 2, seed=2)), In(r(5, 5, seed=3), r(5, 5, seed=4)),
         In(r(3, 2, seed=5), r(3, 2, seed=6)))
def guard_failure_fn_shape_control(x, y):
    if x.shape[0] < 4:
        if y.shape[0] < 3:
            return x * y
        else:
            return x + y
    else:
        return -1


# pytorch test/dynamo/test_misc.py::MiscTests::test_guard_failure_fn_tensor_iter
@program(In(r(10, 10, seed=1)), In(r(9, 10, seed=2)))
def guard_failure_fn_tensor_iter(x):
    for y in x:
        y.add_(1.0)
    return y


# pytorch test/dynamo/test_misc.py::MiscTests::test_guard_sym_node_fstring_when_used
@program(In(r(10, 11, seed=1)), In(r(9, 11, seed=2)))
def guard_sym_node_fstring_when_used(x):
    f_str = f"{x.shape[0]}"
    return x.sin(), f_str


class A:
    a = 4

    def add(self, x):
        return x + 10

    def mul(self, x):
        return x * 0.1


class B(A):
    coeff = 4

    def add(self, x):
        return x + 20

    @classmethod
    def cube(cls, x):
        return cls.coeff * x * x * x

    def mul(self, x):
        return super().mul(x) * x * 0.2


class C(B):
    def add(self, x):
        b = super().cube(x)
        c = A.add(self, x)
        d = B.mul(self, x)
        e = super(B, self).add(x)
        f = super().a * x
        return b + c + d + e + f


def _set_class_attr():
    A.a = 5


# pytorch test/dynamo/test_misc.py::MiscTests::test_call_parent_non_class_methods_from_child
@program(In(r(4, seed=1)), In(r(2, seed=2)), flip=_set_class_attr, globals=("A",), factory=True)
def call_parent_non_class_methods_from_child():
    return C().add


class _MetaClass(type):
    pass


class MyClassWithMeta(metaclass=_MetaClass):
    pass


# pytorch test/dynamo/test_misc.py::MiscTests::test_builder_for_class_with_metaclass
@program(In(r(4, 4, seed=1), MyClassWithMeta()), In(r(4, 4, seed=1), MyClassFoo()), In(r(2, seed=2), 3))
def builder_for_class_with_metaclass(x, y):
    if isinstance(y, MyClassWithMeta):
        return x + 1
    else:
        return x - 1


def _inner_fn(*args):
    acc = torch.ones(10, 10)
    for arg in args:
        acc.add_(arg)
    return acc


_TUPLE_INPUTS = [r(10, 10, seed=i) for i in range(4)]


# pytorch test/dynamo/test_misc.py::MiscTests::test_tuple_from_tuple_iter
@program(In(Fresh(lambda: iter(tuple(_TUPLE_INPUTS[:3])))), In(Fresh(lambda: iter(tuple(_TUPLE_INPUTS[1:])))),
         In(Fresh(lambda: iter(tuple(_TUPLE_INPUTS)))))
def tuple_from_tuple_iter(params):
    y = tuple(params)
    return _inner_fn(*y)
