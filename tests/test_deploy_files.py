"""Checks for the deployment files that cannot run here (no container engine, no cluster, no systemd as PID 1):
they parse, carry the fields that matter, agree with each other and name commands that exist. What can run
here does: the Redis configurations boot a real redis-server, the compose healthcheck runs against one, and
`nkicache queue --live-check` answers for a worker heartbeat present, stale or absent.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml
from click.testing import CliRunner
from helpers_graphs import delete_namespace, unique_namespace
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_cluster import start_server, unavailable
from test_acl import PASSWORDS, redis_conf_text, start_acl_server

from bench.dev_redis import pings
from cachestore.keys import KeySpace
from cachestore.settings import load_settings
from workers.cli import main as nkicache

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SECRET_WORDS = ("PASSWORD", "HMAC", "SECRET", "TOKEN")


# -- reading the files ----------------------------------------------------------------------------------
def kubernetes_objects() -> dict[tuple[str, str], dict]:
    objects = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def redis_conf(text: str) -> dict[str, str]:
    """A redis.conf as {directive: value} (the last one wins, as in Redis)."""
    directives = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition(" ")
            directives[name.lower()] = value.strip().strip('"')
    return directives


def dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), split into stages at each FROM."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def dockerfile_user() -> str:
    users = [line.split(None, 1)[1] for line in dockerfile_stages()[-1] if line.upper().startswith("USER ")]
    assert users, "the final stage has no USER"
    return users[-1]


def systemd_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            sections[section] = []
        else:
            key, _, value = line.partition("=")
            sections[section].append((key.strip(), value.strip()))
    return sections


def env_of(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


# -- Kubernetes ------------------------------------------------------------------------------------------
def test_kubernetes_yaml_parses_into_the_expected_objects() -> None:
    assert set(kubernetes_objects()) == {
        ("ConfigMap", "nkicache-config"), ("Secret", "nkicache-secrets"), ("Secret", "nkicache-reader"),
        ("Deployment", "nkicache-worker"),
        ("Deployment", "nkicache-metrics"), ("ConfigMap", "nkicache-redis"), ("Service", "nkicache-redis"),
        ("StatefulSet", "nkicache-redis"), ("Job", "nkicache-warm"),
    }  # fmt: skip


def mounted_file(pod: dict, container: dict, path: str) -> tuple[dict, str]:
    """(the pod volume holding `path`, the file's name in it), through the container's volume mounts."""
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            return volume, path[len(prefix) :]
    raise AssertionError(f"{path} is in no mounted volume of {container['name']}")


@pytest.mark.parametrize("name", ["nkicache-worker", "nkicache-metrics"])
def test_kubernetes_deployments_run_as_non_root_with_secrets_as_files(name: str) -> None:
    objects = kubernetes_objects()
    pod = objects[("Deployment", name)]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == dockerfile_user() != "0"  # the image's own user
    (container,) = pod["containers"]
    assert container["image"].startswith("nkicache:")
    env = env_of(container)
    # The workers' credentials and the readers' are two Secrets.
    secret_keys = {
        name: set(objects[("Secret", name)]["stringData"]) for name in ("nkicache-secrets", "nkicache-reader")
    }
    config_keys = set(objects[("ConfigMap", "nkicache-config")]["data"])
    for variable, item in env.items():
        if any(word in variable for word in SECRET_WORDS):
            # A secret travels as a file in the Secret's volume, never as a value in the pod spec.
            assert variable.endswith("_FILE") and "valueFrom" not in item, variable
            volume, file_name = mounted_file(pod, container, item["value"])
            name = volume["secret"]["secretName"]
            assert name in secret_keys and file_name in secret_keys[name], variable
    assert {"NKICACHE_REDIS_PASSWORD_FILE", "NKICACHE_TIER", "NKICACHE_CONFIG"} <= set(env)
    volume, file_name = mounted_file(pod, container, env["NKICACHE_CONFIG"]["value"])
    assert volume["configMap"]["name"] == "nkicache-config" and file_name in config_keys
    tier = env["NKICACHE_TIER"]["value"]
    assert re.fullmatch(r"redis://nkicache-(worker|reader)@nkicache-redis:6379/0", tier), tier  # no password
    assert tier.split("@")[1].split(":")[0] == objects[("Service", "nkicache-redis")]["metadata"]["name"]
    assert not any(word.lower() in " ".join(container.get("args", [])).lower() for word in SECRET_WORDS)


def test_kubernetes_worker_deployment_fits_sigterm_and_probes_heartbeats() -> None:
    objects = kubernetes_objects()
    pod = objects[("Deployment", "nkicache-worker")]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 60
    (container,) = pod["containers"]
    assert container["args"][0] == "worker" and "worker" in nkicache.list_commands(None)
    assert "NKICACHE_HMAC_KEY_FILE" in env_of(container)  # workers sign what they store
    probe = container["livenessProbe"]
    assert probe["exec"]["command"] == ["nkicache", "queue", "--live-check"]
    # The probe looks for the heartbeat of the worker named after the pod.
    assert env_of(container)["NKICACHE_WORKER"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    settings = tomllib.loads(objects[("ConfigMap", "nkicache-config")]["data"]["config.toml"])
    # A heartbeat is fresh for 3 intervals; the probe must be allowed to see at least one.
    assert 3 * settings["heartbeat_interval"] <= probe["periodSeconds"] * probe.get("failureThreshold", 3)
    assert probe["timeoutSeconds"] >= 2 * settings["connect_timeout"]


def test_kubernetes_configmap_keys_are_settings(tmp_path: Path) -> None:
    text = kubernetes_objects()[("ConfigMap", "nkicache-config")]["data"]["config.toml"]
    path = tmp_path / "config.toml"
    path.write_text(text)
    settings = load_settings(environ={"NKICACHE_CONFIG": str(path)})  # unknown or mistyped keys raise
    for name, value in tomllib.loads(text).items():
        assert getattr(settings, name) == value, name


def test_kubernetes_redis_statefulset_keeps_its_data_on_a_claim() -> None:
    objects = kubernetes_objects()
    statefulset = objects[("StatefulSet", "nkicache-redis")]
    spec = statefulset["spec"]
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    assert spec["serviceName"] == "nkicache-redis"
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] == pod_labels
    assert objects[("Service", "nkicache-redis")]["spec"]["selector"] == pod_labels
    (container,) = spec["template"]["spec"]["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    conf = redis_conf(objects[("ConfigMap", "nkicache-redis")]["data"]["redis.conf"])
    assert mounts[conf["dir"]] == claim["metadata"]["name"]  # AOF files on the claim
    assert conf["appendonly"] == "yes" and conf["maxmemory-policy"] == "volatile-ttl"
    acl_volume = next(v for v in spec["template"]["spec"]["volumes"] if v["name"] == mounts[conf["aclfile"]])
    assert "secret" in acl_volume  # the ACL file holds password hashes: a Secret, not a ConfigMap


# -- the Redis configurations boot a real server ----------------------------------------------------------
@pytest.fixture
def redis_confs() -> dict[str, str]:
    return {
        "deploy/redis/redis.conf": (DEPLOY / "redis" / "redis.conf").read_text(),
        "kubernetes/redis.yaml": kubernetes_objects()[("ConfigMap", "nkicache-redis")]["data"]["redis.conf"],
    }


@pytest.mark.redis
@pytest.mark.parametrize("source", ["deploy/redis/redis.conf", "kubernetes/redis.yaml"])
def test_redis_conf_boots_with_the_acl_users(source: str, redis_confs: dict, tmp_path: Path) -> None:
    text = redis_confs[source]
    conf = redis_conf(text)
    assert conf["maxmemory-policy"] == "volatile-ttl" and conf["appendonly"] == "yes" and conf["save"] == ""
    try:
        server = start_acl_server(tmp_path, text)
    except RuntimeError as exc:
        unavailable(str(exc))
        raise AssertionError("unreachable") from exc
    try:
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.AuthenticationError):  # `default` is off
            anonymous.ping()
        anonymous.close()
    finally:
        server.cleanup()


# -- compose ---------------------------------------------------------------------------------------------
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


def test_compose_file_is_valid(tmp_path: Path) -> None:
    document = compose()
    assert set(document["services"]) == {"redis", "worker", "metrics"}
    if docker_compose_available():  # the client validates without an engine
        result = subprocess.run(["docker", "compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert result.returncode == 0, result.stderr
    # Without the compose plugin (as here), the structure is checked below either way.
    redis_service = document["services"]["redis"]
    conf_mount = next(v for v in redis_service["volumes"] if v.startswith("./redis/redis.conf:"))
    conf_path = conf_mount.split(":")[1]
    assert redis_service["command"] == ["redis-server", conf_path]
    conf = redis_conf((DEPLOY / "redis" / "redis.conf").read_text())
    targets = {v.split(":")[1]: v.split(":")[0] for v in redis_service["volumes"]}
    assert targets[conf["aclfile"]] == "./redis/users.acl"
    assert targets[conf["dir"]] in document["volumes"]  # AOF on a named volume
    assert conf["appendonly"] == "yes"
    for local in ("./redis/redis.conf", "./redis/users.acl"):
        assert (DEPLOY / local).is_file()


@pytest.mark.parametrize("service", ["worker", "metrics"])
def test_compose_services_take_secrets_as_files(service: str) -> None:
    document = compose()
    spec = document["services"][service]
    assert spec["image"].startswith("nkicache:")
    assert spec["command"][0] in nkicache.list_commands(None) or spec["command"][0] == "serve-metrics"
    for variable, value in spec["environment"].items():
        if any(word in variable for word in SECRET_WORDS):
            assert variable.endswith("_FILE"), variable
            secret = value.removeprefix("/run/secrets/")
            assert secret in spec["secrets"] and secret in document["secrets"], variable
    assert "@" in spec["environment"]["NKICACHE_TIER"] and ":" not in spec["environment"]["NKICACHE_TIER"].split(
        "@")[0].removeprefix("redis://")  # fmt: skip
    assert spec["depends_on"]["redis"]["condition"] == "service_healthy"
    if service == "worker":
        assert int(spec["stop_grace_period"].rstrip("s")) >= 60


def test_compose_healthcheck_keeps_the_password_off_the_command_line() -> None:
    test = compose()["services"]["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    assert not re.search(r"(--pass|-a)\s", test[1]), test


@pytest.mark.redis
def test_compose_healthcheck_passes_only_with_the_right_password(tmp_path: Path) -> None:
    """The healthcheck's shell command, run against a real server with the deployed ACL users (the secret file
    and the port are this test's)."""
    try:
        server = start_acl_server(tmp_path)
    except RuntimeError as exc:
        unavailable(str(exc))
        raise AssertionError("unreachable") from exc
    command = compose()["services"]["redis"]["healthcheck"]["test"][1].replace("$$", "$")
    secret = tmp_path / "reader_password"
    command = command.replace("/run/secrets/reader_password", str(secret))
    command = command.replace("redis-cli ", f"redis-cli -p {server.port} ", 1)
    try:
        for password, healthy in ((PASSWORDS["nkicache-reader"], True), ("wrong", False)):
            secret.write_text(password + "\n")
            result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30)
            assert (result.returncode == 0) is healthy, (password, result.stdout, result.stderr)
    finally:
        server.cleanup()


