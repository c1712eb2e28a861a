"""Graph files, compiled basic blocks (.nkibb), input sampling and the graph runner.

A graph with repeated identical kernels compiles with the expected hits and misses, and every emitted
NKIKLIRKernel's binary, executed, matches the numpy reference.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import msgpack
import numpy as np
import pytest

import bridge
from bridge.artifact import (
    ARTIFACT_MAGIC,
    ArtifactError,
    KernelInstruction,
    build_artifact,
    decode_artifact,
    encode_artifact,
    load_artifact,
    write_artifact,
)
from bridge.codegen import BirCodeGenLoop
from bridge.graph import GraphError, load_graph
from bridge.graph_runner import compare_output, run_compiled, sample_artifact_inputs, tolerance
from bridge.ir import NKIKLIRKernel, Tensor
from bridge.kernels import get_internal_kernel_registry
from bridge.references import _REFERENCES, reference
from bridge.sampling import sample_graph_inputs, sample_inputs
from bridge.targets import Trn1, Trn2

GRAPHS = Path(__file__).parent / "data" / "graphs"

VALID = {
    "name": "small",
    "tensors": {
        "a": {"shape": [64, 32], "dtype": "float32"},
        "b": {"shape": [64, 48], "dtype": "float32"},
        "c": {"shape": [32, 48], "dtype": "float32"},
    },
    "ops": [
        {"type": "Relu", "operands": ["a"], "results": ["r"]},
        {
            "type": "InternalNkiKernel",
            "func_name": "Matmul",
            "kernel_name": "matmul_tiled",
            "operands": ["a", "b"],
            "results": ["c"],
        },
    ],
}


def write_graph(tmp_path: Path, document: object, name: str = "graph.json") -> Path:
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


def mutated(change) -> dict:
    document = copy.deepcopy(VALID)
    change(document)
    return document


def compile_graph(path_or_doc, target=None):
    graph = load_graph(path_or_doc)
    loop = BirCodeGenLoop(target or Trn2())
    return graph, loop, loop.run(graph)


# -- load_graph errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "where", "problem"),
    [
        (lambda d: d.update(author="me"), None, "unknown field 'author'"),
        (lambda d: d["tensors"]["a"].update(layout="NHWC"), "tensor 'a'", "unknown field 'layout'"),
        (lambda d: d["ops"][1].update(priority=1), "op 1", "unknown field 'priority'"),
        (lambda d: d["ops"][0].update(type="Gelu"), "op 0", "unknown op type 'Gelu'"),
        (lambda d: d["ops"][1]["operands"].__setitem__(1, "nowhere"), "op 1", "operand 'nowhere'"),
        (lambda d: d["ops"][1]["results"].__setitem__(0, "undeclared"), "op 1", "result 'undeclared'"),
        (lambda d: d["tensors"]["a"].update(shape=[64, -1]), "tensor 'a'", "positive ints"),
        (lambda d: d["tensors"]["a"].update(shape="64x32"), "tensor 'a'", "positive ints"),
        (lambda d: d["tensors"]["b"].update(dtype="float64"), "tensor 'b'", "unsupported dtype 'float64'"),
        (lambda d: d["ops"][0]["operands"].append("b"), "op 0", "takes 1 operands"),
        (lambda d: d.update(target="Trn9"), None, "unknown target 'Trn9'"),
        (lambda d: d["ops"][0].update(operands=["c"]), "op 0", "operand 'c' is read before op 1 produces it"),
        (lambda d: d["ops"].append(copy.deepcopy(d["ops"][1])), "op 2", "'c' is already produced by op 1"),
    ],
    ids=[
        "top-field",
        "tensor-field",
        "op-field",
        "op-type",
        "undeclared-operand",
        "undeclared-result",
        "negative-dim",
        "shape-not-list",
        "dtype",
        "arity",
        "target",
        "read-before-produced",
        "produced-twice",
    ],
)
def test_load_graph_errors_name_file_and_op(tmp_path: Path, change, where, problem) -> None:
    path = write_graph(tmp_path, mutated(change))
    with pytest.raises(GraphError) as caught:
        load_graph(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    if where:
        assert where in message
    assert problem in message
    assert "\n" not in message


def test_load_graph_malformed_json(tmp_path: Path) -> None:
    path = write_graph(tmp_path, '{"name": "x", "ops": [')
    with pytest.raises(GraphError, match=rf"^{path}: not valid JSON"):
        load_graph(path)


def test_load_graph_not_an_object_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GraphError, match="JSON object"):
        load_graph(write_graph(tmp_path, "[1, 2]"))
    with pytest.raises(GraphError, match="cannot read graph file"):
        load_graph(tmp_path / "absent.json")


def test_load_graph_valid_file(tmp_path: Path) -> None:
    graph = load_graph(write_graph(tmp_path, VALID))
    assert graph.name == "small" and [t.name for t in graph.inputs] == ["a", "b"]
    assert graph.tensors["r"].shape == (64, 32)  # inferred result of an ordinary op


# -- repeated identical kernels -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("file", "kernels", "misses", "hits"),
    [("mlp_repeated.json", 7, 3, 4), ("attention_tiles.json", 5, 3, 2), ("bf16_norm.json", 3, 2, 1)],
)
def test_repeated_kernels_hit_and_every_binary_matches_reference(file: str, kernels: int, misses: int, hits: int):
    graph, loop, bb = compile_graph(GRAPHS / file)
    assert (loop.cache_misses, loop.cache_hits, loop.traces) == (misses, hits, misses)
    emitted = [inst for inst in bb.instructions if isinstance(inst, NKIKLIRKernel)]
    assert len(emitted) == kernels
    kernel_ops = [op for op in graph.ops if type(op).__name__ == "InternalNkiKernel"]
    rng = np.random.default_rng(0)
    for op, inst in zip(kernel_ops, emitted, strict=True):
        arrays = sample_inputs(op.func_name, op.operands, op.get_attrs_dict(), rng)
        outputs = bridge.run_bir(inst.klir_binary, dict(zip(inst.func_args, arrays, strict=True)))
        expected = reference(op.func_name, arrays, op.get_attrs_dict())
        rtol, atol = tolerance([t.dtype for t in (*op.operands, *op.results)])
        for name, result, want in zip(inst.func_outs, op.results, expected, strict=True):
            want = want.astype(bridge.dtypes.to_numpy(result.dtype)).astype(np.float64)
            np.testing.assert_allclose(outputs[name].astype(np.float64), want, rtol=rtol, atol=atol)


def test_whole_graph_runs_and_checks() -> None:
    graph, _loop, bb = compile_graph(GRAPHS / "mlp_repeated.json")
    artifact = build_artifact(graph, bb, "Trn2")
    report = run_compiled(artifact, sample_artifact_inputs(artifact, np.random.default_rng(0)), check=True)
    assert report.ok and len(report.instructions) == len(graph.ops)
    checked = [item for item in report.instructions if item.ok is not None]
    assert len(checked) == 7 and all(item.max_abs_err < 1e-4 for item in checked)
    assert report.outputs == ["r", "p0", "out"]
    values = report.values
    np.testing.assert_allclose(values["r"], np.maximum((values["n0"] + values["n1"]) * values["h2"], 0), rtol=1e-6)
    np.testing.assert_array_equal(values["out"], values["p1"])


def test_run_check_catches_a_binary_that_is_not_the_ops() -> None:
    graph, _loop, bb = compile_graph(GRAPHS / "mlp_repeated.json")
    artifact = build_artifact(graph, bb, "Trn2")
    artifact.kernels[3].attrs = {"eps": 10.0}  # the binary was compiled for eps=1e-6
    report = run_compiled(artifact, sample_artifact_inputs(artifact, np.random.default_rng(0)), check=True)
    assert not report.ok
    assert [item.index for item in report.failures] == [3]
    assert report.failures[0].max_abs_err > 1e-2
    assert all(item.ok for item in report.instructions if item.index != 3 and item.func_name)


def test_run_check_reports_a_reference_that_cannot_take_the_operands() -> None:
    graph, _loop, bb = compile_graph(GRAPHS / "attention_tiles.json")
    artifact = build_artifact(graph, bb, "Trn2")
    artifact.kernels[0].func_name = "Softmax"  # a Matmul's two operands: softmax takes one
    report = run_compiled(artifact, sample_artifact_inputs(artifact, np.random.default_rng(0)), check=True)
    assert [item.index for item in report.failures] == [0]
    assert "reference Softmax failed" in report.failures[0].error
    assert report.instructions[1].ok  # the other kernels still ran and were checked


def test_compare_output_scales_atol_by_the_largest_value_and_rounds_to_the_output_dtype() -> None:
    want = np.array([100.0, 0.0], dtype=np.float32)
    # 5e-3 off a zero: beyond atol 1e-4 alone, within atol scaled by the output's largest value (100).
    close = compare_output([np.array([100.0, 5e-3])], [want], ["float32"], ["float32"])
    assert close.ok and close.max_abs_err == pytest.approx(5e-3) and close.tolerance == (1e-4, 1e-4)
    far = compare_output([np.array([100.0, 2e-2])], [want], ["float32"], ["float32"])
    assert not far.ok and far.failed_output == 0 and far.problem.startswith("differs from the numpy reference")
    # A bfloat16 output is compared with the reference rounded to bfloat16, at the bfloat16 tolerance.
    x = np.float32(1.00390625)  # between two bfloat16 values
    rounded = np.array([x]).astype(bridge.dtypes.to_numpy("bfloat16"))
    assert compare_output([rounded], [np.array([x])], ["float32", "bfloat16"], ["bfloat16"]).max_abs_err == 0.0


def test_compare_output_fails_on_a_missing_or_misshapen_output_and_keeps_nan() -> None:
    want = [np.zeros((2, 3), np.float32), np.zeros(4, np.float32)]
    short = compare_output([np.zeros((2, 3))], want, ["float32"], ["float32"])
    assert (short.ok, short.max_abs_err, short.failed_output, short.problem) == (False, math.inf, 1, "is missing")
    gone = compare_output([np.zeros((2, 3)), None], want, ["float32"], ["float32"] * 2)
    assert (gone.ok, gone.failed_output, gone.problem) == (False, 1, "is missing")
    shaped = compare_output([np.zeros((3, 2)), np.zeros(4)], want, ["float32"], ["float32"] * 2)
    assert (shaped.ok, shaped.max_abs_err, shaped.failed_output) == (False, math.inf, 0)
    assert shaped.problem == "has shape [3, 2], the reference [2, 3]"
    nan = compare_output([np.full((2, 3), np.nan), np.zeros(4)], want, ["float32"], ["float32"] * 2)
    assert not nan.ok and math.isnan(nan.max_abs_err) and nan.failed_output == 0
    exact = compare_output([np.array([1], np.int32)], [np.array([2], np.int32)], ["int32"], ["int32"])
    assert not exact.ok and exact.tolerance == (0.0, 0.0)


def test_run_without_check_reports_nothing_checked() -> None:
    graph, _loop, bb = compile_graph(GRAPHS / "attention_tiles.json")
    artifact = build_artifact(graph, bb, "Trn2")
    report = run_compiled(artifact, sample_artifact_inputs(artifact, np.random.default_rng(0)))
    assert report.ok and all(item.ok is None for item in report.instructions)
    assert report.outputs == ["o", "p2"]


def test_run_rejects_missing_or_misshapen_inputs() -> None:
    graph, _loop, bb = compile_graph(GRAPHS / "attention_tiles.json")
    artifact = build_artifact(graph, bb, "Trn2")
    inputs = sample_artifact_inputs(artifact, np.random.default_rng(0))
    with pytest.raises(bridge.errors.KernelRuntimeError, match="no value for input 'qT'"):
        run_compiled(artifact, {k: v for k, v in inputs.items() if k != "qT"})
    with pytest.raises(bridge.errors.KernelRuntimeError, match="input 'k' has shape"):
        run_compiled(artifact, inputs | {"k": np.zeros((3, 3), np.float32)})


# -- other registered kernels (when the library provides them) -----------------------------------------
LIBRARY_GRAPHS = {
    "Transpose10": {
        "tensors": {"x": ([2, 40, 24], "float32"), "y": ([2, 24, 40], "float32")},
        "op": ("tiled_dve_transpose_10", ["x"], ["y"], {}),
    },
    "ResizeNearest": {
        "tensors": {"x": ([1, 5, 7, 8], "float32"), "y": ([1, 9, 4, 8], "float32")},
        "op": ("resize_nearest_fixed_dma_kernel", ["x"], ["y"], {"out_shape": [1, 9, 4, 8]}),
    },
    "Conv2d": {
        "tensors": {"x": ([1, 4, 9, 9], "float32"), "w": ([8, 4, 3, 3], "float32"), "y": ([1, 8, 5, 4], "float32")},
        "op": ("conv2d_pbp_kxk", ["x", "w"], ["y"], {"stride": [2, 2], "padding": [[1, 1], [0, 0]]}),
    },
    "BlockwiseMatmul": {
        "tensors": {
            "h": ([21, 32], "float32"),
            "aff": ([84, 1], "float32"),
            "wgu": ([4, 32, 2, 16], "float32"),
            "wd": ([4, 16, 32], "float32"),
            "tpi": ([24], "int32"),
            "b2e": ([3, 1], "int32"),
            "y": ([21, 32], "float32"),
        },
        "op": ("blockwise_mm", ["h", "aff", "wgu", "wd", "tpi", "b2e"], ["y"], {"block_size": 8}),
    },
}


def _library_graph(func_name: str) -> dict:
    spec = LIBRARY_GRAPHS[func_name]
    kernel_name, operands, results, attrs = spec["op"]
    tensors = {}
    ops = []
    for copy_index in range(2):  # the same kernel twice, on other tensors: one miss, one hit
        rename = {name: f"{name}{copy_index}" for name in spec["tensors"]}
        for name, (shape, dtype) in spec["tensors"].items():
            tensors[rename[name]] = {"shape": shape, "dtype": dtype}
        ops.append(
            {
                "type": "InternalNkiKernel",
                "func_name": func_name,
                "kernel_name": kernel_name,
                "operands": [rename[n] for n in operands],
                "results": [rename[n] for n in results],
                "attrs": attrs,
            }
        )
    return {"name": f"lib-{func_name}", "tensors": tensors, "ops": ops}


@pytest.mark.parametrize("func_name", sorted(LIBRARY_GRAPHS))
def test_library_kernel_graph_hits_and_checks(func_name: str) -> None:
    if get_internal_kernel_registry().get(func_name) is None or func_name not in _REFERENCES:
        pytest.skip(f"{func_name} is not in this build's kernel library yet")
    graph, loop, bb = compile_graph(_library_graph(func_name))
    assert (loop.cache_misses, loop.cache_hits) == (1, 1)
    artifact = build_artifact(graph, bb, "Trn2")
    for seed in range(2):
        report = run_compiled(artifact, sample_artifact_inputs(artifact, np.random.default_rng(seed)), check=True)
        assert report.ok, [(i.name, i.max_abs_err) for i in report.instructions]


# -- sampling -----------------------------------------------------------------------------------------
def _blockwise_operands(tokens=20, hidden=32, experts=4, inter=16, blocks=3, block=8, dtype="float32"):
    return [
        Tensor("hidden", (tokens + 1, hidden), dtype),
        Tensor("aff", ((tokens + 1) * experts, 1), dtype),
        Tensor("wgu", (experts, hidden, 2, inter), dtype),
        Tensor("wd", (experts, inter, hidden), dtype),
        Tensor("tpi", (blocks * block,), "int32"),
        Tensor("b2e", (blocks, 1), "int32"),
    ]


@pytest.mark.parametrize(("tokens", "blocks", "block"), [(20, 3, 8), (24, 3, 8), (30, 2, 8)])
def test_blockwise_sampler_builds_a_valid_routing(tokens: int, blocks: int, block: int) -> None:
    experts, hidden = 4, 32
    operands = _blockwise_operands(tokens=tokens, blocks=blocks, block=block, experts=experts, hidden=hidden)
    arrays = sample_inputs("BlockwiseMatmul", operands, {"block_size": block}, np.random.default_rng(7))
    assert [a.shape for a in arrays] == [t.shape for t in operands]
    ids, b2e, aff, wgu = arrays[4], arrays[5], arrays[1], arrays[2]
    assert ids.dtype == np.int32 and b2e.dtype == np.int32
    real = ids[ids != tokens]
    assert len(real) == min(tokens, blocks * block)
    assert len(set(real.tolist())) == len(real) and real.min() >= 0 and real.max() < tokens
    assert (ids == tokens).sum() == blocks * block - len(real)  # padding carries id T
    assert b2e.min() >= 0 and b2e.max() < experts
    assert np.all(aff.reshape(-1)[tokens * experts :] == 0)
    assert np.all(aff.reshape(-1)[: tokens * experts] >= 0)
    assert abs(float(wgu.std()) - 1 / math.sqrt(hidden)) < 0.05


def test_default_sampler_is_standard_normal_in_the_tensor_dtype() -> None:
    arrays = sample_inputs("Softmax", [Tensor("x", (200, 50), "bfloat16")], {}, np.random.default_rng(0))
    assert arrays[0].dtype == bridge.dtypes.to_numpy("bfloat16")
    values = arrays[0].astype(np.float32)
    assert abs(float(values.mean())) < 0.05 and abs(float(values.std()) - 1) < 0.05


def test_graph_sampler_uses_the_consuming_ops_sampler() -> None:
    operands = _blockwise_operands()
    tensors = {t.name: t for t in operands} | {"extra": Tensor("extra", (3,), "int32", access_shape=(2,))}
    inputs = ["extra", *[t.name for t in operands]]
    ops = [("BlockwiseMatmul", [t.name for t in operands], {"block_size": 8})]
    first = sample_graph_inputs(inputs, tensors, ops, np.random.default_rng(3))
    second = sample_graph_inputs(inputs, tensors, ops, np.random.default_rng(3))
    assert list(first) == inputs
    assert first["extra"].shape == (2,)  # the access_shape: what a kernel would see
    assert first["tpi"].max() == 20 and sorted(first["tpi"][first["tpi"] < 20].tolist()) == list(range(20))
    for name in inputs:
        np.testing.assert_array_equal(first[name], second[name])  # seeded: the same inputs


# -- the artifact ---------------------------------------------------------------------------------
@pytest.fixture
def artifact_path(tmp_path: Path) -> Path:
    graph, _loop, bb = compile_graph(GRAPHS / "mlp_repeated.json")
    return write_artifact(build_artifact(graph, bb, "Trn2"), tmp_path)


def test_artifact_round_trip(artifact_path: Path) -> None:
    assert artifact_path.name == "mlp-repeated.nkibb"
    artifact = load_artifact(artifact_path)
    assert artifact.graph == "mlp-repeated" and artifact.target == "Trn2"
    assert artifact.inputs == ["x0", "x1", "x2", "w", "g"]
    assert artifact.tensors["out"].shape == (32, 48)
    assert len(artifact.instructions) == 11 and len(artifact.kernels) == 7
    first = artifact.kernels[0]
    assert isinstance(first, KernelInstruction)
    assert (first.name, first.func_name, first.kernel_format) == ("matmul_tiled", "Matmul", "bir")
    assert first.func_args == ["lhsT", "rhs"] and first.operands == ["x0", "w"] and first.results == ["h0"]
    assert artifact.kernels[3].attrs == {"eps": 1e-6}
    assert encode_artifact(artifact) == artifact_path.read_bytes()  # deterministic, lossless


def test_artifact_keeps_access_shape_and_attr_tuples(tmp_path: Path) -> None:
    document = {
        "name": "viewed",
        "tensors": {"x": {"shape": [64, 48], "dtype": "float32", "access_shape": [32, 48]},
                    "y": {"shape": [32, 48], "dtype": "float32"}},
        "ops": [{"type": "InternalNkiKernel", "func_name": "Softmax", "kernel_name": "softmax",
                 "operands": ["x"], "results": ["y"]}],
    }  # fmt: skip
    graph, _loop, bb = compile_graph(document, Trn1())
    artifact = load_artifact(write_artifact(build_artifact(graph, bb, "Trn1"), tmp_path))
    assert artifact.tensors["x"].access_shape == (32, 48) and artifact.target == "Trn1"
    inputs = sample_artifact_inputs(artifact, np.random.default_rng(0))
    assert inputs["x"].shape == (32, 48)
    assert run_compiled(artifact, inputs, check=True).ok


def test_artifact_is_msgpack_with_a_header(artifact_path: Path) -> None:
    envelope = msgpack.unpackb(artifact_path.read_bytes())
    assert (envelope["magic"], envelope["format"], envelope["version"]) == (ARTIFACT_MAGIC, "nkibb", 1)
    assert b"pickle" not in artifact_path.read_bytes()[:64]


def test_artifact_write_is_atomic_and_leaves_no_temporaries(artifact_path: Path, monkeypatch) -> None:
    before = artifact_path.read_bytes()
    artifact = load_artifact(artifact_path)
    import os

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    artifact.graph = "mlp-repeated"
    with pytest.raises(ArtifactError, match="cannot write"):
        write_artifact(artifact, artifact_path.parent)
    assert artifact_path.read_bytes() == before
    assert sorted(p.name for p in artifact_path.parent.iterdir()) == ["mlp-repeated.nkibb"]


def test_artifact_file_name_stays_in_the_output_folder(tmp_path: Path) -> None:
    graph, _loop, bb = compile_graph(mutated(lambda d: d.update(name="../../etc/evil name")))
    path = write_artifact(build_artifact(graph, bb, "Trn2"), tmp_path)
    assert path.parent == tmp_path and path.name == "_.._etc_evil_name.nkibb"


def _corrupt_body(path: Path, change) -> bytes:
    import hashlib

    envelope = msgpack.unpackb(path.read_bytes())
    body = msgpack.unpackb(envelope["body"])
    change(body)
    envelope["body"] = msgpack.packb(body, use_bin_type=True)
    envelope["sha256"] = hashlib.sha256(envelope["body"]).hexdigest()
    return msgpack.packb(envelope, use_bin_type=True)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda data, path: data[: len(data) // 2], "truncated"),
        (lambda data, path: b"", "truncated"),
        (lambda data, path: b"\x80\x04pickle", "truncated or corrupt"),
        (lambda data, path: msgpack.packb({"magic": "nope"}), "header"),
        (lambda data, path: data.replace(b"nkibb", b"other", 1), "format"),
        (lambda data, path: data[:-5] + bytes(b ^ 1 for b in data[-5:]), "sha256"),
        (lambda data, path: _corrupt_body(path, lambda b: b.pop("tensors")), "'tensors'"),
        (lambda data, path: _corrupt_body(path, lambda b: b["tensors"]["w"].update(dtype="f8")), "dtype"),
        (lambda data, path: _corrupt_body(path, lambda b: b["instructions"][0].update(operands=["ghost"])), "ghost"),
        (
            lambda data, path: _corrupt_body(path, lambda b: b["instructions"][0].update(kernel_format="ptx")),
            "kernel_format",
        ),
        (
            lambda data, path: _corrupt_body(path, lambda b: b["instructions"][0].update(klir_binary=b"junk")),
            "instruction 0",
        ),
        (
            lambda data, path: _corrupt_body(path, lambda b: b["instructions"][0].update(func_args=["x", "y"])),
            "func_args",
        ),
    ],
    ids=[
        "half",
        "empty",
        "pickle",
        "magic",
        "format",
        "bitflip",
        "missing-field",
        "dtype",
        "undeclared",
        "kernel-format",
        "bad-binary",
        "func-args",
    ],
)
def test_load_artifact_rejects_malformed_files(artifact_path: Path, damage, problem: str) -> None:
    artifact_path.write_bytes(damage(artifact_path.read_bytes(), artifact_path))
    with pytest.raises(ArtifactError) as caught:
        load_artifact(artifact_path)
    message = str(caught.value)
    assert message.startswith(f"{artifact_path}: ") and problem in message and "\n" not in message


def test_load_artifact_missing_file_and_other_version(tmp_path: Path, artifact_path: Path) -> None:
    with pytest.raises(ArtifactError, match="cannot read"):
        load_artifact(tmp_path / "absent.nkibb")
    envelope = msgpack.unpackb(artifact_path.read_bytes())
    envelope["version"] = 99
    with pytest.raises(ArtifactError, match="version 99"):
        decode_artifact(msgpack.packb(envelope, use_bin_type=True), "x.nkibb")


@pytest.mark.parametrize("depth", [40, 1500, 100_000])
def test_deeply_nested_json_is_one_graph_error_not_a_recursion_error(tmp_path: Path, depth: int) -> None:
    path = tmp_path / "deep.json"
    path.write_text('{"name": "deep", "tensors": {}, "ops": [], "x": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(GraphError, match="nested deeper than 32 levels"):
        load_graph(path)
