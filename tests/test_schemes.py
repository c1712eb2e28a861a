"""Issue 47: one table of tier URL schemes (cachestore.tier_urls.SCHEMES). Each scheme names the module that opens
its store, the stack splitter and the error text come from the table, and no other module reads a scheme."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import msgspec
import pytest

from cachestore.settings import Settings, SettingsError
from cachestore.stores import open_backend
from cachestore.tier_urls import (
    SCHEMES,
    TIER_SCHEMES_TEXT,
    is_cluster,
    is_redis,
    scheme_of,
    tier_levels,
    tier_path,
    tier_url_problem,
)

ROOT = Path(__file__).resolve().parents[1]
# A module reading a URL's scheme itself: a string literal that starts a scheme, matched against a string.
SCHEME_READ = re.compile(r"""(startswith|removeprefix)\(\(?\s*["'](off|local:|dir:|rediss?(\+cluster)?://|unix://)""")


def test_every_scheme_names_a_module_that_opens_its_store() -> None:
    for scheme in SCHEMES:
        assert callable(importlib.import_module(scheme.module).open_store), scheme
        assert scheme.shown in TIER_SCHEMES_TEXT and scheme_of(scheme.prefix + "x") == scheme


def test_a_stack_splits_before_every_scheme() -> None:
    urls = ["local:/a path/with spaces", "dir:/shared", *(s.prefix + "h:1" for s in SCHEMES if not s.names_path)]
    assert tier_levels(" ".join(urls)) == urls


def test_what_a_url_names() -> None:
    assert tier_path("local:/x y") == "/x y" and tier_path("dir:d") == "d" and tier_path("redis://h:1/0") is None
    assert is_redis("rediss+cluster://h:1") and is_cluster("rediss+cluster://h:1") and is_cluster("redis+cluster://h")
    assert is_redis("unix:///tmp/r.sock") and not is_cluster("unix:///tmp/r.sock") and not is_cluster("redis://h")
    assert not is_redis("local:/r") and not is_redis("off") and not is_cluster("local:/r+cluster://")
    assert scheme_of("off") is None and scheme_of("gs://bucket") is None and tier_path("s3://bucket/p") is None
    assert tier_url_problem("memcached://h:1") == f"is not a tier; use {TIER_SCHEMES_TEXT}"


def test_an_unknown_scheme_is_one_error_naming_every_scheme() -> None:
    settings = msgspec.structs.replace(Settings(), tier="memcached://h:1")  # past the settings' own check
    with pytest.raises(SettingsError, match=re.escape(TIER_SCHEMES_TEXT)):
        open_backend(settings)


def test_no_module_but_tier_urls_reads_a_scheme() -> None:
    own = {ROOT / "cachestore" / "tier_urls.py"}
    readers = [
        f"{path.relative_to(ROOT)}:{number}"
        for package in ("bridge", "cachestore", "workers")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in own
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SCHEME_READ.search(line)
    ]
    assert readers == []