# -- systemd ---------------------------------------------------------------------------------------------
UNIT = DEPLOY / "systemd" / "nkicache-worker@.service"


def exec_start() -> list[str]:
    (value,) = [v for k, v in systemd_unit(UNIT)["Service"] if k == "ExecStart"]
    return shlex.split(value)


def test_systemd_unit_starts_a_worker_command_that_exists() -> None:
    argv = exec_start()
    assert Path(argv[0]).name == "nkicache" and argv[1] == "worker"
    result = CliRunner().invoke(nkicache, ["worker", "--help"])
    assert result.exit_code == 0, result.output
    worker_options = {opt for p in nkicache.get_command(None, "worker").params for opt in getattr(p, "opts", [])}
    assert {arg for arg in argv[2:] if arg.startswith("--")} <= worker_options
    service = dict(systemd_unit(UNIT)["Service"])
    assert service["KillSignal"] == "SIGTERM" and int(service["TimeoutStopSec"]) >= 60
    assert service["User"] != "root"
    for key, value in systemd_unit(UNIT)["Service"]:
        if key == "Environment":
            assert not any(word in value.split("=")[0] for word in SECRET_WORDS) or "_FILE=" in value, value


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    executable = Path(sys.executable).parent / "nkicache"
    if not executable.exists():
        pytest.skip("the nkicache console script is not next to this Python")
    # The unit as installed, with ExecStart pointing at this checkout's nkicache (systemd checks it exists).
    text = UNIT.read_text().replace(exec_start()[0], str(executable))
    instance = tmp_path / "nkicache-worker@1.service"
    instance.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(instance)], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    problems = [line for line in result.stderr.splitlines() if instance.name in line]
    assert problems == [], problems


