"""Compile errors name the kernel, the source file and line, and the cause.

Each offending statement carries a `# <-` marker so the expected line number is read from the source, not
hard-coded. The kernels are module-level functions so beta3 can read their source.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from pathlib import Path
from shutil import rmtree as remove_tree

import numpy as np
import pytest
from numpy import exp as numpy_exp

import bridge
import bridge.nki.language as nl
from bridge import Tensor
from bridge.errors import HardwareLimitError, KernelCompileError, NkiCacheError, UnknownKernelError
from bridge.frontends.beta3 import trace_beta3
from bridge.nki.builder import check_matmul_shapes
from bridge.registry import InternalKernelConfig, KernelCall, KernelRegistry, TensorSpec
from bridge.targets import Trn2

THIS_FILE = "tests/test_compile_errors.py"


def marked_line(func, marker: str = "# <-") -> int:
    """The absolute line number in this file of the one line of `func` carrying `marker`."""
    lines, first = inspect.getsourcelines(func)
    hits = [first + offset for offset, line in enumerate(lines) if marker in line]
    assert len(hits) == 1, f"test bug: {func.__name__} must mark exactly one line with {marker!r}"
    return hits[0]


def compile_kernel_func(kernel, inputs, outputs, **attrs) -> dict:
    params = [p.name for p in inspect.signature(kernel).parameters.values() if p.default is p.empty]
    specs = [TensorSpec(name, shape, dtype) for name, (shape, dtype) in zip(params, inputs + outputs, strict=True)]
    call = KernelCall(kernel.__name__, kernel, tuple(specs[: len(inputs)]), tuple(specs[len(inputs) :]), attrs)
    return trace_beta3(call, Trn2())


def expect_error(kind, kernel, inputs, outputs, *fragments: str, marked=None, **attrs) -> KernelCompileError:
    """Compile `kernel`, expect `kind`, and check the message names kernel, file:line and every fragment.
    The line is the marked one in `marked` (a helper the kernel calls) or else in the kernel itself."""
    with pytest.raises(kind) as caught:
        compile_kernel_func(kernel, inputs, outputs, **attrs)
    message = str(caught.value)
    line = marked_line(marked or kernel)
    assert message.startswith(f"kernel {kernel.__name__} at {THIS_FILE}:{line}: "), message
    assert caught.value.kernel == kernel.__name__
    assert caught.value.location == f"{THIS_FILE}:{line}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return caught.value


F32 = "float32"


# -- hardware limits ----------------------------------------------------------------------------------
def k_partition_limit(x, out):
    t = nl.load(x[0:129, :])  # <-
    nl.store(out[0:129, :], value=t)


def k_partition_limit_ndarray(x, out):
    P = x.shape[0]
    scratch = nl.ndarray((P + 1, 4), nl.float32)  # <-
    nl.store(out[:, :], value=scratch[0:P, :])


def k_psum_limit(x, out):
    acc = nl.zeros((4, 513), nl.float32, buffer=nl.psum)  # <-
    nl.store(out[:, :], value=nl.copy(acc))


def k_stationary_limit(x, y, out):
    a = nl.load(x[:, :])
    b = nl.load(y[:, :])
    nl.store(out[:, :], value=nl.copy(nl.matmul(a, b, transpose_x=True)))  # <-


def k_moving_limit(x, y, out):
    a = nl.load(x[:, :])
    b = nl.load(y[:, :])
    nl.store(out[:, :], value=nl.copy(nl.matmul(a, b, transpose_x=True)))  # <-


def k_contraction_limit(x, y, out):
    a = nl.load(x[:, :])
    b = nl.load(y[:, :])  # <-
    nl.store(out[:, :], value=nl.copy(nl.matmul(a, b)))


def k_limit_inside_loop_and_helper(x, out):
    for r in nl.affine_range(0, x.shape[0], 64):
        if r > 0:
            spill(x, out, r)


def spill(x, out, r):
    acc = nl.zeros((64, x.shape[1]), nl.float32, buffer=nl.psum)  # <-
    nl.store(out[r : r + 64, :], value=nl.copy(acc))


def test_partition_limit_on_load() -> None:
    error = expect_error(
        HardwareLimitError, k_partition_limit, [((200, 4), F32)], [((200, 4), F32)], "129 > 128", "partition limit"
    )
    assert isinstance(error, KernelCompileError) and isinstance(error, NkiCacheError)


def test_partition_limit_on_ndarray() -> None:
    expect_error(
        HardwareLimitError, k_partition_limit_ndarray, [((128, 4), F32)], [((128, 4), F32)], "129", "partition limit"
    )


def test_psum_free_size_limit() -> None:
    expect_error(HardwareLimitError, k_psum_limit, [((4, 4), F32)], [((4, 513), F32)], "513 > 512", "PSUM limit")


def test_matmul_stationary_limit() -> None:
    expect_error(
        HardwareLimitError,
        k_stationary_limit,
        [((64, 129), F32), ((64, 8), F32)],
        [((129, 8), F32)],
        "stationary free size 129 > 128",
        "stationary limit",
    )


def test_matmul_moving_limit() -> None:
    expect_error(
        HardwareLimitError,
        k_moving_limit,
        [((64, 8), F32), ((64, 513), F32)],
        [((8, 513), F32)],
        "moving free size 513 > 512",
        "moving limit",
    )


def test_matmul_contraction_over_128_cannot_even_be_loaded() -> None:
    """The contraction dim is the moving operand's partition dim, so a 200-long contraction breaks the
    partition limit as soon as its operand is loaded."""
    expect_error(
        HardwareLimitError,
        k_contraction_limit,
        [((8, 200), F32), ((200, 8), F32)],
        [((8, 8), F32)],
        "partition dim 200 > 128",
        "partition limit",
    )


def test_matmul_contraction_limit_in_the_shape_check() -> None:
    # The same check validates binaries, where shapes come from untrusted bytes.
    with pytest.raises(HardwareLimitError, match=r"matmul contraction 200 > 128 \(partition limit\)"):
        check_matmul_shapes((8, 200), (200, 8), False)
    with pytest.raises(HardwareLimitError, match="contraction 129 > 128"):
        check_matmul_shapes((129, 8), (129, 8), True)
    with pytest.raises(KernelCompileError, match="contraction mismatch"):
        check_matmul_shapes((8, 7), (6, 8), False)
    assert check_matmul_shapes((128, 128), (128, 512), True) == (128, 512)


def test_limit_reached_in_a_helper_inside_a_loop_names_the_helper_line() -> None:
    expect_error(
        HardwareLimitError,
        k_limit_inside_loop_and_helper,
        [((128, 600), F32)],
        [((128, 600), F32)],
        "600 > 512",
        "PSUM limit",
        marked=spill,
    )


def test_limits_allow_exactly_the_maximum() -> None:
    result = compile_kernel_func(k_stationary_limit, [((128, 128), F32), ((128, 512), F32)], [((128, 512), F32)])
    assert result["format"] == "bir"


# -- unsupported Python constructs -------------------------------------------------------------------
def k_while(x, out):
    i = 0
    while i < 2:  # <-
        i += 1
    nl.store(out[:, :], value=nl.load(x[:, :]))


def k_try(x, out):
    try:  # <-
        t = nl.load(x[:, :])
    finally:
        pass
    nl.store(out[:, :], value=t)


def k_lambda(x, out):
    double = lambda t: t * 2.0  # <-  # noqa: E731
    nl.store(out[:, :], value=double(nl.load(x[:, :])))


def k_list_comprehension(x, out):
    tiles = [nl.load(x[i : i + 1, :]) for i in range(2)]  # <-
    nl.store(out[0:1, :], value=tiles[0])


def k_with(x, out):
    with open(os.devnull) as handle:  # <-
        handle.read()
    nl.store(out[:, :], value=nl.load(x[:, :]))


def k_import(x, out):
    import os as inner_os  # <-

    nl.store(out[:, :], value=nl.load(x[:, :]) * len(inner_os.sep))


def k_numpy_call(x, out):
    t = nl.load(x[:, :])
    nl.store(out[:, :], value=np.exp(t))  # <-


def k_os_call(x, out):
    os.system("touch /tmp/nkicache-should-never-exist")  # <-
    nl.store(out[:, :], value=nl.load(x[:, :]))


def k_json_call(x, out):
    text = json.dumps([1, 2])  # <-
    nl.store(out[:, :], value=nl.load(x[:, :]) * len(text))


def k_open_call(x, out):
    handle = open(os.devnull)  # <-  # noqa: SIM115
    nl.store(out[:, :], value=nl.load(x[:, :]) * len(handle.name))


def k_imported_ufunc(x, out):
    nl.store(out[:, :], value=numpy_exp(nl.load(x[:, :])))  # <-


def k_imported_python_function(x, out, victim=""):
    remove_tree(victim)
    nl.store(out[:, :], value=nl.load(x[:, :]))


def k_tile_in_if(x, out):
    t = nl.load(x[:, :])
    if t:  # <-
        t = t * 2.0
    nl.store(out[:, :], value=t)


def k_tile_compare(x, out):
    t = nl.load(x[:, :])
    if t > 0.0:  # <-
        t = t * 2.0
    nl.store(out[:, :], value=t)


def k_runtime_scalar_in_if(x, sel, out):
    s = nl.load_scalar(sel[0, 0])
    if s:  # <-
        pass
    nl.store(out[:, :], value=nl.load(x[:, :]))


def k_global_statement(x, out):
    global THIS_FILE  # <-
    nl.store(out[:, :], value=nl.load(x[:, :]))


def k_dict_literal(x, out):
    table = {"a": 1}  # <-
    nl.store(out[:, :], value=nl.load(x[:, :]) * table["a"])


def k_nested_def(x, out):
    def inner(t):  # <-
        return t

    nl.store(out[:, :], value=inner(nl.load(x[:, :])))


def k_recursion(x, out):
    nl.store(out[:, :], value=recurse(nl.load(x[:, :])))


def recurse(t):
    return recurse(t)  # <-


UNSUPPORTED = [
    (k_while, "While"),
    (k_try, "Try"),
    (k_lambda, "Lambda"),
    (k_list_comprehension, "ListComp"),
    (k_with, "With"),
    (k_import, "Import"),
    (k_global_statement, "Global"),
    (k_dict_literal, "Dict"),
    (k_nested_def, "FunctionDef"),
]


@pytest.mark.parametrize(("kernel", "construct"), UNSUPPORTED, ids=[c for _, c in UNSUPPORTED])
def test_unsupported_construct_is_named(kernel, construct: str) -> None:
    expect_error(
        KernelCompileError, kernel, [((2, 3), F32)], [((2, 3), F32)], f"unsupported Python construct '{construct}'"
    )


@pytest.mark.parametrize(
    ("kernel", "fragments"),
    [
        (k_numpy_call, ("attribute .exp of module numpy is not available in kernels",)),
        (k_os_call, ("attribute .system of module os is not available in kernels",)),
        (k_json_call, ("attribute .dumps of module json is not available in kernels",)),
        (k_open_call, ("name 'open' is not defined",)),
        (k_imported_ufunc, ("calling exp is not supported in kernels",)),
    ],
    ids=["numpy", "os", "json", "open", "imported-ufunc"],
)
def test_calling_arbitrary_functions_is_rejected(kernel, fragments: tuple[str, ...]) -> None:
    expect_error(KernelCompileError, kernel, [((2, 3), F32)], [((2, 3), F32)], *fragments)
    assert not os.path.exists("/tmp/nkicache-should-never-exist")


def test_a_python_function_from_another_module_is_rejected_never_run(tmp_path: Path) -> None:
    """Helpers are inlined only from the kernel's own module and the kernel library; a library function
    such as shutil.rmtree is neither run nor interpreted: the compile fails at the kernel's line."""
    victim = tmp_path / "keep-me"
    victim.mkdir()
    with pytest.raises(KernelCompileError, match=r"kernel k_imported_python_function at tests/.*calling rmtree"):
        compile_kernel_func(k_imported_python_function, [((2, 3), F32)], [((2, 3), F32)], victim=str(victim))
    assert victim.is_dir()


