"""numpy's BLAS on one thread in the processes that compile.

The executor multiplies tiles of at most a few hundred KB, too small for BLAS threads to shorten, and a trace
process takes a core of its own: OpenBLAS's threads (one per core by default) then spin on the cores the other
processes trace on. One thread each: `compile --workers 2` of one graph 1.70x -> 1.84x its `--workers 1`, which
itself spends 9% less CPU for the same wall time (bench/RESULTS.md). The variables are numpy's documented set.
"""

from __future__ import annotations

import os

ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def one_blas_thread() -> None:
    """This process and its children load BLAS with one thread, unless the user set its thread count. Called
    before anything imports numpy: BLAS reads these when it loads."""
    for name, value in ONE_BLAS_THREAD.items():
        os.environ.setdefault(name, value)
