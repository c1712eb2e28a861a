"""A scan of every entry of a tier, split over processes: `inspect verify` and `inspect du`.

Both read every entry and spend most of their time in Python on one core (decoding, hashing, the key
recomputation; bench/RESULTS.md, "Scans split over processes"). A store that declares `splits_scans` (Redis)
hands out its entries' names a page at a time (`entry_pages`); this process runs that one SCAN and deals the
pages to forked processes, each asking for the next page when it starts on one, so the faster takes more. Each
reads its pages (`read_entry_page`), feeds them to its own task (`ScanTask`: what verify or du does to a batch)
and sends back the task's result, which the caller merges. Every entry is read by exactly one process: the
pages come from one SCAN, as when scanning alone.

Small tiers (fewer than SPLIT_AFTER_PAGES pages), a single process, and stores without the ability are scanned
here, by the same task: the split changes who runs the task, never what it computes.

What crosses between processes is msgpack (page names, the result), never pickle. The children inherit the
reader by fork (redis-py gives a forked process new connections of its own). A child that dies or fails fails
the whole scan (`ScanFailed`, or the child's own TierError class), never a report with its entries missing; a
child whose parent died finds its pipe closed and exits.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import msgpack

from bridge.errors import NkiCacheError
from cachestore.api import (
    BATCH,
    PagedReader,
    RawEntry,
    Reader,
    TierBusy,
    TierError,
    TierTimeout,
    TierUnavailable,
    batched,
    pages_of,
)

MAX_PROCESSES = 4  # past a few, the one Redis server's own thread is what a scan waits for
SPLIT_AFTER_PAGES = 4  # a tier of fewer pages is scanned here: forking costs more than the pages take
PAGE = BATCH  # entry names a page
_ASK = b""  # a child's request for its next page; the parent's answer when no page is left
_ERRORS: dict[str, type[TierError]] = {cls.__name__: cls for cls in (TierError, TierUnavailable, TierTimeout, TierBusy)}


class ScanFailed(NkiCacheError):
    """A process scanning part of the entries died or failed: the scan's result would miss its entries."""


class ScanTask(Protocol):
    """What a command does with the entries: fed batches of them, then asked for a msgpack-able result."""

    def add(self, batch: list[RawEntry]) -> None: ...

    def result(self) -> Any: ...


# A task factory takes the index of the process it runs in (0 when scanning alone): a task that samples seeds
# its random numbers with it, so that two processes do not draw alike.
TaskFactory = Callable[[int], ScanTask]


