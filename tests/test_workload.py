"""The workload generator (`nkicache workload`, docs/workload.md): deterministic files, graphs that load and
compile, and a distribution with in-pass hits and variants shared across models."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from bridge.targets import make_target
from workers.cli import main
from workers.workload import generate_workload

# docs/workload.md quotes these figures for `--models 12 --seed 0`; change both together.
DOC_MODELS, DOC_SEED = 12, 0
DOC_KERNEL_OPS, DOC_IN_PASS_HITS, DOC_PER_PASS_VARIANTS, DOC_DISTINCT_VARIANTS = 210, 121, 89, 55
ALL_FUNC_NAMES = {"BlockwiseMatmul", "Conv2d", "ResizeNearest", "Transpose10", "RMSNorm", "Softmax", "Matmul"}


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def doc_workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("workload")
    generate_workload(folder, DOC_MODELS, DOC_SEED)
    return folder


@pytest.fixture(scope="module")
def passes(doc_workload: Path) -> dict[str, BirCodeGenLoop]:
    """One pass per generated graph, no tier: each with a fresh loop and its own in-memory cache."""
    loops = {}
    for path in sorted(doc_workload.glob("*.json")):
        graph = load_graph(path)
        loop = BirCodeGenLoop(make_target(graph.target))
        bb = loop.run(graph)
        assert len(bb.instructions) == len(graph.ops)
        loops[path.name] = loop
    return loops


def test_the_same_seed_writes_byte_identical_files(tmp_path: Path, doc_workload: Path) -> None:
    result = CliRunner().invoke(
        main, ["workload", "--out", str(tmp_path / "cli"), "--models", str(DOC_MODELS), "--seed", str(DOC_SEED)]
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"{DOC_MODELS} graphs written to {tmp_path / 'cli'}"
    again = files_of(tmp_path / "cli")
    assert again == files_of(doc_workload)
    assert len(again) == DOC_MODELS and all(name.endswith(".json") for name in again)

    generate_workload(tmp_path / "other-seed", DOC_MODELS, DOC_SEED + 1)
    assert files_of(tmp_path / "other-seed") != again


def test_every_graph_loads_and_compiles(doc_workload: Path, passes: dict[str, BirCodeGenLoop]) -> None:
    assert set(passes) == {path.name for path in doc_workload.glob("*.json")}
    func_names: Counter = Counter()
    ordinary = set()
    dtypes = set()
    for path in doc_workload.glob("*.json"):
        graph = load_graph(path)
        assert graph.target == "Trn2"
        assert graph.name == path.stem and graph.name.split("-")[0] in ("moe", "unet")
        for op in graph.ops:
            if type(op).__name__ == "InternalNkiKernel":
                func_names[op.func_name] += 1
            else:
                ordinary.add(type(op).__name__)
        dtypes |= {t.dtype for t in graph.tensors.values()}
    assert set(func_names) == ALL_FUNC_NAMES
    assert ordinary == {"Add", "Relu", "Multiply"}
    assert {"float32", "bfloat16", "int32"} <= dtypes


def test_the_distribution_has_in_pass_hits_and_cross_model_sharing(passes: dict[str, BirCodeGenLoop]) -> None:
    kernel_ops = sum(loop.cache_hits + loop.cache_misses for loop in passes.values())
    in_pass_hits = sum(loop.cache_hits for loop in passes.values())
    per_pass_misses = sum(loop.cache_misses for loop in passes.values())
    per_pass_keys = [set(loop._cache_key_components) for loop in passes.values()]
    distinct = set().union(*per_pass_keys)

    # Repetition inside a model: most passes hit their own cache, and a miss is exactly a new key of the pass.
    assert sum(1 for loop in passes.values() if loop.cache_hits > 0) >= len(passes) - 2
    assert per_pass_misses == sum(len(keys) for keys in per_pass_keys)
    # Sharing across models: a shared tier would trace fewer variants than the passes miss.
    assert len(distinct) < per_pass_misses
    shared = [key for key in distinct if sum(key in keys for keys in per_pass_keys) > 1]
    assert shared, "no kernel variant is shared between two models"
    # The figures docs/workload.md quotes.
    assert (kernel_ops, in_pass_hits, per_pass_misses, len(distinct)) == (
        DOC_KERNEL_OPS, DOC_IN_PASS_HITS, DOC_PER_PASS_VARIANTS, DOC_DISTINCT_VARIANTS
    )  # fmt: skip


def test_models_draw_shapes_zipf_like(tmp_path: Path) -> None:
    """Over many models the most common configuration is drawn far more often than the rarest."""
    from workers import workload

    rng_models = 200
    generate_workload(tmp_path, rng_models, seed=7)
    first_layer_shapes: Counter = Counter()
    for path in tmp_path.glob("moe-*.json"):
        graph = load_graph(path)
        x = graph.tensors["l0_x"].shape  # (T, H)
        experts = graph.tensors["l0_w_router"].shape[1]
        first_layer_shapes[(x[0], x[1], experts)] += 1
    commonest = workload.MOE_CONFIGS[0]
    rarest = workload.MOE_CONFIGS[-1]
    counts = {config: first_layer_shapes[(config[0], config[1], config[2])] for config in (commonest, rarest)}
    assert counts[commonest] > 3 * counts[rarest], counts
    assert 60 <= sum(first_layer_shapes.values()) <= 140  # about half the models are MoE


def test_workload_json_lists_the_graphs(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["workload", "--out", str(tmp_path), "--models", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["models"], report["seed"], report["out"]) == (2, 0, str(tmp_path))
    assert sorted(report["graphs"]) == sorted(str(p) for p in tmp_path.glob("*.json"))
