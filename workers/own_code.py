"""The Python processes a command starts import nkicache from where the command did, never from their working
directory.

`python -c ...` and `python -m ...` put the current directory first on `sys.path`, so a forkserver or a compiling
process started from a folder holding another `bridge/`, `workers/` or `cachestore/` (an older checkout, or a
user's own packages) would run that code and label its binaries with the command's toolchain id. The children
are started with safe paths (`PYTHONSAFEPATH`: nothing is put before `sys.path`) and with the command's own
`sys.path` as their `PYTHONPATH`, so they import every module from where the command did.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping

SAFE_PATH = "PYTHONSAFEPATH"
PATH = "PYTHONPATH"


def own_code_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) for a Python child that imports what this process imports.
    Relative entries of `sys.path` ('' included: the current directory) are made absolute, as this process
    resolved them."""
    environment = dict(os.environ if base is None else base)
    environment[SAFE_PATH] = "1"
    environment[PATH] = os.pathsep.join(os.path.abspath(entry) for entry in sys.path)
    return environment


@contextlib.contextmanager
def own_code_launch() -> Iterator[None]:
    """This process's environment set to `own_code_environment()` for the duration: for a launcher that takes
    no environment of its own (multiprocessing's forkserver), restored afterwards."""
    saved = {name: os.environ.get(name) for name in (SAFE_PATH, PATH)}
    launched = own_code_environment()
    os.environ.update({name: launched[name] for name in saved})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
