"""No kernel folder outlives its trace: a trace removes its own however it ends, and the folders of traces
whose process was killed are removed by the next process's first trace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.frontends.kernel_folder import PREFIX, kernel_folder, remove_dead_folders
from tests.helpers_graphs import slow_graph, wait_until, write_graph


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def folder(temporary: Path, name: str) -> Path:
    path = temporary / name
    path.mkdir()
    (path / "kernel.json").write_text("{}")
    return path


def test_the_folders_of_dead_processes_go_and_the_others_stay(tmp_path: Path) -> None:
    dead = folder(tmp_path, f"{PREFIX}{dead_pid()}-abc")
    alive = folder(tmp_path, f"{PREFIX}{os.getpid()}-def")
    unnamed = folder(tmp_path, f"{PREFIX}xyz123")  # an older release's folder, or someone else's name
    other = folder(tmp_path, "nkicache-redis-1")
    assert remove_dead_folders(str(tmp_path)) == 1
    assert not dead.exists() and alive.exists() and unnamed.exists() and other.exists()


def test_a_trace_that_fails_removes_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(RuntimeError), kernel_folder() as directory:
        assert Path(directory).parent == tmp_path and Path(directory).name.startswith(f"{PREFIX}{os.getpid()}-")
        raise RuntimeError("the trace failed")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_trace_s_folder_is_removed_by_the_next_process(tmp_path: Path) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    environment = {**os.environ, "TMPDIR": str(temporary)}
    graph = write_graph(tmp_path, slow_graph("killed", variants=40, base_rows=8192))
    command = [sys.executable, "-m", "workers.cli", "compile", str(graph), "--tier", "off", "--out", str(tmp_path)]
    victim = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: any(temporary.glob(f"{PREFIX}{victim.pid}-*")), timeout=60)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    assert any(temporary.glob(f"{PREFIX}{victim.pid}-*"))  # SIGKILL ran no cleanup
    small = write_graph(tmp_path, slow_graph("next", variants=1, base_rows=128))
    next_command = [sys.executable, "-m", "workers.cli", "compile", str(small), "--tier", "off", "--out", str(tmp_path)]
    subprocess.run(next_command, env=environment, check=True, capture_output=True)
    assert list(temporary.iterdir()) == []
