"""Negative entries: a kernel variant this compiler failed to compile is stored under its key like a trace, in
format FAILED, its "binary" the failure's one-line message (UTF-8, at most MAX_FAILURE_BYTES). A pass that reads
one fails at once with that message instead of compiling the kernel again; it lives the failure_ttl setting.
The names live here, with the compiler, because the loop reads them; the tier's entry codec keeps them too."""

FAILED = "failed"
MAX_FAILURE_BYTES = 4096
