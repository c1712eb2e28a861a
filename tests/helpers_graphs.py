"""Small graphs and tier helpers shared by the tier tests.

Run as a script it compiles one graph in a process of its own against a tier and prints what happened as
one JSON line (the two-process tests use it):

    python tests/helpers_graphs.py GRAPH.json SETTINGS.json [BARRIER_DIR NAME PARTIES]

SETTINGS.json holds `cachestore.settings.Settings` fields (`hmac_key_hex` for the key). With a barrier, the
process writes BARRIER_DIR/NAME.ready and starts compiling only when PARTIES such files exist.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sqlite3
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__":  # run as a script from anywhere: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge import run_bir
from bridge.ir import NKIKLIRKernel
from bridge.references import reference

SCRIPT = Path(__file__).resolve()
KERNEL_NAMES = {"Matmul": "matmul_tiled", "Softmax": "softmax", "RMSNorm": "rmsnorm"}


# -- graph builders ---------------------------------------------------------------------------------
def kernel_op(func_name: str, operands: list[str], results: list[str], attrs: dict | None = None) -> dict:
    op = {"type": "InternalNkiKernel", "func_name": func_name, "kernel_name": KERNEL_NAMES[func_name],
          "operands": operands, "results": results}  # fmt: skip
    if attrs:
        op["attrs"] = attrs
    return op


def tensor(shape: tuple[int, ...] | list[int], dtype: str = "float32") -> dict:
    return {"shape": list(shape), "dtype": dtype}


def mixed_graph(name: str = "mixed", rows: int = 64) -> dict:
    """Matmul, RMSNorm and Softmax, with repeats (local hits) and an elementwise op: 5 distinct kernels."""
    k, m, n = rows, 32, 48
    tensors = {
        "x0": tensor((k, m)), "x1": tensor((k, m)), "w": tensor((k, n)), "w2": tensor((k, 2 * n)),
        "g": tensor((n,)), "h0": tensor((m, n)), "h1": tensor((m, n)), "h2": tensor((m, 2 * n)),
        "n0": tensor((m, n)), "n1": tensor((m, n)), "p0": tensor((m, n)), "p1": tensor((m, 2 * n)),
        "p2": tensor((m, n)),
    }  # fmt: skip
    ops = [
        kernel_op("Matmul", ["x0", "w"], ["h0"]),
        kernel_op("Matmul", ["x1", "w"], ["h1"]),  # same shapes: a local hit
        kernel_op("Matmul", ["x0", "w2"], ["h2"]),
        kernel_op("RMSNorm", ["h0", "g"], ["n0"], {"eps": 1e-6}),
        kernel_op("RMSNorm", ["h1", "g"], ["n1"], {"eps": 1e-5}),  # another eps: another variant
        {"type": "Add", "operands": ["n0", "n1"], "results": ["s"]},
        kernel_op("Softmax", ["n0"], ["p0"]),
        kernel_op("Softmax", ["h2"], ["p1"]),
        kernel_op("Softmax", ["n1"], ["p2"]),  # a local hit
    ]
    return {"name": name, "tensors": tensors, "ops": ops}


MIXED_DISTINCT_KEYS = 6
MIXED_KERNEL_OPS = 8


def slow_graph(name: str = "slow", variants: int = 10, base_rows: int = 4096) -> dict:
    """`variants` distinct Softmax/RMSNorm kernels on tall inputs: each traces in tens of milliseconds."""
    tensors: dict[str, dict] = {"g": tensor((256,))}
    ops = []
    for i in range(variants):
        rows = base_rows + 128 * i
        tensors[f"x{i}"] = tensor((rows, 256))
        tensors[f"y{i}"] = tensor((rows, 256))
        if i % 2:
            ops.append(kernel_op("RMSNorm", [f"x{i}", "g"], [f"y{i}"], {"eps": 1e-6}))
        else:
            ops.append(kernel_op("Softmax", [f"x{i}"], [f"y{i}"]))
    return {"name": name, "tensors": tensors, "ops": ops}


def write_graph(directory: Path, graph: dict) -> Path:
    path = directory / f"{graph['name']}.json"
    path.write_text(json.dumps(graph))
    return path


# -- what a compile produced ------------------------------------------------------------------------
def kernels_of(bb: Any) -> list[NKIKLIRKernel]:
    return [inst for inst in bb.instructions if isinstance(inst, NKIKLIRKernel)]


def binary_digests(bb: Any) -> list[str]:
    """sha256 of every NKIKLIRKernel's binary, in instruction order."""
    return [hashlib.sha256(kernel.klir_binary).hexdigest() for kernel in kernels_of(bb)]