# -- the Dockerfile ----------------------------------------------------------------------------------------
def test_dockerfile_final_stage_is_non_root_without_compilers() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2
    final = " ".join(stages[-1]).lower()
    for compiler in ("build-essential", "gcc", "g++", "clang", "make "):
        assert compiler not in final, compiler
    assert dockerfile_user() not in ("root", "0")
    assert "copy --from=build" in final and "pip install --no-cache-dir --no-index" in final
    assert '["nkicache"]' in final  # ENTRYPOINT
    assert "build-essential" in " ".join(stages[0]).lower()  # compilers stay in the build stage
    for line in stages[0]:
        if line.upper().startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source


def test_dockerfile_image_has_no_matplotlib() -> None:
    """Workers and serve-metrics never draw plots: the image installs nkicache without extras, and nkicache's own
    dependencies leave matplotlib (with pillow, fonttools, kiwisolver) to the html extra."""
    stages = dockerfile_stages()
    (wheel,) = [shlex.split(line) for line in stages[0] if "pip wheel" in line]
    assert wheel[-1] == "."  # the project itself, no `.[extra]`
    (install,) = [shlex.split(line.split("&&")[0]) for line in stages[-1] if "pip install" in line]
    assert install[-1] == "nkicache"
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in dependencies if d.lower().startswith("matplotlib")], dependencies


