"""Tier URLs, read in one place: the schemes, the levels of a stack, the checks made when settings are read,
and the form every output shows (without secrets). The store a URL names is opened by cachestore.stores, with
the module its scheme names here."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

REDIS_MODULE = "cachestore.backends.redis"


def scheme_of(url: str) -> Scheme | None:
    """The scheme of one level's URL, None for `off` or what is no tier URL."""
    return next((scheme for scheme in SCHEMES if url.startswith(scheme.prefix)), None)


def tier_path(url: str) -> str | None:
    """The PATH of a tier named by a path (local:PATH, dir:PATH), None for any other."""
    scheme = scheme_of(url)
    return url[len(scheme.prefix) :] if scheme is not None and scheme.names_path else None


def is_redis(url: str) -> bool:
    """Whether the URL names a Redis server or cluster: what the fleet needs."""
    scheme = scheme_of(url)
    return scheme is not None and scheme.module == REDIS_MODULE


def is_cluster(url: str) -> bool:
    """Whether the URL names a Redis Cluster (redis+cluster://, rediss+cluster://)."""
    scheme = scheme_of(url)
    return scheme is not None and scheme.prefix.endswith("+cluster://")


def tier_levels(tier: str) -> list[str]:
    """The levels of a tier setting, nearest first: `local:PATH redis://HOST` is a local level in front of
    Redis (`--tier` repeated, a list in the config file, a space-separated NKICACHE_TIER)."""
    return [level for level in _LEVEL_START.split(tier.strip()) if level] or [tier]


def shared_level(tier: str) -> str:
    """The farthest level of a tier setting: the one machines share, holding the leases and the fleet metrics.
    Commands that read or administer one store (report, inspect, warm, the fleet queue) use it."""
    return tier_levels(tier)[-1]


SECRET_QUERY_PARAMETERS = ("password", "ssl_password")  # redis-py takes both from a URL's query


