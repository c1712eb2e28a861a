"""KLIR, the beta2 frontend's binary: the same program as BIR, carried as versioned JSON.

The C++ KlirToBirCodegen consumer of the original reads KLIR; here `bridge.run_klir` runs it on the same
executor as BIR, so both formats share one definition of every instruction.
"""

from __future__ import annotations

import json

from bridge.errors import BinaryFormatError
from bridge.program import BIR_VERSION_IDENTIFIER, MAX_BINARY_BYTES, MAX_INSTRUCTIONS, Program, program_from_fields

KLIR_MAGIC = b"KLIR\n"
KLIR_VERSION = 1
KLIR_VERSION_IDENTIFIER = f"nkicache-klir-v{KLIR_VERSION}"
# A binary's format ('bir' or 'klir', as a trace result names it) -> its NKIKLIRKernel version identifier.
VERSION_IDENTIFIERS = {"bir": BIR_VERSION_IDENTIFIER, "klir": KLIR_VERSION_IDENTIFIER}


def encode_klir(program: Program) -> bytes:
    document = {
        "version": KLIR_VERSION,
        "kernel": program.kernel,
        "target": program.target,
        "tensors": {"inputs": program.inputs, "outputs": program.outputs},
        "allocations": program.buffers,
        "registers": program.registers,
        "ops": [{"op": instruction[0], "args": instruction[1:]} for instruction in program.code],
    }
    return KLIR_MAGIC + json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def decode_klir(binary: bytes) -> Program:
    if not isinstance(binary, bytes | bytearray | memoryview):
        raise BinaryFormatError(f"a KLIR binary is bytes, got {type(binary).__name__}")
    binary = bytes(binary)
    if len(binary) > MAX_BINARY_BYTES:
        raise BinaryFormatError(f"KLIR binary of {len(binary)} bytes exceeds the {MAX_BINARY_BYTES}-byte limit")
    if not binary.startswith(KLIR_MAGIC):
        raise BinaryFormatError("not a KLIR binary (missing KLIR header)")
    try:
        document = json.loads(binary[len(KLIR_MAGIC) :])
    except (ValueError, RecursionError) as exc:
        raise BinaryFormatError(f"KLIR binary is truncated or malformed: {exc}") from None
    if not isinstance(document, dict) or document.get("version") != KLIR_VERSION:
        version = document.get("version") if isinstance(document, dict) else None
        raise BinaryFormatError(f"KLIR version {version!r} is not supported (this build reads {KLIR_VERSION})")
    tensors, ops = document.get("tensors"), document.get("ops")
    if not isinstance(tensors, dict) or not isinstance(ops, list) or len(ops) > MAX_INSTRUCTIONS:
        raise BinaryFormatError("KLIR binary lacks its tensors or ops")
    if not all(isinstance(op, dict) and isinstance(op.get("args"), list) for op in ops):
        raise BinaryFormatError("KLIR op entries must be objects with op and args")
    return program_from_fields(
        {
            "kernel": document.get("kernel"),
            "target": document.get("target"),
            "inputs": tensors.get("inputs"),
            "outputs": tensors.get("outputs"),
            "buffers": document.get("allocations"),
            "registers": document.get("registers"),
            "code": [[op.get("op"), *op["args"]] for op in ops],
        },
        "KLIR",
    )
