"""The compiled basic block file, `<graph name>.nkibb`, that `nkicache compile` writes and `nkicache run`
loads (format described in docs/artifact-format.md).

msgpack, never pickle: an envelope map with a magic/format/version header, the SHA-256 of the body and the
body itself (the graph name, target, tensors, graph inputs and instruction list, msgpack-encoded). A file
is written to a temporary name in its own folder and renamed over the final name, so a reader never sees a
half-written artifact; every read is validated and a malformed file raises `ArtifactError` naming it.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import msgspec

from bridge import dtypes
from bridge.errors import BinaryFormatError, NkiCacheError
from bridge.graph import Graph
from bridge.inputs import InputFileError, read_input, shown_path
from bridge.ir import BasicBlock, BirElementwise, InternalNkiKernel, NKIKLIRKernel, Tensor, freeze_attr
from bridge.klir import decode_klir
from bridge.program import decode_bir

ARTIFACT_MAGIC = "NKICACHE-BB"
ARTIFACT_FORMAT = "nkibb"
ARTIFACT_VERSION = 1
ARTIFACT_SUFFIX = ".nkibb"
ELEMENTWISE_OPS = ("Add", "Multiply", "Relu", "Copy")
KERNEL_FORMATS = {"bir": decode_bir, "klir": decode_klir}

# Reading limits: an artifact is untrusted bytes; nothing in it may make the decoder allocate without bound.
MAX_ARTIFACT_BYTES = 1024 * 1024 * 1024
_UNPACK_LIMITS = {
    "max_str_len": 1 << 20,
    "max_bin_len": MAX_ARTIFACT_BYTES,
    "max_array_len": 1 << 20,
    "max_map_len": 1 << 20,
    "max_ext_len": 0,
}
_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class ArtifactError(NkiCacheError):
    """A compiled basic block file is missing, truncated, corrupt or of another version; names the file."""


class KernelInstruction(msgspec.Struct):
    """An NKIKLIRKernel with what `--check` needs beside it: the op's func_name and attrs."""

    name: str  # the kernel_name
    func_name: str
    attrs: dict[str, Any]
    operands: list[str]  # graph tensors bound, in order, to func_args
    results: list[str]  # graph tensors bound, in order, to func_outs
    klir_binary: bytes
    kernel_format: str  # 'bir' (beta3) or 'klir' (beta2)
    nki_binary_version_identifier: str
    func_args: list[str]
    func_outs: list[str]


class ElementwiseInstruction(msgspec.Struct):
    op: str
    operands: list[str]
    results: list[str]


Instruction = KernelInstruction | ElementwiseInstruction


class Artifact(msgspec.Struct):
    graph: str
    target: str
    tensors: dict[str, Tensor] = msgspec.field(default_factory=dict)
    inputs: list[str] = msgspec.field(default_factory=list)
    instructions: list[Instruction] = msgspec.field(default_factory=list)

    @property
    def kernels(self) -> list[KernelInstruction]:
        return [inst for inst in self.instructions if isinstance(inst, KernelInstruction)]


# -- building -------------------------------------------------------------------------------------
def build_artifact(graph: Graph, bb: BasicBlock, target: str) -> Artifact:
    """The artifact of one pass: `bb` is what BirCodeGenLoop.run(graph) returned (one instruction per op,
    in op order), so each NKIKLIRKernel is paired with the op that produced it."""
    if len(bb.instructions) != len(graph.ops):
        raise ArtifactError(
            f"{graph.source}: basic block has {len(bb.instructions)} instructions for {len(graph.ops)} ops"
        )
    instructions: list[Instruction] = []
    for index, (op, inst) in enumerate(zip(graph.ops, bb.instructions, strict=True)):
        if isinstance(inst, NKIKLIRKernel) and isinstance(op, InternalNkiKernel):
            instructions.append(
                KernelInstruction(
                    name=inst.name,
                    func_name=op.func_name,
                    attrs=op.get_attrs_dict(),
                    operands=list(inst.operands),
                    results=list(inst.results),
                    klir_binary=bytes(inst.klir_binary),
                    kernel_format=inst.kernel_format,
                    nki_binary_version_identifier=inst.nki_binary_version_identifier,
                    func_args=list(inst.func_args),
                    func_outs=list(inst.func_outs),
                )
            )
        elif isinstance(inst, BirElementwise) and type(op).__name__ == inst.op:
            instructions.append(ElementwiseInstruction(inst.op, list(inst.operands), list(inst.results)))
        else:
            raise ArtifactError(f"{graph.source}: op {index} ({type(op).__name__}) was lowered to {inst!r}")
    return Artifact(graph.name, target, dict(graph.tensors), [t.name for t in graph.inputs], instructions)


