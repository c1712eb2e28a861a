"""The kernel language, compiled through the beta3 frontend and run by the executor, against numpy.

Each kernel here is a module-level function (beta3 reads its source with `inspect.getsource`) compiled with
`trace_beta3` on a `KernelCall` built by `compile_and_run`, exactly as the registry would marshal it.
Outputs start as NaN in the executor, so an element a kernel forgets to write shows up in the comparison.
"""

from __future__ import annotations

import inspect
import zlib

import ml_dtypes
import numpy as np
import pytest

import bridge.nki.language as nl
from bridge import dtypes, run_bir
from bridge.frontends.beta3 import trace_beta3
from bridge.registry import KernelCall, TensorSpec
from bridge.targets import Trn2

RNG = np.random.default_rng(20240601)


@pytest.fixture(autouse=True)
def seeded_rng(request: pytest.FixtureRequest) -> None:
    """Each test's inputs from a seed of its own name, whatever ran before it in the same worker process."""
    global RNG
    RNG = np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def compile_and_run(kernel, inputs: list[np.ndarray], outputs: list[tuple[tuple[int, ...], str]], **attrs):
    """Compile `kernel` on the given input arrays and output (shape, dtype) specs, run it, return outputs."""
    params = [p.name for p in inspect.signature(kernel).parameters.values() if p.default is p.empty]
    assert len(params) == len(inputs) + len(outputs), "test bug: tensor count does not match the kernel"
    in_specs = tuple(
        TensorSpec(name, a.shape, dtypes.from_numpy(a.dtype)) for name, a in zip(params, inputs, strict=False)
    )
    out_specs = tuple(
        TensorSpec(name, tuple(shape), dtype)
        for name, (shape, dtype) in zip(params[len(inputs) :], outputs, strict=True)
    )
    result = trace_beta3(KernelCall(kernel.__name__, kernel, in_specs, out_specs, attrs), Trn2())
    assert result["input_names"] == params[: len(inputs)]
    produced = run_bir(result["binary"], {spec.name: a for spec, a in zip(in_specs, inputs, strict=True)})
    return [produced[spec.name] for spec in out_specs]


def f32(*shape: int, low: float = -3.0, high: float = 3.0) -> np.ndarray:
    return RNG.uniform(low, high, size=shape).astype(np.float32)


# -- loads and stores ---------------------------------------------------------------------------------
def k_strided(x, out):
    t = nl.load(x[1:9:2, 0:12:3])
    nl.store(out[0:8:2, 1:8:2], value=t)


def test_load_and_store_slices_with_steps() -> None:
    x = f32(10, 12)
    (out,) = compile_and_run(k_strided, [x], [((8, 8), "float32")])
    np.testing.assert_array_equal(out[0:8:2, 1:8:2], x[1:9:2, 0:12:3])
    written = np.zeros(out.shape, dtype=bool)
    written[0:8:2, 1:8:2] = True
    assert np.isnan(out[~written]).all(), "elements no store wrote must keep the executor's NaN"


def k_int_index(x, out_plane, out_row, out_col):
    plane = nl.load(x[2, :, :])
    nl.store(out_plane[:, :], value=plane)
    row = nl.load(x[1, 3, :])
    nl.store(out_row[0, :], value=row)
    col = nl.load(x[0, :, 4])
    nl.store(out_col[:], value=col)


def test_int_index_drops_the_axis() -> None:
    x = f32(3, 5, 6)
    plane, row, col = compile_and_run(k_int_index, [x], [((5, 6), "float32"), ((2, 6), "float32"), ((5,), "float32")])
    np.testing.assert_array_equal(plane, x[2])
    np.testing.assert_array_equal(row[0], x[1, 3])
    assert np.isnan(row[1]).all()
    np.testing.assert_array_equal(col, x[0, :, 4])


def k_gather(table, ids, out):
    idx = nl.load(ids[:, :])
    rows = nl.load(table[idx, :])
    nl.store(out[:, :], value=rows)


