"""The executor treats a binary as untrusted bytes, and reports bad inputs at run time clearly.

Every malformed binary must raise `BinaryFormatError` with a message naming what is wrong: never an
IndexError/KeyError/TypeError from deep inside, never a msgpack exception, never a hang and never unpickling.
"""

from __future__ import annotations

import copy
import math
import pickle
import random
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import numpy as np
import pytest

import bridge
import bridge.nki.language as nl
import bridge.program
from bridge import Tensor, binary_info, run_bir
from bridge.errors import BinaryFormatError, KernelRuntimeError, NkiCacheError
from bridge.executor import INT_POISON
from bridge.frontends.beta3 import trace_beta3
from bridge.program import decode_bir
from bridge.registry import KernelCall, TensorSpec
from bridge.targets import Trn2

F32 = "float32"


# -- kernels and binaries used below ------------------------------------------------------------------
def k_gather_select(table, ids, sel, out_rows, out_plane):
    idx = nl.load(ids[:, :])
    nl.store(out_rows[:, :], value=nl.load(table[0, idx, :]))
    e = nl.load_scalar(sel[0, 0])
    nl.store(out_plane[:, :], value=nl.exp(nl.load(table[e, :, :])) + 1.0)


def k_uninitialised(x, out, out_int):
    scratch = nl.ndarray((x.shape[0], x.shape[1]), nl.float32)
    nl.store(out[:, :], value=scratch)
    ints = nl.ndarray((2, 3), nl.int32)
    nl.store(out_int[:, :], value=ints)


def k_half_written(x, out):
    t = nl.ndarray(x.shape, nl.float32)
    t[:, 0:2] = nl.load(x[:, 0:2])
    nl.store(out[:, :], value=t * 2.0)


def compile_func(kernel, inputs, outputs) -> bytes:
    import inspect

    params = [p.name for p in inspect.signature(kernel).parameters.values() if p.default is p.empty]
    specs = [TensorSpec(name, shape, dtype) for name, (shape, dtype) in zip(params, inputs + outputs, strict=True)]
    call = KernelCall(kernel.__name__, kernel, tuple(specs[: len(inputs)]), tuple(specs[len(inputs) :]), {})
    return trace_beta3(call, Trn2())["binary"]


@pytest.fixture(scope="module")
def matmul_binary() -> bytes:
    return bridge.compile_kernel(
        "Matmul", [Tensor("a", (129, 130), F32), Tensor("b", (129, 5), F32)], [Tensor("o", (130, 5), F32)]
    )["binary"]


@pytest.fixture(scope="module")
def matmul_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "lhsT": rng.standard_normal((129, 130)).astype(np.float32),
        "rhs": rng.standard_normal((129, 5)).astype(np.float32),
    }


GATHER_SPECS = ([((3, 40, 6), F32), ((4, 1), "int32"), ((1, 1), "int32")], [((4, 6), F32), ((40, 6), F32)])


@pytest.fixture(scope="module")
def gather_binary() -> bytes:
    return compile_func(k_gather_select, *GATHER_SPECS)


def gather_inputs(ids=(1, 39, 0, 7), sel=2) -> dict[str, np.ndarray]:
    table = np.arange(3 * 40 * 6, dtype=np.float32).reshape(3, 40, 6) / 100
    return {
        "table": table,
        "ids": np.array(ids, dtype=np.int32).reshape(-1, 1),
        "sel": np.array([[sel]], dtype=np.int32),
    }


def document(binary: bytes) -> dict:
    return msgpack.unpackb(binary, raw=False)


def rebuild(binary: bytes, change: Callable[[dict], None]) -> bytes:
    doc = copy.deepcopy(document(binary))
    change(doc)
    return msgpack.packb(doc, use_bin_type=True)


def first(doc: dict, opcode: str) -> list:
    return next(instruction for instruction in doc["code"] if instruction[0] == opcode)


