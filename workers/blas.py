"""numpy's BLAS on one thread in the processes that compile.

The executor multiplies tiles of a few hundred KB at most, too small for BLAS threads to shorten, and each trace
process has a core of its own: OpenBLAS's threads (one per core by default) would spin on the cores the other
processes trace on, which cost `compile --workers 2` a tenth of its speed (bench/RESULTS.md, "One BLAS thread a
trace process"). One variable for each BLAS a numpy build may load: OpenBLAS (the wheels on Linux and Windows), MKL,
OpenMP builds, and Accelerate (macOS).
"""

from __future__ import annotations

import os

ONE_BLAS_THREAD = {
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
}


def one_blas_thread() -> None:
    """This process and its children load BLAS with one thread, unless the user set any of these (OpenBLAS reads
    its own variable before OMP_NUM_THREADS, so setting only the others could override theirs). Called before
    anything imports numpy: BLAS reads them when it loads."""
    if not any(name in os.environ for name in ONE_BLAS_THREAD):
        os.environ.update(ONE_BLAS_THREAD)
