"""One settings object: defaults < config file < NKICACHE_* environment < command-line flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachestore.settings import Settings, SettingsError, load_settings


@pytest.fixture(autouse=True)
def _no_ambient_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ./nkicache.toml or ~/.config/nkicache/config.toml of the machine may leak into these tests."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def config(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "nkicache.toml"
    path.write_text(text)
    return {"NKICACHE_CONFIG": str(path)}


def test_defaults() -> None:
    settings = load_settings(environ={})
    assert settings.tier.startswith("local:") and settings.tier.endswith("tier.sqlite")
    assert settings.tier_mode == "read-through"
    assert settings.connect_timeout == 0.5 and settings.op_timeout == 1.0
    assert settings.entry_ttl == 30 * 24 * 3600
    assert settings.single_flight is True
    assert settings.hmac_key is None and settings.redis_password is None


def test_precedence_defaults_file_environment_flags(tmp_path: Path) -> None:
    environ = config(
        tmp_path,
        'op_timeout = 2.0\nlease_wait = 10.0\nnamespace = "from-file"\ntier = "redis://file:6379/0"\n'
        "single_flight = false\nentry_ttl = 3600\n",
    )
    from_file = load_settings(environ=environ)
    assert (from_file.op_timeout, from_file.lease_wait, from_file.namespace) == (2.0, 10.0, "from-file")
    assert from_file.single_flight is False and from_file.entry_ttl == 3600
    assert from_file.breaker_cooldown == Settings().breaker_cooldown  # untouched: the default

    environ |= {"NKICACHE_OP_TIMEOUT": "3", "NKICACHE_NAMESPACE": "from-env", "NKICACHE_SINGLE_FLIGHT": "yes"}
    from_env = load_settings(environ=environ)
    assert (from_env.op_timeout, from_env.lease_wait, from_env.namespace) == (3.0, 10.0, "from-env")
    assert from_env.single_flight is True and from_env.tier == "redis://file:6379/0"

    flags = {"op_timeout": 4.0, "namespace": None, "tier": "off", "tier_mode": None}
    from_flags = load_settings(flags, environ=environ)
    assert (from_flags.op_timeout, from_flags.namespace, from_flags.tier) == (4.0, "from-env", "off")
    assert from_flags.lease_wait == 10.0 and from_flags.tier_mode == "read-through"


def test_config_file_from_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "nkicache.toml").write_text('tier_mode = "mirror"\n')
    assert load_settings(environ={}).tier_mode == "mirror"


def test_dashes_in_config_keys(tmp_path: Path) -> None:
    assert load_settings(environ=config(tmp_path, "breaker-cooldown = 0.25\n")).breaker_cooldown == 0.25


def test_empty_environment_values_are_ignored(tmp_path: Path) -> None:
    environ = config(tmp_path, "op_timeout = 2.0\n") | {"NKICACHE_OP_TIMEOUT": ""}
    assert load_settings(environ=environ).op_timeout == 2.0


# -- secrets -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("secret", ["hmac_key", "redis_password", "hmac-key"])
def test_secrets_in_a_config_file_are_refused(tmp_path: Path, secret: str) -> None:
    environ = config(tmp_path, f'{secret} = "s3cret"\n')
    with pytest.raises(SettingsError) as info:
        load_settings(environ=environ)
    message = str(info.value)
    assert "nkicache.toml" in message and secret.replace("-", "_") in message and "environment" in message
    assert "s3cret" not in message


def test_secrets_from_the_environment() -> None:
    settings = load_settings(environ={"NKICACHE_HMAC_KEY": "key-1", "NKICACHE_REDIS_PASSWORD": "pw"})
    assert settings.hmac_key == b"key-1" and settings.redis_password == "pw"
    assert "key-1" not in repr(settings) and "pw" not in repr(settings)


def test_secrets_from_files_named_in_the_environment(tmp_path: Path) -> None:
    (tmp_path / "hmac").write_text("file-key\n")
    (tmp_path / "password").write_text("file-pw\n")
    environ = {
        "NKICACHE_HMAC_KEY_FILE": str(tmp_path / "hmac"),
        "NKICACHE_REDIS_PASSWORD_FILE": str(tmp_path / "password"),
    }
    settings = load_settings(environ=environ)
    assert settings.hmac_key == b"file-key" and settings.redis_password == "file-pw"
    # The variable itself wins over the file.
    assert load_settings(environ=environ | {"NKICACHE_HMAC_KEY": "direct"}).hmac_key == b"direct"


def test_an_unreadable_secret_file_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"NKICACHE_HMAC_KEY_FILE"):
        load_settings(environ={"NKICACHE_HMAC_KEY_FILE": str(tmp_path / "missing")})


@pytest.mark.parametrize("secret", ["hmac_key", "redis_password"])
def test_secrets_are_refused_as_flags(secret: str) -> None:
    with pytest.raises(SettingsError, match=secret):
        load_settings({secret: "on-the-command-line"}, environ={})


# -- bad values name the setting and the source ------------------------------------------------------
@pytest.mark.parametrize(
    ("variable", "value", "setting"),
    [
        ("NKICACHE_OP_TIMEOUT", "fast", "op_timeout"),
        ("NKICACHE_ENTRY_TTL", "30d", "entry_ttl"),
        ("NKICACHE_SINGLE_FLIGHT", "maybe", "single_flight"),
        ("NKICACHE_OUTBOX_LIMIT", "1.5", "outbox_limit"),
        ("NKICACHE_OP_TIMEOUT", "-1", "op_timeout"),
        ("NKICACHE_BREAKER_COOLDOWN", "0", "breaker_cooldown"),
        ("NKICACHE_TIER_MODE", "sideways", "tier_mode"),
        ("NKICACHE_NAMESPACE", "a:b", "namespace"),
    ],
)
def test_bad_environment_values_name_setting_and_variable(variable: str, value: str, setting: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(environ={variable: value})
    assert setting in str(info.value) and f"${variable}" in str(info.value)


@pytest.mark.parametrize(
    ("line", "setting"),
    [
        ('op_timeout = "soon"', "op_timeout"),
        ("lease_ttl = -5", "lease_ttl"),
        ('tier_mode = "both"', "tier_mode"),
        ("single_flight = 3", "single_flight"),
        ('namespace = "has space"', "namespace"),
    ],
)
def test_bad_config_values_name_setting_and_file(tmp_path: Path, line: str, setting: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(environ=config(tmp_path, line + "\n"))
    assert setting in str(info.value) and "nkicache.toml" in str(info.value)


@pytest.mark.parametrize(
    ("flags", "setting"),
    [({"op_timeout": "fast"}, "op_timeout"), ({"tier_mode": "both"}, "tier_mode"), ({"lease_wait": 0}, "lease_wait")],
)
def test_bad_flag_values_name_setting_and_the_command_line(flags: dict, setting: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(flags, environ={})
    assert setting in str(info.value) and "command line" in str(info.value)


def test_flag_values_are_coerced() -> None:
    settings = load_settings({"op_timeout": "2.5", "entry_ttl": "60", "single_flight": "off"}, environ={})
    assert (settings.op_timeout, settings.entry_ttl, settings.single_flight) == (2.5, 60, False)


def test_unknown_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"nkicache\.toml.*'colour'"):
        load_settings(environ=config(tmp_path, 'colour = "blue"\n'))
    with pytest.raises(SettingsError, match="'colour'"):
        load_settings({"colour": "blue"}, environ={})


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"nkicache\.toml.*TOML"):
        load_settings(environ=config(tmp_path, "op_timeout = = 1\n"))


def test_missing_config_file_named_in_the_environment(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"missing\.toml"):
        load_settings(environ={"NKICACHE_CONFIG": str(tmp_path / "missing.toml")})


# -- the tier URL and numbers, checked when read ---------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://127.0.0.1:6379/0?foo=1", "unknown query parameter 'foo'"),
        ("redis://127.0.0.1:6379/0?ssl_cert_reqs=bogus", "ssl_cert_reqs must be one of"),
        ("redis://127.0.0.1:6379?db=zero", "'db' has an invalid value"),
        ("redis://127.0.0.1:6379/abc", "names database 'abc'; a database is a number"),
        ("redis://127.0.0.1:6379/0?db=3", "names its database twice"),
        ("redis://127.0.0.1:6379/0?socket_timeout=60", "use the op_timeout setting"),
        ("redis://", "needs a host"),
        ("rediss://:secret@/0", "needs a host"),
        ("redis://127.0.0.1:99999", "not a valid URL"),
        ("redis+cluster://127.0.0.1:7000,127.0.0.1", "'127.0.0.1' is not host:port"),
        ("unix://", "needs the socket's path"),
        ("local:", "needs a path"),
        ("memcached://127.0.0.1", "is not a tier"),
    ],
)
def test_a_bad_tier_url_is_one_error_naming_its_source(url: str, problem: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(environ={"NKICACHE_TIER": url})
    assert problem in str(info.value) and str(info.value).startswith("$NKICACHE_TIER: tier ")
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379?password=x&db=2&client_name=w1",
        "redis://127.0.0.1:6379/3?client_name=w1",
        "rediss://h:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=true",
        "redis+cluster://u:p@a:7000,b:7001",
        "unix:///run/redis.sock?db=1",
        "local:~/tier.sqlite",
        "off",
    ],
)
def test_good_tier_urls_pass(url: str) -> None:
    assert load_settings({"tier": url}, environ={}).tier == url


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ["op_timeout", "final_flush_timeout", "flush_interval"])
def test_numbers_that_are_not_finite_are_refused(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"{name} must be"):
        load_settings({name: value}, environ={})


@pytest.mark.parametrize("content", [b"", b"  \n"])
def test_an_hmac_key_file_without_a_key_is_refused(tmp_path: Path, content: bytes) -> None:
    key_file = tmp_path / "hmac.key"
    key_file.write_bytes(content)
    with pytest.raises(SettingsError, match=r"\$NKICACHE_HMAC_KEY_FILE: .*hmac.key holds no key"):
        load_settings(environ={"NKICACHE_HMAC_KEY_FILE": str(key_file)})


def test_an_hmac_key_file_is_read_as_text_or_raw_bytes(tmp_path: Path) -> None:
    (tmp_path / "text").write_bytes(b"secret\n")
    (tmp_path / "binary").write_bytes(b"\xff\x00\x10")
    assert load_settings(environ={"NKICACHE_HMAC_KEY_FILE": str(tmp_path / "text")}).hmac_key == b"secret"
    assert load_settings(environ={"NKICACHE_HMAC_KEY_FILE": str(tmp_path / "binary")}).hmac_key == b"\xff\x00\x10"


@pytest.mark.parametrize("name", ["NKICACHE_ENTRY_TTL", "NKICACHE_LEASE_TTL", "NKICACHE_JOB_TTL"])
def test_a_time_beyond_ten_years_is_refused(name: str) -> None:
    with pytest.raises(SettingsError, match=r"must be at most 315360000 seconds"):
        load_settings(environ={name: "1e23" if name == "NKICACHE_LEASE_TTL" else "100000000000"})


@pytest.mark.parametrize(
    ("value", "kind"), [("NKICACHE_ENTRY_TTL", "a whole number"), ("NKICACHE_OP_TIMEOUT", "a number")]
)
def test_a_setting_that_is_no_number_says_what_it_must_be(value: str, kind: str) -> None:
    with pytest.raises(SettingsError, match=f"must be {kind}, got 'soon'"):
        load_settings(environ={value: "soon"})


@pytest.mark.parametrize(
    ("name", "value"),
    [("NKICACHE_LEASE_TTL", "1e-9"), ("NKICACHE_HEARTBEAT_INTERVAL", "1e-300"), ("NKICACHE_JOB_MEMORY", "1")],
)
def test_a_positive_value_too_small_to_work_is_one_error(name: str, value: str) -> None:
    """Issue 45 F16: a lease renewed every third of a nanosecond, a heartbeat every 1e-300 s, a job in one byte of
    address space: refused when read, naming the least value and why."""
    with pytest.raises(SettingsError, match=rf"^\${name}: .* must be at least .*\(.*\), got "):
        load_settings(environ={name: value})
