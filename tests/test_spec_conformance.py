"""One or more tests per claim of the specification ("NKI-Frontend Bridge and Binary Cache").

docs/spec-conformance.md maps every claim to the code and to the tests here. Kernels are tiny (tens of
rows), so every real beta3 compile costs milliseconds.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

import bridge
from bridge import codegen
from bridge.codegen import BANNER, CACHE_KEY_LOG_PREFIX, BirCodeGenLoop
from bridge.errors import NkiCacheError, UnknownKernelError
from bridge.graph import load_graph
from bridge.ir import BasicBlock, InternalNkiKernel, NKIKLIRKernel, Tensor
from bridge.kernels import get_internal_kernel_registry
from bridge.metrics import KernelCategory, KernelMetricsCollector
from bridge.program import BIR_VERSION_IDENTIFIER
from bridge.references import reference
from bridge.registry import InternalKernelConfig
from bridge.targets import TARGET_ENV, Target, Trn1, Trn2, get_platform_target

TRACE_RESULT_KEYS = {"binary", "input_names", "output_names", "format"}
CACHE_METHODS = (
    "__init__",
    "_compute_cache_key_from_components",
    "_get_cached_new_nki_frontend_binary",
    "_cache_new_nki_frontend_binary",
    "_record_cache_usage",
)


# -- helpers ----------------------------------------------------------------------------------------
def t(name: str, shape: tuple, dtype: str = "float32", access_shape: tuple | None = None) -> Tensor:
    return Tensor(name, shape, dtype, access_shape)


def matmul(tag: str = "", k: int = 64, m: int = 32, n: int = 48, dtype: str = "float32") -> InternalNkiKernel:
    return InternalNkiKernel(
        "Matmul",
        "matmul_tiled",
        [t(f"a{tag}", (k, m), dtype), t(f"b{tag}", (k, n), dtype)],
        [t(f"c{tag}", (m, n), dtype)],
    )


def softmax(tag: str = "", rows: int = 32, cols: int = 48, dtype: str = "float32") -> InternalNkiKernel:
    return InternalNkiKernel(
        "Softmax", "softmax", [t(f"x{tag}", (rows, cols), dtype)], [t(f"y{tag}", (rows, cols), dtype)]
    )


def rmsnorm(tag: str = "", eps: float = 1e-6) -> InternalNkiKernel:
    return InternalNkiKernel(
        "RMSNorm", "rmsnorm", [t(f"a{tag}", (16, 24)), t(f"g{tag}", (24,))], [t(f"o{tag}", (16, 24))], {"eps": eps}
    )


def codegen_all(loop: BirCodeGenLoop, *ops: InternalNkiKernel) -> BasicBlock:
    bb = BasicBlock()
    for op in ops:
        loop.codegenInternalNativeNkiKernel(op, bb)
    return bb


def independent_key(op: InternalNkiKernel, target: Target) -> str:
    """The key as the specification writes it, computed without the loop."""

    def info(tensors: list[Tensor]) -> dict:
        shapes = [x.access_shape if hasattr(x, "access_shape") else x.shape for x in tensors]
        return {"shapes": shapes, "dtypes": [x.dtype for x in tensors]}

    components = {
        "kernel_name": op.kernel_name,
        "operands": info(op.operands),
        "results": info(op.results),
        "attrs": op.get_attrs_dict(),
        "target": type(target).__name__,
        "num_neuroncores": target.num_neuroncores_per_sengine,
    }
    if op.func_name == "ResizeNearest":
        components["out_shape"] = info(op.results[:1])["shapes"][0]
    return hashlib.sha256(str(sorted(components.items())).encode()).hexdigest()


class Spy:
    """Wraps a method: counts calls, keeps positional arguments, then calls through (or not)."""

    def __init__(self, function=None, result=None):
        self.function, self.result, self.calls = function, result, []

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        if self.function is None:
            return self.result
        return self.function(*args, **kwargs)


def spy_method(monkeypatch: pytest.MonkeyPatch, name: str) -> Spy:
    original = getattr(BirCodeGenLoop, name)
    spy = Spy(original)
    monkeypatch.setattr(BirCodeGenLoop, name, lambda self, *a, **k: spy(self, *a, **k))
    return spy


def fake_trace(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """A beta3 leaf that compiles nothing, for func_names without a registered kernel."""
    spy = Spy(result={"binary": b"fake", "input_names": ["data"], "output_names": ["out"], "format": "bir"})
    monkeypatch.setattr(BirCodeGenLoop, "_trace_kernel_beta3", lambda self, inst, key: spy(inst, key))
    return spy


def debug_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bridge.codegen" and r.levelno == logging.DEBUG]


def run_binary(result: dict, arrays: list[np.ndarray]) -> list[np.ndarray]:
    runner = bridge.run_bir if result["format"] == "bir" else bridge.run_klir
    outputs = runner(result["binary"], dict(zip(result["input_names"], arrays, strict=True)))
    return [outputs[name] for name in result["output_names"]]


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> KernelMetricsCollector:
    """A fresh singleton collector for this test (the process-wide one is restored afterwards)."""
    monkeypatch.setattr(KernelMetricsCollector, "_instance", None)
    return KernelMetricsCollector.get_instance()


@pytest.fixture
def loop() -> BirCodeGenLoop:
    return BirCodeGenLoop(Trn2())


# -- the method roster ------------------------------------------------------------------------------
SPEC_METHODS = {
    "__init__": ["self", "target", "tier"],
    "codegenInternalNativeNkiKernel": ["self", "inst", "bb"],
    "_extract_tensor_info": ["self", "tensors"],
    "_compute_cache_key_from_components": ["self", "key_components"],
    "_get_cached_new_nki_frontend_binary": ["self", "cache_key"],
    "_cache_new_nki_frontend_binary": ["self", "cache_key", "binary", "key_components"],
    "_record_cache_usage": ["self", "cache_key"],
    "_trace_internal_kernel_to_new_nki_frontend": ["self", "inst", "cache_key"],
    "_resolve_kernel_config": ["self", "inst"],
    "_trace_kernel_beta3": ["self", "inst", "cache_key"],
    "_trace_kernel_beta2": ["self", "inst", "cache_key"],
    "_print_new_nki_frontend_cache_statistics": ["self"],
    "_export_new_nki_fe_metrics": ["self"],
}


def test_all_spec_methods_exist_with_their_signatures() -> None:
    assert len(SPEC_METHODS) == 13
    for name, params in SPEC_METHODS.items():
        assert list(inspect.signature(getattr(BirCodeGenLoop, name)).parameters) == params, name


def test_docstrings_are_the_specifications() -> None:
    orchestrator_doc = (
        "Codegen for internal NKI kernels using new NKI frontend path. Traces the kernel to new NKI frontend at "
        "codegen time and creates BIR NKIKLIRKernel instruction. Uses caching to avoid redundant tracing of "
        "identical kernels."
    )
    assert " ".join(BirCodeGenLoop.codegenInternalNativeNkiKernel.__doc__.split()) == orchestrator_doc
    assert (
        BirCodeGenLoop._extract_tensor_info.__doc__
        == "Helper to extract shape and dtype info from tensors for cache key."
    )
    assert BirCodeGenLoop._compute_cache_key_from_components.__doc__ == "Compute a cache key from key components."
    assert BirCodeGenLoop._export_new_nki_fe_metrics.__doc__ == "Export new NKI FE kernel metrics to the collector."
    dispatcher = inspect.getdoc(BirCodeGenLoop._trace_internal_kernel_to_new_nki_frontend)
    assert dispatcher.splitlines() == [  # verbatim, stale NKI_FRONTEND paragraph included (indentation aside)
        "Trace an internal NKI kernel using beta2 (KLIR) or beta3 (BIR) path.",
        "Environment variable NKI_FRONTEND controls the path:",
        '- "beta2": Use beta2 KLIR tracing (default)',
        '- "beta3": Use beta3 BIR compilation',
        "Returns a dict with keys: 'binary', 'input_names', 'output_names', 'format' ('klir' or 'bir').",
    ]


# -- the bridge -------------------------------------------------------------------------------------
def test_bridge_returns_the_uniform_trace_result_dict(loop: BirCodeGenLoop) -> None:
    result = loop._trace_internal_kernel_to_new_nki_frontend(matmul(), "some-key")
    assert set(result) == TRACE_RESULT_KEYS
    assert result["format"] == "bir"
    assert isinstance(result["binary"], bytes)
    assert result["input_names"] == ["lhsT", "rhs"] and result["output_names"] == ["out"]


def test_bridge_signature_is_self_inst_cache_key() -> None:
    params = list(inspect.signature(BirCodeGenLoop._trace_internal_kernel_to_new_nki_frontend).parameters)
    assert params == ["self", "inst", "cache_key"]
    for leaf in ("_trace_kernel_beta3", "_trace_kernel_beta2"):
        assert list(inspect.signature(getattr(BirCodeGenLoop, leaf)).parameters) == ["self", "inst", "cache_key"]


def test_bridge_rejects_two_or_four_arguments(loop: BirCodeGenLoop) -> None:
    with pytest.raises(TypeError):
        loop._trace_internal_kernel_to_new_nki_frontend(matmul())  # (self, inst): D-P19's wrong arity
    with pytest.raises(TypeError):
        loop._trace_internal_kernel_to_new_nki_frontend(matmul(), "key", "extra")


def test_bridge_threads_the_precomputed_key_to_beta3(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    beta3 = spy_method(monkeypatch, "_trace_kernel_beta3")
    compute = spy_method(monkeypatch, "_compute_cache_key_from_components")
    op = matmul()
    codegen_all(loop, op)
    assert len(compute.calls) == 1  # the bridge does not recompute the key
    assert len(beta3.calls) == 1
    _self, inst, cache_key = beta3.calls[0]
    assert inst is op and cache_key == independent_key(op, loop.target)


def test_beta3_only_even_with_nki_frontend_beta2(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    monkeypatch.setenv("NKI_FRONTEND", "beta2")
    monkeypatch.setenv("nki_frontend", "beta2")
    beta2 = spy_method(monkeypatch, "_trace_kernel_beta2")
    beta3 = spy_method(monkeypatch, "_trace_kernel_beta3")
    bb = codegen_all(loop, matmul(), softmax())
    assert beta2.calls == []
    assert len(beta3.calls) == 2
    assert [inst.kernel_format for inst in bb.instructions] == ["bir", "bir"]
    assert loop.nki_frontend_setting == "beta2"  # read, and ignored


def test_beta3_only_with_nki_frontend_beta3_gives_the_same_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    binaries = []
    for value in ("beta2", "beta3"):
        monkeypatch.setenv("nki_frontend", value)
        monkeypatch.setenv("NKI_FRONTEND", value)
        bb = codegen_all(BirCodeGenLoop(Trn2()), matmul())
        binaries.append(bb.instructions[0].klir_binary)
    assert binaries[0] == binaries[1]


def test_beta2_name_is_never_loaded_by_the_loop() -> None:
    """The xref asymmetry: _trace_kernel_beta2 is defined but no body of the loop refers to it."""
    for name, member in inspect.getmembers(BirCodeGenLoop, inspect.isfunction):
        if name != "_trace_kernel_beta2":
            assert "_trace_kernel_beta2" not in inspect.getsource(member), name
    dispatcher = inspect.getsource(BirCodeGenLoop._trace_internal_kernel_to_new_nki_frontend)
    assert "_trace_kernel_beta3" in dispatcher and "environ" not in dispatcher


def test_beta2_never_called_by_a_graph_compile(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    beta2 = spy_method(monkeypatch, "_trace_kernel_beta2")
    loop.run(load_graph(_graph(matmul("m"), softmax("s"), rmsnorm("r"))))
    assert beta2.calls == []


def test_beta2_leaf_traces_to_klir_matching_beta3(loop: BirCodeGenLoop) -> None:
    rng = np.random.default_rng(0)
    for op in (matmul(), softmax(), rmsnorm()):
        klir = loop._trace_kernel_beta2(op, "unused")
        bir = loop._trace_kernel_beta3(op, "unused")
        assert set(klir) == TRACE_RESULT_KEYS
        assert klir["format"] == "klir"
        assert klir["input_names"] == bir["input_names"] and klir["output_names"] == bir["output_names"]
        arrays = [rng.standard_normal(x.shape).astype(np.float32) for x in op.operands]
        got_klir, got_bir = run_binary(klir, arrays), run_binary(bir, arrays)
        for a, b, want in zip(got_klir, got_bir, reference(op.func_name, arrays, op.get_attrs_dict()), strict=True):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-4)


def test_beta2_leaf_uses_the_trace_kernel_context(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    steps: list[str] = []

    from bridge.frontends import beta2  # the loop imports TraceKernel from it when the leaf runs

    class RecordingTraceKernel(beta2.TraceKernel):
        def __init__(self, **kwargs):
            steps.append(f"init target={type(kwargs['target']).__name__} cores={kwargs['num_neuroncores_per_sengine']}")
            super().__init__(**kwargs)

        def __enter__(self):
            steps.append("enter")
            return super().__enter__()

        def __exit__(self, *exc):
            steps.append("exit")
            return super().__exit__(*exc)

        def bind_arguments(self, call_args):
            steps.append("bind_arguments")
            return super().bind_arguments(call_args)

        def specialize_and_call(self, kernel_func, additional_args):
            steps.append(f"specialize_and_call {kernel_func.__name__} {dict(additional_args)}")
            return super().specialize_and_call(kernel_func, additional_args)

        def trace(self):
            steps.append("trace")
            return super().trace()

    monkeypatch.setattr(beta2, "TraceKernel", RecordingTraceKernel)
    result = loop._trace_kernel_beta2(rmsnorm(eps=1e-3), "key")
    assert result["format"] == "klir"
    assert steps == [
        "init target=Trn2 cores=2",
        "enter",
        "bind_arguments",
        "specialize_and_call rmsnorm {'eps': 0.001}",
        "trace",
        "exit",
    ]


def test_beta3_leaf_uses_parser_frontend_compile_to_bir(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    from bridge.frontends import beta3

    spy = Spy(beta3.ParserFrontend.compile_to_bir)
    monkeypatch.setattr(beta3.ParserFrontend, "compile_to_bir", lambda self, path: spy(self, path))
    result = loop._trace_kernel_beta3(softmax(), "key")
    assert len(spy.calls) == 1
    assert result["format"] == "bir"
    assert bridge.binary_info(result["binary"])["kernel"] == "softmax"


def test_beta3_leaf_compiles_for_the_loops_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deviation: the spec's leaf asks get_platform_target(); ours compiles for self.target, the target the
    key folds in, so a key made for Trn1 never holds a binary compiled for the platform's Trn2."""
    monkeypatch.setenv(TARGET_ENV, "Trn2")
    assert isinstance(get_platform_target(), Trn2)
    loop = BirCodeGenLoop(Trn1())
    bb = codegen_all(loop, softmax())
    [components] = loop._cache_key_components.values()
    assert components["target"] == "Trn1"
    assert bridge.binary_info(bb.instructions[0].klir_binary)["target"] == "Trn1"