def redact_url(url: str) -> str:
    """The URL without its secrets, for every output (logs, errors, JSON, reports): the password of the
    user-info part (`redis://user:SECRET@host`) and secret query parameters (`?password=SECRET`), read as
    redis-py reads a URL (urlsplit), so what it would send is what is hidden."""
    levels = tier_levels(url)
    if len(levels) > 1:
        return " ".join(map(redact_url, levels))
    if "://" not in url:
        return url  # off, local:PATH, dir:PATH
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL (redis://[::1): shown to say so, without what could be user-info or a query
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{rest.partition('?')[0].rpartition('@')[2]}"
    netloc = parts.netloc
    if "@" in netloc:
        user_info, _, hosts = netloc.rpartition("@")
        user = user_info.partition(":")[0]
        netloc = f"{user}@{hosts}" if user else hosts
    query = "&".join(item for item in parts.query.split("&") if item and not _is_secret(item))
    return f"{parts.scheme}://{netloc}{parts.path}{'?' + query if query else ''}"


def _is_secret(query_item: str) -> bool:
    return unquote(query_item.partition("=")[0]).lower() in SECRET_QUERY_PARAMETERS


# Query parameters a tier URL may carry: what redis-py parses (it passes unknown ones on to the client, which
# then fails every connection), minus what would override nkicache's own timeouts and retries.
URL_TEXT_PARAMETERS = (
    "username",
    "password",
    "client_name",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_cert_reqs",
)
URL_SETTINGS_PARAMETERS = {  # set by nkicache's settings instead
    "socket_timeout": "op_timeout",
    "timeout": "op_timeout",
    "socket_connect_timeout": "connect_timeout",
    "retry_on_timeout": "op_timeout",
    "retry_on_error": "op_timeout",
}
SSL_CERT_REQS = ("none", "optional", "required")


def tier_url_problem(url: str) -> str | None:
    """What is wrong with a tier URL (or a stack of them), or None: checked when settings are read, so that a
    bad URL is one error before anything runs instead of a failure in every compile."""
    levels = tier_levels(url)
    if len(levels) > 1:
        return _stack_problem(levels)
    scheme = scheme_of(url)
    if url == "off":
        return None
    if scheme is None:
        return f"is not a tier; use {TIER_SCHEMES_TEXT}"
    if not scheme.names_path and any(character.isspace() for character in url):
        return f"holds a space; each level of a stack starts with {TIER_SCHEMES_TEXT.replace('PATH', '')}"
    try:
        return scheme.problem(url)
    except ValueError as exc:
        return f"is not a valid URL: {exc}"


def _path_problem(url: str) -> str | None:
    scheme, _, path = url.partition(":")
    return None if path.strip() else f"{scheme}: needs a path ({scheme}:PATH)"


# S3's rules for a bucket's name: 3 to 63 lowercase letters, digits, dots and hyphens, a letter or digit at each end.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def _s3_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if "@" in parts.netloc or parts.query or parts.fragment:
        return "takes no user, query or fragment; credentials come from the AWS environment (docs/tiers.md)"
    if not _BUCKET.fullmatch(parts.netloc):
        return f"names bucket {parts.netloc!r}; a bucket is 3-63 lowercase letters, digits, dots and hyphens"
    return None


def _redis_problem(url: str) -> str | None:
    parts = urlsplit(url)
    return _address_problem(parts) or _database_problem(parts) or _query_problem(parts.query)


def _stack_problem(levels: list[str]) -> str | None:
    if "off" in levels:
        return "off cannot be a level of a stack; leave the other levels out instead"
    if len(set(levels)) < len(levels):
        return "names one level twice"
    for level in levels:
        problem = tier_url_problem(level)
        if problem:
            return f"level {redact_url(level)!r} {problem}"
    return None


def _address_problem(parts: SplitResult) -> str | None:
    if parts.scheme == "unix":
        return None if parts.path else "unix:// needs the socket's path (unix:///path/to/redis.sock)"
    if parts.scheme.endswith("+cluster"):
        hosts = parts.netloc.rpartition("@")[2].split(",")
        bad = [h for h in hosts if not h.rpartition(":")[0] or not h.rpartition(":")[2].isdigit()]
        return f"cluster node {bad[0]!r} is not host:port" if bad else None
    if not parts.hostname:
        return f"{parts.scheme}:// needs a host ({parts.scheme}://HOST:PORT)"
    parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    return None


def _database_problem(parts: SplitResult) -> str | None:
    """A database number that redis-py would read otherwise than it is written: a path that is not one (it takes
    `/abc` for db 0) or a `?db=` beside a path's (the query wins, silently)."""
    if parts.scheme == "unix" or parts.scheme.endswith("+cluster"):
        return None
    path = parts.path.strip("/")
    if path and not path.isdecimal():
        return f"names database {path!r}; a database is a number (redis://HOST:PORT/0)"
    if path and "db" in parse_qs(parts.query):
        return "names its database twice (in the path and in ?db=); keep one"
    return None


def _query_problem(query: str) -> str | None:
    if not query:
        return None  # (redis-py is not imported to check nothing: a compile imports it later, off its critical path)
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS

    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name in URL_SETTINGS_PARAMETERS:
            return f"query parameter {name!r} is set by nkicache; use the {URL_SETTINGS_PARAMETERS[name]} setting"
        parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
        if parser is None and name not in URL_TEXT_PARAMETERS:
            return f"unknown query parameter {name!r}"
        try:
            if callable(parser):
                parser(values[0])
        except (TypeError, ValueError):
            return f"query parameter {name!r} has an invalid value"
        if name == "ssl_cert_reqs" and values[0].lower() not in SSL_CERT_REQS:
            return f"ssl_cert_reqs must be one of {', '.join(SSL_CERT_REQS)}"
    return None


class Scheme(NamedTuple):
    """A kind of tier URL: how it starts, the module whose `open_store` opens what it names (imported only
    then), how `--help` and errors name it, and its URL's check. A scheme without "//" names a path (local:PATH)."""

    prefix: str
    module: str
    shown: str
    problem: Callable[[str], str | None]  # what is wrong with a URL of this scheme, or None

    @property
    def names_path(self) -> bool:
        return "//" not in self.prefix


LOCAL = Scheme("local:", "cachestore.backends.sqlite", "local:PATH", _path_problem)  # the embedded default
# Every tier URL there is: nothing outside this module reads a URL's scheme.
SCHEMES = (
    LOCAL,
    Scheme("dir:", "cachestore.backends.directory", "dir:PATH", _path_problem),
    Scheme("s3://", "cachestore.backends.s3", "s3://BUCKET/PREFIX", _s3_problem),
    Scheme("redis://", REDIS_MODULE, "redis://", _redis_problem),
    Scheme("rediss://", REDIS_MODULE, "rediss://", _redis_problem),
    Scheme("unix://", REDIS_MODULE, "unix://", _redis_problem),
    Scheme("redis+cluster://", REDIS_MODULE, "redis+cluster://", _redis_problem),
    Scheme("rediss+cluster://", REDIS_MODULE, "rediss+cluster://", _redis_problem),
)
TIER_SCHEMES_TEXT = f"off, {', '.join(s.shown for s in SCHEMES[:-1])} or {SCHEMES[-1].shown}"

# A level of a stacked tier starts after whitespace with a scheme, so a local path may still hold spaces.
_LEVEL_START = re.compile(r"\s+(?=off(?:\s|$)|" + "|".join(re.escape(s.prefix) for s in SCHEMES) + ")")
