"""The one settings object. Sources, later winning: defaults < config file < NKICACHE_* environment < flags.

The config file is TOML: $NKICACHE_CONFIG, else ./nkicache.toml, else ~/.config/nkicache/config.toml, with
the field names below as keys. Secrets (the HMAC key, the Redis password) come only from the environment
or from files named there, never from flags, so they never show in `ps`.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from bridge.errors import NkiCacheError
from bridge.limits import Limits
from cachestore.entry import MAX_ENTRY_BYTES
from cachestore.keys import (
    DEFAULT_JOB_SHARDS,
    DEFAULT_METRICS_SHARDS,
    MAX_JOB_SHARDS,
    MAX_METRICS_SHARDS,
    QUARANTINE_SCOPE,
)
from cachestore.tier_urls import redact_url, tier_levels, tier_path, tier_url_problem

# read-through: ask the tier before tracing and write what was traced; mirror: write only; read-only: ask,
# never write (no entries, leases, TTL refreshes nor metrics: for clients whose credentials cannot write).
TIER_MODES = ("read-through", "mirror", "read-only", "off")
DAY = 24 * 3600
SCOPE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_SECONDS = 10 * 365 * DAY
SECONDS_SETTINGS = (
    "connect_timeout",
    "op_timeout",
    "entry_ttl",
    "failure_ttl",
    "lease_ttl",
    "lease_wait",
    "breaker_cooldown",
    "flush_interval",
    "final_flush_timeout",
    "job_claim_idle",
    "heartbeat_interval",
    "job_timeout",
    "job_ttl",
    "wait_timeout",
)


class SettingsError(NkiCacheError):
    """A setting has a bad value; the message names the setting and where it came from."""


def _host_name() -> str:
    """This machine's name, as gethostname(2) gives it (uname's nodename is the same name, without loading the
    socket module for it)."""
    return os.uname().nodename


def default_tier_url() -> str:
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return f"local:{Path(cache_home) / 'nkicache' / 'tier.sqlite'}"


class Settings(msgspec.Struct, frozen=True):
    tier: str = msgspec.field(default_factory=default_tier_url)  # URL, local:PATH or off
    tier_mode: str = "read-through"  # read-through | mirror | read-only | off
    namespace: str = "nkicache"  # prefix of every Redis key
    connect_timeout: float = 0.5  # seconds to open a connection to the tier
    op_timeout: float = 1.0  # seconds for one tier operation
    entry_ttl: int = 30 * DAY  # seconds a binary entry lives unused; refreshed on every use
    # Larger entries, stored or decompressed, are neither read nor written (8 MiB: 100 times the default workload's
    # largest binary, cachestore.entry.MAX_ENTRY_BYTES); raise it for kernels with larger binaries.
    max_entry_bytes: int = MAX_ENTRY_BYTES
    # Seconds a kernel that failed to compile is remembered (a negative entry): every pass that meets it before then
    # fails at once with the same message instead of compiling it again; retry_failed (--retry-failed) traces it.
    failure_ttl: int = 600
    retry_failed: bool = False
    single_flight: bool = True  # one worker traces a key that several miss at once
    lease_ttl: float = 6.0  # seconds a trace lease lives unless renewed (its holder renews it every third of that)
    lease_wait: float = 30.0  # seconds a worker waits for another's trace before tracing itself
    breaker_cooldown: float = 5.0  # seconds the tier is left alone after a failure
    flush_interval: float = 0.2  # seconds between background mirror flushes
    final_flush_timeout: float = 2.0  # seconds flush() and close() wait for the outbox to drain (a pass does not)
    outbox_limit: int = 10_000  # queued mirror writes kept during an outage; older ones are dropped, counted
    job_claim_idle: float = 60.0  # seconds a job's worker may be silent (dead) before another reclaims the job
    job_max_attempts: int = 3  # failed attempts before a job goes to the dead-letter stream
    # Dead-lettered jobs kept per job shard, the oldest trimmed: each holds its graph, and a flood of bad jobs must
    # not fill Redis (their results, with the error, stay for job_ttl).
    dead_letter_limit: int = 10_000
    heartbeat_interval: float = 2.0  # seconds between worker heartbeats; 3 missed = not live
    require_signed: bool = True  # with an HMAC key: reject unsigned entries
    reject_unverifiable: bool = False  # without an HMAC key: reject signed entries (cannot verify)
    host: str = msgspec.field(default_factory=_host_name)
    # The metrics' worker label: stable, so local runs add to one series per host instead of one per process
    # (a pid would make a new Prometheus series every run). Fleet workers are named by `worker --name`.
    worker: str = "local"
    # Shards of the fleet metrics in Redis, each in its own slot (a cluster spreads them over its nodes). Used
    # once, when a namespace's first batch is applied; the namespace keeps that count from then on.
    metrics_shards: int = DEFAULT_METRICS_SHARDS
    # Secrets: environment or files only.
    hmac_key: bytes | None = None
    redis_password: str | None = None
    # Bounds on one graph's work (bridge.limits), locally and in the fleet; a job's own bounds in the fleet.
    max_graph_bytes: int = 16 * 1024 * 1024  # a graph file (and so a job's graph) larger than this is refused
    max_tensor_elements: int = 2**27  # elements of one tensor (512 MiB of float32)
    max_graph_elements: int = 2**29  # elements of all of a graph's tensors together
    max_kernel_instructions: int = 1_000_000  # instructions one traced kernel may emit
    job_timeout: float = 600.0  # seconds one fleet job may compile before its compiling process is killed
    job_memory: int = 4 * 1024**3  # bytes of address space a job's compiling process may use (RLIMIT_AS)
    job_ttl: int = 7 * DAY  # seconds a job's result, artifact and batch are kept after it finishes
    wait_timeout: float = 3600.0  # seconds `submit --wait` waits unless --timeout says otherwise
    # The local tier's file, in bytes: past it the least valuable entries (cachestore.value) are deleted as entries
    # are written, and the space goes back to the file system (ccache's default cap is 5 GB).
    max_size: int = 5 * 1024**3
    # Shards of the fleet's job queue, each in its own slot (a cluster spreads them over its nodes). Used once,
    # when a namespace's first job is submitted or its first worker starts; the namespace keeps that count.
    job_shards: int = DEFAULT_JOB_SHARDS
    # Per-writer signatures (issue 22, cachestore.trust). The writer's Ed25519 private key (`nkicache keygen`):
    # every entry it stores is signed with it. The trust policy: a TOML file of the writers whose entries this
    # client accepts; set, an entry without a trusted writer's signature is rejected.
    writer_key_file: str = ""
    trust_policy: str = ""
    # Where this client reads and writes entries: auto (the trusted scope when its writer key is one its trust
    # policy lists, when it only reads, or when neither key nor policy is set; else a scope of its own key),
    # trusted, or a name of letters, digits, '.', '_' and '-' (an untrusted scope, shared by whoever names it).
    scope: str = "auto"
    # The share of the trusted entries in use that `nkicache sentinel` traces again and compares (0: none).
    sentinel_rate: float = 0.0

    def __repr__(self) -> str:
        shown = (
            f"{name}={'<secret>' if name in SECRET_SETTINGS else repr(getattr(self, name))}"
            for name in self.__struct_fields__
        )
        return f"Settings({', '.join(shown)})"

    def replace(self, **changes: Any) -> Settings:
        return msgspec.structs.replace(self, **changes)

    @property
    def read_only(self) -> bool:
        """Whether this client never writes to the tier: the one place tier_mode read-only is asked. The compile
        path answers it with cachestore.read_only.ReadOnlyTier; commands that must write refuse to run."""
        return self.tier_mode == "read-only"

    def limits(self) -> Limits:
        """The bounds on one graph's work, as the compiler side takes them."""
        return Limits(**{name: getattr(self, name) for name in Limits.__struct_fields__})