def assert_outputs_correct(graph: dict, bb: Any, seed: int = 0) -> None:
    """Run every kernel binary of `bb` on random inputs and compare with bridge.references."""
    rng = np.random.default_rng(seed)
    kernel_ops = [op for op in graph["ops"] if op["type"] == "InternalNkiKernel"]
    kernels = kernels_of(bb)
    assert len(kernels) == len(kernel_ops)
    for op, kernel in zip(kernel_ops, kernels, strict=True):
        arrays = [rng.standard_normal(graph["tensors"][name]["shape"]).astype(np.float32) for name in op["operands"]]
        outputs = run_bir(kernel.klir_binary, dict(zip(kernel.func_args, arrays, strict=True)))
        expected = reference(op["func_name"], arrays, op.get("attrs"))
        for out_name, want in zip(kernel.func_outs, expected, strict=True):
            np.testing.assert_allclose(outputs[out_name], want, rtol=1e-4, atol=1e-4, err_msg=str(op))


def softmax_graph(folder: Path, name: str, rows: int, cols: int = 1000) -> Path:
    """A one-op graph file (a softmax over rows x cols) in `folder`, made if need be."""
    from workers.workload import GraphBuilder

    folder.mkdir(parents=True, exist_ok=True)
    g = GraphBuilder(name)
    g.tensor("x", (rows, cols), "float32")
    g.tensor("y", (rows, cols), "float32")
    g.kernel("Softmax", ["x"], ["y"])
    path = folder / f"{name}.json"
    path.write_text(json.dumps(g.document()))
    return path


# -- looking inside a tier --------------------------------------------------------------------------
def stored_entries(backend: Any) -> dict[str, bytes]:
    """Every live entry of a backend, {cache key: encoded entry}, read through its own scan."""
    return {raw.cache_key: raw.data for raw in backend.scan_entries()}


def metrics_shards(client: Any, keys: Any) -> list[Any]:
    """The keys of every metrics shard of a namespace on a Redis (its stored count; 1 when none is stored)."""
    return [keys.metrics_shard(i) for i in range(int(client.get(keys.metrics_shard_count) or 1))]


def summed_metrics_hash(client: Any, keys: Any, name_of: Any) -> dict[str, float]:
    """One metrics hash (`name_of(shard)`) read raw from every shard and summed field by field."""
    summed: dict[str, float] = {}
    for shard in metrics_shards(client, keys):
        for field, value in client.hgetall(name_of(shard)).items():
            summed[field.decode()] = summed.get(field.decode(), 0.0) + float(value)
    return summed


def local_or_fake_backend(kind: str, tmp_path: Path) -> Any:
    """A fresh backend: the embedded SQLite tier ("local") in `tmp_path`, or Redis on a fakeredis of its own."""
    import uuid

    import fakeredis

    from cachestore.backends.redis import RedisBackend
    from cachestore.backends.sqlite import SqliteBackend
    from cachestore.keys import KeySpace

    if kind == "local":
        return SqliteBackend(tmp_path / "tier.sqlite")
    return RedisBackend(fakeredis.FakeRedis(server=fakeredis.FakeServer()), KeySpace(f"t{uuid.uuid4().hex}"))


class TierView:
    """Reads (and for fault injection, writes) a backend's storage directly, the same way for every backend."""

    def __init__(self, backend: Any):
        self.backend = backend

    @staticmethod
    def of(backend: Any) -> TierView:
        from cachestore.backends.sqlite import SqliteBackend

        return LocalView(backend) if isinstance(backend, SqliteBackend) else RedisView(backend)