def artifact_filename(graph_name: str) -> str:
    """`<graph name>.nkibb`, with anything that could leave the output folder replaced by '_'."""
    safe = _UNSAFE_FILE_CHARS.sub("_", graph_name).lstrip(".") or "_"
    return safe + ARTIFACT_SUFFIX


# -- encoding -------------------------------------------------------------------------------------
def _tensor_doc(tensor: Tensor) -> dict:
    doc: dict[str, Any] = {"shape": list(tensor.shape), "dtype": tensor.dtype}
    if hasattr(tensor, "access_shape"):
        doc["access_shape"] = list(tensor.access_shape)
    return doc


def _instruction_doc(inst: Instruction) -> dict:
    if isinstance(inst, ElementwiseInstruction):
        return {"kind": "BirElementwise", "op": inst.op, "operands": inst.operands, "results": inst.results}
    return {
        "kind": "NKIKLIRKernel",
        "name": inst.name,
        "func_name": inst.func_name,
        "attrs": inst.attrs,
        "operands": inst.operands,
        "results": inst.results,
        "klir_binary": inst.klir_binary,
        "kernel_format": inst.kernel_format,
        "nki_binary_version_identifier": inst.nki_binary_version_identifier,
        "func_args": inst.func_args,
        "func_outs": inst.func_outs,
    }