def expect_format_error(binary: object, inputs: dict, *fragments: str) -> str:
    with pytest.raises(BinaryFormatError) as caught:
        run_bir(binary, inputs)  # type: ignore[arg-type]
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    # binary_info decodes the same way and must fail the same way (it validates less, so only the decode).
    return message


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: SIGALRM interrupts the block after `seconds`."""

    def expire(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- the valid binaries work (so the failures below are about the damage) -----------------------------
def test_valid_binaries_run(matmul_binary, matmul_inputs, gather_binary) -> None:
    out = run_bir(matmul_binary, matmul_inputs)["out"]
    np.testing.assert_allclose(out, matmul_inputs["lhsT"].T @ matmul_inputs["rhs"], rtol=1e-5, atol=1e-4)
    inputs = gather_inputs()
    result = run_bir(gather_binary, inputs)
    np.testing.assert_array_equal(result["out_rows"], inputs["table"][0, [1, 39, 0, 7]])
    np.testing.assert_allclose(result["out_plane"], np.exp(inputs["table"][2]) + 1, rtol=1e-6)


# -- malformed containers -----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_random_bytes(seed: int) -> None:
    rng = random.Random(seed)
    junk = rng.randbytes(rng.randint(1, 4000))
    with pytest.raises(BinaryFormatError):
        run_bir(junk, {})
    with pytest.raises(BinaryFormatError):
        binary_info(junk)


def test_empty_binary() -> None:
    expect_format_error(b"", {}, "truncated or malformed")


@pytest.mark.parametrize("not_bytes", ["NKIBIR", None, 12, [1, 2]])
def test_non_bytes_binary(not_bytes: object) -> None:
    expect_format_error(not_bytes, {}, "binary is bytes")


@pytest.mark.parametrize("tenth", range(10))
def test_truncated_at_every_tenth(matmul_binary, matmul_inputs, tenth: int) -> None:
    cut = matmul_binary[: len(matmul_binary) * tenth // 10]
    expect_format_error(cut, matmul_inputs)


def test_truncated_by_one_byte(matmul_binary, matmul_inputs) -> None:
    expect_format_error(matmul_binary[:-1], matmul_inputs, "truncated or malformed")


def test_trailing_garbage(matmul_binary, matmul_inputs) -> None:
    expect_format_error(matmul_binary + b"\x00", matmul_inputs, "truncated or malformed")


def test_a_msgpack_value_that_is_not_a_map(matmul_inputs) -> None:
    expect_format_error(msgpack.packb([1, 2, 3]), matmul_inputs, "not a BIR binary")


def test_wrong_magic(matmul_binary, matmul_inputs) -> None:
    def change(doc):
        doc["magic"] = "NKIKLIR"

    expect_format_error(rebuild(matmul_binary, change), matmul_inputs, "not a BIR binary")
    expect_format_error(rebuild(matmul_binary, lambda doc: doc.pop("magic")), matmul_inputs, "not a BIR binary")


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_wrong_version(matmul_binary, matmul_inputs, version) -> None:
    def change(doc):
        doc["version"] = version

    message = expect_format_error(rebuild(matmul_binary, change), matmul_inputs, "not supported")
    assert f"version {version!r}" in message
    assert f"reads version {bridge.program.BIR_VERSION}" in message


@pytest.mark.parametrize("field", ["kernel", "target", "inputs", "outputs", "buffers", "registers", "code"])
def test_missing_or_mistyped_field(matmul_binary, matmul_inputs, field: str) -> None:
    expect_format_error(rebuild(matmul_binary, lambda doc: doc.pop(field)), matmul_inputs, repr(field))
    expect_format_error(rebuild(matmul_binary, lambda doc: doc.update({field: {}})), matmul_inputs)


def test_unknown_target(matmul_binary, matmul_inputs) -> None:
    expect_format_error(
        rebuild(matmul_binary, lambda doc: doc.update(target="Trn9")), matmul_inputs, "unknown target 'Trn9'"
    )


def test_unknown_opcode(matmul_binary, matmul_inputs) -> None:
    def change(doc):
        doc["code"][2][0] = "fused_multiply_add"

    expect_format_error(rebuild(matmul_binary, change), matmul_inputs, "instruction 2", "unknown opcode")


@pytest.mark.parametrize("instruction", [[], "load", 7, None, {}])
def test_instruction_that_is_not_a_list(matmul_binary, matmul_inputs, instruction) -> None:
    def change(doc):
        doc["code"][1] = instruction

    expect_format_error(rebuild(matmul_binary, change), matmul_inputs, "instruction 1")


def test_wrong_field_count(matmul_binary, matmul_inputs) -> None:
    def change(doc):
        first(doc, "matmul").append("extra")

    expect_format_error(rebuild(matmul_binary, change), matmul_inputs, "(matmul)", "malformed fields")


MALFORMED_FIELDS = [
    ("buffer id", lambda doc: first(doc, "load")[1].__setitem__(0, 999), "buffer 999 does not exist"),
    ("negative buffer id", lambda doc: first(doc, "load")[1].__setitem__(0, -1), "buffer -1 does not exist"),
    ("buffer id type", lambda doc: first(doc, "load")[1].__setitem__(0, "0"), "buffer id must be an int"),
    ("region stop", lambda doc: first(doc, "load")[1][1][0].__setitem__(1, 129), "out of bounds"),
    ("region step", lambda doc: first(doc, "load")[1][1][0].__setitem__(2, 0), "out of bounds"),
    ("region rank", lambda doc: first(doc, "load")[1][1].pop(), "does not match the rank"),
    ("tensor id", lambda doc: first(doc, "load")[2].__setitem__(0, 7), "tensor 7 does not exist"),
    ("tensor slice", lambda doc: first(doc, "load")[2][1][0].__setitem__(2, 1000), "out of bounds"),
    ("tensor rank", lambda doc: first(doc, "load")[2][1].pop(), "indices for rank 2"),
    ("index entry", lambda doc: first(doc, "load")[2][1].__setitem__(0, ["z", 1]), "bad index entry"),
    ("store into input", lambda doc: first(doc, "store")[1].__setitem__(0, 0), "store into input tensor"),
    ("shape mismatch", lambda doc: first(doc, "load")[1][1][0].__setitem__(1, 64), "does not fit"),
    ("operand kind", lambda doc: first(doc, "binary").__setitem__(4, ["q", 1]), "bad operand"),
    ("constant type", lambda doc: first(doc, "memset").__setitem__(2, ["c", "zero"]), "memset value"),
    ("binary op", lambda doc: first(doc, "binary").__setitem__(1, "pow"), "unknown binary op 'pow'"),
    ("matmul flag", lambda doc: first(doc, "matmul").__setitem__(4, 1), "transpose_x must be a bool"),
    ("matmul space", lambda doc: first(doc, "matmul")[1].__setitem__(0, 1), "must be in PSUM"),
    ("input dtype", lambda doc: doc["inputs"][0].__setitem__(2, "float64"), "unknown dtype 'float64'"),
    ("input shape", lambda doc: doc["inputs"][0].__setitem__(1, [0, 130]), "shape [0, 130] is invalid"),
    ("huge input", lambda doc: doc["inputs"][0].__setitem__(1, [1 << 20, 1 << 20]), "is invalid"),
    ("input spec", lambda doc: doc["inputs"].__setitem__(0, "lhsT"), "input 0 spec"),
    ("register count", lambda doc: doc.update(registers=-1), "register count -1"),
    ("buffer dtype", lambda doc: doc["buffers"][0].__setitem__(1, "complex64"), "unknown dtype"),
    ("buffer space", lambda doc: doc["buffers"][1].__setitem__(2, "dram"), "unknown buffer 'dram'"),
]


@pytest.mark.parametrize(("what", "change", "fragment"), MALFORMED_FIELDS, ids=[case[0] for case in MALFORMED_FIELDS])
def test_out_of_range_and_malformed_fields(matmul_binary, matmul_inputs, what, change, fragment) -> None:
    expect_format_error(rebuild(matmul_binary, change), matmul_inputs, fragment)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda doc: first(doc, "load_scalar").__setitem__(1, 3), "register 3 does not exist"),
        (lambda doc: first(doc, "load_scalar").__setitem__(1, -1), "register -1 does not exist"),
        (
            lambda doc: first(doc, "load_scalar").__setitem__(2, [0, [["i", 0], ["i", 0], ["i", 0]]]),
            "exactly one int32",
        ),
        (lambda doc: doc["inputs"][2].__setitem__(2, "float32"), "exactly one int32"),
        (lambda doc: doc.update(registers=0), "register 0 does not exist"),
    ],
)
def test_bad_registers(gather_binary, change, fragment) -> None:
    expect_format_error(rebuild(gather_binary, change), gather_inputs(), fragment)


def test_gather_index_tile_must_be_int32_column(gather_binary) -> None:
    def change(doc):
        gather_load = next(i for i in doc["code"] if i[0] == "load" and i[2][1][1][0] == "g")
        index_buf = gather_load[2][1][1][1]
        doc["buffers"][index_buf][1] = "float32"

    expect_format_error(rebuild(gather_binary, change), gather_inputs(), "must be an int32 [P, 1] tile")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ([[129, 4], "float32", "sbuf"], "partition dim 129 > 128"),
        ([[4, 513], "float32", "psum"], "free size 513 > 512"),
        ([[4, 8], "bfloat16", "psum"], "PSUM tiles hold float32"),
        ([[1, 1 << 20], "float32", "sbuf"], "SBUF partition size"),
        ([[0, 4], "float32", "sbuf"], "positive int dims"),
        ([[], "float32", "sbuf"], "positive int dims"),
        ([[4, 4.5], "float32", "sbuf"], "dim must be an int, got 4.5"),
    ],
)
def test_buffer_spec_breaking_a_hardware_limit(matmul_binary, matmul_inputs, spec, fragment) -> None:
    def change(doc):
        doc["buffers"][0] = spec

    message = expect_format_error(rebuild(matmul_binary, change), matmul_inputs, "buffer 0", fragment)
    assert "\n" not in message


# -- the decoder's own limits -------------------------------------------------------------------------
def test_binary_larger_than_the_limit(matmul_binary, matmul_inputs, monkeypatch) -> None:
    monkeypatch.setattr(bridge.program, "MAX_BINARY_BYTES", len(matmul_binary) - 1)
    expect_format_error(matmul_binary, matmul_inputs, f"{len(matmul_binary)} bytes exceeds the")
    monkeypatch.setattr(bridge.program, "MAX_BINARY_BYTES", len(matmul_binary))
    assert "out" in run_bir(matmul_binary, matmul_inputs)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 billion elements
        b"\xdf\xff\xff\xff\xff",  # a map header claiming 4 billion entries
        b"\xdb\xff\xff\xff\xff",  # a 4 GB string header
        b"\xc6\xff\xff\xff\xff",  # a 4 GB bin header
        b"\x91" * 100_000 + b"\x00",  # 100k nested arrays
        b"\xc7\x10\x05" + b"\x00" * 16,  # an ext type
        msgpack.packb({1: 2}),  # a non-string map key
    ],
    ids=["array", "map", "str", "bin", "nesting", "ext", "int-key"],
)
def test_hostile_msgpack(payload: bytes) -> None:
    with deadline(10):
        expect_format_error(payload, {})


class CreatesFile:
    """Unpickling this calls open(path, "w"): a pickle payload with a side effect."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_is_never_unpickled(tmp_path: Path, matmul_inputs) -> None:
    canary = tmp_path / "unpickled"
    payloads = [
        pickle.dumps(CreatesFile(str(canary)), protocol=protocol) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)
    ]
    payloads.append(pickle.dumps({"magic": "NKIBIR", "version": 1, "code": CreatesFile(str(canary))}))
    for payload in payloads:
        expect_format_error(payload, matmul_inputs)
        with pytest.raises(BinaryFormatError):
            binary_info(payload)
        assert not canary.exists(), "the executor unpickled its input"
    # The payload is live: unpickling it really does create the file.
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(CreatesFile(str(proof)))).close()
    assert proof.exists()