class LocalView(TierView):
    def _rows(self, sql: str, params: tuple = ()) -> list[tuple]:
        db = sqlite3.connect(self.backend.path, timeout=5)
        try:
            return db.execute(sql, params).fetchall()
        finally:
            db.close()

    def _write(self, sql: str, params: tuple = ()) -> None:
        db = sqlite3.connect(self.backend.path, timeout=5, isolation_level=None)
        try:
            db.execute(sql, params)
        finally:
            db.close()

    def totals(self) -> dict[str, float]:
        return dict(self._rows("SELECT name, value FROM totals"))

    def worker_totals(self, host: str, worker: str) -> dict[str, float]:
        return dict(self._rows("SELECT name, value FROM worker_totals WHERE host = ? AND worker = ?", (host, worker)))

    def kernel_calls(self) -> dict[str, int]:
        return {k: v for k, v, _ in self._rows("SELECT kernel_name, call_count, variants FROM kernels")}

    def variants(self) -> dict[str, int]:
        return {k: n for k, _, n in self._rows("SELECT kernel_name, call_count, variants FROM kernels")}

    def key_usage(self, cache_key: str) -> tuple[int, float, float] | None:
        rows = self._rows("SELECT usage, first_use, last_use FROM key_usage WHERE cache_key = ?", (cache_key,))
        return tuple(rows[0]) if rows else None

    def key_hosts(self, cache_key: str) -> set[str]:
        return {h for (h,) in self._rows("SELECT host FROM key_hosts WHERE cache_key = ?", (cache_key,))}

    def pass_log(self) -> list[dict]:
        return [json.loads(r) for (r,) in self._rows("SELECT record FROM pass_log ORDER BY id")]

    def ttl(self, cache_key: str) -> float | None:
        rows = self._rows("SELECT expires FROM entries WHERE toolchain = ? AND cache_key = ?", self._at(cache_key))
        return rows[0][0] - time.time() if rows else None

    def set_ttl(self, cache_key: str, seconds: float) -> None:
        self._write("UPDATE entries SET expires = ? WHERE toolchain = ? AND cache_key = ?",
                    (time.time() + seconds, *self._at(cache_key)))  # fmt: skip

    def raw(self, cache_key: str) -> bytes | None:
        rows = self._rows("SELECT data FROM entries WHERE toolchain = ? AND cache_key = ?", self._at(cache_key))
        return bytes(rows[0][0]) if rows else None

    def put_raw(self, cache_key: str, data: bytes, ttl: float = 3600) -> None:
        self._write(
            "INSERT OR REPLACE INTO entries (toolchain, cache_key, data, digest, expires, used) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (*self._at(cache_key), data, "0" * 64, time.time() + ttl, time.time()),
        )

    def delete(self, cache_key: str) -> None:
        self._write("DELETE FROM entries WHERE toolchain = ? AND cache_key = ?", self._at(cache_key))

    def _at(self, cache_key: str) -> tuple[str, str]:
        """Where an entry of the backend's partition is."""
        return self.backend.partition, cache_key


class RedisView(TierView):
    @property
    def _r(self) -> Any:
        return self.backend.client

    @property
    def _k(self) -> Any:
        return self.backend.keys

    @staticmethod
    def _decoded(mapping: dict) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in mapping.items()}

    def _shards(self) -> list[Any]:
        return self.backend._metric_shards()

    def _shard_of(self, cache_key: str) -> Any:
        from cachestore.keys import key_shard

        return self._k.metrics_shard(key_shard(cache_key, len(self._shards())))

    def _summed(self, name_of: Any, kind: type = float) -> dict[str, Any]:
        """A hash summed over every metrics shard, read raw."""
        summed: dict[str, Any] = {}
        for shard in self._shards():
            for k, v in self._decoded(self._r.hgetall(name_of(shard))).items():
                summed[k] = summed.get(k, 0) + kind(float(v))
        return summed

    def totals(self) -> dict[str, float]:
        return self._summed(lambda shard: shard.totals)

    def worker_totals(self, host: str, worker: str) -> dict[str, float]:
        return self._summed(lambda shard: shard.worker_metrics(host, worker))

    def kernel_calls(self) -> dict[str, int]:
        return self._summed(lambda shard: shard.kernel_calls, int)

    def variants(self) -> dict[str, int]:
        return self._summed(lambda shard: shard.kernel_variants, int)

    def key_usage(self, cache_key: str) -> tuple[int, float, float] | None:
        shard = self._shard_of(cache_key)
        usage = self._r.hget(shard.key_usage, cache_key)
        if usage is None:
            return None
        first = self._r.hget(shard.key_first, cache_key)
        last = self._r.hget(shard.key_last, cache_key)
        return int(usage), float(first), float(last)

    def key_hosts(self, cache_key: str) -> set[str]:
        return {h.decode() for h in self._r.smembers(self._shard_of(cache_key).key_hosts(cache_key))}

    def pass_log(self) -> list[dict]:
        """Every shard's pass log, in the order the records were added."""
        records = [
            (stream_id, fields) for shard in self._shards() for stream_id, fields in self._r.xrange(shard.pass_log)
        ]
        records.sort(key=lambda item: tuple(int(part) for part in item[0].split(b"-")))
        return [json.loads(fields[b"pass"]) for _, fields in records]

    def ttl(self, cache_key: str) -> float | None:
        ms = self._r.pttl(self._k.entry(self.backend.partition, cache_key))
        return None if ms < 0 else ms / 1000

    def set_ttl(self, cache_key: str, seconds: float) -> None:
        self._r.pexpire(self._k.entry(self.backend.partition, cache_key), max(1, int(seconds * 1000)))

    def raw(self, cache_key: str) -> bytes | None:
        return self._r.get(self._k.entry(self.backend.partition, cache_key))

    def put_raw(self, cache_key: str, data: bytes, ttl: float = 3600) -> None:
        self._r.set(self._k.entry(self.backend.partition, cache_key), data, ex=int(ttl))

    def delete(self, cache_key: str) -> None:
        self._r.delete(self._k.entry(self.backend.partition, cache_key))