def encode_artifact(artifact: Artifact) -> bytes:
    body_doc = {
        "graph": artifact.graph,
        "target": artifact.target,
        "tensors": {name: _tensor_doc(t) for name, t in artifact.tensors.items()},
        "inputs": list(artifact.inputs),
        "instructions": [_instruction_doc(inst) for inst in artifact.instructions],
    }
    try:
        body = msgpack.packb(body_doc, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise ArtifactError(
            f"graph {artifact.graph!r}: cannot encode the artifact (attrs must be plain values): {exc}"
        ) from None
    return msgpack.packb(
        {
            "magic": ARTIFACT_MAGIC,
            "format": ARTIFACT_FORMAT,
            "version": ARTIFACT_VERSION,
            "sha256": hashlib.sha256(body).hexdigest(),
            "body": body,
        },
        use_bin_type=True,
    )


def write_artifact(artifact: Artifact, out_dir: str | Path) -> Path:
    """Write `<out_dir>/<graph>.nkibb` atomically (temporary file in the same folder, then os.replace)."""
    data = encode_artifact(artifact)
    directory = Path(out_dir)
    path = directory / artifact_filename(artifact.graph)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        temporary = directory / f".{path.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
        # Created exclusively, with the mode (after the umask) any output file gets.
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot write the artifact: {exc.strerror or exc}") from None
    return path


# -- loading --------------------------------------------------------------------------------------
def load_artifact(path: str | Path) -> Artifact:
    """Read and validate an artifact; any problem raises ArtifactError naming the file."""
    source = shown_path(path)
    try:
        data = read_input(path, MAX_ARTIFACT_BYTES, "artifact", "on artifacts")
    except InputFileError as exc:
        raise ArtifactError(f"{source}: {exc}") from None
    return decode_artifact(data, source)


def decode_artifact(data: bytes, source: str = "<bytes>") -> Artifact:
    try:
        return _decode(data)
    except _Malformed as exc:
        raise ArtifactError(f"{source}: not a valid {ARTIFACT_SUFFIX} artifact: {exc}") from None


class _Malformed(Exception):
    pass


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise _Malformed(f"{what} is truncated or corrupt ({type(exc).__name__}: {exc})") from None


def _decode(data: bytes) -> Artifact:
    envelope = _unpack(data, "file")
    if not isinstance(envelope, dict) or envelope.get("magic") != ARTIFACT_MAGIC:
        raise _Malformed(f"missing the {ARTIFACT_MAGIC} header")
    if envelope.get("format") != ARTIFACT_FORMAT:
        raise _Malformed(f"format {envelope.get('format')!r} is not {ARTIFACT_FORMAT!r}")
    if envelope.get("version") != ARTIFACT_VERSION:
        raise _Malformed(
            f"version {envelope.get('version')!r} is not supported (this build reads version {ARTIFACT_VERSION})"
        )
    body = envelope.get("body")
    if not isinstance(body, bytes) or not isinstance(envelope.get("sha256"), str):
        raise _Malformed("the body or its sha256 is missing")
    if hashlib.sha256(body).hexdigest() != envelope["sha256"]:
        raise _Malformed("the body does not match its sha256 (corrupted)")
    doc = _unpack(body, "body")
    _expect(doc, {"graph": str, "target": str, "tensors": dict, "inputs": list, "instructions": list}, "body")
    tensors = {name: _tensor(name, spec) for name, spec in doc["tensors"].items()}
    inputs = _names(doc["inputs"], "inputs", tensors)
    instructions = [_instruction(i, inst, tensors) for i, inst in enumerate(doc["instructions"])]
    return Artifact(doc["graph"], doc["target"], tensors, inputs, instructions)


def _expect(doc: object, fields: Mapping[str, type], where: str) -> None:
    if not isinstance(doc, dict):
        raise _Malformed(f"{where} is not a map")
    for name, kind in fields.items():
        if not isinstance(doc.get(name), kind):
            raise _Malformed(f"{where}: field {name!r} is missing or not a {kind.__name__}")


def _shape(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(type(n) is int and n > 0 for n in value):
        raise _Malformed(f"{where}: bad shape {value!r}")
    return tuple(value)


def _tensor(name: object, spec: object) -> Tensor:
    where = f"tensor {name!r}"
    if not isinstance(name, str):
        raise _Malformed(f"{where}: name is not a string")
    _expect(spec, {"shape": list, "dtype": str}, where)
    if spec["dtype"] not in dtypes.ITEM_BYTES:
        raise _Malformed(f"{where}: unsupported dtype {spec['dtype']!r}")
    access = spec.get("access_shape")
    access_shape = None if access is None else _shape(access, where)
    return Tensor(name, _shape(spec["shape"], where), spec["dtype"], access_shape)


def _names(value: object, where: str, tensors: Mapping[str, Tensor]) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise _Malformed(f"{where} is not a list of tensor names")
    unknown = [n for n in value if n not in tensors]
    if unknown:
        raise _Malformed(f"{where} names undeclared tensor {unknown[0]!r}")
    return list(value)


def _instruction(index: int, doc: object, tensors: Mapping[str, Tensor]) -> Instruction:
    where = f"instruction {index}"
    _expect(doc, {"kind": str, "operands": list, "results": list}, where)
    operands = _names(doc["operands"], f"{where}: operands", tensors)
    results = _names(doc["results"], f"{where}: results", tensors)
    if doc["kind"] == "BirElementwise":
        _expect(doc, {"op": str}, where)
        if doc["op"] not in ELEMENTWISE_OPS:
            raise _Malformed(f"{where}: unknown elementwise op {doc['op']!r}")
        return ElementwiseInstruction(doc["op"], operands, results)
    if doc["kind"] != "NKIKLIRKernel":
        raise _Malformed(f"{where}: unknown instruction kind {doc['kind']!r}")
    fields = {
        "name": str,
        "func_name": str,
        "attrs": dict,
        "klir_binary": bytes,
        "kernel_format": str,
        "nki_binary_version_identifier": str,
        "func_args": list,
        "func_outs": list,
    }
    _expect(doc, fields, where)
    where = f"{where} ({doc['name']})"
    decode = KERNEL_FORMATS.get(doc["kernel_format"])
    if decode is None:
        raise _Malformed(f"{where}: unknown kernel_format {doc['kernel_format']!r}")
    try:
        program = decode(doc["klir_binary"])
    except BinaryFormatError as exc:
        raise _Malformed(f"{where}: {exc}") from None
    _bound(program.input_names, doc["func_args"], operands, f"{where}: func_args")
    _bound(program.output_names, doc["func_outs"], results, f"{where}: func_outs")
    return KernelInstruction(
        name=doc["name"],
        func_name=doc["func_name"],
        attrs={name: freeze_attr(value) for name, value in doc["attrs"].items()},
        operands=operands,
        results=results,
        klir_binary=doc["klir_binary"],
        kernel_format=doc["kernel_format"],
        nki_binary_version_identifier=doc["nki_binary_version_identifier"],
        func_args=list(doc["func_args"]),
        func_outs=list(doc["func_outs"]),
    )


def _bound(binary_names: Sequence[str], declared: Sequence[str], graph_names: Sequence[str], where: str) -> None:
    if list(declared) != list(binary_names):
        raise _Malformed(f"{where} {list(declared)} do not match the binary's {list(binary_names)}")
    if len(declared) != len(graph_names):
        raise _Malformed(f"{where}: {len(declared)} names for {len(graph_names)} graph tensors")
