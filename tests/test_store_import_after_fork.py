"""`compile --workers N` on Redis imports redis-py (60-70 ms) after forking its helpers, which trace meanwhile: a
core no longer idles through the import, which made a Redis tier that fails cost more than no tier at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.broken_tier import closed_port
from workers.workload import generate_workload

ROOT = Path(__file__).resolve().parents[1]

# Runs the compile in a fresh interpreter (this one imported redis-py long ago), noting at the helpers' fork and at
# their first go whether redis-py is imported yet.
COMPILE = """
import json, sys
from cachestore.settings import load_settings
from workers import variant_pool

events = []
fork, go = variant_pool.Helpers.__init__, variant_pool.Helpers.go

def forked(self, *args, **kwargs):
    events.append(["fork", "redis" in sys.modules])
    fork(self, *args, **kwargs)

def went(self):
    events.append(["go", "redis" in sys.modules])
    go(self)

variant_pool.Helpers.__init__, variant_pool.Helpers.go = forked, went
settings = load_settings({"tier": sys.argv[1]})
paths = sys.argv[3:]
run = variant_pool.compile_in_parallel(
    paths, settings=settings, workers=2, out_dir=sys.argv[2], target_name=None, on_result=lambda result: None
)
print(json.dumps({"events": events, "errors": [r.error for r in run.results], "redis": "redis" in sys.modules}))
"""


def test_helpers_fork_and_trace_before_the_compile_imports_redis_py(tmp_path: Path) -> None:
    paths = [str(p) for p in generate_workload(tmp_path / "graphs", 3, seed=2)]
    down = f"redis://127.0.0.1:{closed_port()}/0"  # no server needed: the order is the same on any Redis tier
    line = [sys.executable, "-c", COMPILE, down, str(tmp_path / "out"), *paths]
    done = subprocess.run(line, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    assert run["errors"] == [None, None, None]
    assert run["events"][:2] == [["fork", False], ["go", False]]  # settings and the tier client did not import it
    assert run["redis"]  # the compile did, after