def test_deploy_files_name_nkicache_commands_that_exist() -> None:
    named = {exec_start()[1], *(c[0] for c in (compose()["services"][s]["command"] for s in ("worker", "metrics")))}
    for (kind, _), document in kubernetes_objects().items():
        if kind == "Deployment":
            named.add(document["spec"]["template"]["spec"]["containers"][0]["args"][0])
    assert named <= set(nkicache.list_commands(None)), named - set(nkicache.list_commands(None))


# -- cross references: what each deployment reads is defined, documented or installed ---------------------------
README = DEPLOY / "README.md"
WORKER_CREDENTIALS = ("NKICACHE_REDIS_PASSWORD_FILE", "NKICACHE_HMAC_KEY_FILE")


def readme_code() -> list[list[str]]:
    """The shell commands of deploy/README.md's fenced code blocks, each as argv (continuations joined,
    comments dropped); blocks indented under a list item count too."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"^[ \t]*```[a-z]*\n(.*?)^[ \t]*```", text, re.M | re.S):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:1] == ["sudo"]:
                argv = argv[1:]
            if argv:
                commands.append(argv)
    return commands


def readme_script(*needles: str) -> str:
    """The one fenced sh block of deploy/README.md that contains every needle, as text."""
    blocks = re.findall(r"^```sh\n(.*?)^```", README.read_text(), re.M | re.S)
    (block,) = [b for b in blocks if all(needle in b for needle in needles)]
    return block


def documented_objects() -> dict[tuple[str, str], dict]:
    """{(kind, name): {"keys": set, "files": [path]}} for every `kubectl create secret generic` and `kubectl
    create configmap` command in deploy/README.md, with the keys the object gets and the files it reads."""
    documented = {}
    for argv in readme_code():
        if argv[:2] != ["kubectl", "create"] or argv[2] not in ("secret", "configmap"):
            continue
        kind, rest = ("Secret", argv[4:]) if argv[2] == "secret" else ("ConfigMap", argv[3:])
        assert kind == "ConfigMap" or argv[3] == "generic", argv
        keys, files = set(), []
        name = rest[0]
        for option in rest[1:]:
            flag, _, value = option.partition("=")
            if flag == "--from-file":
                key, _, path = value.rpartition("=")
                keys.add(key or Path(path).name)
                files.append(path)
            elif flag == "--from-literal":
                keys.add(value.split("=", 1)[0])
        documented[(kind, name)] = {"keys": keys, "files": files, "argv": argv}
    return documented


def defined_keys(kind: str, name: str) -> set[str] | None:
    """The keys of a Secret or ConfigMap that a manifest defines or deploy/README.md creates; None if neither."""
    document = kubernetes_objects().get((kind, name))
    if document is not None:
        return {*document.get("data", {}), *document.get("stringData", {}), *document.get("binaryData", {})}
    created = documented_objects().get((kind, name))
    return None if created is None else created["keys"]


def pod_specs() -> dict[str, dict]:
    """{"Kind/name": pod spec} for every workload in deploy/kubernetes."""
    specs = {}
    for (kind, name), document in kubernetes_objects().items():
        if kind == "CronJob":
            specs[f"{kind}/{name}"] = document["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif kind in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
            specs[f"{kind}/{name}"] = document["spec"]["template"]["spec"]
    return specs


def pod_references(pod: dict) -> set[tuple[str, str, str | None]]:
    """(kind, name, key) of every Secret and ConfigMap the pod reads: volumes (key None = every key, unless
    every mount of the volume takes one subPath), projected sources, env and envFrom, image pull secrets."""
    containers = pod.get("containers", []) + pod.get("initContainers", [])
    mounts = [mount for container in containers for mount in container.get("volumeMounts", [])]
    found: set[tuple[str, str, str | None]] = set()
    for volume in pod.get("volumes", []):
        sources = [volume, *volume.get("projected", {}).get("sources", [])]
        for source in sources:
            for kind, field in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if field not in source:
                    continue
                reference = source[field]
                name = reference.get("secretName") or reference["name"]
                if "items" in reference:
                    keys: list[str | None] = [item["key"] for item in reference["items"]]
                else:
                    sub_paths = [m.get("subPath") for m in mounts if m["name"] == volume["name"]]
                    keys = [None] if None in sub_paths or not sub_paths else sub_paths
                found.update((kind, name, key) for key in keys)
    for container in containers:
        for item in container.get("env", []):
            for kind, field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if field in item.get("valueFrom", {}):
                    found.add((kind, item["valueFrom"][field]["name"], item["valueFrom"][field]["key"]))
        for item in container.get("envFrom", []):
            for kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                if field in item:
                    found.add((kind, item[field]["name"], None))
    found.update(("Secret", item["name"], None) for item in pod.get("imagePullSecrets", []))
    return found


def test_kubernetes_pods_read_only_secrets_and_configmaps_that_are_defined_or_documented() -> None:
    """A pod that mounts a Secret nobody creates waits in ContainerCreating forever: every Secret and ConfigMap a
    pod reads is a manifest here, or deploy/README.md has the `kubectl create` command that makes it, from files
    that exist, with the keys the pod takes."""
    documented = documented_objects()
    for (kind, name), created in documented.items():
        for path in created["files"]:
            assert (ROOT / path).is_file(), f"{kind} {name}: {path} is not in the repository"
    checked = set()
    for pod_name, pod in pod_specs().items():
        for kind, name, key in pod_references(pod):
            keys = defined_keys(kind, name)
            assert keys is not None, f"{pod_name} reads {kind} {name}, which no manifest defines nor README creates"
            assert key is None or key in keys, f"{pod_name} reads key {key} of {kind} {name}, which has {keys}"
            checked.add((kind, name))
    assert ("Secret", "nkicache-redis-acl") in checked  # the Redis ACL file: created from deploy/redis/users.acl
    assert documented[("Secret", "nkicache-redis-acl")]["files"] == ["deploy/redis/users.acl"]
    if shutil.which("kubectl") is not None:  # the client makes the object without a cluster
        for (kind, name), created in documented.items():
            result = subprocess.run([*created["argv"], "--dry-run=client", "-o", "json"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=60)  # fmt: skip
            assert result.returncode == 0, result.stderr
            made = json.loads(result.stdout)
            assert (made["kind"], made["metadata"]["name"]) == (kind, name)
            assert set(made["data"]) == created["keys"]


def acl_users(path: Path) -> set[str]:
    return {line.split()[1] for line in path.read_text().splitlines() if line.startswith("user ")}


def secret_key_behind(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in the container."""
    volume, file_name = mounted_file(pod, container, path)
    reference = volume["secret"]
    keys = {item["path"]: item["key"] for item in reference.get("items", [])} or {file_name: file_name}
    return reference["secretName"], keys[file_name]