def test_a_tile_cannot_drive_an_if() -> None:
    expect_error(KernelCompileError, k_tile_in_if, [((2, 3), F32)], [((2, 3), F32)], "cannot drive control flow")
    expect_error(KernelCompileError, k_tile_compare, [((2, 3), F32)], [((2, 3), F32)], "cannot be compared")


def test_a_runtime_scalar_cannot_drive_an_if() -> None:
    expect_error(
        KernelCompileError,
        k_runtime_scalar_in_if,
        [((2, 3), F32), ((1, 1), "int32")],
        [((2, 3), F32)],
        "runtime scalar cannot drive compile-time control flow",
    )


def test_unbounded_recursion_is_a_compile_error() -> None:
    expect_error(KernelCompileError, k_recursion, [((2, 3), F32)], [((2, 3), F32)], "nest deeper than", marked=recurse)


# -- kernel asserts and bad calls -------------------------------------------------------------------
def k_assert(x, out, limit=4):
    assert x.shape[1] <= limit, f"x has {x.shape[1]} columns, more than {limit}"  # <-
    nl.store(out[:, :], value=nl.load(x[:, :]))


def k_bare_assert(x, out):
    assert x.shape[0] == 1  # <-
    nl.store(out[:, :], value=nl.load(x[:, :]))