def test_gather_load_by_int32_index_tile() -> None:
    table = f32(50, 7)
    ids = np.array([[3], [0], [49], [3], [17], [8]], dtype=np.int32)
    (out,) = compile_and_run(k_gather, [table, ids], [((6, 7), "float32")])
    np.testing.assert_array_equal(out, table[ids[:, 0]])


def k_gather_inner_axis(table, ids, out):
    idx = nl.load(ids[:, :])
    nl.store(out[:, :], value=nl.load(table[1, idx, 2:5]))


def test_gather_on_a_non_leading_axis() -> None:
    table = f32(3, 40, 6)
    ids = np.array([[39], [1], [20]], dtype=np.int32)
    (out,) = compile_and_run(k_gather_inner_axis, [table, ids], [((3, 3), "float32")])
    np.testing.assert_array_equal(out, table[1, ids[:, 0], 2:5])


def k_select_expert(data, sel, out):
    e = nl.load_scalar(sel[1, 0])
    nl.store(out[:, :], value=nl.load(data[e, :, :]))


@pytest.mark.parametrize("expert", [0, 2, 3])
def test_load_scalar_runtime_index_selects_a_slice(expert: int) -> None:
    data = f32(4, 5, 6)
    sel = np.array([[9], [expert]], dtype=np.int32)
    (out,) = compile_and_run(k_select_expert, [data, sel], [((5, 6), "float32")])
    np.testing.assert_array_equal(out, data[expert])


def test_one_binary_serves_every_runtime_index() -> None:
    data = f32(4, 5, 6)
    in_specs = (TensorSpec("data", (4, 5, 6), "float32"), TensorSpec("sel", (2, 1), "int32"))
    call = KernelCall("k_select_expert", k_select_expert, in_specs, (TensorSpec("out", (5, 6), "float32"),), {})
    binary = trace_beta3(call, Trn2())["binary"]
    for expert in range(4):
        sel = np.array([[0], [expert]], dtype=np.int32)
        np.testing.assert_array_equal(run_bir(binary, {"data": data, "sel": sel})["out"], data[expert])


def k_scatter(src, ids, out):
    idx = nl.load(ids[:, :])
    nl.store(out[idx, :], value=nl.load(src[:, :]))


def test_scatter_store_by_index_tile() -> None:
    src = f32(9, 4)
    perm = RNG.permutation(9).astype(np.int32)
    (out,) = compile_and_run(k_scatter, [src, perm[:, None]], [((9, 4), "float32")])
    expected = np.empty_like(src)
    expected[perm] = src
    np.testing.assert_array_equal(out, expected)


# -- PE array -----------------------------------------------------------------------------------------
def k_matmuls(x, y, xT, out_plain, out_transposed):
    a = nl.load(x[:, :])
    b = nl.load(y[:, :])
    nl.store(out_plain[:, :], value=nl.copy(nl.matmul(a, b)))
    at = nl.load(xT[:, :])
    nl.store(out_transposed[:, :], value=nl.copy(nl.matmul(at, b, transpose_x=True)))