def readable_secret_keys(pod: dict) -> set[tuple[str, str]]:
    readable = set()
    for kind, name, key in pod_references(pod):
        if kind == "Secret":
            readable.update((name, k) for k in ([key] if key else sorted(defined_keys(kind, name) or ())))
    return readable


def tier_user(url: str) -> str:
    return url.split("://", 1)[1].split("@", 1)[0]


def test_reader_pods_get_only_reader_credentials() -> None:
    """`serve-metrics` reads as nkicache-reader: it mounts that user's password and no key of the worker's (with
    the worker's password or the HMAC key, a metrics pod could write or sign entries that workers trust). Every
    nkicache pod can read exactly the secret keys its environment names."""
    pods = {}
    for pod_name, pod in pod_specs().items():
        (container,) = pod["containers"]
        env = env_of(container)
        if "NKICACHE_TIER" in env:
            pods[pod_name] = (pod, container, env, tier_user(env["NKICACHE_TIER"]["value"]))
    assert {user for *_, user in pods.values()} == {"nkicache-worker", "nkicache-reader"}
    assert acl_users(DEPLOY / "redis" / "users.acl") >= {"nkicache-worker", "nkicache-reader"}
    worker_keys = {secret_key_behind(pod, container, env[variable]["value"])
                   for pod, container, env, user in pods.values() if user == "nkicache-worker"
                   for variable in WORKER_CREDENTIALS}  # fmt: skip
    assert len(worker_keys) == 2
    for pod_name, (pod, container, env, user) in pods.items():
        named = {secret_key_behind(pod, container, item["value"]) for variable, item in env.items()
                 if variable.endswith("_FILE") and any(word in variable for word in SECRET_WORDS)}  # fmt: skip
        readable = readable_secret_keys(pod)
        assert readable == named, f"{pod_name} can read {sorted(readable)}; its environment names {sorted(named)}"
        if user == "nkicache-reader":
            assert not named & worker_keys, pod_name
            # Not even in the Secret it mounts: a reader's Secret holds no worker credential at all.
            assert not {secret for secret, _ in readable} & {secret for secret, _ in worker_keys}, pod_name
            assert "NKICACHE_HMAC_KEY_FILE" not in env and "NKICACHE_HMAC_KEY" not in env, pod_name
            assert named == {secret_key_behind(pod, container, env["NKICACHE_REDIS_PASSWORD_FILE"]["value"])}
    # The same split in compose: a reader service (and the Redis healthcheck, which pings as the reader) gets
    # only the reader's password.
    document = compose()
    for name, spec in document["services"].items():
        if tier_user(spec.get("environment", {}).get("NKICACHE_TIER", "redis://nkicache-reader@")) == "nkicache-reader":
            assert set(spec.get("secrets", [])) <= {"reader_password"}, name


