"""The beta2 frontend (TraceKernel -> KLIR) against beta3 (ParserFrontend -> BIR) for every kernel.

beta2 runs the kernel function on tracer tensors, beta3 interprets its source; both drive the same
builder, and both binaries run on the same executor, so the numbers must be identical, not just close.
"""

from __future__ import annotations

import numpy as np
import pytest

import bridge
from bridge import Tensor
from bridge.errors import BinaryFormatError, KernelCompileError
from bridge.frontends.beta2 import TraceKernel, trace_beta2
from bridge.frontends.beta3 import trace_beta3
from bridge.kernels import get_internal_kernel_registry
from bridge.klir import decode_klir
from bridge.program import decode_bir
from bridge.sampling import sample_inputs
from bridge.targets import Trn1, Trn2

CONV = {"stride": (2, 1), "padding": ((1, 0), (2, 1)), "dilation": (1, 2)}
CASES = [
    ("Matmul", [((130, 70), "float32"), ((130, 600), "float32")], [((70, 600), "float32")], {}),
    ("Softmax", [((129, 33), "bfloat16")], [((129, 33), "bfloat16")], {}),
    ("RMSNorm", [((140, 50), "float32"), ((50,), "float32")], [((140, 50), "float32")], {"eps": 1e-5}),
    ("Transpose10", [((3, 130, 7), "float32")], [((3, 7, 130), "float32")], {}),
    ("ResizeNearest", [((1, 5, 7, 3), "float32")], [((1, 11, 4, 3), "float32")], {"out_shape": (1, 11, 4, 3)}),
    ("Conv2d", [((1, 3, 9, 8), "float32"), ((4, 3, 3, 3), "float32")], [((1, 4, 4, 7), "float32")], CONV),
    (
        "BlockwiseMatmul",
        [((9, 16), "float32"), ((27, 1), "float32"), ((3, 16, 2, 8), "float32"), ((3, 8, 16), "float32"),
         ((12,), "int32"), ((3, 1), "int32")],
        [((9, 16), "float32")],
        {"block_size": 4},
    ),
]  # fmt: skip


def _call(func_name, operands, results, attrs):
    config = get_internal_kernel_registry().resolve(func_name)
    ops = [Tensor(f"in{i}", shape, dtype) for i, (shape, dtype) in enumerate(operands)]
    outs = [Tensor(f"out{i}", shape, dtype) for i, (shape, dtype) in enumerate(results)]
    return config.marshal(ops, outs, attrs), ops


@pytest.mark.parametrize(("func_name", "operands", "results", "attrs"), CASES, ids=[c[0] for c in CASES])
def test_beta2_klir_gives_the_same_numbers_as_beta3_bir(func_name, operands, results, attrs):
    call, tensors = _call(func_name, operands, results, attrs)
    klir = trace_beta2(call, Trn2())
    bir = trace_beta3(call, Trn2())
    assert (klir["format"], bir["format"]) == ("klir", "bir")
    assert klir["input_names"] == bir["input_names"] and klir["output_names"] == bir["output_names"]
    # The same program, carried in two formats.
    assert decode_klir(klir["binary"]).code == decode_bir(bir["binary"]).code
    arrays = sample_inputs(func_name, tensors, call.attrs, np.random.default_rng(7))
    inputs = dict(zip(bir["input_names"], arrays, strict=True))
    from_klir = bridge.run_klir(klir["binary"], inputs)
    from_bir = bridge.run_bir(bir["binary"], inputs)
    for name in bir["output_names"]:
        assert np.isfinite(from_bir[name].astype(np.float32)).all()
        np.testing.assert_array_equal(from_klir[name], from_bir[name])


def test_trace_kernel_is_a_context_manager_with_the_spec_methods():
    call, _ = _call(*CASES[0])
    with TraceKernel(target=Trn1(), num_neuroncores_per_sengine=1, kernel_name=call.kernel_name) as tk:
        tk.bind_arguments({"inputs": list(call.inputs), "outputs": list(call.outputs)})
        tk.specialize_and_call(call.kernel_func, call.attrs)
        klir = tk.trace()
    assert klir.startswith(b"KLIR\n")
    assert decode_klir(klir).target == "Trn1"


def test_trace_needs_arguments_first():
    with TraceKernel(target=Trn2()) as tk, pytest.raises(KernelCompileError, match="bind_arguments"):
        tk.trace()


def test_beta2_errors_name_the_kernel_line():
    call, _ = _call("Matmul", [((64, 8), "float32"), ((32, 8), "float32")], [((8, 8), "float32")], {})
    with pytest.raises(
        KernelCompileError, match=r"kernel matmul_tiled at .*bridge/kernels/matmul\.py:\d+: contraction"
    ):
        trace_beta2(call, Trn2())


@pytest.mark.parametrize("damage", [b"", b"KLIR\n{", b"KLIR\n[]", b'KLIR\n{"version": 2}', b"NKIBIR"])
def test_malformed_klir_is_a_clear_error(damage):
    with pytest.raises(BinaryFormatError):
        bridge.run_klir(damage, {})
