"""`nkicache compile` and `nkicache run`: passes, JSON reports, per-file failures, artifacts, --check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bridge.artifact import load_artifact
from workers.cli import main

GRAPHS = Path(__file__).parent / "data" / "graphs"
GOOD = ["attention_tiles.json", "bf16_norm.json", "mlp_repeated.json"]
# (misses, hits) per graph, and its artifact's file name
EXPECTED = {
    "attention_tiles.json": (3, 2, "attention-tiles.nkibb"),
    "bf16_norm.json": (2, 1, "bf16-norm.nkibb"),
    "mlp_repeated.json": (3, 4, "mlp-repeated.nkibb"),
}


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def compile_json(*args: str) -> tuple[object, dict]:
    result = invoke("compile", "--json", *args)
    return result, json.loads(result.stdout)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out")
    result = invoke("compile", GRAPHS, "--out", out)
    assert result.exit_code == 0, (result.output, result.exception)
    return out


def bad_graphs(folder: Path) -> dict[str, Path]:
    """A malformed file, an unknown func_name and a Matmul whose contraction dims disagree."""
    folder.mkdir(parents=True, exist_ok=True)
    malformed = folder / "a_malformed.json"
    malformed.write_text('{"name": "broken", "ops": [}')
    document = json.loads((GRAPHS / "attention_tiles.json").read_text())
    unknown = json.loads(json.dumps(document))
    unknown["name"] = "unknown-kernel"
    unknown["ops"][1]["func_name"] = "FlashAttention"
    (folder / "b_unknown.json").write_text(json.dumps(unknown))
    impossible = json.loads(json.dumps(document))
    impossible["name"] = "impossible"
    impossible["tensors"]["k"]["shape"] = [30, 40]
    (folder / "c_impossible.json").write_text(json.dumps(impossible))
    return {"malformed": malformed, "unknown": folder / "b_unknown.json", "impossible": folder / "c_impossible.json"}


# -- compile --------------------------------------------------------------------------------------
def test_compile_json_keys_and_values(tmp_path: Path) -> None:
    result, report = compile_json(GRAPHS / "mlp_repeated.json", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert {"passes", "kernels", "cache_hits", "cache_misses", "traces", "seconds", "failed", "artifacts"} <= set(
        report
    )
    assert report["passes"] == 1 and report["compiled"] == 1
    assert (report["kernels"], report["cache_misses"], report["cache_hits"], report["traces"]) == (7, 3, 4, 3)
    assert report["failed"] == [] and report["seconds"] > 0
    assert report["artifacts"] == [str(tmp_path / "mlp-repeated.nkibb")]
    assert load_artifact(report["artifacts"][0]).graph == "mlp-repeated"
    assert result.stderr == ""


def test_compile_directory_is_one_pass_per_file_with_a_fresh_cache(tmp_path: Path) -> None:
    folder = tmp_path / "graphs"
    folder.mkdir()
    for name in GOOD:
        shutil.copy(GRAPHS / name, folder / name)
    shutil.copy(GRAPHS / "mlp_repeated.json", folder / "z_again.json")
    (folder / "notes.txt").write_text("not a graph")
    (folder / "z_again.json").write_text((GRAPHS / "mlp_repeated.json").read_text().replace("mlp-repeated", "again"))
    result, report = compile_json(folder, "--out", tmp_path / "out", "--tier", "off")
    assert result.exit_code == 0, result.output
    assert report["passes"] == 4
    assert [Path(g["file"]).name for g in report["graphs"]] == [*GOOD, "z_again.json"]  # sorted
    for graph in report["graphs"][:3]:
        misses, hits, artifact = EXPECTED[Path(graph["file"]).name]
        traced = graph["traces"]  # by the pass, or by a trace task for it (2 workers)
        assert (graph["cache_misses"], graph["cache_hits"], traced) == (misses, hits, misses)
        assert Path(graph["artifact"]).name == artifact
    # The same graph again, in another pass: everything is traced again (the cache died with the pass).
    assert (report["graphs"][3]["cache_misses"], report["graphs"][3]["cache_hits"]) == (3, 4)
    assert report["cache_misses"] == 3 + 2 + 3 + 3 and report["cache_hits"] == 2 + 1 + 4 + 4
    assert report["kernels"] == report["cache_hits"] + report["cache_misses"]
    assert report["traces"] == report["cache_misses"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "again.nkibb",
        "attention-tiles.nkibb",
        "bf16-norm.nkibb",
        "mlp-repeated.nkibb",
    ]


def test_compile_with_the_default_tier_traces_each_variant_once_across_passes(tmp_path: Path) -> None:
    """The same graphs as above with the default (local) tier: later passes get what earlier ones traced."""
    folder = tmp_path / "graphs"
    folder.mkdir()
    for name in GOOD:
        shutil.copy(GRAPHS / name, folder / name)
    (folder / "z_again.json").write_text((GRAPHS / "mlp_repeated.json").read_text().replace("mlp-repeated", "again"))
    result, report = compile_json(folder, "--out", tmp_path / "out", "--workers", "1")
    assert result.exit_code == 0, result.output
    # Local counts keep the specification's meaning; the tier turns repeated misses into remote hits.
    assert report["cache_misses"] == 3 + 2 + 3 + 3 and report["cache_hits"] == 2 + 1 + 4 + 4
    assert report["remote_hits"] + report["traces"] == report["cache_misses"]
    again = report["graphs"][3]
    assert (again["remote_hits"], again["traces"]) == (3, 0)
    _, second = compile_json(folder, "--out", tmp_path / "out2", "--workers", "2")
    assert second["traces"] == 0 and second["remote_hits"] == second["cache_misses"]


def test_compile_text_summary(tmp_path: Path) -> None:
    result = invoke("compile", GRAPHS / "attention_tiles.json", "--out", tmp_path)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].startswith(
        f"[1/1] {GRAPHS / 'attention_tiles.json'} -> {tmp_path / 'attention-tiles.nkibb'}: Trn2, "
    )
    assert "5 kernels, 2 in-pass hits, 0 remote hits, 3 traces" in lines[0]
    assert lines[1].startswith("1 pass (1 compiled, 0 failed): 5 kernels, 2 in-pass hits, 0 remote hits, 3 traces; "
                               "shared-cache hit rate 0% (0 of 3 tier lookups), in-pass hit rate 40%; ")  # fmt: skip


def test_compile_failures_are_one_line_each_and_others_still_compile(tmp_path: Path) -> None:
    bad = bad_graphs(tmp_path / "bad")
    out = tmp_path / "out"
    args = [GRAPHS / "attention_tiles.json", bad["malformed"], bad["unknown"], GRAPHS / "bf16_norm.json"]
    result, report = compile_json(*args, bad["impossible"], "--out", out)
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 3
    malformed, unknown, impossible = lines
    assert malformed.startswith(f"nkicache: error: {bad['malformed']}: not valid JSON")
    assert unknown.startswith(f"nkicache: error: {bad['unknown']}: op 1 (FlashAttention): ")
    assert "no internal kernel is registered for func_name 'FlashAttention'" in unknown
    assert impossible.startswith(f"nkicache: error: {bad['impossible']}: op 0 (Matmul): ")
    assert "contraction mismatch" in impossible
    assert "Traceback" not in result.output
    assert [f["file"] for f in report["failed"]] == [str(bad[k]) for k in ("malformed", "unknown", "impossible")]
    assert report["passes"] == 5 and report["compiled"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["attention-tiles.nkibb", "bf16-norm.nkibb"]
    assert report["artifacts"] == [str(out / "attention-tiles.nkibb"), str(out / "bf16-norm.nkibb")]


def test_compile_text_mode_failure_exit_code(tmp_path: Path) -> None:
    bad = bad_graphs(tmp_path / "bad")
    result = invoke("compile", bad["unknown"], GRAPHS / "bf16_norm.json", "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert len(result.stderr.splitlines()) == 1
    assert "1 failed" in result.stdout and (tmp_path / "out" / "bf16-norm.nkibb").exists()


def test_compile_internal_error_in_one_pass_spares_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bridge.codegen import BirCodeGenLoop

    real_run = BirCodeGenLoop.run

    def run(self, graph):
        if graph.name == "bf16-norm":
            raise RuntimeError("boom")
        return real_run(self, graph)

    monkeypatch.setattr(BirCodeGenLoop, "run", run)
    result, report = compile_json(GRAPHS, "--out", tmp_path, "--workers", "1")  # in this process
    assert result.exit_code == 1
    assert result.stderr == (
        f"nkicache: error: {GRAPHS / 'bf16_norm.json'}: internal error (a bug, please report): RuntimeError: boom\n"
    )
    assert report["compiled"] == 2


def test_compile_json_never_prints_a_nan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts that hold a NaN (a store that handed the loop a NaN compile time, say) make `compile --json` a
    clear error naming the number, never a document with NaN in it, which is not JSON."""
    from bridge.codegen import BirCodeGenLoop

    real_summary = BirCodeGenLoop.pass_summary

    def pass_summary(self):
        return {**real_summary(self), "tier_saved_seconds": float("nan")}

    monkeypatch.setattr(BirCodeGenLoop, "pass_summary", pass_summary)
    result = invoke("compile", "--json", GRAPHS / "bf16_norm.json", "--out", tmp_path, "--workers", "1")
    assert "NaN" not in result.stdout
    assert result.exit_code == 2
    assert result.stderr == "nkicache: error: cannot print JSON: $.tier_saved_seconds is not a finite number\n"
    assert (tmp_path / "bf16-norm.nkibb").exists()  # the compile itself went through