def test_compose_does_not_publish_redis_on_a_fixed_host_port() -> None:
    """127.0.0.1:6379 on the host clashes with a Redis already running there: Redis is not published, or only on
    a loopback port Docker picks. The healthcheck runs inside the container, so it needs no published port."""
    redis_service = compose()["services"]["redis"]
    for port in redis_service.get("ports", []):
        if isinstance(port, dict):
            host_ip, published = port.get("host_ip"), port.get("published")
        else:
            parts = str(port).split(":")
            assert len(parts) == 3, f"{port}: name the loopback address"
            host_ip, published = parts[0], parts[1]
        assert host_ip == "127.0.0.1" and not published, port
    assert redis_service["healthcheck"]["test"][0] == "CMD-SHELL"


@pytest.mark.redis  # the script is checked against a redis-server of its own
def test_readme_secrets_script_fills_the_acl_file_and_the_secret(tmp_path: Path) -> None:
    """The script of deploy/README.md, run on copies: random secrets in deploy/secrets/ (0600), their hashes in
    users.acl, their values in worker.yaml's Secret; a second run changes nothing; Redis boots with the ACL file
    and each user logs in with its password."""
    (tmp_path / "deploy" / "redis").mkdir(parents=True)
    (tmp_path / "deploy" / "kubernetes").mkdir()
    for name in ("redis/users.acl", "kubernetes/worker.yaml"):
        shutil.copy(DEPLOY / name, tmp_path / "deploy" / name)
    script = readme_script("deploy/secrets", "sha256sum")

    def run() -> dict[str, str]:
        result = subprocess.run(["sh", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return {p.name: p.read_text() for p in (tmp_path / "deploy").rglob("*") if p.is_file()}

    first = run()
    secrets = {name: (tmp_path / "deploy" / "secrets" / name) for name in ("worker_password", "reader_password",
                                                                          "hmac_key")}  # fmt: skip
    for path in secrets.values():
        assert re.fullmatch(r"[0-9a-f]{64}", path.read_text()) and path.stat().st_mode & 0o077 == 0, path
    assert len({path.read_text() for path in secrets.values()}) == 3
    assert run() == first  # kept, not made again
    acl = (tmp_path / "deploy" / "redis" / "users.acl").read_text()
    assert "#" + "0" * 64 not in acl
    untrusted = tmp_path / "deploy" / "secrets" / "untrusted_password"
    assert re.fullmatch(r"[0-9a-f]{64}", untrusted.read_text()) and untrusted.read_text() not in acl
    for user in ("worker", "reader", "untrusted"):
        password = secrets[f"{user}_password"] if user in ("worker", "reader") else untrusted
        digest = hashlib.sha256(password.read_bytes()).hexdigest()
        (line,) = [line for line in acl.splitlines() if line.startswith(f"user nkicache-{user} ")]
        assert line.split()[3] == "#" + digest
    documents = list(yaml.safe_load_all((tmp_path / "deploy" / "kubernetes" / "worker.yaml").read_text()))
    filled = {key: value for d in documents if d["kind"] == "Secret" for key, value in d["stringData"].items()}
    assert filled == {name: path.read_text() for name, path in secrets.items()}
    original = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "worker.yaml").read_text()) if d]
    assert [d for d in documents if d["kind"] != "Secret"] == [d for d in original if d["kind"] != "Secret"]

    acl_path = tmp_path / "server" / "users.acl"
    acl_path.parent.mkdir()
    acl_path.write_text(acl)
    conf_path = tmp_path / "server" / "redis.conf"
    conf_path.write_text(redis_conf_text(acl_path, acl_path.parent))
    passwords = {f"nkicache-{user}": secrets[f"{user}_password"].read_text() for user in ("worker", "reader")}

    def client(port: int, user: str, password: str) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, username=user, password=password, socket_timeout=2,
                           socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))  # fmt: skip

    def worker_answers(port: int) -> bool:
        return pings(client(port, "nkicache-worker", passwords["nkicache-worker"]))

    try:
        server = start_server([str(conf_path), "--port", "{port}"], worker_answers)
    except RuntimeError as exc:
        unavailable(str(exc))
        raise AssertionError("unreachable") from exc
    try:
        for user, password in passwords.items():
            connection = client(server.port, user, password)
            assert connection.ping()
            connection.close()
            with pytest.raises(redis.AuthenticationError):
                client(server.port, user, "change-me").ping()
    finally:
        server.cleanup()