def test_kernel_assert_gives_its_message() -> None:
    expect_error(KernelCompileError, k_assert, [((2, 9), F32)], [((2, 9), F32)], "x has 9 columns, more than 4")
    expect_error(KernelCompileError, k_assert, [((2, 9), F32)], [((2, 9), F32)], "more than 8", limit=8)
    assert compile_kernel_func(k_assert, [((2, 9), F32)], [((2, 9), F32)], limit=9)["format"] == "bir"


def test_bare_assert_shows_its_condition() -> None:
    expect_error(
        KernelCompileError, k_bare_assert, [((2, 3), F32)], [((2, 3), F32)], "assertion failed: x.shape[0] == 1"
    )


def k_store_into_input(x, out):
    nl.store(x[:, :], value=nl.load(x[:, :]))  # <-


def k_store_shape_mismatch(x, out):
    nl.store(out[0:2, :], value=nl.load(x[:, :]))  # <-


def k_undefined_name(x, out):
    nl.store(out[:, :], value=nl.load(x[:, :]) * not_defined_anywhere)  # <-  # noqa: F821


def k_bad_dtype(x, out):
    t = nl.zeros((2, 3), "float64")  # <-
    nl.store(out[:, :], value=t)


@pytest.mark.parametrize(
    ("kernel", "fragment"),
    [
        (k_store_into_input, "cannot store into input tensor x"),
        (k_store_shape_mismatch, "store of a [3, 3] tile into out region [2, 3]"),
        (k_undefined_name, "name 'not_defined_anywhere' is not defined"),
        (k_bad_dtype, "unsupported dtype 'float64'"),
    ],
    ids=["store-into-input", "store-shape", "undefined-name", "dtype"],
)
def test_language_misuse_is_named(kernel, fragment: str) -> None:
    expect_error(KernelCompileError, kernel, [((3, 3), F32)], [((3, 3), F32)], fragment)


