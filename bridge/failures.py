"""Negative entries: a kernel variant this compiler failed to compile is stored under its key like a trace, in
format FAILED, its "binary" the failure's one-line message (UTF-8, at most MAX_FAILURE_BYTES). A pass that reads
one fails at once with that message instead of compiling the kernel again; it lives the failure_ttl setting.
The names live here, with the compiler, because the loop reads them; the tier's entry codec keeps them too."""

from collections.abc import Iterator

FAILED = "failed"
MAX_FAILURE_BYTES = 4096
MAX_CAUSES = 32  # links of an exception's chain of causes looked at (a chain may loop)


def causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what caused it (its __cause__, else its __context__), and so on: MAX_CAUSES at most."""
    seen: BaseException | None = exc
    for _ in range(MAX_CAUSES):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def lasting(exc: BaseException) -> bool:
    """Whether a failure to compile is the variant's own, the same each time this compiler compiles it: one of
    the project's errors, not one that running out of memory or of stack caused (a job's memory limit, a deep
    recursion), which another process may not meet."""
    from bridge.errors import NkiCacheError

    return isinstance(exc, NkiCacheError) and not any(isinstance(c, MemoryError | RecursionError) for c in causes(exc))