def test_matmul_with_and_without_transpose_x() -> None:
    x, y = f32(128, 100), f32(100, 512)  # stationary, contraction and moving at their limits or close
    xT = np.ascontiguousarray(f32(100, 128))
    plain, transposed = compile_and_run(k_matmuls, [x, y, xT], [((128, 512), "float32"), ((128, 512), "float32")])
    np.testing.assert_allclose(plain, x.astype(np.float64) @ y, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(transposed, xT.T.astype(np.float64) @ y, rtol=1e-5, atol=1e-4)


def k_matmul_accumulate(x, y, out):
    acc = nl.zeros((x.shape[1], y.shape[1]), nl.float32, buffer=nl.psum)
    for k in nl.sequential_range(0, x.shape[0], 64):
        acc += nl.matmul(nl.load(x[k : k + 64, :]), nl.load(y[k : k + 64, :]), transpose_x=True)
    nl.store(out[:, :], value=nl.copy(acc, dtype=out.dtype))


def test_matmul_accumulates_in_psum_in_float32() -> None:
    x = f32(256, 16).astype(ml_dtypes.bfloat16)
    y = f32(256, 8).astype(ml_dtypes.bfloat16)
    (out,) = compile_and_run(k_matmul_accumulate, [x, y], [((16, 8), "float32")])
    np.testing.assert_allclose(out, x.astype(np.float64).T @ y.astype(np.float64), rtol=1e-5, atol=1e-4)


def k_transpose(x, out):
    nl.store(out[:, :], value=nl.transpose(nl.load(x[:, :])))


@pytest.mark.parametrize("shape", [(128, 3), (5, 128), (1, 1)])
def test_transpose(shape: tuple[int, int]) -> None:
    x = f32(*shape)
    (out,) = compile_and_run(k_transpose, [x], [(shape[::-1], "float32")])
    np.testing.assert_array_equal(out, x.T)


# -- elementwise --------------------------------------------------------------------------------------
UNARY_FUNCTIONS = (
    ("exp", nl.exp),
    ("log", nl.log),
    ("sqrt", nl.sqrt),
    ("rsqrt", nl.rsqrt),
    ("tanh", nl.tanh),
    ("sigmoid", nl.sigmoid),
    ("silu", nl.silu),
    ("gelu", nl.gelu),
    ("relu", nl.relu),
    ("negative", nl.negative),
    ("abs", nl.abs),
    ("square", nl.square),
    ("reciprocal", nl.reciprocal),
)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


UNARY_NUMPY = {
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "tanh": np.tanh,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "gelu": _gelu_tanh,
    "relu": lambda x: np.maximum(x, 0),
    "negative": np.negative,
    "abs": np.abs,
    "square": np.square,
    "reciprocal": lambda x: 1 / x,
}
POSITIVE_DOMAIN = {"log", "sqrt", "rsqrt", "reciprocal"}


def k_unary(x, out, op="exp"):
    t = nl.load(x[:, :])
    for name, function in UNARY_FUNCTIONS:
        if name == op:
            nl.store(out[:, :], value=function(t))


@pytest.mark.parametrize("op", [name for name, _ in UNARY_FUNCTIONS])
def test_every_unary_op(op: str) -> None:
    x = f32(37, 19, low=0.1, high=4.0) if op in POSITIVE_DOMAIN else f32(37, 19, low=-4.0, high=4.0)
    (out,) = compile_and_run(k_unary, [x], [((37, 19), "float32")], op=op)
    np.testing.assert_allclose(out, UNARY_NUMPY[op](x.astype(np.float64)), rtol=2e-6, atol=1e-6)


def test_unary_op_names_cover_the_instruction_set() -> None:
    from bridge.nki import isa

    assert {name for name, _ in UNARY_FUNCTIONS} == set(isa.UNARY_OPS)


BINARY_FUNCTIONS = (
    ("add", nl.add),
    ("subtract", nl.subtract),
    ("multiply", nl.multiply),
    ("divide", nl.divide),
    ("maximum", nl.maximum),
    ("minimum", nl.minimum),
)
BINARY_NUMPY = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
}


def k_binary(x, y, out_tiles, out_const_right, out_const_left, op="add"):
    a = nl.load(x[:, :])
    b = nl.load(y[:, :])
    for name, function in BINARY_FUNCTIONS:
        if name == op:
            nl.store(out_tiles[:, :], value=function(a, b))
            nl.store(out_const_right[:, :], value=function(a, 1.5))
            nl.store(out_const_left[:, :], value=function(-2.5, b))