# -- compile_kernel and the registry ------------------------------------------------------------------
def test_unknown_func_name() -> None:
    with pytest.raises(UnknownKernelError, match=r"'NoSuchKernel'.*known: .*Matmul"):
        bridge.compile_kernel("NoSuchKernel", [Tensor("a", (2, 2), F32)], [Tensor("b", (2, 2), F32)])


def test_wrong_operand_count() -> None:
    with pytest.raises(KernelCompileError, match=r"Matmul \(matmul_tiled\) takes 3 tensors .*got 1 operands"):
        bridge.compile_kernel("Matmul", [Tensor("a", (2, 2), F32)], [Tensor("c", (2, 2), F32)])
    with pytest.raises(KernelCompileError, match="got 3 operands and 1 results"):
        bridge.compile_kernel("Softmax", [Tensor(n, (2, 2), F32) for n in "abc"], [Tensor("c", (2, 2), F32)])


def test_unknown_attr() -> None:
    with pytest.raises(KernelCompileError, match=r"RMSNorm \(rmsnorm\) has no attr 'epsilon'; known attrs: eps"):
        bridge.compile_kernel(
            "RMSNorm", [Tensor("a", (2, 3), F32), Tensor("g", (3,), F32)], [Tensor("o", (2, 3), F32)], {"epsilon": 1}
        )
    with pytest.raises(KernelCompileError, match="known attrs: none"):
        bridge.compile_kernel("Softmax", [Tensor("a", (2, 3), F32)], [Tensor("o", (2, 3), F32)], {"axis": 1})


