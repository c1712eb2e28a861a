"""Negative entries: a kernel variant this compiler failed to compile is stored under its key like a trace, in
format FAILED, its "binary" the failure's one-line message (UTF-8, at most MAX_FAILURE_BYTES). A pass that reads
one fails at once with that message instead of compiling the kernel again; it lives the failure_ttl setting.
The names live here, with the compiler, because the loop reads them; the tier's entry codec keeps them too."""

FAILED = "failed"
MAX_FAILURE_BYTES = 4096


def lasting(exc: BaseException) -> bool:
    """Whether a failure to compile is the variant's own, the same each time this compiler compiles it: one of
    the project's errors, not one that running out of memory or of stack caused (a job's memory limit, a deep
    recursion), which another process may not meet."""
    from bridge.errors import NkiCacheError

    if not isinstance(exc, NkiCacheError):
        return False
    seen: BaseException | None = exc
    for _ in range(32):  # the chain of causes, bounded
        if seen is None:
            return True
        if isinstance(seen, MemoryError | RecursionError):
            return False
        seen = seen.__cause__ or seen.__context__
    return True
