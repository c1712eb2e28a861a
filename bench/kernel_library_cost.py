"""What the internal kernel library costs to compile at realistic shapes, next to a Redis GET of the binary.

A benchmark, not a test: for each case it compiles the kernel `--runs` times through
`bridge.compile_kernel` (beta3) and prints the median compile time, the instruction count and the binary
size as a Markdown table for bench/RESULTS.md. Next to each it stores the binary under a unique key in
Redis, times GET round trips of exactly those bytes, deletes the key, and shows how many round trips one
compile costs: caching a kernel only pays if fetching it is much cheaper than compiling it.

    python bench/kernel_library_cost.py                        # every case, median of 5 compiles
    python bench/kernel_library_cost.py --runs 3 --verify      # also run each binary once vs the reference
    python bench/kernel_library_cost.py --redis-url redis://host:6379/0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

import bridge
from bridge import Tensor, references
from bridge.dtypes import to_numpy

Spec = tuple[tuple[int, ...], str]  # (shape, dtype)


@dataclass(frozen=True)
class Case:
    func_name: str
    operands: tuple[Spec, ...]
    results: tuple[Spec, ...]
    attrs: dict = field(default_factory=dict)
    shape: str = ""
    make_inputs: Callable[[np.random.Generator], list[np.ndarray]] | None = None

    @property
    def dtype(self) -> str:
        return "/".join(sorted({dtype for _, dtype in self.operands + self.results}))

    def compile(self) -> dict:
        return bridge.compile_kernel(
            self.func_name,
            [Tensor(f"operand{i}", shape, dtype) for i, (shape, dtype) in enumerate(self.operands)],
            [Tensor(f"result{i}", shape, dtype) for i, (shape, dtype) in enumerate(self.results)],
            self.attrs,
        )

    def inputs(self, rng: np.random.Generator) -> list[np.ndarray]:
        if self.make_inputs is not None:
            return self.make_inputs(rng)
        return [rng.standard_normal(shape, dtype=np.float32).astype(to_numpy(dtype)) for shape, dtype in self.operands]


# -- cases ---------------------------------------------------------------------------------------------
def blockwise(tokens: int, hidden: int, experts: int, inter: int, block: int, dtype: str = "float32") -> Case:
    """Top-2 routing: every expert's tokens fill blocks of `block`, the last one padded, so N ~ 2T/B + E."""
    blocks = -(-2 * tokens // block) + experts
    operands = (
        ((tokens + 1, hidden), dtype),
        (((tokens + 1) * experts, 1), dtype),
        ((experts, hidden, 2, inter), dtype),
        ((experts, inter, hidden), dtype),
        ((blocks * block,), "int32"),
        ((blocks, 1), "int32"),
    )

    def make_inputs(rng: np.random.Generator) -> list[np.ndarray]:
        np_dtype = to_numpy(dtype)
        choice = np.argsort(rng.random((tokens, experts)), axis=1)[:, :2]
        affinities = np.zeros((tokens + 1) * experts, np.float32)
        ids = np.full(blocks * block, tokens, np.int32)
        expert_of_block = np.zeros(blocks, np.int32)
        n = 0
        for e in range(experts):
            routed = np.flatnonzero((choice == e).any(axis=1))
            affinities[routed * experts + e] = rng.uniform(0.1, 1.0, len(routed))
            for start in range(0, len(routed), block):
                chunk = routed[start : start + block]
                ids[n * block : n * block + len(chunk)] = chunk
                expert_of_block[n] = e
                n += 1
        return [
            rng.standard_normal((tokens + 1, hidden)).astype(np_dtype),
            affinities.reshape(-1, 1).astype(np_dtype),
            (rng.standard_normal((experts, hidden, 2, inter)) / np.sqrt(hidden)).astype(np_dtype),
            (rng.standard_normal((experts, inter, hidden)) / np.sqrt(inter)).astype(np_dtype),
            ids,
            expert_of_block.reshape(-1, 1),
        ]

    return Case(
        "BlockwiseMatmul",
        operands,
        (((tokens + 1, hidden), dtype),),
        {"block_size": block},
        f"T={tokens} H={hidden} E={experts} I={inter} B={block} N={blocks}",
        make_inputs,
    )


def conv(n, c, h, w, o, k, stride=1, pad=0, dtype="float32") -> Case:
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    return Case(
        "Conv2d",
        (((n, c, h, w), dtype), ((o, c, k, k), dtype)),
        (((n, o, oh, ow), dtype),),
        {"stride": (stride, stride), "padding": ((pad, pad), (pad, pad)), "dilation": (1, 1)},
        f"{n}x{c}x{h}x{w} * {o}x{c}x{k}x{k} s{stride} p{pad}",
    )


def resize(n, h, w, c, ho, wo, dtype="float32") -> Case:
    return Case(
        "ResizeNearest",
        (((n, h, w, c), dtype),),
        (((n, ho, wo, c), dtype),),
        {"out_shape": (n, ho, wo, c)},
        f"{n}x{h}x{w}x{c} -> {ho}x{wo}",
    )


def transpose(shape: tuple[int, ...], dtype="float32") -> Case:
    out = (*shape[:-2], shape[-1], shape[-2])
    return Case("Transpose10", ((shape, dtype),), ((out, dtype),), {}, "x".join(map(str, shape)))


CASES: list[Case] = [
    blockwise(1024, 1024, 8, 512, 128),
    blockwise(1024, 1024, 8, 512, 128, "bfloat16"),
    blockwise(4096, 1024, 8, 512, 128),
    conv(1, 3, 224, 224, 64, 3, pad=1),
    conv(1, 64, 224, 224, 64, 3, pad=1),
    conv(1, 3, 224, 224, 64, 7, stride=2, pad=3),  # a ResNet stem
    conv(1, 256, 56, 56, 64, 1),  # conv2d_pbp_1x1
    resize(1, 112, 112, 64, 224, 224),
    resize(1, 224, 224, 32, 300, 300),
    resize(1, 224, 224, 64, 150, 150),
    transpose((4096, 4096)),
    transpose((8, 12, 512, 64)),
]


# -- measuring -----------------------------------------------------------------------------------------
@dataclass
class Row:
    kernel: str
    shape: str
    dtype: str
    instructions: int
    binary_bytes: int
    compile_seconds: float
    binary: bytes = field(repr=False, default=b"")
    get_seconds: float | None = None
    verified: str = ""


def measure(case: Case, runs: int, verify: bool) -> Row:
    case.compile()  # untimed: the first compile also parses the kernel source
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = case.compile()
        times.append(time.perf_counter() - start)
    info = bridge.binary_info(result["binary"])
    row = Row(
        f"{case.func_name} ({info['kernel']})",
        case.shape,
        case.dtype,
        info["instructions"],
        len(result["binary"]),
        statistics.median(times),
        result["binary"],
    )
    if verify:
        row.verified = verify_against_reference(case, result)
    return row


def verify_against_reference(case: Case, result: dict) -> str:
    arrays = case.inputs(np.random.default_rng(0))
    (name,) = result["output_names"]
    out = bridge.run_bir(result["binary"], dict(zip(result["input_names"], arrays, strict=True)))[name]
    (expected,) = references.reference(case.func_name, arrays, case.attrs)
    error = float(np.max(np.abs(out.astype(np.float64) - expected)) / max(1.0, float(np.max(np.abs(expected)))))
    return f"max rel err {error:.1e}"


GET_REPEATS = 100


def redis_get_seconds(url: str, value: bytes, repeats: int = GET_REPEATS) -> float | None:
    """Median GET round trip of `value` under a fresh key (deleted afterwards); None without a server."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
    key = f"nkicache:bench:kernel-library:{uuid.uuid4().hex}"
    try:
        client.set(key, value, ex=600)
        for _ in range(10):
            client.get(key)  # warm the connection
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fetched = client.get(key)
            times.append(time.perf_counter() - start)
        assert fetched == value
        return statistics.median(times)
    except redis.RedisError as exc:
        print(f"redis at {url} unavailable: {exc}", file=sys.stderr)
        return None
    finally:
        with contextlib.suppress(redis.RedisError):
            client.delete(key)
        client.close()


def format_table(rows: Sequence[Row], runs: int) -> str:
    verify = any(row.verified for row in rows)
    header = (
        f"| kernel | shape | dtype | instructions | binary bytes | compile s (median of {runs}) "
        "| Redis GET ms (median) | compile / GET |"
    )
    lines = [
        header + (" check |" if verify else ""),
        "|---|---|---|---:|---:|---:|---:|---:|" + ("---|" if verify else ""),
    ]
    for row in rows:
        get_ms = f"{row.get_seconds * 1e3:.3f}" if row.get_seconds else "n/a"
        ratio = f"{row.compile_seconds / row.get_seconds:,.0f}x" if row.get_seconds else "n/a"
        lines.append(
            f"| {row.kernel} | {row.shape} | {row.dtype} | {row.instructions:,} | {row.binary_bytes:,} "
            f"| {row.compile_seconds:.3f} | {get_ms} | {ratio} |" + (f" {row.verified} |" if verify else "")
        )
    return "\n".join(lines)


def machine_description() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, numpy {np.__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed compiles per case (median reported)")
    parser.add_argument("--verify", action="store_true", help="run each binary once against bridge.references")
    parser.add_argument("--kernel", action="append", help="only this func_name (repeatable)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = parser.parse_args(argv)
    cases = [case for case in CASES if args.kernel is None or case.func_name in args.kernel]
    print(f"machine: {machine_description()}\n")
    rows = []
    for case in cases:
        rows.append(measure(case, args.runs, args.verify))
        print(f"  measured {rows[-1].kernel} {rows[-1].shape} {rows[-1].dtype}", file=sys.stderr, flush=True)
    for row in rows:
        row.get_seconds = redis_get_seconds(args.redis_url, row.binary)
    print(format_table(rows, args.runs))
    print(f"\nRedis: {args.redis_url}, GET of each binary's own bytes, median of {GET_REPEATS} round trips.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