def test_bad_tensor_specs_name_the_tensor() -> None:
    with pytest.raises(KernelCompileError, match=r"operand 1 \(weights\) has invalid shape \[0, 3\]"):
        bridge.compile_kernel("Matmul", [Tensor("a", (2, 3), F32), Tensor("weights", (0, 3), F32)], [])
    with pytest.raises(KernelCompileError, match=r"result 0 \(o\).*unsupported dtype 'float64'"):
        bridge.compile_kernel("Softmax", [Tensor("a", (2, 3), F32)], [Tensor("o", (2, 3), "float64")])


def _kernel_line(func, text: str) -> int:
    lines, first = inspect.getsourcelines(func)
    return next(first + i for i, line in enumerate(lines) if text in line)


def test_matmul_contraction_mismatch_names_the_cause_and_line() -> None:
    from bridge.kernels.matmul import matmul_tiled

    with pytest.raises(KernelCompileError) as caught:
        bridge.compile_kernel(
            "Matmul", [Tensor("a", (5, 3), F32), Tensor("b", (6, 4), F32)], [Tensor("c", (3, 4), F32)]
        )
    message = str(caught.value)
    assert "kernel matmul_tiled" in message
    assert "contraction mismatch: lhsT [5, 3] vs rhs [6, 4]" in message
    assert f"bridge/kernels/matmul.py:{_kernel_line(matmul_tiled, 'contraction mismatch')}" in message


@pytest.mark.parametrize(
    ("func_name", "operands", "result", "fragment"),
    [
        ("Matmul", [(5, 3), (5, 4)], (4, 3), "out must be [3, 4], got [4, 3]"),
        ("Softmax", [(2, 3, 4)], (2, 3, 4), "softmax takes a 2-D input, got [2, 3, 4]"),
        ("Softmax", [(2, 3)], (3, 2), "out must match x [2, 3], got [3, 2]"),
        ("RMSNorm", [(2, 3), (4,)], (2, 3), "g must be [3], got [4]"),
    ],
)
def test_internal_kernels_reject_bad_shapes(func_name, operands, result, fragment: str) -> None:
    tensors = [Tensor(f"t{i}", shape, F32) for i, shape in enumerate(operands)]
    with pytest.raises(KernelCompileError) as caught:
        bridge.compile_kernel(func_name, tensors, [Tensor("r", result, F32)])
    assert fragment in str(caught.value)
    assert re.search(r"bridge/kernels/\w+\.py:\d+", str(caught.value))


def test_attrs_must_be_json_values() -> None:
    with pytest.raises(KernelCompileError, match="must be JSON values"):
        bridge.compile_kernel(
            "RMSNorm", [Tensor("a", (2, 3), F32), Tensor("g", (3,), F32)], [Tensor("o", (2, 3), F32)], {"eps": object()}
        )


def test_a_local_registry_resolves_and_reports_its_own_kernels() -> None:
    registry = KernelRegistry()
    registry.register(InternalKernelConfig("Assert", "k_assert", k_assert, attr_defaults={"limit": 2}))
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(InternalKernelConfig("Assert", "k_assert", k_assert))
    assert registry.get("Missing") is None
    with pytest.raises(UnknownKernelError, match="known: Assert"):
        registry.resolve("Missing")
    call = registry.resolve("Assert").marshal([Tensor("g", (1, 3), F32)], [Tensor("h", (1, 3), F32)], {})
    assert [s.name for s in call.inputs + call.outputs] == ["x", "out"]
    with pytest.raises(KernelCompileError, match="x has 3 columns, more than 2"):
        trace_beta3(call, Trn2())


def test_errors_carry_kernel_and_location_attributes() -> None:
    with pytest.raises(KernelCompileError) as caught:
        compile_kernel_func(k_while, [((2, 3), F32)], [((2, 3), F32)])
    assert caught.value.kernel == "k_while"
    assert caught.value.location == f"{THIS_FILE}:{marked_line(k_while)}"
    assert caught.value.reason.startswith("unsupported Python construct 'While'")
    assert math.isfinite(marked_line(k_while))