_SECRETS = {"hmac_key", "redis_password"}
SECRET_SETTINGS = frozenset(_SECRETS)  # never printed: `nkicache config` masks them


def load_settings(overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Build the settings from every source; `overrides` are the command-line flags (None = not given)."""
    return load_settings_with_sources(overrides, environ)[0]


def load_settings_with_sources(
    overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[Settings, dict[str, str]]:
    """The settings and, for each one not left at its default, where its value came from: the config file's
    path, `$NKICACHE_NAME` or `command line` (`nkicache config` shows them)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # setting -> where its value came from, for error messages
    config_path = _config_path(environ)
    if config_path is not None:
        from_file = _from_file(config_path)
        values.update(from_file)
        sources.update(dict.fromkeys(from_file, str(config_path)))
    for name, (value, source) in _from_environment(environ).items():
        values[name] = value
        sources[name] = source
    for name, value in (overrides or {}).items():
        if value is None or value == ():  # () is a repeatable flag (--tier) not given
            continue
        if name in _SECRETS:
            raise SettingsError(f"{name} belongs in the environment (NKICACHE_{name.upper()}), not on the command line")
        values[name] = _coerce(name, value, "command line")
        sources[name] = "command line"
    settings = Settings(**values)
    _validate(settings, sources)
    return settings, sources


def config_candidates(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Where a config file is looked for, in order; the first that exists is read ($NKICACHE_CONFIG, when set,
    is the only one)."""
    environ = os.environ if environ is None else environ
    if environ.get("NKICACHE_CONFIG"):
        return [Path(environ["NKICACHE_CONFIG"])]
    return [Path("nkicache.toml"), Path.home() / ".config" / "nkicache" / "config.toml"]


def config_file(environ: Mapping[str, str] | None = None) -> Path | None:
    """The config file the settings are read from, or None when there is none."""
    return _config_path(os.environ if environ is None else environ)


def _config_path(environ: Mapping[str, str]) -> Path | None:
    if environ.get("NKICACHE_CONFIG"):
        return Path(environ["NKICACHE_CONFIG"])
    return next((candidate for candidate in config_candidates(environ) if candidate.is_file()), None)


def _from_file(path: Path) -> dict[str, Any]:
    import tomllib  # only a process that has a config file parses TOML

    try:
        # Read as bytes and decoded here: read_text() would raise a UnicodeDecodeError (no OSError, and a
        # traceback) for a file that is not UTF-8, and would decode with the locale's encoding, not TOML's.
        document = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: config file is not UTF-8 text (TOML is): byte {exc.start} is invalid") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    document = {key.replace("-", "_"): value for key, value in document.items()}
    secrets = _SECRETS & set(document)
    if secrets:
        raise SettingsError(f"{path}: {sorted(secrets)[0]} belongs in the environment, not in a config file")
    return {key: _coerce(key, value, str(path)) for key, value in document.items()}


def _from_environment(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """{setting: (value, source)} from the NKICACHE_* variables."""
    values: dict[str, tuple[Any, str]] = {}
    for setting in Settings.__struct_fields__:
        name = "NKICACHE_" + setting.upper()
        secret_source = f"${name}" if environ.get(name) else f"${name}_FILE"  # where a secret was read
        if setting == "hmac_key":
            key = _hmac_key(environ, name)
            if key is not None:
                values[setting] = (key, secret_source)
        elif setting in _SECRETS:
            secret = _secret(environ, name)
            if secret is not None:
                values[setting] = (secret, secret_source)
        elif environ.get(name):
            values[setting] = (_coerce(setting, environ[name], f"${name}"), f"${name}")
    return values


def _hmac_key(environ: Mapping[str, str], name: str) -> bytes | None:
    """The HMAC key as bytes. A key is bytes to HMAC, and a random one (`head -c32 /dev/urandom`) is binary:
    a key file that is UTF-8 text is read as text (surrounding whitespace, such as the newline `echo` adds,
    is not part of the key), any other is the key's raw bytes, whole. A variable holding bytes that are not
    UTF-8 reaches Python with them escaped (surrogateescape): os.fsencode gives the bytes back."""
    if environ.get(name):
        return os.fsencode(environ[name])
    data = _secret_file(environ, name)
    if data is None:
        return None
    try:
        key = data.decode("utf-8").strip().encode()
    except UnicodeDecodeError:
        key = data
    if not key:  # an empty key would sign every entry with a secret anyone knows
        raise SettingsError(f"${name}_FILE: {environ[name + '_FILE']} holds no key (it is empty or only whitespace)")
    return key


def _secret(environ: Mapping[str, str], name: str) -> str | None:
    """A text secret (the Redis password: redis-py sends it as UTF-8 text)."""
    if environ.get(name):
        try:
            environ[name].encode("utf-8")  # bytes that are not UTF-8 come escaped, and fail at the first AUTH
        except UnicodeEncodeError:
            raise SettingsError(f"${name} is not UTF-8 text") from None
        return environ[name]
    data = _secret_file(environ, name)
    if data is None:
        return None
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise SettingsError(f"${name}_FILE: {environ[name + '_FILE']} is not UTF-8 text") from None


def _secret_file(environ: Mapping[str, str], name: str) -> bytes | None:
    """The bytes of the file $NAME_FILE names, or None when it names none."""
    file_name = environ.get(name + "_FILE")
    if not file_name:
        return None
    try:
        return Path(file_name).read_bytes()
    except OSError as exc:
        raise SettingsError(f"${name}_FILE: cannot read {file_name}: {exc.strerror or exc}") from None


@functools.cache
def _setting_fields() -> dict[str, msgspec.structs.FieldInfo]:
    return {field.name: field for field in msgspec.structs.fields(Settings)}


def _coerce(name: str, value: Any, source: str) -> Any:
    fields = _setting_fields()
    if name not in fields:
        raise SettingsError(f"{source}: unknown setting {name!r}")
    if name == "tier" and isinstance(value, list | tuple):
        value = _tier_stack(value, source)
    if name == "tier" and isinstance(value, str) and len(tier_levels(value)) > 1:
        value = " ".join(tier_levels(value))  # one space between levels, however they were separated
    default = fields[name].default
    kind = type(default) if default is not msgspec.NODEFAULT else str
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            lowered = str(value).strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(value)
            return lowered in ("1", "true", "yes", "on")
        coerced = kind(value)
    except (TypeError, ValueError):
        what = {int: "a whole number", float: "a number"}.get(kind, f"a {kind.__name__}")
        raise SettingsError(f"{source}: {name} must be {what}, got {value!r}") from None
    if isinstance(coerced, str) and tier_path(coerced) is None:  # a path may be any bytes
        try:
            # Bytes that are not UTF-8 reach Python escaped (in the environment and on the command line alike):
            # a host, worker or namespace, or a Redis URL, holding them would fail every write to the tier.
            coerced.encode("utf-8")
        except UnicodeEncodeError:
            raise SettingsError(f"{source}: {name} is not UTF-8 text") from None
    return coerced


def _tier_stack(levels: list | tuple, source: str) -> str:
    """A stack of tier levels (a list in the config file, --tier repeated), nearest first, as the one string
    the setting holds: the levels separated by spaces, as NKICACHE_TIER takes them (tier_urls.tier_levels)."""
    if not levels or not all(isinstance(level, str) and level.strip() for level in levels):
        raise SettingsError(f"{source}: tier must be a URL or a list of URLs (nearest first), got {levels!r}")
    for level in levels:  # each one, so that an unknown scheme is not read as part of a local path before it
        problem = tier_url_problem(level.strip())
        if problem:
            raise SettingsError(f"{source}: tier level {redact_url(level.strip())!r} {problem}")
    return " ".join(level.strip() for level in levels)


# Settings whose positive values can still be too small to work: name -> (the least value, why).
MINIMUMS = {
    "lease_ttl": (0.1, "seconds; its holder renews it every third of that, in a round trip to the tier"),
    "heartbeat_interval": (0.01, "seconds between a worker's heartbeats, each a round trip to Redis"),
    "job_memory": (256 * 1024**2, "bytes; a compiling process needs more address space to import the compiler"),
}


def _validate(settings: Settings, sources: Mapping[str, str]) -> None:
    def fail(name: str, problem: str) -> None:
        raise SettingsError(f"{sources.get(name, 'default')}: {name} {problem}")

    problem = tier_url_problem(settings.tier)
    if problem:
        fail("tier", f"{redact_url(settings.tier)!r}: {problem}")
    for name in settings.__struct_fields__:
        value = getattr(settings, name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(name, f"must be a finite number, got {value}")
    if settings.tier_mode not in TIER_MODES:
        fail("tier_mode", f"must be one of {', '.join(TIER_MODES)}, got {settings.tier_mode!r}")
    for name in (
        "connect_timeout",
        "op_timeout",
        "lease_ttl",
        "lease_wait",
        "breaker_cooldown",
        "flush_interval",
        "job_claim_idle",
        "job_max_attempts",
        "dead_letter_limit",
        "heartbeat_interval",
        "entry_ttl",
        "failure_ttl",
        "max_entry_bytes",
        "outbox_limit",
        "max_graph_bytes",
        "max_tensor_elements",
        "max_graph_elements",
        "max_kernel_instructions",
        "job_timeout",
        "job_memory",
        "job_ttl",
        "wait_timeout",
        "max_size",
    ):
        if getattr(settings, name) <= 0:
            fail(name, f"must be positive, got {getattr(settings, name)}")
    for name, (least, why) in MINIMUMS.items():
        if getattr(settings, name) < least:
            fail(name, f"must be at least {least:g} ({why}), got {getattr(settings, name):g}")
    for name in SECONDS_SETTINGS:
        if getattr(settings, name) > MAX_SECONDS:  # Redis refuses such an expiry: every write would fail
            fail(name, f"must be at most {MAX_SECONDS} seconds (10 years), got {getattr(settings, name)}")
    if not 1 <= settings.metrics_shards <= MAX_METRICS_SHARDS:
        fail("metrics_shards", f"must be from 1 to {MAX_METRICS_SHARDS}, got {settings.metrics_shards}")
    if not 1 <= settings.job_shards <= MAX_JOB_SHARDS:
        fail("job_shards", f"must be from 1 to {MAX_JOB_SHARDS}, got {settings.job_shards}")
    if settings.final_flush_timeout < 0:
        fail("final_flush_timeout", f"must not be negative, got {settings.final_flush_timeout}")
    if settings.scope not in ("auto", "trusted") and not SCOPE_NAME.fullmatch(settings.scope):
        fail("scope", f"{settings.scope!r} must be auto, trusted or 1-64 letters, digits, '.', '_' or '-'")
    if settings.scope == QUARANTINE_SCOPE:  # what the sentinel took out of service is never served
        fail("scope", f"{QUARANTINE_SCOPE!r} holds the sentinel's quarantined entries; no client reads it")
    if not 0 <= settings.sentinel_rate <= 1:
        fail("sentinel_rate", f"must be from 0 to 1, got {settings.sentinel_rate}")
    if not settings.namespace or any(c in settings.namespace for c in "{}: "):
        fail("namespace", f"{settings.namespace!r} must be non-empty without braces, colons or spaces")