def test_compile_missing_file_and_empty_directory(tmp_path: Path) -> None:
    result, report = compile_json(tmp_path / "absent.json", GRAPHS / "bf16_norm.json", "--out", tmp_path / "o")
    assert result.exit_code == 1
    assert "absent.json: cannot read graph file" in result.stderr
    assert report["compiled"] == 1
    (tmp_path / "empty").mkdir()
    result = invoke("compile", tmp_path / "empty", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "no .json graph files" in result.output


def test_compile_same_graph_name_twice_is_refused_not_overwritten(tmp_path: Path) -> None:
    copy = tmp_path / "copy.json"
    shutil.copy(GRAPHS / "bf16_norm.json", copy)
    result, report = compile_json(GRAPHS / "bf16_norm.json", copy, "--out", tmp_path / "o")
    assert result.exit_code == 1
    assert report["failed"][0]["file"] == str(copy) and "already compiled" in report["failed"][0]["error"]


def test_compile_target_option_overrides_the_graphs(tmp_path: Path) -> None:
    result, report = compile_json(GRAPHS / "bf16_norm.json", GRAPHS / "mlp_repeated.json", "--out", tmp_path)
    assert [g["target"] for g in report["graphs"]] == ["Trn1", "Trn2"]  # as the files say
    result, report = compile_json(
        GRAPHS / "bf16_norm.json", GRAPHS / "mlp_repeated.json", "--out", tmp_path, "--target", "Trn1"
    )
    assert result.exit_code == 0
    assert [g["target"] for g in report["graphs"]] == ["Trn1", "Trn1"]
    assert load_artifact(tmp_path / "mlp-repeated.nkibb").target == "Trn1"
    assert invoke("compile", GRAPHS, "--target", "Trn7").exit_code == 2


def test_compile_default_out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("compile", GRAPHS / "bf16_norm.json")
    assert result.exit_code == 0
    assert (tmp_path / "out" / "bf16-norm.nkibb").exists()


@pytest.mark.parametrize("command", ["compile", "run"])
def test_help_explains(command: str) -> None:
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "--json" in result.output and "exit code" in result.output.lower()


# -- run ------------------------------------------------------------------------------------------
def test_run_check_passes_on_compiled_artifacts(compiled: Path) -> None:
    result = invoke("run", compiled, "--check", "--json", "--seed", "3")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["checked"] is True and report["failed"] == []
    assert [Path(a["file"]).name for a in report["artifacts"]] == sorted(e[2] for e in EXPECTED.values())
    kernels = [i for a in report["artifacts"] for i in a["instructions"] if i["func_name"]]
    assert len(kernels) == 5 + 3 + 7
    assert all(i["ok"] is True and i["max_abs_err"] < 1e-3 for i in kernels)


def test_run_is_seeded(compiled: Path) -> None:
    def digests(seed: str) -> list:
        result = invoke("run", compiled / "mlp-repeated.nkibb", "--json", "--seed", seed)
        assert result.exit_code == 0
        return [a["outputs"] for a in json.loads(result.stdout)["artifacts"]]

    assert digests("5") == digests("5")
    assert digests("5") != digests("6")


def test_run_text_output(compiled: Path) -> None:
    result = invoke("run", compiled / "attention-tiles.nkibb", "--check")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{compiled / 'attention-tiles.nkibb'}: attention-tiles (Trn2), 5 instructions")
    assert lines[0].endswith("-> OK")
    assert lines[1:] == ["1 artifact run, 5 kernel outputs checked against numpy references: all OK"]
    verbose = invoke("run", compiled / "attention-tiles.nkibb", "--check", "-v").stdout.splitlines()
    assert verbose[1].startswith("  [0] Matmul matmul_tiled: max abs err ") and verbose[1].endswith(" ok")
    assert len(verbose) == 1 + 5 + 1


def test_run_check_on_a_folder_is_a_line_per_artifact_and_a_summary(compiled: Path) -> None:
    lines = invoke("run", compiled, "--check").stdout.splitlines()
    assert len(lines) == len(EXPECTED) + 1
    assert lines[-1] == "3 artifacts run, 15 kernel outputs checked against numpy references: all OK"


def test_run_truncated_artifact_is_a_clear_error(compiled: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.nkibb"
    data = (compiled / "mlp-repeated.nkibb").read_bytes()
    broken.write_bytes(data[: len(data) // 3])
    result = invoke("run", broken, compiled / "bf16-norm.nkibb", "--check", "--json")
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"nkicache: error: {broken}: not a valid .nkibb artifact: file is truncated or corrupt")
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["failed"][0]["file"] == str(broken)
    assert report["artifacts"][0]["ok"] is True  # the good one still ran


def test_run_check_mismatch_exits_1(compiled: Path, tmp_path: Path) -> None:
    from bridge.artifact import write_artifact

    artifact = load_artifact(compiled / "mlp-repeated.nkibb")
    artifact.kernels[3].attrs = {"eps": 10.0}  # not what the binary was compiled for
    path = write_artifact(artifact, tmp_path)
    result = invoke("run", path, "--check")
    assert result.exit_code == 1
    assert "MISMATCH" in result.stdout and result.stdout.splitlines()[0].endswith("-> FAILED")
    assert result.stdout.splitlines()[-1].endswith(": 1 MISMATCHED in 1 artifact")
    assert sum(line.split()[-1] == "ok" for line in result.stdout.splitlines()) == 0  # only the mismatch listed
    assert invoke("run", path).exit_code == 0  # without --check nothing is compared


def test_run_no_artifacts_is_a_usage_error(tmp_path: Path) -> None:
    result = invoke("run", tmp_path)
    assert result.exit_code == 2 and "no .nkibb files" in result.output


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0?foo=1", "redis://", "redis://127.0.0.1:6379/0?ssl_cert_reqs=x"]
)
def test_a_bad_tier_url_is_one_line_and_exit_2_before_any_graph_is_compiled(tmp_path: Path, url: str) -> None:
    graph = tmp_path / "g.json"
    graph.write_text(json.dumps({"name": "g", "tensors": {}, "ops": []}))
    result = invoke("compile", graph, "--out", tmp_path / "out", "--tier", url)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("nkicache: error: command line: tier ")
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_a_deeply_nested_graph_fails_alone_and_the_others_compile(tmp_path: Path) -> None:
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    (graphs / "a-deep.json").write_text('{"name": "deep", "tensors": {}, "ops": ' + "[" * 1500 + "]" * 1500 + "}")
    (graphs / "b-good.json").write_text(json.dumps({"name": "good", "tensors": {}, "ops": []}))
    for workers in ("1", "2"):
        result = invoke("compile", graphs, "--out", tmp_path / f"out{workers}", "--workers", workers, "--json")
        assert result.exit_code == 1, result.output
        answer = json.loads(result.stdout)
        assert (answer["passes"], answer["failed"][0]["file"]) == (2, str(graphs / "a-deep.json"))
        assert "nested deeper than 32 levels" in answer["failed"][0]["error"]
        assert (tmp_path / f"out{workers}" / "good.nkibb").exists()


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_artifacts_are_written_with_the_umask_like_any_output(tmp_path: Path, umask: int, mode: int) -> None:
    graph = tmp_path / "g.json"
    graph.write_text(json.dumps({"name": "g", "tensors": {}, "ops": []}))
    command = [sys.executable, "-c", "from workers.cli import main; main()", "compile", str(graph), "--out",
               str(tmp_path / "out"), "--tier", "off"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, preexec_fn=lambda: os.umask(umask), check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "g.nkibb").stat().st_mode & 0o777 == mode


def test_on_a_terminal_the_per_graph_lines_stay_when_the_progress_bar_goes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from workers.cli_common import Progress

    class Terminal:
        def isatty(self) -> bool:
            return True

        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Terminal())
    progress = Progress(2, "compiling", quiet=False)
    assert progress._bar is not None  # the terminal path: a rich progress bar
    progress.advance("a.json -> out/a.nkibb: Trn2, 5 kernels")
    progress.advance("b.json -> out/b.nkibb: Trn2, 3 kernels")
    progress.close()
    out = capsys.readouterr().out
    assert "[1/2] a.json -> out/a.nkibb: Trn2, 5 kernels" in out
    assert "[2/2] b.json -> out/b.nkibb: Trn2, 3 kernels" in out