# -- run-time errors ----------------------------------------------------------------------------------
def test_missing_input(matmul_binary, matmul_inputs) -> None:
    with pytest.raises(KernelRuntimeError, match=r"kernel matmul_tiled needs input 'rhs'; given \['lhsT'\]"):
        run_bir(matmul_binary, {"lhsT": matmul_inputs["lhsT"]})


def test_graph_tensor_names_are_not_input_names(matmul_binary, matmul_inputs) -> None:
    with pytest.raises(KernelRuntimeError, match="needs input 'lhsT'"):
        run_bir(matmul_binary, {"a": matmul_inputs["lhsT"], "b": matmul_inputs["rhs"]})


@pytest.mark.parametrize("shape", [(130, 129), (129, 131), (129 * 130,), (1, 129, 130)])
def test_wrong_input_shape(matmul_binary, matmul_inputs, shape) -> None:
    inputs = {**matmul_inputs, "lhsT": np.zeros(shape, np.float32)}
    with pytest.raises(KernelRuntimeError, match=rf"input 'lhsT' has shape {list(shape)}".replace("[", r"\[")):
        run_bir(matmul_binary, inputs)


def test_inputs_are_cast_to_the_binary_dtype(matmul_binary, matmul_inputs) -> None:
    as64 = {name: array.astype(np.float64) for name, array in matmul_inputs.items()}
    np.testing.assert_array_equal(run_bir(matmul_binary, as64)["out"], run_bir(matmul_binary, matmul_inputs)["out"])