def fresh_tier_backend(request: Any, tmp_path: Path) -> Iterator[tuple[str, str, Any]]:
    """(URL, namespace, a backend of the test's own on it) of a fresh tier, for a fixture parametrized "local"
    (an embedded file, created up front as a tier that persists between runs would be) or "redis" (a namespace
    of its own on the test Redis, deleted afterwards)."""
    import redis

    from cachestore.backends.redis import RedisBackend
    from cachestore.backends.sqlite import SqliteBackend
    from cachestore.keys import KeySpace

    namespace = unique_namespace()
    if request.param == "local":
        path = tmp_path / "tier.sqlite"
        backend = SqliteBackend(path)
        yield f"local:{path}", namespace, backend
        backend.close()
        return
    url = request.getfixturevalue("redis_url")
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        yield url, namespace, RedisBackend(client, KeySpace(namespace))
    finally:
        delete_namespace(client, namespace)
        client.close()


def delete_namespace(client: Any, namespace: str) -> None:
    """Delete every key of a KeySpace namespace, the metrics keys (which start with '{') included."""
    for pattern in (f"{namespace}:*", f"{{{namespace}:*"):
        keys = list(client.scan_iter(match=pattern, count=1000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])


def unique_namespace() -> str:
    """A namespace Settings accepts (no colons) and that no other test uses."""
    return f"nkicachetest-{uuid.uuid4().hex[:16]}"


def wait_until(predicate: Any, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


# -- compiling in another process ---------------------------------------------------------------------
def start_compile_process(
    tmp_path: Path, graph_path: Path, settings: dict, barrier: tuple[Path, str, int] | None = None
) -> Any:
    import subprocess

    settings_path = tmp_path / f"settings-{uuid.uuid4().hex[:8]}.json"
    settings_path.write_text(json.dumps(settings))
    argv = [sys.executable, str(SCRIPT), str(graph_path), str(settings_path)]
    if barrier is not None:
        argv += [str(barrier[0]), barrier[1], str(barrier[2])]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def compile_process_result(process: Any, timeout: float = 60) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"compile process failed ({process.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def _wait_at_barrier(directory: Path, name: str, parties: int) -> None:
    (directory / f"{name}.ready").write_text("")
    deadline = time.monotonic() + 30
    while len(list(directory.glob("*.ready"))) < parties:
        if time.monotonic() > deadline:
            raise SystemExit("barrier: the other processes never arrived")
        time.sleep(0.001)


def peak_rss_kib() -> int:
    """This process's peak resident memory since it started its program, in KiB. Linux's ru_maxrss is no use
    here: it keeps the high-water mark of the process it was forked from (pytest's) across exec."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))


def main(argv: list[str]) -> None:
    from bridge.codegen import BirCodeGenLoop
    from bridge.graph import load_graph
    from cachestore.settings import Settings
    from cachestore.stores import open_tier

    graph = load_graph(argv[0])
    fields = json.loads(Path(argv[1]).read_text())
    if "hmac_key_hex" in fields:
        fields["hmac_key"] = bytes.fromhex(fields.pop("hmac_key_hex"))
    tier = open_tier(Settings(**fields))
    batches: list = []  # every metrics batch the client made (on its flusher), read once it is closed
    if tier is not None:
        from cachestore import client as client_module

        make = client_module.metrics_batch
        client_module.metrics_batch = lambda *args: batches.append(make(*args)) or batches[-1]
    if len(argv) > 2:
        _wait_at_barrier(Path(argv[2]), argv[3], int(argv[4]))
    started = time.time()
    loop = BirCodeGenLoop(tier=tier)
    bb = loop.run(graph)
    finished = time.time()
    if tier is not None:
        tier.close(timeout=10)
    report = {
        "summary": loop.pass_summary(),
        "batches": [dict(batch.totals) for batch in batches],
        "digests": binary_digests(bb),
        "stats": tier.stats.snapshot() if tier is not None else {},
        "started": started,
        "finished": finished,
        "max_rss_kib": peak_rss_kib(),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
