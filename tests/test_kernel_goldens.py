"""Golden kernel sources: the generated C translation unit and Triton module of a representative
set of programs, compared byte for byte with files under ``tests/goldens/kernels/``.

They pin what code generation writes, so a refactor of the renderers shows it changes no output.
A change that is meant to alter the generated code regenerates the affected files with

    SYMTRACE_UPDATE_GOLDENS=1 .venv/bin/python -m pytest tests/test_kernel_goldens.py

and the diff of the golden files is reviewed with the change. Nothing is compiled or run here
(rendering Triton source needs no triton): the programs are lowered (``Lowering``, and
``TritonLowering`` for the ``cuda`` path, on CPU tensors as under the interpreter) and the
sources rendered. The C math prelude (``prelude.h``, not generated) stands as one marker line;
the Triton preludes (generated) have golden files of their own.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import symtrace  # noqa: E402
from symtrace.lower import codegen_c, codegen_triton  # noqa: E402
from symtrace.lower.ir import (BINARY_OPS, UNARY_OPS, Affine, Buffer, ExprBuilder, Kernel, Store, Var,  # noqa: E402
                               walk)
from symtrace.lower.lowering import Lowering  # noqa: E402
from symtrace.passes.fuse_attention import fuse_attention  # noqa: E402

GOLDEN_DIR = Path(__file__).parent / "goldens" / "kernels"
UPDATE = os.environ.get("SYMTRACE_UPDATE_GOLDENS", "") not in ("", "0")
C_PRELUDE = "/* prelude.h */"


# --------------------------------------------------------------------------- the programs

def unary_float(x):
    return (-x, x.abs(), torch.relu(x), x.floor(), x.ceil(), x.round(), x.trunc(), x.sign(),
            x.reciprocal(), x.sqrt(), x.rsqrt(), x.exp(), x.log(), x.log1p(), x.expm1(), x.sigmoid(),
            x.tanh(), torch.erf(x), F.gelu(x), F.gelu(x, approximate="tanh"), F.silu(x), x.sin(), x.cos(),
            x.isnan(), torch.logical_not(x), x.square(), x.clamp(-1, 1), F.leaky_relu(x), F.hardswish(x))


def binary_float(x, y):
    p, q = x > 0, y > 0
    return (x + y, x - y, x * y, x / y, torch.pow(x, y), torch.pow(x, 2.5), torch.pow(x, 0.5), torch.pow(x, -1),
            torch.maximum(x, y), torch.minimum(x, y), x == y, x != y, x < y, x <= y, x > y, x >= y,
            torch.logical_and(p, q), torch.logical_or(p, q), torch.logical_xor(p, q), x + 3 * y - 0.5, 2.0 - x,
            1.0 / x)


def integer_ops(a, b):
    return (a + b, a - b, a * b, -a, a.abs(), torch.relu(a), a.sign(), a.floor(), a.round(), a.clamp(-5, 5),
            torch.maximum(a, b), torch.minimum(a, b), a == b, a < b, a >= b, torch.logical_not(a), a.isnan(),
            a * 2 + 7, a / b)


def bool_ops(p, q):
    return (torch.logical_and(p, q), torch.logical_or(p, q), torch.logical_xor(p, q), ~p, p * q, p == q, p != q,
            p < q, torch.maximum(p, q), torch.minimum(p, q), torch.where(p, q, ~q))


def casts_from(x):
    return tuple(x.to(dt) for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                     torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool))


def round_trips(x):
    out = [x.to(dt).to(x.dtype) for dt in (torch.float16, torch.bfloat16, torch.float32, torch.bool, torch.int8,
                                           torch.uint8, torch.int16, torch.int32, torch.int64)]
    return tuple(out) + (x.to(torch.int32) * 3, (x.to(torch.float16) * 2).to(torch.int8))


def int_round_trips(a):
    return tuple(a.to(dt).to(torch.float32) + a for dt in (torch.int8, torch.uint8, torch.int16, torch.bool,
                                                            torch.float16, torch.float32))


def half_chain(x, y):
    return F.gelu(x * y + 1) - x.exp(), (x + y).sum(-1), torch.softmax(x, -1)


def mixed_half_int(x, a):
    return x * a, x + 2.5, x / a.float()


def softmax(x):
    return torch.softmax(x, dim=-1)


def log_softmax(x):
    return F.log_softmax(x, dim=-1)


def layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def row_reductions(x):
    return x.sum(-1), x.mean(-1), x.amax(-1), x.amin(-1), x - x.mean(-1, keepdim=True), x.var(-1), x.std(-1)


def int_row_reductions(a, p):
    return a.sum(-1), a.amax(-1), a.amin(-1), p.amax(-1), p.amin(-1), p.sum(-1)


def full_reductions(x):
    return x.sum(), x.amax(), x.amin(), x.mean()


def int_full_reductions(a, p):
    return a.sum(), a.amax(), a.amin(), p.sum(), p.amax(), p.amin()


def scalar_input(s, x):
    return s * 2 + 1, s.sum(), x * s


def empty_sum(x):
    return x.sum(), x * 2


def broadcasting(x, y, b):
    return x + y, torch.relu(x * b + 1), (x + b).softmax(-1)


def non_contiguous(x, t):
    return (x.t() * 2 + 1, x[:, ::2].exp(), t + 1, x[1:, 3:].sum(-1), x.unsqueeze(0).expand(3, -1, -1) * x,
            x[:, ::2].sum(), t.amax(), x.unsqueeze(0).expand(3, -1, -1)[:, :, ::3].sum())


def where_masks(x, m):
    return (torch.where(x > 0, x, 0.0), x.masked_fill(m, float("-inf")).softmax(-1),
            torch.where(m, x, x * 2), x.masked_fill(m, float("nan")).amax(-1))


def special_constants(x, d):
    return (x + float("inf"), x * float("nan"), x.clamp(-3e38, 3e38) * 1e39, d * 1e300, d - float("-inf"),
            x - 0.0, x + (-0.0))


def float64_rows(d):
    return torch.softmax(d, -1), d.amax(-1), d.sum()


def _transformer():
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from examples import models
    return models.build("transformer"), models.example_inputs("transformer")


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _i(*shape, dtype=torch.int32):
    lo = 0 if dtype == torch.uint8 else -50
    return torch.randint(lo, 50, shape, dtype=dtype)


def programs():
    """(name, function or module, example inputs, fuse attention) of every golden program."""
    torch.manual_seed(0)
    big = codegen_triton.PERSISTENT_MAX + 100   # a Triton row that loops over blocks
    many = 3 * codegen_c.BLOCK + 5               # a full reduction over several blocks
    block, xs = _transformer()
    return [
        ("unary_f32", unary_float, (_r(4, 33),), False),
        ("unary_f64", unary_float, (_r(4, 33, dtype=torch.float64),), False),
        ("unary_f16", unary_float, (_r(4, 33, dtype=torch.float16),), False),
        ("binary_f32", binary_float, (_r(4, 33), _r(4, 33)), False),
        ("binary_f64", binary_float, (_r(4, 33, dtype=torch.float64), _r(4, 33, dtype=torch.float64)), False),
        ("integer_i32", integer_ops, (_i(4, 33), _i(4, 33)), False),
        ("integer_i64", integer_ops, (_i(4, 33, dtype=torch.int64), _i(4, 33, dtype=torch.int64)), False),
        ("integer_i8", integer_ops, (_i(4, 33, dtype=torch.int8), _i(4, 33, dtype=torch.int8)), False),
        ("integer_u8", integer_ops, (_i(4, 33, dtype=torch.uint8), _i(4, 33, dtype=torch.uint8)), False),
        ("integer_i16", integer_ops, (_i(4, 33, dtype=torch.int16), _i(4, 33, dtype=torch.int16)), False),
        ("bool_ops", bool_ops, (_r(4, 33) > 0, _r(4, 33) > 0), False),
        ("casts_from_f32", casts_from, (_r(4, 33),), False),
        ("casts_from_f64", casts_from, (_r(4, 33, dtype=torch.float64),), False),
        ("casts_from_f16", casts_from, (_r(4, 33, dtype=torch.float16),), False),
        ("casts_from_bf16", casts_from, (_r(4, 33, dtype=torch.bfloat16),), False),
        ("casts_from_i32", casts_from, (_i(4, 33),), False),
        ("casts_from_i64", casts_from, (_i(4, 33, dtype=torch.int64),), False),
        ("casts_from_u8", casts_from, (_i(4, 33, dtype=torch.uint8),), False),
        ("casts_from_bool", casts_from, (_r(4, 33) > 0,), False),
        ("round_trips_f32", round_trips, (_r(4, 33),), False),
        ("round_trips_f64", round_trips, (_r(4, 33, dtype=torch.float64),), False),
        ("int_round_trips", int_round_trips, (_i(4, 33, dtype=torch.int64),), False),
        ("half_chain_f16", half_chain, (_r(4, 33, dtype=torch.float16), _r(4, 33, dtype=torch.float16)), False),
        ("half_chain_bf16", half_chain, (_r(4, 33, dtype=torch.bfloat16), _r(4, 33, dtype=torch.bfloat16)), False),
        ("mixed_half_int", mixed_half_int, (_r(4, 33, dtype=torch.float16), _i(4, 33)), False),
        ("softmax", softmax, (_r(8, 100),), False),
        ("softmax_long_row", softmax, (_r(2, big),), False),
        ("softmax_bf16", softmax, (_r(8, 100, dtype=torch.bfloat16),), False),
        ("log_softmax", log_softmax, (_r(8, 100),), False),
        ("layernorm", layernorm, (_r(2, 8, 64), _r(64), _r(64)), False),
        ("layernorm_f16", layernorm, (_r(8, 64, dtype=torch.float16), _r(64, dtype=torch.float16),
                                      _r(64, dtype=torch.float16)), False),
        ("rmsnorm", rmsnorm, (_r(8, 64), _r(64)), False),
        ("row_reductions", row_reductions, (_r(6, 50),), False),
        ("row_reductions_long", row_reductions, (_r(3, big),), False),
        ("int_row_reductions", int_row_reductions, (_i(6, 50), _r(6, 50) > 0), False),
        ("full_reductions", full_reductions, (_r(10, 30),), False),
        ("full_reductions_many_blocks", full_reductions, (_r(many),), False),
        ("full_reductions_f64", full_reductions, (_r(many, dtype=torch.float64),), False),
        ("int_full_reductions", int_full_reductions, (_i(many, dtype=torch.int64), _r(50) > 0), False),
        ("scalar_input", scalar_input, (torch.tensor(1.5), _r(5)), False),
        ("empty_sum", empty_sum, (_r(0),), False),
        ("broadcasting", broadcasting, (_r(4, 1, 8), _r(1, 5, 8), _r(8)), False),
        ("non_contiguous", non_contiguous, (_r(6, 10), _r(10, 6).t()), False),
        ("where_masks", where_masks, (_r(6, 20), _r(6, 20) > 0.5), False),
        ("special_constants", special_constants, (_r(4, 9), _r(4, 9, dtype=torch.float64)), False),
        ("float64_rows", float64_rows, (_r(5, 40, dtype=torch.float64),), False),
        ("transformer_block", block, xs, True),
        ("transformer_block_unfused", block, xs, False),
    ]


def hand_built_kernels():
    """Kernels no program lowers to today but the renderers accept: stores that convert
    (float -> integer, integer -> float, float -> bool buffers), roundings to bool, to an integer
    dtype from a float or bool, to float64; bool add/sub."""
    eb, v = ExprBuilder(), Var("i0", 7)
    idx = Affine.of(v)

    def buf(name, dtype, role="input"):
        return Buffer(name, dtype, (7,), (1,), role)
    x, n = eb.load(buf("x", torch.float32), idx), eb.load(buf("n", torch.int64), idx)
    p, d = eb.load(buf("p", torch.bool), idx), eb.load(buf("d", torch.float64), idx)
    stores = [Store(buf("o_i8", torch.int8, "output"), idx, x), Store(buf("o_u8", torch.uint8, "output"), idx, d),
              Store(buf("o_f32", torch.float32, "output"), idx, n), Store(buf("o_b", torch.bool, "output"), idx, x),
              Store(buf("o_f64", torch.float64, "output"), idx, p)]
    values = [eb.round_to(x, torch.bool), eb.round_to(x, torch.int8), eb.round_to(d, torch.int32),
              eb.round_to(p, torch.int16), eb.round_to(x, torch.float64), eb.binary("add", p, p),
              eb.binary("sub", p, eb.unary("not", p))]
    stores += [Store(buf(f"r{j}", torch.float32 if e.ty == "f32" else torch.float64 if e.ty == "f64" else torch.bool,
                         "output"), idx, e) for j, e in enumerate(values)]
    return [Kernel("k0", "pointwise", [], v, [], stores, ["hand_built"])]


class _Lowered:
    def __init__(self, kernels):
        self.kernels = kernels


# --------------------------------------------------------------------------- rendering

def lowerings(name, fn, inputs, fuse):
    """The CPU lowering and the ``cuda``-path (Triton) lowering of one program."""
    from symtrace.lower.triton_backend import TritonLowering
    gm = symtrace.symbolic_trace(fn, example_inputs=inputs)
    if fuse:
        fuse_attention(gm, masks=False)
    return Lowering(gm, inputs).run(), TritonLowering(gm, inputs, "cpu").run()


def render(cpu, cuda):
    """{file name suffix: source} of one program."""
    c = codegen_c.translation_unit(cpu.kernels, C_PRELUDE)
    head = codegen_triton.prelude(portable=True)
    triton = codegen_triton.module_source(cuda.kernels, portable=True)
    assert triton.startswith(head)
    plans = []
    for k in cuda.kernels:
        lp = codegen_triton.launch_plan(k)
        plans.append(f"# launch {k.name}: grid={lp.grid} warps={lp.warps} parts={lp.parts} "
                     f"part_dtype={lp.part_dtype}\n")
    return {".c.golden": c, ".triton.golden": "# <prelude>" + triton[len(head):] + "".join(plans)}


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    old = os.environ.get("SYMTRACE_CACHE_DIR")
    os.environ["SYMTRACE_CACHE_DIR"] = str(tmp_path_factory.mktemp("symtrace-cache"))
    yield
    if old is None:
        del os.environ["SYMTRACE_CACHE_DIR"]
    else:
        os.environ["SYMTRACE_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def lowered():
    out = {name: lowerings(name, fn, inputs, fuse) for name, fn, inputs, fuse in programs()}
    out["hand_built"] = (_Lowered(hand_built_kernels()), _Lowered(hand_built_kernels()))
    return out


def check_golden(path: Path, text: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no golden file {path}; generate it with SYMTRACE_UPDATE_GOLDENS=1"
    want = path.read_text()
    if text != want:
        import difflib
        diff = difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "now")
        diff = "".join(list(diff)[:60])
        pytest.fail(f"generated source differs from {path.name}:\n{diff}")


@pytest.mark.parametrize("name", [p[0] for p in programs()] + ["hand_built"])
def test_kernel_sources_match_goldens(name, lowered):
    for suffix, text in render(*lowered[name]).items():
        check_golden(GOLDEN_DIR / f"{name}{suffix}", text)


@pytest.mark.parametrize("portable", [True, False])
def test_triton_prelude_matches_golden(portable):
    check_golden(GOLDEN_DIR / f"triton_prelude_{'portable' if portable else 'libdevice'}.golden",
                 codegen_triton.prelude(portable=portable))


def test_goldens_cover_every_op_kind_and_dtype(lowered):
    """The programs stay representative: every unary and binary op, every kernel kind (with and
    without an inner loop, outer loops, a row cache), stores of every dtype, casts between every
    pair of compute types and roundings to every storage dtype."""
    ops, kinds, dtypes, rounds, casts = set(), set(), set(), set(), set()
    for cpu, _ in lowered.values():
        for k in cpu.kernels:
            kinds.add((k.kind, k.inner is not None, len(k.outer) > 0, bool(k.row_cache)))
            dtypes.update(s.buffer.dtype for s in k.stores)
            for root in [p.value for p in k.phases] + [s.value for s in k.stores]:
                for e in walk(root):
                    ops.add(e.op)
                    if e.op == "round" and e.payload is not None:
                        rounds.add(e.payload)
                    if e.op == "cast":
                        casts.add((e.args[0].ty, e.ty))
    assert set(UNARY_OPS) | set(BINARY_OPS) | {"load", "const", "acc", "cast", "round", "where"} <= ops
    assert {("pointwise", True, False, False), ("pointwise", False, False, False), ("pointwise", True, True, False),
            ("row", True, True, True), ("row", False, True, False), ("full", True, False, False),
            ("full", True, True, False), ("full", False, False, False)} <= kinds
    everything = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                  torch.int16, torch.int32, torch.int64, torch.bool}
    assert dtypes == everything and everything - {torch.int64} <= rounds
    assert {(a, b) for a in ("f32", "f64", "i64", "b") for b in ("f32", "f64", "i64", "b") if a != b} <= casts