def test_deploy_readme_says_how_the_image_reaches_a_cluster(tmp_path: Path) -> None:
    """Every deployment runs the image the Dockerfile's build command tags; deploy/README.md builds, tags and
    pushes it to a registry, and its command for the image fields moves both Deployments to the pushed image."""
    deployments = {name: d["spec"]["template"]["spec"]["containers"] for (kind, name), d in
                   kubernetes_objects().items() if kind == "Deployment"}  # fmt: skip
    images = {c["image"] for containers in deployments.values() for c in containers}
    images |= {compose()["services"][s]["image"] for s in ("worker", "metrics")}
    (image,) = images
    build_comment = shlex.split((DEPLOY / "Dockerfile").read_text().split("docker build", 1)[1].splitlines()[0])
    assert build_comment[build_comment.index("-t") + 1] == image
    commands = readme_code()
    builds = [argv for argv in commands if argv[:2] == ["docker", "build"]]
    assert any(argv[argv.index("-t") + 1] == image and argv[argv.index("-f") + 1] == "deploy/Dockerfile"
               for argv in builds), builds  # fmt: skip
    (tag,) = [argv for argv in commands if argv[:2] == ["docker", "tag"]]
    assert tag[2] == image and tag[3].endswith("/" + image)
    pushed = tag[3]
    assert ["docker", "push", pushed] in commands
    (rewrite,) = [argv for argv in commands if argv[0] == "sed" and "deploy/kubernetes/worker.yaml" in argv
                  and "image:" in " ".join(argv)]  # fmt: skip
    copy = tmp_path / "worker.yaml"
    shutil.copy(DEPLOY / "kubernetes" / "worker.yaml", copy)
    result = subprocess.run([*rewrite[:-1], str(copy)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for document in yaml.safe_load_all(copy.read_text()):
        if document["kind"] == "Deployment":
            assert [c["image"] for c in document["spec"]["template"]["spec"]["containers"]] == [pushed]
    for argv in commands:  # `kubectl set image deployment/NAME CONTAINER=IMAGE` names real ones
        if argv[:3] == ["kubectl", "set", "image"]:
            container, _, new_image = argv[4].partition("=")
            assert container in {c["name"] for c in deployments[argv[3].removeprefix("deployment/")]}
            assert new_image == pushed


def documented_installs() -> dict[str, str]:
    """{destination: source} of every `install` command in deploy/README.md; a directory made with -d maps to
    ""."""
    installed = {}
    for argv in readme_code():
        if argv[0] != "install":
            continue
        args, directory, rest = [], False, iter(argv[1:])
        for arg in rest:
            if arg in ("-m", "-g", "-o"):
                next(rest)
            elif arg == "-d":
                directory = True
            else:
                args.append(arg)
        if directory:
            installed.update(dict.fromkeys(args, ""))
            continue
        *sources, destination = args
        for source in sources:
            installed[destination + Path(source).name if destination.endswith("/") else destination] = source
    return installed


def test_systemd_unit_is_self_contained() -> None:
    """Everything the unit needs exists after deploy/README.md's install steps: its user (systemd-sysusers, from
    a file shipped here), a state directory systemd makes (StateDirectory=, the worker's home and working
    directory), the venv of ExecStart, and each file it reads, installed from a file in the repository (the
    settings load; the environment file names the worker user and secret files only)."""
    service = systemd_unit(UNIT)["Service"]
    values = dict(service)
    assert values.get("StateDirectory"), "no StateDirectory=: nothing creates the worker's writable directory"
    state = f"/var/lib/{values['StateDirectory'].split()[0]}"
    dynamic = values.get("DynamicUser", "no").lower() in ("yes", "true", "on", "1")
    assert dynamic or values.get("User"), "neither User= nor DynamicUser="
    environment = dict(item.split("=", 1) for k, v in service if k == "Environment" for item in shlex.split(v))
    assert values.get("WorkingDirectory", state) == state and environment.get("HOME", state) == state
    installs, commands = documented_installs(), readme_code()
    for source in installs.values():
        assert not source or (ROOT / source).is_file() or source.startswith("deploy/secrets/"), source
    assert installs[f"/etc/systemd/system/{UNIT.name}"] == f"deploy/systemd/{UNIT.name}"
    if not dynamic:
        # A fixed user must exist before the first start: systemd-sysusers makes it from the file shipped here.
        (sysusers,) = [source for destination, source in installs.items() if destination.startswith("/etc/sysusers.d/")]
        users = {fields[1]: fields for line in (ROOT / sysusers).read_text().splitlines()
                 if (fields := shlex.split(line, comments=True))[:1] == ["u"]}  # fmt: skip
        assert values["User"] in users and values.get("Group", values["User"]) == values["User"]  # `u` makes both
        assert users[values["User"]][4] == state  # home
        assert ["systemd-sysusers"] in commands
    venv = str(Path(exec_start()[0]).parents[1])
    assert ["python3", "-m", "venv", venv] in commands
    assert any(argv[:2] == [f"{venv}/bin/pip", "install"] for argv in commands)
    config = installs[environment["NKICACHE_CONFIG"]]
    settings = load_settings(environ={"NKICACHE_CONFIG": str(ROOT / config)})  # unknown or mistyped keys raise
    assert settings.namespace == "nkicache"  # the namespace users.acl grants
    env_file = installs[values["EnvironmentFile"].lstrip("-")]
    variables = dict(line.split("=", 1) for line in (ROOT / env_file).read_text().splitlines()
                     if line.strip() and not line.startswith("#"))  # fmt: skip
    assert tier_user(variables["NKICACHE_TIER"]) == "nkicache-worker"  # no password in the URL either
    secrets_script = readme_script("deploy/secrets", "sha256sum")
    for variable, value in variables.items():
        if any(word in variable for word in SECRET_WORDS):
            assert variable.endswith("_FILE"), variable
            source = installs[value]
            assert source.startswith("deploy/secrets/") and Path(source).name in secrets_script, (variable, source)


# -- the liveness probe against a real Redis ----------------------------------------------------------------
@pytest.fixture
def fleet_env(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, KeySpace]]:
    namespace = unique_namespace()
    monkeypatch.setenv("NKICACHE_TIER", redis_url)
    monkeypatch.setenv("NKICACHE_NAMESPACE", namespace)
    monkeypatch.setenv("NKICACHE_WORKER", "nkicache-worker-7d9f-abcde")  # the pod name, as Kubernetes sets it
    yield redis_url, KeySpace(namespace)
    client = redis.Redis.from_url(redis_url)
    delete_namespace(client, namespace)
    client.close()


def probe() -> int:
    command = kubernetes_objects()[("Deployment", "nkicache-worker")]["spec"]["template"]["spec"]["containers"][0]
    argv = command["livenessProbe"]["exec"]["command"]
    return CliRunner().invoke(nkicache, argv[1:]).exit_code


def beat(url: str, keys: KeySpace, name: str, age: float) -> None:
    client = redis.Redis.from_url(url)
    try:
        record = {"time": time.time() - age, "host": "h", "pid": 1, "job": None, "done": 0}
        client.hset(keys.worker_heartbeats, name, json.dumps(record))
    finally:
        client.close()


def test_live_check_follows_the_worker_heartbeat(fleet_env: tuple[str, KeySpace]) -> None:
    from workers.fleet import Worker

    url, keys = fleet_env
    assert probe() == 1  # no heartbeat at all
    worker = Worker(load_settings(), "nkicache-worker-7d9f-abcde")
    try:
        worker._heartbeat()  # what a running worker writes
        assert probe() == 0
    finally:
        worker.client.hdel(keys.worker_heartbeats, worker.name)
    assert probe() == 1  # gone (a worker that exits removes its heartbeat)
    beat(url, keys, "nkicache-worker-7d9f-abcde", age=60)
    assert probe() == 1  # stale: the worker hung
    beat(url, keys, "nkicache-worker-7d9f-abcde-1", age=0)
    assert probe() == 0  # `worker --concurrency N` names its processes POD-i
    beat(url, keys, "nkicache-worker-other-pod", age=0)
    beat(url, keys, "nkicache-worker-7d9f-abcde-1", age=60)
    assert probe() == 1  # another pod's heartbeat does not keep this one alive


def test_the_warm_job_runs_nkicache_warm_as_a_writer_and_the_readme_says_when() -> None:
    job = kubernetes_objects()[("Job", "nkicache-warm")]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][0] == "warm" and pod["restartPolicy"] == "Never"
    env = env_of(container)
    assert env["NKICACHE_TIER"]["value"].startswith("redis://nkicache-worker@")  # it stores entries
    assert {"NKICACHE_REDIS_PASSWORD_FILE", "NKICACHE_HMAC_KEY_FILE"} <= set(env)
    readme = (DEPLOY / "README.md").read_text()
    assert "## Upgrading the compiler" in readme and "warm-job.yaml" in readme and "--other-toolchains" in readme
