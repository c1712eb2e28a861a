"""Matmul, Softmax and RMSNorm through `bridge.compile_kernel` + `bridge.run_bir` against numpy written here.

The expected values are computed in float64 from the exact inputs the kernel sees (already rounded to the
input dtype), so the tolerance only has to absorb the kernel's float32 arithmetic and the final cast.
`bridge.references` is checked separately against the same numpy, so a wrong reference cannot hide a wrong
kernel (nor the other way round).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import bridge
import bridge.kernels
from bridge import Tensor, references

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# (rtol, atol) on O(1) outputs; matmul's atol is scaled by sqrt(K), the typical size of a K-term sum.
TOLERANCES = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, low: float = -2.0, high: float = 2.0):
    return rng.uniform(low, high, size=shape).astype(NP_DTYPES[dtype])


def _compile_and_run(func_name, inputs: dict[str, np.ndarray], out_shape, dtype, attrs=None):
    operands = [Tensor(f"graph_{name}", array.shape, dtype) for name, array in inputs.items()]
    result = bridge.compile_kernel(func_name, operands, [Tensor("graph_out", out_shape, dtype)], attrs)
    assert result["format"] == "bir"
    assert isinstance(result["binary"], bytes)
    # The binary is keyed by the kernel's parameter names, never by graph tensor names.
    assert result["input_names"] == list(inputs)
    assert result["output_names"] == ["out"]
    outputs = bridge.run_bir(result["binary"], inputs)
    assert list(outputs) == ["out"]
    out = outputs["out"]
    assert out.shape == tuple(out_shape)
    assert out.dtype == np.dtype(NP_DTYPES[dtype])
    return out


def _check(actual: np.ndarray, expected: np.ndarray, dtype: str, atol_scale: float = 1.0) -> None:
    rtol, atol = TOLERANCES[dtype]
    actual = actual.astype(np.float64)
    assert np.isfinite(actual).all(), "kernel output has NaN/inf (an uninitialised or unwritten region?)"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol * atol_scale)


# -- numpy written for these tests --------------------------------------------------------------------
def numpy_matmul(lhsT: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    return np.einsum("km,kn->mn", lhsT.astype(np.float64), rhs.astype(np.float64))


def numpy_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=1, keepdims=True)
    return np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)


def numpy_rmsnorm(a: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    a, g = a.astype(np.float64), g.astype(np.float64)
    return a / np.sqrt((a**2).mean(axis=1, keepdims=True) + eps) * g[None, :]


# -- Matmul ---------------------------------------------------------------------------------------------
MATMUL_SHAPES = [  # (K, M, N): single elements, one-short, one-over and several ragged tiles per axis
    (1, 1, 1),
    (1, 127, 511),
    (7, 129, 513),
    (128, 128, 512),
    (129, 200, 1),
    (255, 1, 700),
    (300, 129, 513),
    (257, 200, 700),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("K", "M", "N"), MATMUL_SHAPES)
def test_matmul_matches_numpy(K: int, M: int, N: int, dtype: str) -> None:
    rng = np.random.default_rng(K * 1_000_003 + M * 1009 + N)
    lhsT, rhs = _random(rng, (K, M), dtype), _random(rng, (K, N), dtype)
    out = _compile_and_run("Matmul", {"lhsT": lhsT, "rhs": rhs}, (M, N), dtype)
    # A sum of K random products grows like sqrt(K), and so does its rounding error: scale atol with it.
    _check(out, numpy_matmul(lhsT, rhs), dtype, atol_scale=np.sqrt(K))


def test_matmul_float32_is_tight_on_exact_integers() -> None:
    """Small integers multiply and add exactly in float32: any tiling mistake shows as a non-zero error."""
    rng = np.random.default_rng(7)
    K, M, N = 300, 200, 700
    lhsT = rng.integers(-3, 4, size=(K, M)).astype(np.float32)
    rhs = rng.integers(-3, 4, size=(K, N)).astype(np.float32)
    out = _compile_and_run("Matmul", {"lhsT": lhsT, "rhs": rhs}, (M, N), "float32")
    np.testing.assert_array_equal(out, numpy_matmul(lhsT, rhs))


# -- Softmax --------------------------------------------------------------------------------------------
SOFTMAX_SHAPES = [(1, 1), (1, 7), (127, 1000), (128, 7), (129, 1), (129, 1000), (300, 7), (300, 1000)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("R", "C"), SOFTMAX_SHAPES)
def test_softmax_matches_numpy(R: int, C: int, dtype: str) -> None:
    rng = np.random.default_rng(R * 7919 + C)
    x = _random(rng, (R, C), dtype, -8.0, 8.0)
    out = _compile_and_run("Softmax", {"x": x}, (R, C), dtype)
    expected = numpy_softmax(x)
    _check(out, expected, dtype)
    np.testing.assert_allclose(out.astype(np.float64).sum(axis=1), 1.0, rtol=0, atol=10 * TOLERANCES[dtype][0])


def test_softmax_is_shift_invariant_and_stable_for_large_values() -> None:
    """exp(x - max): rows of huge values neither overflow nor differ from the same rows shifted down."""
    rng = np.random.default_rng(3)
    x = rng.uniform(-5, 5, size=(129, 33)).astype(np.float32)
    out_small = _compile_and_run("Softmax", {"x": x}, x.shape, "float32")
    out_large = _compile_and_run("Softmax", {"x": x + np.float32(1000.0)}, x.shape, "float32")
    assert np.isfinite(out_large).all()
    np.testing.assert_allclose(out_large, out_small, rtol=1e-4, atol=1e-6)


# -- RMSNorm --------------------------------------------------------------------------------------------
RMSNORM_SHAPES = [(1, 1), (1, 7), (127, 1000), (128, 64), (129, 1), (129, 1000), (300, 7), (300, 513)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("R", "C"), RMSNORM_SHAPES)
def test_rmsnorm_matches_numpy(R: int, C: int, dtype: str) -> None:
    rng = np.random.default_rng(R * 104729 + C)
    a = _random(rng, (R, C), dtype)
    g = _random(rng, (C,), dtype, 0.5, 1.5)
    out = _compile_and_run("RMSNorm", {"a": a, "g": g}, (R, C), dtype)
    # |a / rms(a)| can reach sqrt(C) in a row dominated by one element; the bulk is O(1).
    _check(out, numpy_rmsnorm(a, g, 1e-6), dtype, atol_scale=2.0)


@pytest.mark.parametrize("eps", [1e-6, 0.5, 3.0])
def test_rmsnorm_eps_attr_is_used(eps: float) -> None:
    rng = np.random.default_rng(11)
    a = _random(rng, (130, 9), "float32", -0.1, 0.1)  # small values so eps dominates the mean square
    g = _random(rng, (9,), "float32", 0.5, 1.5)
    out = _compile_and_run("RMSNorm", {"a": a, "g": g}, a.shape, "float32", {"eps": eps})
    _check(out, numpy_rmsnorm(a, g, eps), "float32")


def test_rmsnorm_default_eps_is_1e_6() -> None:
    a = np.full((3, 4), 1e-3, dtype=np.float32)
    g = np.ones(4, dtype=np.float32)
    out = _compile_and_run("RMSNorm", {"a": a, "g": g}, a.shape, "float32")
    _check(out, numpy_rmsnorm(a, g, 1e-6), "float32")
    # Without eps the result would be exactly 1; eps=1e-6 against a mean square of 1e-6 gives 1/sqrt(2).
    np.testing.assert_allclose(out, 1 / np.sqrt(2), rtol=1e-5)


# -- bridge.references agrees with the numpy above ----------------------------------------------------
def test_references_agree_with_test_numpy() -> None:
    rng = np.random.default_rng(5)
    lhsT, rhs = _random(rng, (129, 7), "float32"), _random(rng, (129, 513), "float32")
    (ref,) = references.reference("Matmul", [lhsT, rhs])
    np.testing.assert_allclose(ref, numpy_matmul(lhsT, rhs), rtol=1e-5, atol=1e-4)

    x = _random(rng, (129, 1000), "float32", -8, 8)
    (ref,) = references.reference("Softmax", [x])
    np.testing.assert_allclose(ref, numpy_softmax(x), rtol=1e-5, atol=1e-7)

    a, g = _random(rng, (129, 33), "float32"), _random(rng, (33,), "float32", 0.5, 1.5)
    for attrs, eps in ((None, 1e-6), ({"eps": 0.25}, 0.25)):
        (ref,) = references.reference("RMSNorm", [a, g], attrs)
        np.testing.assert_allclose(ref, numpy_rmsnorm(a, g, eps), rtol=1e-5, atol=1e-6)


def test_references_accept_bfloat16_inputs() -> None:
    rng = np.random.default_rng(6)
    x = _random(rng, (5, 9), "bfloat16")
    (ref,) = references.reference("Softmax", [x])
    np.testing.assert_allclose(ref, numpy_softmax(x), rtol=1e-5, atol=1e-7)


def test_kernels_are_registered_under_their_names() -> None:
    registry = bridge.kernels.get_internal_kernel_registry()
    names = {config.func_name: config.kernel_name for config in map(registry.get, ("Matmul", "Softmax", "RMSNorm"))}
    assert names == {"Matmul": "matmul_tiled", "Softmax": "softmax", "RMSNorm": "rmsnorm"}


def test_binary_info_describes_a_compiled_kernel() -> None:
    result = bridge.compile_kernel(
        "Matmul",
        [Tensor("a", (300, 200), "float32"), Tensor("b", (300, 700), "float32")],
        [Tensor("c", (200, 700), "float32")],
    )
    info = bridge.binary_info(result["binary"])
    assert info["kernel"] == "matmul_tiled"
    assert [spec[0] for spec in info["inputs"]] == ["lhsT", "rhs"]
    assert [spec[0] for spec in info["outputs"]] == ["out"]
    assert info["bytes"] == len(result["binary"])
    # 2 M tiles x 2 N tiles x 3 K tiles, each with two loads and a matmul.
    assert info["instructions"] >= 2 * 2 * 3 * 3


def test_access_shape_is_preferred_over_shape() -> None:
    """The registry specializes on a tensor's access_shape when it has one (as the cache key does)."""
    lhsT = Tensor("a", (999, 999), "float32", access_shape=(3, 4))
    rhs = Tensor("b", (999, 999), "float32", access_shape=(3, 5))
    result = bridge.compile_kernel("Matmul", [lhsT, rhs], [Tensor("c", (999, 999), "float32", access_shape=(4, 5))])
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(15, dtype=np.float32).reshape(3, 5)
    np.testing.assert_array_equal(bridge.run_bir(result["binary"], {"lhsT": a, "rhs": b})["out"], a.T @ b)


def test_compile_cost_bench_helpers_measure_a_case() -> None:
    """bench/compile_cost.py is a benchmark, not a test; this only keeps its helpers importable and working."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "compile_cost.py"
    spec = importlib.util.spec_from_file_location("compile_cost", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    assert {case.func_name for case in module.CASES} >= {"Matmul", "Softmax", "RMSNorm"}
    row = module.measure(module.matmul(130, 3, 5), compile_runs=1, run_runs=1)
    assert row.kernel == "Matmul (matmul_tiled)"
    assert row.instructions > 0 and row.binary_bytes > 0
    assert "| Matmul (matmul_tiled) | K=130 M=3 N=5 | float32 |" in module.format_table([row])