def default_processes() -> int:
    """The CPUs this process may run on, at most MAX_PROCESSES."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_PROCESSES, cpus))


def scan_split(
    reader: Reader,
    make_task: TaskFactory,
    *,
    processes: int | None = None,
    every_partition: bool = False,
    with_ttl: bool = False,
) -> list[Any]:
    """The results of `make_task`'s tasks over every entry of the reader's partition (of every partition:
    `every_partition`), one result per process that ran one (`processes`: default_processes() when None)."""
    wanted = default_processes() if processes is None else processes
    if not pages_of(reader):
        return [_scan_here(make_task(0), _batches_here(reader, every_partition, with_ttl))]
    # One SCAN, of every partition at once when asked (not one a partition), whether split or not.
    pages = reader.entry_pages(every_partition, PAGE)
    head = list(itertools.islice(pages, SPLIT_AFTER_PAGES if wanted > 1 else 0))
    if wanted < 2 or len(head) < SPLIT_AFTER_PAGES:
        return [
            _scan_here(make_task(0), (reader.read_entry_page(page, with_ttl) for page in itertools.chain(head, pages)))
        ]
    return _scan_in_processes(reader, make_task, itertools.chain(head, pages), wanted, with_ttl)


def _batches_here(reader: Reader, every_partition: bool, with_ttl: bool) -> Iterator[list[RawEntry]]:
    if not every_partition:
        return batched(reader.scan_entries(with_ttl=with_ttl))
    every = (
        raw
        for partition in reader.entry_partitions()
        for raw in reader.in_partition(partition).scan_entries(with_ttl=with_ttl)
    )
    return batched(every)


def _scan_here(task: ScanTask, batches: Iterator[list[RawEntry]]) -> Any:
    for batch in batches:
        task.add(batch)
    return task.result()


def _scan_in_processes(
    reader: PagedReader, make_task: TaskFactory, pages: Iterator[list[str]], processes: int, with_ttl: bool
) -> list[Any]:
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("fork")  # the children inherit the reader and the task's closure
    children: dict[Any, Any] = {}  # the parent's end of each child's pipe -> the child
    try:
        for index in range(processes):
            mine, theirs = context.Pipe()
            child = context.Process(target=_child, args=(theirs, reader, make_task, index, with_ttl), daemon=True)
            child.start()
            theirs.close()  # so that the child's death reads as the end of its pipe here
            children[mine] = child
        return _deal(children, pages, wait)
    finally:
        for conn, child in children.items():
            if child.is_alive():
                child.terminate()
            child.join()
            conn.close()


def _deal(children: dict[Any, Any], pages: Iterator[list[str]], wait: Callable) -> list[Any]:
    """Answer each child's requests with the next page until none is left, then gather their results."""
    results: dict[Any, Any] = {}
    ended: set[Any] = set()
    while len(results) < len(children):
        for conn in wait([conn for conn in children if conn not in results]):
            child = children[conn]
            try:
                message = conn.recv_bytes()
                if message != _ASK:
                    results[conn] = _result_of(message, child.pid)
                elif conn not in ended:  # a request after the end was sent: the child already has its last answer
                    page = next(pages, None)
                    if page is None:
                        ended.add(conn)
                    conn.send_bytes(_ASK if page is None else msgpack.packb(page))
            except (EOFError, OSError):  # its end of the pipe closed: it failed and said so, or it died
                if (last := _last_word(conn)) is not None:  # (a page sent after it failed finds the pipe closed)
                    results[conn] = _result_of(last, child.pid)
                    continue
                child.join(timeout=5)
                raise ScanFailed(
                    f"scan process {child.pid} ended (exit code {child.exitcode}) before sending its "
                    "result: its entries were not all read"
                ) from None
    return [results[conn] for conn in children]


def _last_word(conn: Any) -> bytes | None:
    """The result or error a child sent before its end of the pipe closed, None when it sent neither."""
    with contextlib.suppress(EOFError, OSError):
        while conn.poll():
            if (message := conn.recv_bytes()) != _ASK:
                return message
    return None


def _result_of(message: bytes, pid: int | None) -> Any:
    reply = msgpack.unpackb(message, raw=False, strict_map_key=False)
    if "error" in reply:
        kind, text = reply["error"], reply["message"]
        raise _ERRORS.get(kind, ScanFailed)(text if kind in _ERRORS else f"scan process {pid}: {kind}: {text}")
    return reply["ok"]


def _child(conn: Any, reader: PagedReader, make_task: TaskFactory, index: int, with_ttl: bool) -> None:
    """A forked scanning process: two requests in flight (a page waits while the last one is read), its task
    fed page by page, its result sent when the parent answers a request with the end."""
    try:
        task = make_task(index)
        conn.send_bytes(_ASK)
        conn.send_bytes(_ASK)
        while (page := conn.recv_bytes()) != _ASK:
            conn.send_bytes(_ASK)
            task.add(reader.read_entry_page(msgpack.unpackb(page, raw=False), with_ttl))
        conn.send_bytes(msgpack.packb({"ok": task.result()}))
    except BaseException as exc:  # whatever it is, the parent must learn the scan is incomplete
        with contextlib.suppress(OSError):  # the parent gone: nobody waits for the result
            conn.send_bytes(msgpack.packb({"error": type(exc).__name__, "message": str(exc)}))
    finally:
        conn.close()