@pytest.mark.parametrize("op", [name for name, _ in BINARY_FUNCTIONS])
def test_every_binary_op_on_tiles_and_constants(op: str) -> None:
    x, y = f32(33, 21), f32(33, 21, low=0.5, high=3.0)
    spec = ((33, 21), "float32")
    tiles, right, left = compile_and_run(k_binary, [x, y], [spec, spec, spec], op=op)
    function = BINARY_NUMPY[op]
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    np.testing.assert_allclose(tiles, function(x64, y64), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(right, function(x64, 1.5), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(left, function(-2.5, y64), rtol=1e-6, atol=1e-7)


def k_operators(x, y, out):
    a = nl.load(x[:, :])
    b = nl.load(y[:, :])
    nl.store(out[:, :], value=(a + b) * 2.0 - a / b + (1.0 - a) * (3.0 / b) - -a)


def test_python_operators_on_tiles() -> None:
    x, y = f32(20, 30), f32(20, 30, low=0.5, high=2.0)
    (out,) = compile_and_run(k_operators, [x, y], [((20, 30), "float32")])
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    expected = (x64 + y64) * 2.0 - x64 / y64 + (1.0 - x64) * (3.0 / y64) + x64
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


# -- reductions and broadcasting ----------------------------------------------------------------------
def k_reductions(x, o_sum, o_max, o_min, o_mean, o_last):
    t = nl.load(x[:, :])
    nl.store(o_sum[:, :], value=nl.sum(t, axis=1))
    nl.store(o_max[:, :], value=nl.max(t, axis=1))
    nl.store(o_min[:, :], value=nl.min(t, axis=1))
    nl.store(o_mean[:, :], value=nl.mean(t, axis=1))
    nl.store(o_last[:, :], value=nl.sum(t, axis=-1))


def test_reductions_along_the_free_axis() -> None:
    x = f32(77, 301)
    column = ((77, 1), "float32")
    s, mx, mn, mean, last = compile_and_run(k_reductions, [x], [column] * 5)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(s[:, 0], x64.sum(axis=1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(mx[:, 0], x.max(axis=1))
    np.testing.assert_array_equal(mn[:, 0], x.min(axis=1))
    np.testing.assert_allclose(mean[:, 0], x64.mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(last, s, rtol=0, atol=0)


def k_reduce_3d(x, out_both, out_inner):
    t = nl.load(x[:, :, :])
    nl.store(out_both[:, :, :], value=nl.max(t, axis=(1, 2)))
    nl.store(out_inner[:, :, :], value=nl.mean(t, axis=2))


def test_reductions_over_several_free_axes() -> None:
    x = f32(6, 4, 5)
    both, inner = compile_and_run(k_reduce_3d, [x], [((6, 1, 1), "float32"), ((6, 4, 1), "float32")])
    np.testing.assert_array_equal(both, x.max(axis=(1, 2), keepdims=True))
    np.testing.assert_allclose(inner, x.astype(np.float64).mean(axis=2, keepdims=True), rtol=1e-6, atol=1e-6)


def k_column_broadcast(x, c, out_centered, out_scaled):
    t = nl.load(x[:, :])
    nl.store(out_centered[:, :], value=t - nl.mean(t, axis=1))
    nl.store(out_scaled[:, :], value=nl.multiply(nl.load(c[:, :]), t))


def test_column_broadcast_of_p_by_1_tiles() -> None:
    x, c = f32(100, 9), f32(100, 1)
    centered, scaled = compile_and_run(k_column_broadcast, [x, c], [((100, 9), "float32")] * 2)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(centered, x64 - x64.mean(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scaled, c * x64, rtol=1e-6)


def k_broadcast_to(row, col, out_rows, out_cols):
    r = nl.load(row[0:8])
    nl.store(out_rows[:, :], value=nl.broadcast_to(r, (5, 8)))
    c = nl.load(col[:, :])
    nl.store(out_cols[:, :], value=nl.broadcast_to(c, (5, 8)) + 0.0)


def test_broadcast_to_rows_and_columns() -> None:
    row, col = f32(8), f32(5, 1)
    rows, cols = compile_and_run(k_broadcast_to, [row, col], [((5, 8), "float32")] * 2)
    np.testing.assert_array_equal(rows, np.broadcast_to(row, (5, 8)))
    np.testing.assert_array_equal(cols, np.broadcast_to(col, (5, 8)))


# -- writes into existing tiles -----------------------------------------------------------------------
def k_in_place(x, y, out):
    t = nl.load(x[:, :])
    t[0:2, :] += 100.0
    view = t[:, 1:3]
    view *= 2.0
    t[2:4, 4:6] -= nl.load(y[0:2, 0:2])
    acc = nl.zeros(t.shape, nl.float32)
    acc += t
    acc /= 4.0
    nl.store(out[:, :], value=acc)


def test_in_place_updates_through_tile_views() -> None:
    x, y = f32(6, 7), f32(2, 2)
    (out,) = compile_and_run(k_in_place, [x, y], [((6, 7), "float32")])
    expected = x.astype(np.float64)
    expected[0:2, :] += 100.0
    expected[:, 1:3] *= 2.0
    expected[2:4, 4:6] -= y
    np.testing.assert_allclose(out, expected / 4.0, rtol=1e-6)


def k_setitem(x, out):
    t = nl.load(x[:, :])
    t[1:3, :] = 5.0
    t[:, 4] = 0.0
    t[:, 0:2] = t[:, 5:7]
    u = nl.ndarray((t.shape[0], 1), nl.float32)
    u[...] = -1.0
    t[:, 3:4] = u
    nl.store(out[...], value=t)


def test_setitem_with_constants_and_tiles() -> None:
    x = f32(4, 7)
    (out,) = compile_and_run(k_setitem, [x], [((4, 7), "float32")])
    expected = x.copy()
    expected[1:3, :] = 5.0
    expected[:, 4] = 0.0
    expected[:, 0:2] = expected[:, 5:7]
    expected[:, 3] = -1.0
    np.testing.assert_array_equal(out, expected)


# -- compile-time Python ------------------------------------------------------------------------------
def scale_shift(t, scale=2.0, shift=1.0):
    return t * scale + shift


def normalized_pair(t, eps=0.0):
    total = nl.sum(t, axis=1)
    return t / (total + eps), total


def twice(t):
    return scale_shift(t, shift=0.0)


def k_helpers(x, out_default, out_keyword, out_nested, out_pair, out_total):
    t = nl.load(x[:, :])
    nl.store(out_default[:, :], value=scale_shift(t))
    nl.store(out_keyword[:, :], value=scale_shift(t, shift=-1.0))
    nl.store(out_nested[:, :], value=twice(twice(t)))
    ratio, total = normalized_pair(t, eps=1.0)
    nl.store(out_pair[:, :], value=ratio)
    nl.store(out_total[:, :], value=total)


def test_helper_functions_are_inlined_with_defaults() -> None:
    x = f32(10, 6, low=0.1, high=1.0)
    full, col = ((10, 6), "float32"), ((10, 1), "float32")
    d, k, n, pair, total = compile_and_run(k_helpers, [x], [full, full, full, full, col])
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(d, x64 * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(k, x64 * 2 - 1, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(n, x64 * 4, rtol=1e-6)
    np.testing.assert_allclose(total[:, 0], x64.sum(axis=1), rtol=1e-6)
    np.testing.assert_allclose(pair, x64 / (x64.sum(axis=1, keepdims=True) + 1), rtol=1e-6)


def k_branches(x, out, mode=0):
    R, C = x.shape
    t = nl.load(x[:, :])
    if mode == 0:
        result = t + 1.0
    elif mode == 1 and R > 4:
        result = t * 10.0
    elif mode < 0:
        result = t
    else:
        # Never compiled for these shapes: a load past the end would be a compile error.
        result = nl.load(x[0 : R + 1, :])
    if C % 2 == 0:
        result = result - 0.5
    nl.store(out[:, :], value=result if mode >= 0 else t)


@pytest.mark.parametrize(("mode", "shape"), [(0, (5, 3)), (1, (5, 3)), (0, (3, 4)), (1, (6, 4)), (-1, (2, 2))])
def test_if_else_on_compile_time_values(mode: int, shape: tuple[int, int]) -> None:
    x = f32(*shape)
    (out,) = compile_and_run(k_branches, [x], [(shape, "float32")], mode=mode)
    if mode < 0:
        expected = x
    else:
        expected = x.astype(np.float64) + 1.0 if mode == 0 else x.astype(np.float64) * 10.0
        if shape[1] % 2 == 0:
            expected = expected - 0.5
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_the_branch_not_taken_is_never_compiled() -> None:
    from bridge.errors import KernelCompileError

    with pytest.raises(KernelCompileError, match="out of bounds"):
        compile_and_run(k_branches, [f32(3, 3)], [((3, 3), "float32")], mode=1)


def k_loops(x, out):
    P, W = x.shape
    F = W // 4
    acc = nl.zeros((P, F), nl.float32)
    for i in nl.sequential_range(4):
        acc += nl.load(x[:, i * F : (i + 1) * F])
    for j in nl.static_range(0, F, 2):
        acc[:, j] = acc[:, j] * 2.0
    for i, j in zip(nl.affine_range(F - 1, -1, -1), nl.affine_range(F), strict=True):
        if i < j:
            break
        acc[:, i] = acc[:, i] + j
    nl.store(out[:, :], value=acc)


def test_static_sequential_and_affine_ranges() -> None:
    x = f32(7, 20)
    (out,) = compile_and_run(k_loops, [x], [((7, 5), "float32")])
    expected = x.astype(np.float64).reshape(7, 4, 5).sum(axis=1)
    expected[:, 0::2] *= 2.0
    for i, j in zip(range(4, -1, -1), range(5), strict=True):
        if i < j:
            break
        expected[:, i] += j
    # The kernel sums four float32 values in float32: an element that cancels to near 0 keeps their rounding
    # (a few float32 epsilons of 3.0), which a relative bound alone does not allow for.
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=4 * 3.0 * np.finfo(np.float32).eps)


def k_unpacking(x, out, sizes=(2, 3)):
    R, C = x.shape
    (a, b), c = sizes, 1
    a, b = b, a
    first, second = (R, C)
    nl.store(out[:, :], value=nl.load(x[:, :]) * a + b * c + first + second)


def test_tuple_unpacking_and_tuple_attrs() -> None:
    x = f32(4, 5)
    (out,) = compile_and_run(k_unpacking, [x], [((4, 5), "float32")], sizes=(2, 3))
    np.testing.assert_allclose(out, x.astype(np.float64) * 3 + 2 + 4 + 5, rtol=1e-6)


def k_shape_and_dtype(x, out):
    assert x.dtype == nl.bfloat16 and out.dtype == nl.float16 and x.ndim == 2
    t = nl.ndarray(x.shape, dtype=x.dtype)
    t[...] = nl.load(x[:, :])
    wide = nl.zeros((x.shape[0], x.shape[1] * 2), dtype=out.dtype)
    wide[:, 0 : x.shape[1]] = t
    nl.store(out[:, :], value=wide)


def test_tensor_shape_dtype_and_ndim() -> None:
    x = f32(3, 4).astype(ml_dtypes.bfloat16)
    (out,) = compile_and_run(k_shape_and_dtype, [x], [((3, 8), "float16")])
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out[:, :4], x.astype(np.float16))
    np.testing.assert_array_equal(out[:, 4:], 0)


def k_casts(x, out_f32, out_f16, out_bf16):
    wide = nl.load(x[:, :], dtype=nl.float32)
    nl.store(out_f32[:, :], value=wide * 1.0)
    nl.store(out_f16[:, :], value=wide)
    narrow = nl.load(x[:, :], dtype=nl.bfloat16)
    nl.store(out_bf16[:, :], value=nl.copy(narrow, dtype=nl.float32))


def test_dtype_casts_on_load_store_and_copy() -> None:
    x = f32(6, 9)
    o32, o16, obf = compile_and_run(k_casts, [x], [((6, 9), "float32"), ((6, 9), "float16"), ((6, 9), "float32")])
    np.testing.assert_array_equal(o32, x)
    assert o16.dtype == np.float16
    np.testing.assert_array_equal(o16, x.astype(np.float16))
    np.testing.assert_array_equal(obf, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not np.array_equal(obf, x), "loading with dtype=bfloat16 must round"


def k_bf16_math(x, out):
    t = nl.load(x[:, :])
    nl.store(out[:, :], value=nl.exp(t) + t)


def test_bfloat16_elementwise_computes_in_float32_and_rounds_once() -> None:
    x = f32(8, 16, low=-1, high=1).astype(ml_dtypes.bfloat16)
    (out,) = compile_and_run(k_bf16_math, [x], [((8, 16), "float32")])
    x32 = x.astype(np.float32)
    # exp(t) is a bfloat16 tile (inputs keep their float dtype), then the add is rounded again.
    step1 = np.exp(x32).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(out, (step1 + x32).astype(ml_dtypes.bfloat16).astype(np.float32))


def k_int_math(a, b, out_sum, out_mix, out_max, out_float):
    x = nl.load(a[:, :])
    y = nl.load(b[:, :])
    nl.store(out_sum[:, :], value=x + y)
    nl.store(out_mix[:, :], value=x * 3 - y + 7)
    nl.store(out_max[:, :], value=nl.maximum(x, y))
    nl.store(out_float[:, :], value=x * 0.5)


def test_int32_tile_arithmetic_is_exact() -> None:
    a = RNG.integers(-(2**26), 2**26, size=(5, 6)).astype(np.int32)
    a[0, 0] = 2**24 + 1  # not representable in float32
    b = RNG.integers(-1000, 1000, size=(5, 6)).astype(np.int32)
    spec = ((5, 6), "int32")
    s, mix, mx, half = compile_and_run(k_int_math, [a, b], [spec, spec, spec, ((5, 6), "float32")])
    assert s.dtype == np.int32
    np.testing.assert_array_equal(s, a.astype(np.int64) + b)
    np.testing.assert_array_equal(mix, a.astype(np.int64) * 3 - b + 7)
    np.testing.assert_array_equal(mx, np.maximum(a, b))
    np.testing.assert_allclose(half, a.astype(np.float64) * 0.5, rtol=1e-7)


def k_index_arithmetic(ids, table, out):
    idx = nl.load(ids[:, :])
    shifted = idx + 1
    nl.store(out[:, :], value=nl.load(table[shifted, :]))


def test_int32_tiles_computed_in_kernel_index_a_gather() -> None:
    table = f32(12, 3)
    ids = np.array([[0], [10], [4]], dtype=np.int32)
    (out,) = compile_and_run(k_index_arithmetic, [ids, table], [((3, 3), "float32")])
    np.testing.assert_array_equal(out, table[ids[:, 0] + 1])


def k_full_and_memset(x, out):
    t = nl.full((x.shape[0], 3), 2.5, nl.float32)
    z = nl.zeros((x.shape[0], 3), nl.float32)
    nl.store(out[:, 0:3], value=t + z)
    nl.store(out[:, 3:6], value=nl.load(x[:, :]))


def test_full_zeros_and_partial_stores_compose() -> None:
    x = f32(4, 3)
    (out,) = compile_and_run(k_full_and_memset, [x], [((4, 6), "float32")])
    np.testing.assert_array_equal(out[:, :3], 2.5)
    np.testing.assert_array_equal(out[:, 3:], x)


def test_beta3_interprets_the_source_and_never_calls_the_kernel() -> None:
    import sys

    calls: list[str] = []
    watched = {k_operators.__code__, scale_shift.__code__, k_helpers.__code__}

    def profiler(frame, event, arg) -> None:
        if event == "call" and frame.f_code in watched:
            calls.append(frame.f_code.co_name)

    x, y = f32(2, 3), f32(2, 3, low=1, high=2)
    sys.setprofile(profiler)
    try:
        compile_and_run(k_operators, [x, y], [((2, 3), "float32")])
        compile_and_run(k_helpers, [x], [((2, 3), "float32")] * 4 + [((2, 1), "float32")])
        assert calls == []
        # The watch works: calling the kernel for real is seen (it fails at once: None is no tensor).
        with pytest.raises(TypeError):
            k_operators(None, None, None)
    finally:
        sys.setprofile(None)
    assert calls == ["k_operators"]