def test_resolve_kernel_config_goes_through_the_registry(loop: BirCodeGenLoop) -> None:
    cfg, kernel_func, additional_args, call_args = loop._resolve_kernel_config(rmsnorm(eps=1e-3))
    assert isinstance(cfg, InternalKernelConfig)
    assert cfg is get_internal_kernel_registry().get("RMSNorm")
    assert kernel_func is cfg.kernel_func
    assert additional_args == {"eps": 1e-3}
    assert call_args["kernel_name"] == "rmsnorm"
    assert [s.name for s in call_args["inputs"]] == ["a", "g"] and [s.name for s in call_args["outputs"]] == ["out"]
    with pytest.raises(UnknownKernelError, match="NoSuchKernel"):
        loop._resolve_kernel_config(InternalNkiKernel("NoSuchKernel", "x", [t("a", (4,))], [t("b", (4,))]))


def test_cache_hit_does_not_consult_the_registry(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    resolve = spy_method(monkeypatch, "_resolve_kernel_config")
    codegen_all(loop, matmul("1"), matmul("2"), matmul("3"))
    assert len(resolve.calls) == loop.cache_misses == 1


# -- the environment key ----------------------------------------------------------------------------
def test_orchestrator_reads_lowercase_nki_frontend_as_data(
    monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop
) -> None:
    real_get = os.environ.get
    keys: list[str] = []

    def get(key, default=None):
        keys.append(key)
        return real_get(key, default)

    monkeypatch.setattr(os.environ, "get", get)
    monkeypatch.setenv("nki_frontend", "some-value")
    codegen_all(loop, matmul())
    assert codegen.NKI_FRONTEND_ENV_KEY == "nki_frontend"
    assert "nki_frontend" in keys
    assert "NKI_FRONTEND" not in keys
    assert loop.nki_frontend_setting == "some-value"


def test_nki_frontend_default_is_beta2_when_unset(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    monkeypatch.delenv("nki_frontend", raising=False)
    codegen_all(loop, matmul())
    assert loop.nki_frontend_setting == "beta2"


# -- the cache key ----------------------------------------------------------------------------------
def test_key_formula_is_sha256_of_str_sorted_items(loop: BirCodeGenLoop) -> None:
    components = {"kernel_name": "k", "operands": {"shapes": [(2, 3)], "dtypes": ["float32"]}, "attrs": {"x": 1}}
    expected_items = {**components, "target": "Trn2", "num_neuroncores": 2}
    expected = hashlib.sha256(str(sorted(expected_items.items())).encode()).hexdigest()
    key = loop._compute_cache_key_from_components(dict(components))
    assert key == expected
    assert len(key) == 64 and int(key, 16) >= 0  # a hex digest


def test_orchestrator_key_equals_independent_computation(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    lookup = spy_method(monkeypatch, "_get_cached_new_nki_frontend_binary")
    ops = [matmul(), softmax(dtype="bfloat16"), rmsnorm(eps=1e-3)]
    codegen_all(loop, *ops)
    assert [args[1] for args in lookup.calls] == [independent_key(op, loop.target) for op in ops]


def test_key_is_insertion_order_insensitive(loop: BirCodeGenLoop) -> None:
    parts = [
        ("kernel_name", "matmul_tiled"),
        ("operands", {"shapes": [(64, 32), (64, 48)], "dtypes": ["float32", "float32"]}),
        ("results", {"shapes": [(32, 48)], "dtypes": ["float32"]}),
        ("attrs", {}),
    ]
    forward, backward = dict(parts), dict(reversed(parts))
    assert str(forward) != str(backward)  # hashing str(dict) would split them ...
    assert loop._compute_cache_key_from_components(forward) == loop._compute_cache_key_from_components(backward)


def test_key_builder_mutates_the_callers_dict() -> None:
    components = {"kernel_name": "k"}
    BirCodeGenLoop(Trn1())._compute_cache_key_from_components(components)
    assert components == {"kernel_name": "k", "target": "Trn1", "num_neuroncores": 1}
    components = {"kernel_name": "k"}
    BirCodeGenLoop(Trn2())._compute_cache_key_from_components(components)
    assert components["target"] == "Trn2" and components["num_neuroncores"] == 2


def test_key_folds_in_target_class_name_and_neuroncore_count() -> None:
    def key(target: Target) -> str:
        return BirCodeGenLoop(target)._compute_cache_key_from_components({"kernel_name": "k"})

    class Trn2(Target):  # same class name as the real Trn2, another neuroncore count
        num_neuroncores_per_sengine = 4

    assert key(bridge.targets.Trn2()) != key(Trn1())
    assert key(bridge.targets.Trn2()) != key(Trn2())
    assert key(bridge.targets.Trn2()) == key(bridge.targets.Trn2())


def test_key_components_of_an_op(loop: BirCodeGenLoop) -> None:
    op = rmsnorm(eps=1e-3)
    codegen_all(loop, op)
    (components,) = loop._cache_key_components.values()
    assert components == {
        "kernel_name": "rmsnorm",
        "operands": {"shapes": [(16, 24), (24,)], "dtypes": ["float32", "float32"]},
        "results": {"shapes": [(16, 24)], "dtypes": ["float32"]},
        "attrs": {"eps": 1e-3},
        "target": "Trn2",
        "num_neuroncores": 2,
    }


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (softmax(dtype="float32"), softmax(dtype="bfloat16")),  # dtype
        (softmax(rows=32), softmax(rows=33)),  # shape
        (rmsnorm(eps=1e-6), rmsnorm(eps=1e-5)),  # attrs
    ],
    ids=["dtype", "shape", "attrs"],
)
def test_key_distinguishes_dtype_shape_and_attrs(loop: BirCodeGenLoop, first, second) -> None:
    codegen_all(loop, first, second)
    assert loop.cache_misses == 2 and loop.cache_hits == 0


def test_attr_order_in_a_graph_does_not_split_a_variant(loop: BirCodeGenLoop) -> None:
    """str() of the attrs dict is inside the key (the spec sorts only the top level), so the IR keeps attrs
    in name order, as a compiler op's attributes come in a fixed order."""

    def op(attrs: dict) -> InternalNkiKernel:
        return InternalNkiKernel("Softmax", "softmax", [t("x", (8, 8))], [t("y", (8, 8))], attrs)

    fake = {"b": [1, 2], "a": {"z": 1, "y": [3]}}
    same = {"a": {"y": (3,), "z": 1}, "b": (1, 2)}
    assert op(fake).get_attrs_dict() == op(same).get_attrs_dict()
    assert str(op(fake).get_attrs_dict()) == str(op(same).get_attrs_dict())
    assert independent_key(op(fake), loop.target) == independent_key(op(same), loop.target)
    assert list(op(fake).get_attrs_dict()) == ["a", "b"]


def test_key_ignores_graph_tensor_names(loop: BirCodeGenLoop) -> None:
    codegen_all(loop, matmul("first"), matmul("second"))
    assert (loop.cache_misses, loop.cache_hits) == (1, 1)


# -- _extract_tensor_info -----------------------------------------------------------------------------
def test_extract_tensor_info_shapes_and_dtypes(loop: BirCodeGenLoop) -> None:
    info = loop._extract_tensor_info([t("a", (2, 3)), t("b", (4,), "int32")])
    assert info == {"shapes": [(2, 3), (4,)], "dtypes": ["float32", "int32"]}


def test_orchestrator_extracts_operands_then_results(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    extract = spy_method(monkeypatch, "_extract_tensor_info")
    op = rmsnorm()
    codegen_all(loop, op)
    assert [args[1] for args in extract.calls] == [op.operands, op.results]


def test_extract_prefers_access_shape(loop: BirCodeGenLoop) -> None:
    info = loop._extract_tensor_info([t("a", (4, 8), access_shape=(2, 8))])
    assert info["shapes"] == [(2, 8)]


def test_extract_falls_back_to_shape_on_attribute_error(loop: BirCodeGenLoop) -> None:
    tensor = t("a", (4, 8))
    with pytest.raises(AttributeError):
        _ = tensor.access_shape
    assert loop._extract_tensor_info([tensor])["shapes"] == [(4, 8)]


def test_access_shape_different_from_shape_keys_differently(loop: BirCodeGenLoop) -> None:
    plain = InternalNkiKernel("Softmax", "softmax", [t("x", (64, 48))], [t("y", (32, 48))])
    viewed = InternalNkiKernel("Softmax", "softmax", [t("x", (64, 48), access_shape=(32, 48))], [t("y", (32, 48))])
    same_view = InternalNkiKernel("Softmax", "softmax", [t("x", (32, 48))], [t("y", (32, 48))])
    assert independent_key(viewed, loop.target) != independent_key(plain, loop.target)
    codegen_all(loop, viewed, same_view)  # the kernel sees [32, 48] in both: one variant
    assert (loop.cache_misses, loop.cache_hits) == (1, 1)
    with pytest.raises(NkiCacheError):  # while the raw shape [64, 48] -> [32, 48] is no softmax
        codegen_all(loop, plain)


# -- out_shape only for ResizeNearest -----------------------------------------------------------------
def test_out_shape_only_for_resize_nearest(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    fake_trace(monkeypatch)
    resize = InternalNkiKernel(
        "ResizeNearest",
        "resize_nearest_fixed_dma_kernel",
        [t("x", (1, 3, 5, 8))],
        [t("y", (1, 8, 8, 8), access_shape=(1, 6, 9, 8))],
        {"out_shape": (1, 6, 9, 8)},
    )
    unviewed = InternalNkiKernel("ResizeNearest", "r", [t("x", (1, 3, 5, 8))], [t("y", (1, 7, 7, 8))])
    lookalike = InternalNkiKernel("resizenearest", "r", [t("x", (1, 3, 5, 8))], [t("y", (1, 7, 7, 8))])
    codegen_all(loop, resize, unviewed, lookalike, matmul())
    components = list(loop._cache_key_components.values())
    assert components[0]["out_shape"] == (1, 6, 9, 8)  # the result's access_shape
    assert components[1]["out_shape"] == (1, 7, 7, 8)  # its shape when it has none
    assert "out_shape" not in components[2]  # an exact string compare
    assert "out_shape" not in components[3]


def test_out_shape_with_the_real_resize_kernel(loop: BirCodeGenLoop) -> None:
    if get_internal_kernel_registry().get("ResizeNearest") is None:
        pytest.skip("ResizeNearest is not registered in this build")
    op = InternalNkiKernel(
        "ResizeNearest",
        "resize_nearest_fixed_dma_kernel",
        [t("x", (1, 3, 5, 8))],
        [t("y", (1, 6, 9, 8))],
        {"out_shape": [1, 6, 9, 8]},
    )
    bb = codegen_all(loop, op)
    (components,) = loop._cache_key_components.values()
    assert components["out_shape"] == (1, 6, 9, 8)
    assert bb.instructions[0].kernel_format == "bir"


# -- the hit/miss short-circuit -----------------------------------------------------------------------
def test_hit_skips_the_trace_entirely(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    bridge_spy = spy_method(monkeypatch, "_trace_internal_kernel_to_new_nki_frontend")
    beta3 = spy_method(monkeypatch, "_trace_kernel_beta3")
    codegen_all(loop, matmul("1"))
    assert len(bridge_spy.calls) == len(beta3.calls) == 1
    codegen_all(loop, matmul("2"), matmul("3"))
    assert len(bridge_spy.calls) == len(beta3.calls) == 1
    assert loop.traces == 1


def test_counters_count_hits_and_misses(loop: BirCodeGenLoop) -> None:
    assert (loop.cache_hits, loop.cache_misses) == (0, 0)
    codegen_all(loop, matmul("1"), softmax("1"), matmul("2"), softmax("2"), matmul("3"), rmsnorm())
    assert (loop.cache_hits, loop.cache_misses) == (3, 3)


def test_hit_and_miss_log_lines(caplog: pytest.LogCaptureFixture, loop: BirCodeGenLoop) -> None:
    caplog.set_level(logging.INFO, logger="bridge.codegen")
    op = matmul()
    codegen_all(loop, op, matmul("2"))
    prefix = independent_key(op, loop.target)[:CACHE_KEY_LOG_PREFIX]
    info = [r.getMessage() for r in caplog.records if r.name == "bridge.codegen" and r.levelno == logging.INFO]
    assert info == [f"Cache miss for Matmul (cache key: {prefix}...)", f"Cache hit for Matmul (cache key: {prefix}...)"]


def test_store_is_called_with_three_arguments(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    params = list(inspect.signature(BirCodeGenLoop._cache_new_nki_frontend_binary).parameters)
    assert params == ["self", "cache_key", "binary", "key_components"]
    store = spy_method(monkeypatch, "_cache_new_nki_frontend_binary")
    codegen_all(loop, matmul(), matmul("2"))
    assert len(store.calls) == 1
    _self, _cache_key, result, key_components = store.calls[0]
    assert set(result) == TRACE_RESULT_KEYS and key_components["kernel_name"] == "matmul_tiled"
    assert key_components["target"] == "Trn2"  # the same dict the key builder mutated


def test_store_writes_the_three_maps(loop: BirCodeGenLoop) -> None:
    codegen_all(loop, matmul())
    key = independent_key(matmul(), loop.target)
    assert list(loop._new_nki_frontend_kernel_cache) == [key]
    assert set(loop._new_nki_frontend_kernel_cache[key]) == TRACE_RESULT_KEYS
    assert list(loop._cache_key_components) == [key]
    assert loop._cache_key_components[key]["kernel_name"] == "matmul_tiled"
    assert loop._cache_usage_counts == {key: 1}


def test_store_helper_directly(loop: BirCodeGenLoop) -> None:
    result, components = {"binary": b"x"}, {"kernel_name": "k"}
    loop._cache_new_nki_frontend_binary("key", result, components)
    assert loop._new_nki_frontend_kernel_cache == {"key": result}
    assert loop._cache_key_components["key"] is components
    assert loop._cache_usage_counts == {"key": 1}


class LoggedDict(dict):
    """A dict that logs (its name, the key) to a shared list on every item assignment."""

    def __init__(self, name: str, log: list[tuple[str, str]]):
        super().__init__()
        self.name, self.log = name, log

    def __setitem__(self, key, value) -> None:
        self.log.append((self.name, key))
        super().__setitem__(key, value)


def test_store_writes_the_three_maps_in_order(loop: BirCodeGenLoop) -> None:
    """Claim 28: kernel cache, then key components, then usage count; a hit writes the usage count only."""
    writes: list[tuple[str, str]] = []
    maps = ("_new_nki_frontend_kernel_cache", "_cache_key_components", "_cache_usage_counts")
    for name in maps:
        setattr(loop, name, LoggedDict(name, writes))
    loop._cache_new_nki_frontend_binary("key", {"binary": b"x"}, {"kernel_name": "k"})
    assert writes == [(name, "key") for name in maps]
    writes.clear()
    codegen_all(loop, matmul(), matmul("2"))  # a miss, then a hit
    key = independent_key(matmul(), loop.target)
    assert writes == [(name, key) for name in maps] + [("_cache_usage_counts", key)]


def test_lookup_is_a_pure_get(loop: BirCodeGenLoop) -> None:
    assert loop._get_cached_new_nki_frontend_binary("missing") is None
    assert loop._new_nki_frontend_kernel_cache == {} and loop._cache_usage_counts == {}
    assert (loop.cache_hits, loop.cache_misses) == (0, 0)
    loop._cache_new_nki_frontend_binary("key", {"binary": b"x"}, {})
    assert loop._get_cached_new_nki_frontend_binary("key") == {"binary": b"x"}
    assert loop._cache_usage_counts == {"key": 1}


def test_record_usage_only_for_known_keys(loop: BirCodeGenLoop) -> None:
    loop._record_cache_usage("unknown")
    assert loop._cache_usage_counts == {}
    loop._cache_new_nki_frontend_binary("key", {}, {})
    loop._record_cache_usage("key")
    loop._record_cache_usage("key")
    assert loop._cache_usage_counts == {"key": 3}


def test_usage_is_one_plus_hits(loop: BirCodeGenLoop) -> None:
    codegen_all(loop, matmul("1"), matmul("2"), matmul("3"), matmul("4"), softmax())
    usage = {loop._cache_key_components[k]["kernel_name"]: n for k, n in loop._cache_usage_counts.items()}
    assert usage == {"matmul_tiled": 1 + 3, "softmax": 1 + 0}
    assert sum(loop._cache_usage_counts.values()) == loop.cache_hits + loop.cache_misses


def test_hit_and_miss_emit_the_same_instruction(loop: BirCodeGenLoop) -> None:
    bb = codegen_all(loop, matmul("1"), matmul("2"))
    first, second = bb.instructions
    assert isinstance(first, NKIKLIRKernel) and isinstance(second, NKIKLIRKernel) and first is not second
    assert second.klir_binary is first.klir_binary  # the cached blob re-attached
    for inst, tag in ((first, "1"), (second, "2")):
        assert inst.name == "matmul_tiled"
        assert inst.kernel_format == "bir"
        assert inst.nki_binary_version_identifier == BIR_VERSION_IDENTIFIER
        assert inst.func_args == ["lhsT", "rhs"] and inst.func_outs == ["out"]
        assert inst.operands == [f"a{tag}", f"b{tag}"] and inst.results == [f"c{tag}"]


def test_emitted_binary_is_bir_and_matches_the_reference(loop: BirCodeGenLoop) -> None:
    rng = np.random.default_rng(1)
    ops = [matmul(), softmax(), rmsnorm()]
    bb = codegen_all(loop, *ops)
    for op, inst in zip(ops, bb.instructions, strict=True):
        assert bridge.binary_info(inst.klir_binary)["kernel"] == op.kernel_name
        arrays = [rng.standard_normal(x.shape).astype(np.float32) for x in op.operands]
        outputs = bridge.run_bir(inst.klir_binary, dict(zip(inst.func_args, arrays, strict=True)))
        want = reference(op.func_name, arrays, op.get_attrs_dict())
        np.testing.assert_allclose(outputs[inst.func_outs[0]], want[0], rtol=1e-4, atol=1e-4)


# -- cache state and lifetime -------------------------------------------------------------------------
def test_new_loop_starts_empty() -> None:
    loop = BirCodeGenLoop()
    five = [
        "_new_nki_frontend_kernel_cache",
        "_cache_key_components",
        "_cache_usage_counts",
        "cache_hits",
        "cache_misses",
    ]
    assert [name for name in vars(loop) if name in five] == five  # created in the specification's order
    assert loop._new_nki_frontend_kernel_cache == {}
    assert loop._cache_key_components == {}
    assert loop._cache_usage_counts == {}
    assert loop.cache_hits == 0 and loop.cache_misses == 0
    assert isinstance(loop.target, Target)


def test_second_loop_misses_again() -> None:
    first, second = BirCodeGenLoop(Trn2()), BirCodeGenLoop(Trn2())
    codegen_all(first, matmul(), matmul("2"))
    codegen_all(second, matmul())
    assert (first.cache_misses, first.cache_hits) == (1, 1)
    assert (second.cache_misses, second.cache_hits, second.traces) == (1, 0, 1)
    assert second._new_nki_frontend_kernel_cache is not first._new_nki_frontend_kernel_cache


def test_cache_methods_do_no_io() -> None:
    for name in CACHE_METHODS:
        source = inspect.getsource(getattr(BirCodeGenLoop, name))
        for word in ("open(", "pickle", "json.dump", "os.path", ".write("):
            assert word not in source, (name, word)


def test_a_compile_leaves_no_files_behind(tmp_path, monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    """Neither the current directory nor the temp folder the beta3 leaf writes its kernel json under
    (`tempfile.mkdtemp` in bridge/frontends/beta3.py) keeps anything once the pass is over."""
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # gettempdir() caches TMPDIR: point the cache too
    made: list[Path] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs) -> str:
        made.append(Path(real_mkdtemp(*args, **kwargs)))
        return str(made[-1])

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    codegen_all(loop, matmul(), matmul("2"), softmax())
    loop.afterStmtTransform()
    assert list(cwd.iterdir()) == []
    assert made and all(path.parent == temp for path in made)  # the leaf did use the temp folder looked at
    assert list(temp.iterdir()) == []


# -- statistics ---------------------------------------------------------------------------------------
def test_statistics_lines(caplog: pytest.LogCaptureFixture, loop: BirCodeGenLoop) -> None:
    codegen_all(loop, matmul("1"), softmax(), matmul("2"), matmul("3", k=128, m=16, n=8))
    caplog.set_level(logging.DEBUG, logger="bridge.codegen")
    loop._print_new_nki_frontend_cache_statistics()
    assert debug_lines(caplog) == [
        BANNER,
        "New NKI Frontend Kernel Cache Statistics",
        BANNER,
        "Total kernels processed: 4",
        "  Cache hits:   1 (25.0%)",
        "  Cache misses: 3 (75.0%)",
        "Unique cached variants: 3",
        "Distinct kernel types: 2",
        "Kernel: matmul_tiled",  # most used first
        "  Variants: 2",
        "  Total usage: 3",
        "    Operand shapes: [(64, 32), (64, 48)]",
        "    Result shapes:  [(32, 48)]",
        "    Operand shapes: [(128, 16), (128, 8)]",
        "    Result shapes:  [(16, 8)]",
        "Kernel: softmax",
        "  Variants: 1",
        "  Total usage: 1",
        "    Operand shapes: [(32, 48)]",
        "    Result shapes:  [(32, 48)]",
        BANNER,
    ]


def test_statistics_never_call_nothing_processed_a_100_percent_miss_rate(
    caplog: pytest.LogCaptureFixture, loop: BirCodeGenLoop
) -> None:
    """A cache filled before any lookup (total 0) is reported, as the specification's short-circuit says, with
    no rate: 0 misses of 0 kernels is not 100%."""
    result = loop._trace_internal_kernel_to_new_nki_frontend(softmax(), "k")
    loop._cache_new_nki_frontend_binary("k", result, {"kernel_name": "softmax", "operands": {"shapes": [(32, 48)]},
                                                      "results": {"shapes": [(32, 48)]}})  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="bridge.codegen")
    loop._print_new_nki_frontend_cache_statistics()
    lines = debug_lines(caplog)
    assert "Total kernels processed: 0" in lines
    assert "  Cache hits:   0 (n/a)" in lines and "  Cache misses: 0 (n/a)" in lines
    assert not any("100.0%" in line for line in lines), lines


def test_statistics_silent_when_nothing_processed(caplog: pytest.LogCaptureFixture, loop: BirCodeGenLoop) -> None:
    caplog.set_level(logging.DEBUG, logger="bridge.codegen")
    loop._print_new_nki_frontend_cache_statistics()
    loop.run(load_graph({"name": "no-kernels", "tensors": {"a": {"shape": [4], "dtype": "float32"}},
                         "ops": [{"type": "Relu", "operands": ["a"], "results": ["b"]}]}))  # fmt: skip
    assert debug_lines(caplog) == []


def test_statistics_go_to_the_logger_not_stdout(capsys, caplog, loop: BirCodeGenLoop) -> None:
    caplog.set_level(logging.DEBUG, logger="bridge.codegen")
    codegen_all(loop, softmax())
    loop._print_new_nki_frontend_cache_statistics()
    assert debug_lines(caplog)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_statistics_have_no_time_saved_figure(caplog: pytest.LogCaptureFixture, loop: BirCodeGenLoop) -> None:
    caplog.set_level(logging.DEBUG, logger="bridge.codegen")
    codegen_all(loop, softmax(), softmax("2"))
    loop._print_new_nki_frontend_cache_statistics()
    text = "\n".join(debug_lines(caplog)).lower()
    for word in ("time", "second", "saved", " ms", "latency"):
        assert word not in text
    source = inspect.getsource(BirCodeGenLoop._print_new_nki_frontend_cache_statistics)
    assert "perf_counter" not in source and "time." not in source


def test_statistics_is_one_method() -> None:
    """The pf/pw pair (_316/_317) of the binary is a single Python method."""
    names = [n for n, _ in inspect.getmembers(BirCodeGenLoop) if "cache_statistics" in n]
    assert names == ["_print_new_nki_frontend_cache_statistics"]


# -- metrics --------------------------------------------------------------------------------------
def test_metrics_export_values(collector: KernelMetricsCollector, loop: BirCodeGenLoop) -> None:
    codegen_all(loop, matmul("1"), matmul("2"), matmul("3", k=128, m=16, n=8), softmax(), matmul("4"))
    loop._export_new_nki_fe_metrics()
    records = {r.kernel_name: r for r in collector.records}
    assert set(records) == {"matmul_tiled", "softmax"}
    assert (records["matmul_tiled"].call_count, records["matmul_tiled"].number_of_variances) == (4, 2)
    assert (records["softmax"].call_count, records["softmax"].number_of_variances) == (1, 1)
    assert all(r.category is KernelCategory.NEW_NKI_FE for r in collector.records)
    assert sum(r.call_count for r in collector.records) == sum(loop._cache_usage_counts.values())
    assert sum(r.number_of_variances for r in collector.records) == len(loop._new_nki_frontend_kernel_cache)


def test_metrics_export_records_each_kernel_name_once(collector: KernelMetricsCollector, loop: BirCodeGenLoop) -> None:
    codegen_all(loop, softmax("1", rows=8), softmax("2", rows=9), softmax("3", rows=10))
    loop._export_new_nki_fe_metrics()
    assert [(r.kernel_name, r.call_count, r.number_of_variances) for r in collector.records] == [("softmax", 3, 3)]


def test_metrics_export_skips_when_empty(collector: KernelMetricsCollector, loop: BirCodeGenLoop) -> None:
    loop._export_new_nki_fe_metrics()
    assert collector.records == []


def test_new_nki_fe_is_an_enum_member_not_an_environment_variable(
    monkeypatch: pytest.MonkeyPatch, collector: KernelMetricsCollector, loop: BirCodeGenLoop
) -> None:
    assert isinstance(KernelCategory.NEW_NKI_FE, KernelCategory)
    assert isinstance(KernelCategory.NKI_BETA3_FE, KernelCategory)
    monkeypatch.setenv("NEW_NKI_FE", "0")
    monkeypatch.setenv("NKI_BETA3_FE", "0")
    codegen_all(loop, softmax())
    loop._export_new_nki_fe_metrics()
    assert [r.category for r in collector.records] == [KernelCategory.NEW_NKI_FE]


def test_metrics_collector_is_a_singleton(collector: KernelMetricsCollector) -> None:
    assert KernelMetricsCollector.get_instance() is collector


def test_after_stmt_transform_calls_export_and_statistics(
    monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop
) -> None:
    export = spy_method(monkeypatch, "_export_new_nki_fe_metrics")
    stats = spy_method(monkeypatch, "_print_new_nki_frontend_cache_statistics")
    loop.afterStmtTransform()
    assert len(export.calls) == len(stats.calls) == 1


def test_run_tears_down_once_at_the_end(
    monkeypatch: pytest.MonkeyPatch, collector: KernelMetricsCollector, loop: BirCodeGenLoop
) -> None:
    teardown = spy_method(monkeypatch, "afterStmtTransform")
    loop.run(load_graph(_graph(matmul(), matmul("2"))))
    assert len(teardown.calls) == 1
    assert [(r.kernel_name, r.call_count) for r in collector.records] == [("matmul_tiled", 2)]


def test_a_failed_op_skips_the_end_of_pass_export(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    collector: KernelMetricsCollector,
    loop: BirCodeGenLoop,
) -> None:
    """An op's codegen error leaves run() before afterStmtTransform, as the exception leaves the spec's statement
    transform: no metrics export and no statistics, though the ops before it filled the maps."""
    caplog.set_level(logging.DEBUG, logger="bridge.codegen")
    teardown = spy_method(monkeypatch, "afterStmtTransform")
    unknown = InternalNkiKernel("NoSuchKernel", "no_such_kernel", [t("p", (4,))], [t("q", (4,))])
    with pytest.raises(NkiCacheError, match=r"op 1 \(NoSuchKernel\)"):
        loop.run(load_graph(_graph(softmax(), unknown)))
    assert len(loop._cache_key_components) == 1  # softmax was cached: an export would have recorded it
    assert teardown.calls == []
    assert collector.records == []
    assert debug_lines(caplog) == []


# -- the codegen loop -------------------------------------------------------------------------------
def test_run_dispatches_by_op_type_name(monkeypatch: pytest.MonkeyPatch, loop: BirCodeGenLoop) -> None:
    orchestrator = spy_method(monkeypatch, "codegenInternalNativeNkiKernel")
    graph = load_graph(_graph(softmax(), extra_ops=[{"type": "Relu", "operands": ["y"], "results": ["z"]}]))
    bb = loop.run(graph)
    assert len(orchestrator.calls) == 1 and orchestrator.calls[0][1] is graph.ops[0]
    assert [type(i).__name__ for i in bb.instructions] == ["NKIKLIRKernel", "BirElementwise"]
    assert bb.instructions[1].op == "Relu"


def test_run_rejects_an_op_without_codegen(loop: BirCodeGenLoop) -> None:
    graph = load_graph(_graph(softmax()))

    class Mystery:
        operands, results = [], []

    graph.ops.append(Mystery())
    with pytest.raises(NkiCacheError, match="no codegen for Mystery"):
        loop.run(graph)


def test_registry_and_cache_are_orthogonal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry hit still pays the compile on the first cache miss of every pass."""
    for _ in range(2):
        loop = BirCodeGenLoop(Trn2())
        codegen_all(loop, softmax())
        assert loop.traces == 1


def _graph(*ops: InternalNkiKernel, extra_ops: list | None = None) -> dict:
    tensors = {}
    documents = []
    for op in ops:
        for x in (*op.operands, *op.results):
            tensors[x.name] = {"shape": list(x.shape), "dtype": x.dtype}
        documents.append(
            {
                "type": "InternalNkiKernel",
                "func_name": op.func_name,
                "kernel_name": op.kernel_name,
                "operands": [x.name for x in op.operands],
                "results": [x.name for x in op.results],
                "attrs": op.get_attrs_dict(),
            }
        )
    return {"name": "g", "tensors": tensors, "ops": documents + (extra_ops or [])}


def test_conformance_doc_points_to_real_tests() -> None:
    """Every test docs/spec-conformance.md names exists (pytest runs them all)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "spec-conformance.md").read_text()
    named = re.findall(r"`(?:(tests/[\w/]+\.py)::)?(test_\w+)`", doc)
    assert len(named) > 40
    for path, name in named:
        source = (root / (path or "tests/test_spec_conformance.py")).read_text()
        assert f"def {name}(" in source, (path, name)
