"""A compiled kernel as both binary formats carry it, and the BIR container format.

A `Program` is the frontend-neutral form: argument tensors, on-chip buffers, registers and the flat
instruction list of `bridge.nki.isa`. BIR stores it as one msgpack map; KLIR (the beta2 format, see
`bridge.klir`) stores the same program another way. Both decode to a `Program` that the executor validates
and runs, so the instruction semantics exist once.
"""

from __future__ import annotations

import msgpack
import msgspec

from bridge.errors import BinaryFormatError

BIR_MAGIC = "NKIBIR"
BIR_VERSION = 1
BIR_VERSION_IDENTIFIER = f"nkicache-bir-v{BIR_VERSION}"

# Reading limits: a binary is untrusted bytes (it may come from a cache), so nothing in it may make the
# decoder allocate without bound.
MAX_BINARY_BYTES = 256 * 1024 * 1024
MAX_INSTRUCTIONS = 5_000_000
_UNPACK_LIMITS = {
    "max_str_len": 1 << 16,
    "max_bin_len": 0,
    "max_array_len": MAX_INSTRUCTIONS,
    "max_map_len": 64,
    "max_ext_len": 0,
}


class Program(msgspec.Struct):
    kernel: str
    target: str
    inputs: list[list] = msgspec.field(default_factory=list)  # [name, shape, dtype]
    outputs: list[list] = msgspec.field(default_factory=list)
    buffers: list[list] = msgspec.field(default_factory=list)  # [shape, dtype, space]
    registers: int = 0
    code: list[list] = msgspec.field(default_factory=list)

    @property
    def input_names(self) -> list[str]:
        return [spec[0] for spec in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [spec[0] for spec in self.outputs]


def encode_bir(program: Program) -> bytes:
    """Serialize deterministically: no addresses, sets, timestamps or paths, maps in a fixed order."""
    return msgpack.packb(
        {
            "magic": BIR_MAGIC,
            "version": BIR_VERSION,
            "kernel": program.kernel,
            "target": program.target,
            "inputs": program.inputs,
            "outputs": program.outputs,
            "buffers": program.buffers,
            "registers": program.registers,
            "code": program.code,
        },
        use_bin_type=True,
    )


def decode_bir(binary: bytes) -> Program:
    """The program in a BIR binary; any malformation raises BinaryFormatError, never something deeper."""
    document = unpack_limited(binary, "BIR")
    if not isinstance(document, dict) or document.get("magic") != BIR_MAGIC:
        raise BinaryFormatError("not a BIR binary (missing NKIBIR header)")
    if document.get("version") != BIR_VERSION:
        raise BinaryFormatError(
            f"BIR version {document.get('version')!r} is not supported (this build reads version {BIR_VERSION})"
        )
    return program_from_fields(document, "BIR")


def unpack_limited(binary: object, fmt: str) -> object:
    if not isinstance(binary, bytes | bytearray | memoryview):
        raise BinaryFormatError(f"a {fmt} binary is bytes, got {type(binary).__name__}")
    if len(binary) > MAX_BINARY_BYTES:
        raise BinaryFormatError(f"{fmt} binary of {len(binary)} bytes exceeds the {MAX_BINARY_BYTES}-byte limit")
    try:
        return msgpack.unpackb(bytes(binary), raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except MemoryError:  # the process's memory limit, not the binary's fault
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise BinaryFormatError(f"{fmt} binary is truncated or malformed: {type(exc).__name__}: {exc}") from None


def program_from_fields(document: dict, fmt: str) -> Program:
    expected = {
        "kernel": str,
        "target": str,
        "inputs": list,
        "outputs": list,
        "buffers": list,
        "registers": int,
        "code": list,
    }
    for name, kind in expected.items():
        if not isinstance(document.get(name), kind):
            raise BinaryFormatError(f"{fmt} binary field {name!r} is missing or not a {kind.__name__}")
    return Program(
        kernel=document["kernel"],
        target=document["target"],
        inputs=document["inputs"],
        outputs=document["outputs"],
        buffers=document["buffers"],
        registers=document["registers"],
        code=document["code"],
    )