@pytest.mark.parametrize(("ids", "bad"), [((1, 40, 0, 7), 40), ((1, 2, -1, 7), -1), ((99, 0, 0, 0), 99)])
def test_out_of_range_gather_index(gather_binary, ids, bad) -> None:
    with pytest.raises(KernelRuntimeError, match=rf"gather index {bad} out of range for axis 1 of 'table' \(size 40\)"):
        run_bir(gather_binary, gather_inputs(ids=ids))


@pytest.mark.parametrize("sel", [3, -1, 1 << 30])
def test_out_of_range_runtime_scalar_index(gather_binary, sel: int) -> None:
    with pytest.raises(
        KernelRuntimeError, match=rf"kernel k_gather_select, instruction \d+ \(load\): runtime index {sel}"
    ):
        run_bir(gather_binary, gather_inputs(sel=sel))


def test_a_failed_run_leaves_the_binary_usable(gather_binary) -> None:
    with pytest.raises(KernelRuntimeError):
        run_bir(gather_binary, gather_inputs(sel=5))
    assert run_bir(gather_binary, gather_inputs(sel=1))["out_plane"].shape == (40, 6)


def test_reading_an_uninitialised_tile_shows_nan() -> None:
    binary = compile_func(k_uninitialised, [((5, 3), F32)], [((5, 3), F32), ((2, 3), "int32")])
    result = run_bir(binary, {"x": np.ones((5, 3), np.float32)})
    assert np.isnan(result["out"]).all()
    assert (result["out_int"] == INT_POISON).all()


