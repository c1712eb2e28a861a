"""Start-up loads only what a command needs: each check runs in a fresh interpreter and reads its sys.modules.

A warm compile's whole process is what a user feels (`nkicache bench`: version_ms, warm_compile_*_vs_floor);
these tests hold the reason it can be fast: no numpy or ml_dtypes unless a value is computed, no cryptography
or PyNaCl, nor the key and trust-policy code (cachestore.trust), unless a key or a policy is configured, no
redis-py unless a Redis tier is, no obstore unless an S3 one is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers_graphs import kernel_op, mixed_graph, tensor, write_graph

HEAVY = ("numpy", "ml_dtypes", "cryptography", "nacl", "redis", "rich", "matplotlib", "prometheus_client", "obstore",
         "cachestore.trust")  # fmt: skip


def loaded_after(
    code: str, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> tuple[set[str], str]:
    """(the HEAVY modules loaded, by top-level or full name, and stdout) after running `code` in a new
    interpreter."""
    names = "({m.split('.')[0] for m in sys.modules} | set(sys.modules))"
    probe = f"{code}\nimport sys\nprint('LOADED', *sorted({names} & {set(HEAVY)}))"
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=cwd,
                          env=env or os.environ, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    head, _, loaded = done.stdout.rpartition("LOADED")
    return set(loaded.split()), head


def compile_in_fresh_process(
    graph: Path, tier: str, out: Path, env: dict[str, str] | None = None
) -> tuple[set[str], dict]:
    code = (
        "import sys\nfrom workers.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n    assert not exc.code, exc.code"
    )
    loaded, printed = loaded_after(code, "compile", str(graph), "--tier", tier, "--out", str(out), "--json", env=env)
    return loaded, json.loads(printed)


def test_the_storage_contract_and_the_command_line_load_nothing_heavy() -> None:
    loaded, _ = loaded_after("import cachestore.api, cachestore.settings, workers.cli, bridge")
    assert loaded == set()


def test_version_loads_neither_the_compiler_nor_the_storage_side() -> None:
    code = "from workers.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass"
    loaded, printed = loaded_after(code)
    assert loaded == set() and "toolchain" in printed


def test_a_warm_compile_on_the_local_tier_loads_no_numpy_crypto_or_redis(tmp_path: Path) -> None:
    graph = write_graph(tmp_path, mixed_graph("startup-warm"))
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    cold_loaded, cold = compile_in_fresh_process(graph, tier, tmp_path / "cold")
    assert cold["traces"] > 0 and "numpy" in cold_loaded  # a trace validates its binary on the executor
    warm_loaded, warm = compile_in_fresh_process(graph, tier, tmp_path / "warm")
    assert warm["traces"] == 0 and warm["remote_hits"] == cold["traces"]
    assert warm_loaded == set()
    assert (tmp_path / "warm" / "startup-warm.nkibb").read_bytes() == (
        tmp_path / "cold" / "startup-warm.nkibb"
    ).read_bytes()


def test_with_a_writer_key_and_a_trust_policy_a_fresh_process_signs_and_verifies(tmp_path: Path) -> None:
    from cachestore.trust import write_writer_key

    key = write_writer_key(tmp_path / "ci.key", "ci")
    policy = tmp_path / "trust.toml"
    policy.write_text(key.policy_entry("ci"))
    env = {**os.environ, "NKICACHE_WRITER_KEY_FILE": str(tmp_path / "ci.key"), "NKICACHE_TRUST_POLICY": str(policy)}
    graph = write_graph(tmp_path, mixed_graph("startup-signed"))
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    _, cold = compile_in_fresh_process(graph, tier, tmp_path / "cold", env)
    loaded, warm = compile_in_fresh_process(graph, tier, tmp_path / "warm", env)
    # Every hit verified by the policy, which rejects an entry without a trusted writer's signature.
    assert warm["traces"] == 0 and warm["remote_hits"] == cold["traces"] > 0 and warm["tier_rejected"] == 0
    assert {"cachestore.trust", "nacl"} <= loaded


def test_no_compile_loads_ml_dtypes_and_a_bfloat16_one_runs_and_checks_with_it(tmp_path: Path) -> None:
    """ml_dtypes takes 0.6-0.8 s to import: a trace validates its binary by loading it, which needs no bfloat16
    array; running it does."""
    float32 = write_graph(tmp_path, mixed_graph("startup-float32"))
    loaded, result = compile_in_fresh_process(float32, "off", tmp_path / "out")
    assert result["traces"] > 0 and "ml_dtypes" not in loaded
    bfloat16 = write_graph(tmp_path, {
        "name": "startup-bfloat16",
        "tensors": {"x": tensor((129, 200), "bfloat16"), "y": tensor((129, 200), "bfloat16")},
        "ops": [kernel_op("Softmax", ["x"], ["y"])],
    })  # fmt: skip
    loaded, result = compile_in_fresh_process(bfloat16, "off", tmp_path / "out")
    assert result["failed"] == [] and result["traces"] > 0 and "ml_dtypes" not in loaded
    code = (
        "import sys\nfrom workers.cli import main\n"
        "try:\n    main(['run', '--check', '--json', sys.argv[1]])\nexcept SystemExit as exc:\n    assert not exc.code"
    )
    loaded, printed = loaded_after(code, str(tmp_path / "out" / "startup-bfloat16.nkibb"))
    checked = json.loads(printed)
    assert "ml_dtypes" in loaded
    assert checked["ok"] is True and checked["checked"] is True and checked["failed"] == []
    assert [i["ok"] for i in checked["artifacts"][0]["instructions"]] == [True]
