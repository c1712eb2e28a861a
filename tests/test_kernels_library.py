"""The internal kernel library (issue 3): blockwise_mm, conv2d_pbp_*, resize_nearest_fixed_dma_kernel and
tiled_dve_transpose_10 through `bridge.compile_kernel` + `bridge.run_bir`, against `bridge.references`.

The references are whole-array numpy that shares nothing with the kernels; a few tests below also check
them against more naive numpy (per-token, per-pixel loops in float64) so that a wrong reference cannot
hide a wrong kernel. Shapes are small and ragged on purpose (partition/PSUM/moving limits crossed by a
few elements); realistic shapes live in bench/kernel_library_cost.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import bridge
from bridge import Tensor, references
from bridge.errors import KernelCompileError, KernelRuntimeError

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int32": np.int32}
# (rtol, atol relative to the largest |expected|): float32 tight, bfloat16 loose.
TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}


def _compile(func_name, inputs: dict[str, np.ndarray], out_shape, out_dtype, attrs=None) -> dict:
    operands = [Tensor(f"graph_{name}", array.shape, _dtype_name(array)) for name, array in inputs.items()]
    result = bridge.compile_kernel(func_name, operands, [Tensor("graph_out", out_shape, out_dtype)], attrs)
    assert result["format"] == "bir"
    assert result["input_names"] == list(inputs)
    return result


def _run(func_name, inputs, out_shape, out_dtype, attrs=None) -> tuple[np.ndarray, str]:
    """(the kernel's only output, the kernel_name the registry chose)."""
    result = _compile(func_name, inputs, out_shape, out_dtype, attrs)
    (name,) = result["output_names"]
    out = bridge.run_bir(result["binary"], inputs)[name]
    assert out.shape == tuple(out_shape)
    assert out.dtype == np.dtype(NP_DTYPES[out_dtype])
    return out, bridge.binary_info(result["binary"])["kernel"]


def _dtype_name(array: np.ndarray) -> str:
    return next(name for name, dtype in NP_DTYPES.items() if np.dtype(dtype) == array.dtype)


def _expected(func_name, inputs: dict[str, np.ndarray], attrs=None) -> np.ndarray:
    (expected,) = references.reference(func_name, list(inputs.values()), attrs)
    return expected


def _check_close(actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    rtol, atol = TOLERANCES[dtype]
    actual = actual.astype(np.float64)
    assert np.isfinite(actual).all(), "kernel output has NaN/inf (an uninitialised or unwritten region?)"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol * max(1.0, float(np.abs(expected).max())))


def _random(rng, shape, dtype="float32", scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(NP_DTYPES[dtype])


# -- Transpose10 -----------------------------------------------------------------------------------------
TRANSPOSE_SHAPES = [(5, 7), (130, 260), (3, 200, 131), (2, 3, 129, 5)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES, ids=str)
def test_transpose10_matches_reference_exactly(shape, dtype):
    x = _random(np.random.default_rng(1), shape, dtype)
    out_shape = (*shape[:-2], shape[-1], shape[-2])
    out, kernel = _run("Transpose10", {"x": x}, out_shape, dtype)
    assert kernel == "tiled_dve_transpose_10"
    np.testing.assert_array_equal(out, _expected("Transpose10", {"x": x}).astype(out.dtype))
    np.testing.assert_array_equal(out, np.swapaxes(x, -1, -2))


# -- ResizeNearest ---------------------------------------------------------------------------------------
RESIZE_CASES = [
    ((1, 30, 20, 64), (1, 59, 38, 64)),  # up by non-integer scales
    ((2, 26, 14, 3), (2, 22, 46, 3)),  # down H, up W; float32 rounding moves a source index on both axes
    ((1, 300, 17, 5), (1, 131, 40, 5)),  # down across several 128-row chunks, up W
    ((1, 9, 12, 2), (1, 4, 5, 2)),  # down on both axes
    ((1, 6, 6, 1), (1, 6, 6, 1)),  # identity
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("in_shape", "out_shape"), RESIZE_CASES, ids=str)
def test_resize_nearest_matches_reference_exactly(in_shape, out_shape, dtype):
    data = _random(np.random.default_rng(2), in_shape, dtype)
    attrs = {"out_shape": list(out_shape)}
    out, kernel = _run("ResizeNearest", {"data": data}, out_shape, dtype, attrs)
    assert kernel == "resize_nearest_fixed_dma_kernel"
    np.testing.assert_array_equal(out, _expected("ResizeNearest", {"data": data}, attrs).astype(out.dtype))


def test_resize_reference_uses_float32_source_indices():
    """26 -> 22 rows: float32(26/22) * 11 rounds to 12.999999, so output row 11 reads source row 12, where
    exact arithmetic (11 * 26 // 22) would read row 13."""
    data = np.arange(26, dtype=np.float32).reshape(1, 26, 1, 1)
    (out,) = references.reference("ResizeNearest", [data], {"out_shape": (1, 22, 1, 1)})
    rows = out[0, :, 0, 0].astype(int)
    assert rows[11] == 12 and (11 * 26) // 22 == 13
    naive = [int(np.floor(np.float32(o) * (np.float32(26) / np.float32(22)))) for o in range(22)]
    assert rows.tolist() == naive


# -- Conv2d ----------------------------------------------------------------------------------------------
KXK = "conv2d_pbp_kxk"
CONV_CASES = [
    # (input NCHW, weight OIHW, attrs, expected kernel)
    ((1, 3, 8, 9), (5, 3, 3, 3), {"stride": (2, 2), "padding": ((1, 2), (0, 1))}, "conv2d_pbp_kxk"),
    (
        (2, 4, 10, 7),
        (6, 4, 3, 2),
        {"stride": (1, 2), "padding": ((2, 0), (1, 1)), "dilation": (2, 2)},
        "conv2d_pbp_kxk",
    ),
    ((1, 130, 6, 5), (140, 130, 3, 3), {"padding": ((1, 1), (1, 1))}, "conv2d_pbp_kxk"),
    ((1, 130, 6, 5), (140, 130, 1, 1), {}, "conv2d_pbp_1x1"),
    ((2, 3, 3, 600), (4, 3, 1, 1), {}, "conv2d_pbp_1x1"),  # a row wider than the 512 moving limit
    ((1, 3, 5, 5), (2, 3, 1, 1), {"stride": (2, 2)}, "conv2d_pbp_kxk"),  # 1x1 with stride: the general kernel
]


def _conv_out_shape(in_shape, w_shape, attrs) -> tuple[int, ...]:
    (sh, sw), (dh, dw) = attrs.get("stride", (1, 1)), attrs.get("dilation", (1, 1))
    (pt, pb), (pl, pr) = attrs.get("padding", ((0, 0), (0, 0)))
    oh = (in_shape[2] + pt + pb - dh * (w_shape[2] - 1) - 1) // sh + 1
    ow = (in_shape[3] + pl + pr - dw * (w_shape[3] - 1) - 1) // sw + 1
    return (in_shape[0], w_shape[0], oh, ow)


@pytest.mark.parametrize(("in_shape", "w_shape", "attrs", "kernel_name"), CONV_CASES, ids=str)
def test_conv2d_matches_reference(in_shape, w_shape, attrs, kernel_name):
    rng = np.random.default_rng(3)
    inputs = {"input": _random(rng, in_shape), "weight": _random(rng, w_shape, scale=0.3)}
    out, kernel = _run("Conv2d", inputs, _conv_out_shape(in_shape, w_shape, attrs), "float32", attrs)
    assert kernel == kernel_name
    _check_close(out, _expected("Conv2d", inputs, attrs), "float32")


@pytest.mark.parametrize(("in_shape", "w_shape", "attrs", "kernel_name"), CONV_CASES[1:4], ids=str)
def test_conv2d_bfloat16(in_shape, w_shape, attrs, kernel_name):
    rng = np.random.default_rng(4)
    inputs = {"input": _random(rng, in_shape, "bfloat16"), "weight": _random(rng, w_shape, "bfloat16", 0.3)}
    out, kernel = _run("Conv2d", inputs, _conv_out_shape(in_shape, w_shape, attrs), "bfloat16", attrs)
    assert kernel == kernel_name
    _check_close(out, _expected("Conv2d", inputs, attrs), "bfloat16")


def test_conv2d_reference_against_per_pixel_loops():
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((1, 2, 5, 6)), rng.standard_normal((3, 2, 2, 3))
    stride, padding, dilation = (2, 1), ((1, 0), (2, 1)), (2, 1)
    (fast,) = references.reference("Conv2d", [x, w], {"stride": stride, "padding": padding, "dilation": dilation})
    out = np.zeros(fast.shape)
    for o, oh, ow in np.ndindex(*out.shape[1:]):
        for c, kh, kw in np.ndindex(*w.shape[1:]):
            ih = oh * stride[0] - padding[0][0] + kh * dilation[0]
            iw = ow * stride[1] - padding[1][0] + kw * dilation[1]
            if 0 <= ih < x.shape[2] and 0 <= iw < x.shape[3]:
                out[0, o, oh, ow] += x[0, c, ih, iw] * w[o, c, kh, kw]
    np.testing.assert_allclose(fast, out, rtol=1e-5, atol=1e-5)


# -- BlockwiseMatmul -------------------------------------------------------------------------------------
def moe_inputs(rng, T, H, E, inter, B, top_k=2, dtype="float32", extra_blocks=0) -> dict[str, np.ndarray]:
    """A routed batch: every token goes to top_k experts, each expert's tokens fill blocks of B padded with
    id T (affinity 0). Experts with more than B tokens get several blocks; `extra_blocks` adds blocks of
    padding only."""
    choice = np.argsort(rng.random((T, E)), axis=1)[:, :top_k]
    affinities = np.zeros((T + 1) * E, np.float32)
    ids, experts = [], []
    for e in range(E):
        tokens = np.flatnonzero((choice == e).any(axis=1))
        affinities[tokens * E + e] = rng.uniform(0.1, 1.0, size=len(tokens))
        for start in range(0, max(len(tokens), 1), B):
            block = np.full(B, T, np.int32)
            chunk = tokens[start : start + B]
            block[: len(chunk)] = chunk
            ids.append(block)
            experts.append(e)
    for _ in range(extra_blocks):
        ids.append(np.full(B, T, np.int32))
        experts.append(int(rng.integers(E)))
    return {
        "hidden": _random(rng, (T + 1, H), dtype),
        "expert_affinities_masked": affinities.reshape(-1, 1).astype(NP_DTYPES[dtype]),
        "gate_up_proj_weight": _random(rng, (E, H, 2, inter), dtype, 1 / np.sqrt(H)),
        "down_proj_weight": _random(rng, (E, inter, H), dtype, 1 / np.sqrt(inter)),
        "token_position_to_id": np.concatenate(ids).astype(np.int32),
        "block_to_expert": np.array(experts, np.int32).reshape(-1, 1),
    }


BLOCKWISE_CASES = [
    # (T, H, E, inter, B)
    (10, 8, 3, 5, 4),  # several blocks per expert, padding in most blocks
    (50, 256, 2, 128, 16),  # H over two partitions' worth
    (200, 130, 4, 600, 130),  # ragged: B > 128 (two token tiles), I > 512 (two PSUM tiles), H = 128 + 2
]


def _run_blockwise(inputs, dtype="float32"):
    B = inputs["token_position_to_id"].shape[0] // inputs["block_to_expert"].shape[0]
    out, kernel = _run("BlockwiseMatmul", inputs, inputs["hidden"].shape, dtype, {"block_size": B})
    assert kernel == "blockwise_mm"
    return out, B


@pytest.mark.parametrize(("T", "H", "E", "inter", "B"), BLOCKWISE_CASES, ids=str)
def test_blockwise_mm_matches_reference(T, H, E, inter, B):
    inputs = moe_inputs(np.random.default_rng(6), T, H, E, inter, B, extra_blocks=1)
    experts = inputs["block_to_expert"][:, 0].tolist()
    assert len(set(experts)) > 1 and len(experts) > len(set(experts)), "want several experts, one used twice"
    assert (inputs["token_position_to_id"] == T).any(), "want padding tokens"
    out, B = _run_blockwise(inputs)
    expected = _expected("BlockwiseMatmul", inputs, {"block_size": B})
    _check_close(out, expected, "float32")
    assert not out[T].any(), "the padding row only ever receives zero contributions"


def test_blockwise_mm_bfloat16():
    inputs = moe_inputs(np.random.default_rng(7), 50, 256, 3, 128, 16, dtype="bfloat16")
    out, B = _run_blockwise(inputs, "bfloat16")
    _check_close(out, _expected("BlockwiseMatmul", inputs, {"block_size": B}), "bfloat16")


def test_blockwise_mm_accumulates_a_token_over_blocks_of_the_same_expert():
    """Token 0 in two blocks of expert 1 and one block of expert 0: three contributions add up."""
    rng = np.random.default_rng(8)
    T, H, E, inter, B = 3, 4, 2, 3, 2
    inputs = moe_inputs(rng, T, H, E, inter, B)
    inputs["token_position_to_id"] = np.array([0, 3, 0, 1, 2, 0], np.int32)
    inputs["block_to_expert"] = np.array([[1], [1], [0]], np.int32)
    inputs["expert_affinities_masked"] = rng.uniform(0.5, 1.0, ((T + 1) * E, 1)).astype(np.float32)
    inputs["expert_affinities_masked"][T * E :] = 0
    out, _ = _run_blockwise(inputs)
    _check_close(out, _naive_blockwise(inputs, B), "float32")


def _naive_blockwise(inputs: dict[str, np.ndarray], B: int) -> np.ndarray:
    """Token by token in float64: the DESIGN formula written without fancy indexing."""
    h, aff = inputs["hidden"].astype(np.float64), inputs["expert_affinities_masked"].astype(np.float64)
    gu, down = inputs["gate_up_proj_weight"].astype(np.float64), inputs["down_proj_weight"].astype(np.float64)
    E = gu.shape[0]
    out = np.zeros(h.shape)
    for position, token in enumerate(inputs["token_position_to_id"]):
        e = inputs["block_to_expert"][position // B, 0]
        gate, up = h[token] @ gu[e, :, 0, :], h[token] @ gu[e, :, 1, :]
        out[token] += (gate / (1 + np.exp(-gate)) * up) @ down[e] * aff[token * E + e, 0]
    return out


def test_blockwise_reference_against_token_loop():
    inputs = moe_inputs(np.random.default_rng(9), 12, 6, 3, 5, 4)
    (fast,) = references.reference("BlockwiseMatmul", list(inputs.values()), {"block_size": 4})
    np.testing.assert_allclose(fast, _naive_blockwise(inputs, 4), rtol=1e-5, atol=1e-5)


# -- wrong inputs ----------------------------------------------------------------------------------------
def _blockwise_tensors(T=6, H=8, E=2, inter=4, B=4, N=3, **overrides) -> list[Tensor]:
    shapes = {
        "hidden": ((T + 1, H), "float32"),
        "affinities": (((T + 1) * E, 1), "float32"),
        "gate_up": ((E, H, 2, inter), "float32"),
        "down": ((E, inter, H), "float32"),
        "ids": ((N * B,), "int32"),
        "experts": ((N, 1), "int32"),
    }
    shapes.update(overrides)
    return [Tensor(name, shape, dtype) for name, (shape, dtype) in shapes.items()]


@pytest.mark.parametrize(
    ("overrides", "attrs", "cause"),
    [
        ({"down": ((2, 4, 9), "float32")}, {"block_size": 4}, "down_proj_weight must be"),
        ({"ids": ((11,), "int32")}, {"block_size": 4}, "token_position_to_id must be"),
        ({"ids": ((12,), "float32")}, {"block_size": 4}, "token_position_to_id must be int32"),
        ({"affinities": ((14, 2), "float32")}, {"block_size": 4}, "expert_affinities_masked must be"),
        ({"gate_up": ((2, 8, 3, 4), "float32")}, {"block_size": 4}, "gate_up_proj_weight must be"),
        ({}, {}, "block_size"),
    ],
)
def test_blockwise_mm_shape_errors_at_compile_time(overrides, attrs, cause):
    with pytest.raises(KernelCompileError, match=cause) as info:
        bridge.compile_kernel(
            "BlockwiseMatmul", _blockwise_tensors(**overrides), [Tensor("o", (7, 8), "float32")], attrs
        )
    assert info.value.kernel == "blockwise_mm"
    assert "blockwise_mm.py" in str(info.value)


@pytest.mark.parametrize(
    ("func_name", "operands", "result", "attrs", "cause"),
    [
        ("Conv2d", [(1, 3, 8, 8), (4, 5, 3, 3)], (1, 4, 6, 6), {}, "5 input channels but input"),
        ("Conv2d", [(1, 3, 8, 8), (4, 3, 3, 3)], (1, 4, 8, 8), {}, r"out must be \[1, 4, 6, 6\]"),
        ("Conv2d", [(1, 3, 8, 8), (4, 3, 3, 3)], (1, 4, 6, 6), {"stride": (0, 1)}, "stride must be positive"),
        ("Conv2d", [(1, 3, 8, 8), (4, 3, 3, 3)], (1, 4, 6, 6), {"padding": (1, 1)}, "padding must be"),
        ("Conv2d", [(1, 3, 2, 2), (4, 3, 3, 3)], (1, 4, 1, 1), {}, "output would be empty"),
        ("ResizeNearest", [(1, 4, 4, 3)], (1, 8, 8, 3), {"out_shape": (1, 8, 8, 2)}, "keep batch 1 and channels 3"),
        ("ResizeNearest", [(1, 4, 4, 3)], (1, 8, 8, 3), {"out_shape": (1, 8, 9, 3)}, "does not match out_shape"),
        ("ResizeNearest", [(1, 4, 4, 3)], (1, 8, 8, 3), {}, "needs attr out_shape"),
        ("Transpose10", [(4, 5)], (4, 5), {}, r"out must be \[5, 4\]"),
        ("Transpose10", [(2, 2, 2, 4, 5)], (2, 2, 2, 5, 4), {}, "2-D, 3-D or 4-D"),
    ],
)
def test_shape_errors_at_compile_time(func_name, operands, result, attrs, cause):
    tensors = [Tensor(f"t{i}", shape, "float32") for i, shape in enumerate(operands)]
    with pytest.raises(KernelCompileError, match=cause):
        bridge.compile_kernel(func_name, tensors, [Tensor("r", result, "float32")], attrs)


@pytest.mark.parametrize("bad_id", [-1, 11, 2**31 - 1])
def test_blockwise_mm_out_of_range_token_id_fails_at_run_time(bad_id):
    inputs = moe_inputs(np.random.default_rng(10), 10, 8, 3, 5, 4)
    inputs["token_position_to_id"][-1] = bad_id  # the last block, after earlier blocks already stored
    result = _compile("BlockwiseMatmul", inputs, inputs["hidden"].shape, "float32", {"block_size": 4})
    with pytest.raises(KernelRuntimeError, match=rf"gather index {bad_id} out of range .*'hidden'"):
        bridge.run_bir(result["binary"], inputs)


@pytest.mark.parametrize("bad_expert", [3, -1, 100])
def test_blockwise_mm_block_mapped_to_missing_expert_fails_at_run_time(bad_expert):
    inputs = moe_inputs(np.random.default_rng(11), 10, 8, 3, 5, 4)
    inputs["block_to_expert"][1, 0] = bad_expert
    result = _compile("BlockwiseMatmul", inputs, inputs["hidden"].shape, "float32", {"block_size": 4})
    with pytest.raises(KernelRuntimeError, match=rf"runtime index {bad_expert} out of range .*'gate_up_proj_weight'"):
        bridge.run_bir(result["binary"], inputs)


# -- determinism -----------------------------------------------------------------------------------------
DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import hashlib
    import bridge
    from bridge import Tensor as T

    f = "float32"
    calls = [
        ("BlockwiseMatmul",
         [T("h", (201, 130), f), T("a", (804, 1), f), T("g", (4, 130, 2, 600), f), T("d", (4, 600, 130), f),
          T("t", (520,), "int32"), T("b", (4, 1), "int32")],
         [T("o", (201, 130), f)], {"block_size": 130}),
        ("Conv2d", [T("x", (2, 4, 10, 7), f), T("w", (6, 4, 3, 2), f)], [T("y", (2, 6, 8, 4), f)],
         {"stride": (1, 2), "padding": ((2, 0), (1, 1)), "dilation": (2, 2)}),
        ("Conv2d", [T("x", (1, 130, 6, 5), f), T("w", (140, 130, 1, 1), f)], [T("y", (1, 140, 6, 5), f)], {}),
        ("ResizeNearest", [T("x", (2, 26, 14, 3), f)], [T("y", (2, 22, 46, 3), f)], {"out_shape": (2, 22, 46, 3)}),
        ("Transpose10", [T("x", (2, 3, 129, 5), f)], [T("y", (2, 3, 5, 129), f)], {}),
    ]
    for func_name, operands, results, attrs in calls:
        binary = bridge.compile_kernel(func_name, operands, results, attrs)["binary"]
        print(func_name, hashlib.sha256(binary).hexdigest())
    """
)


def test_binaries_are_identical_across_processes():
    digests = []
    for seed in ("0", "12345"):  # different str hashing per process: no set/dict-order leaks into binaries
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", DETERMINISM_SCRIPT], capture_output=True, text=True, env=env, timeout=120
        )
        assert run.returncode == 0, run.stderr
        digests.append(run.stdout.splitlines())
    assert len(digests[0]) == 5
    assert digests[0] == digests[1]
    # ... and equal to this process's compile of the same kernel.
    here = bridge.compile_kernel(
        "Transpose10", [Tensor("x", (2, 3, 129, 5), "float32")], [Tensor("y", (2, 3, 5, 129), "float32")]
    )
    assert digests[0][-1] == f"Transpose10 {hashlib.sha256(here['binary']).hexdigest()}"