def test_a_half_written_tile_shows_nan_where_unwritten() -> None:
    binary = compile_func(k_half_written, [((4, 5), F32)], [((4, 5), F32)])
    x = np.arange(20, dtype=np.float32).reshape(4, 5)
    out = run_bir(binary, {"x": x})["out"]
    np.testing.assert_array_equal(out[:, :2], x[:, :2] * 2)
    assert np.isnan(out[:, 2:]).all()


def test_runs_do_not_share_state(matmul_binary, matmul_inputs) -> None:
    first_run = run_bir(matmul_binary, matmul_inputs)["out"]
    doubled = {name: array * 2 for name, array in matmul_inputs.items()}
    run_bir(matmul_binary, doubled)
    np.testing.assert_array_equal(run_bir(matmul_binary, matmul_inputs)["out"], first_run)


# -- seeded byte-flip mutations -----------------------------------------------------------------------
def _inputs_for(binary: bytes, fallback: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs matching the (possibly mutated) binary's specs when they are small, else the originals."""
    try:
        program = decode_bir(binary)
    except NkiCacheError:
        return fallback
    inputs = {}
    for spec in program.inputs:
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str) and isinstance(spec[1], list)):
            return fallback
        name, shape, dtype = spec
        if not all(type(n) is int and 0 < n <= 1 << 16 for n in shape) or dtype not in ("float32", "int32"):
            return fallback
        if math.prod(shape) > 1 << 16:
            return fallback
        inputs[name] = rng.integers(0, 3, size=shape).astype(dtype)
    return inputs


def _mutation_survivors(binary: bytes, inputs: dict[str, np.ndarray], seed: int, count: int = 200) -> dict[str, int]:
    rng = random.Random(seed)
    data_rng = np.random.default_rng(seed)
    outcome = {"ran": 0, "rejected": 0}
    for position in sorted(rng.randrange(len(binary)) for _ in range(count)):
        mutated = bytearray(binary)
        mutated[position] ^= rng.randrange(1, 256)
        mutated = bytes(mutated)
        try:
            run_bir(mutated, _inputs_for(mutated, inputs, data_rng))
            outcome["ran"] += 1
        except NkiCacheError:
            outcome["rejected"] += 1
        except Exception as exc:  # pragma: no cover - the failure message is the point
            pytest.fail(f"byte {position} flipped: {type(exc).__name__}: {exc} (not a project error)")
    return outcome


# A flipped float constant may overflow float32 on its way into a tile; that is a value, not an error.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def test_byte_flips_in_a_matmul_binary(matmul_binary, matmul_inputs) -> None:
    with deadline(30):
        outcome = _mutation_survivors(matmul_binary, matmul_inputs, seed=2024)
    assert outcome["ran"] + outcome["rejected"] == 200
    assert outcome["rejected"] > 0


def test_byte_flips_in_a_gather_binary(gather_binary) -> None:
    with deadline(30):
        outcome = _mutation_survivors(gather_binary, gather_inputs(), seed=7)
    assert outcome["ran"] + outcome["rejected"] == 200
    assert outcome["rejected"] > 0


def test_byte_flips_in_a_softmax_binary() -> None:
    binary = bridge.compile_kernel("Softmax", [Tensor("x", (130, 9), F32)], [Tensor("y", (130, 9), F32)])["binary"]
    inputs = {"x": np.linspace(-1, 1, 130 * 9, dtype=np.float32).reshape(130, 9)}
    with deadline(30):
        outcome = _mutation_survivors(binary, inputs, seed=99)
    assert outcome["ran"] + outcome["rejected"] == 200
