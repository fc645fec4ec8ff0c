"""The remote tier's config keys, validated, and how its URL and secrets are shown."""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvtiers.core.checks import check_int, describe
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.tiers._files import check_path
from kvtiers.tiers._integrity import OPTION_NAMES as INTEGRITY_OPTIONS
from kvtiers.tiers._pool_options import seconds
from kvtiers.tiers.base import check_option_keys

__all__ = ["RemoteOptions", "Redactor", "display_url"]

_OPTIONS = (
    "breaker_cooldown",
    "breaker_failures",
    "layer_reads",
    "max_in_flight",
    "read_timeout",
    "retries",
    "scan_interval",
    "storage_options",
    "timeout",
    "ttl",
    "url",
    *INTEGRITY_OPTIONS,
)
# Option names whose values are credentials; matched as whole words of a snake-case name.
_SECRET_WORDS = frozenset(
    {"secret", "token", "password", "passwd", "credential", "credentials", "key", "sas"}
)
_MIN_SECRET_CHARS = 4  # shorter values would be redacted out of ordinary text
_MIN_ENV_SECRET_CHARS = 8  # environment values are many and not all credentials
# NOTE: real storage options nest a few levels (client_kwargs.config.retries); deeper is a
# mistake, or a YAML anchor inside itself, and would exhaust the stack of whoever walks it.
_MAX_STORAGE_DEPTH = 32
_WALKED = object()  # _check_nesting's marker: the container above is walked
_PATH_PROTOCOLS = frozenset({"file", "local", "memory"})  # "a//b" is "a/b" there, or listed


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    """The remote tier's own config keys."""

    url: str
    """fsspec URL of the pool's root, e.g. `"s3://bucket/prefix"`; chunks go below it."""
    storage_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Passed to the fsspec filesystem (credentials, `endpoint_url`, `client_kwargs`...)."""
    max_in_flight: int = 16
    """Object requests in flight at once, over all of the tier's calls."""
    timeout: float = 10.0
    """Seconds one request may take before it counts as failed."""
    read_timeout: float | None = None
    """Seconds one read call (`contains`, `get`, `get_layers`) may take in all, slot waits
    and retries included; chunks not read by then are misses. `None`: `timeout`."""
    retries: int = 3
    """Retries of a failed request, with exponential backoff, before it is given up."""
    breaker_failures: int = 5
    """Consecutive failed requests that open the circuit breaker."""
    breaker_cooldown: float = 5.0
    """Seconds the breaker stays open before one probe request may try the store."""
    ttl: float | None = None
    """Seconds after its last access that an object expires; `None`: never."""
    scan_interval: float = 300.0
    """Seconds between scans of the namespace (usage, eviction, expiry); 0: at open only.

    A scan lists the namespace (one request per 1000 objects) and reads every process's
    access log, so on a large pool it is not free."""
    layer_reads: bool | None = None
    """Whether a layer-wise load reads objects wave by wave as byte ranges (one request
    per object and wave) rather than whole. `None` (the default): on a local filesystem
    (`file://`), where it pays, off on other stores, where each request's latency can
    cost more than the waves save (docs/benchmarks.md); set it for a store whose reads
    are bound by bandwidth rather than by requests."""

    @classmethod
    def from_config(cls, config: TierConfig) -> RemoteOptions:
        """Validate the kind options of `config`.

        Raises:
            ConfigError: an option is missing, unknown or invalid; the message names it.
        """
        where, raw = config.where, dict(config.options)
        check_option_keys(config, "remote", _OPTIONS)
        url = raw.get("url")
        if not isinstance(url, str) or not url.strip():
            raise ConfigError(
                f"{where}.url: required; expected an fsspec URL such as 's3://bucket/prefix', "
                f"got {describe(url)}"
            )
        check_path(url.strip().split("://", 1)[-1], f"{where}.url")
        _check_segments(url.strip(), f"{where}.url")
        storage = raw.get("storage_options", {})
        if not isinstance(storage, Mapping) or not all(isinstance(k, str) for k in storage):
            raise ConfigError(f"{where}.storage_options: expected a table, got {describe(storage)}")
        _check_nesting(storage, f"{where}.storage_options")
        ttl = raw.get("ttl")
        read_timeout = raw.get("read_timeout")
        return cls(
            url=url.strip(),
            storage_options=MappingProxyType(dict(storage)),
            max_in_flight=_int(raw, "max_in_flight", 16, 1, where),
            timeout=seconds(raw, "timeout", 10.0, where),
            read_timeout=(
                None if read_timeout is None else seconds(raw, "read_timeout", 0.0, where)
            ),
            retries=_int(raw, "retries", 3, 0, where),
            breaker_failures=_int(raw, "breaker_failures", 5, 1, where),
            breaker_cooldown=seconds(raw, "breaker_cooldown", 5.0, where),
            ttl=None if ttl is None else seconds(raw, "ttl", 0.0, where),
            scan_interval=seconds(raw, "scan_interval", 300.0, where, allow_zero=True),
            layer_reads=_flag(raw, "layer_reads", where),
        )


def _check_segments(url: str, where: str) -> None:
    """Refuse an object store URL with an empty segment (`s3://bucket//prefix`).

    NOTE: an object store keeps the empty segment in the object names, but its listings
    of `bucket//prefix` find none of them, so no scan would ever see the pool: no
    eviction, no expiry, and `kvtiers remote ls` and `purge` would find it empty.
    """
    protocol, sep, path = url.partition("://")
    if not sep or protocol.lower() in _PATH_PROTOCOLS:
        return
    if "" in path.rstrip("/").split("/"):
        raise ConfigError(
            f"{where}: has an empty segment ('//'); an object store could not list the "
            f"objects below it; got {display_url(url)!r:.200}"
        )


def _int(raw: dict[str, Any], name: str, default: int, minimum: int, where: str) -> int:
    return check_int(f"{where}.{name}", raw.get(name, default), minimum)


def _flag(raw: dict[str, Any], name: str, where: str) -> bool | None:
    if name not in raw:
        return None
    value = raw[name]
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{name}: expected true or false, got {describe(value)}")
    return value


def display_url(url: str) -> str:
    """Return `url` without user info, query or fragment, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return url.split("?", 1)[0]
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def _is_secret_name(name: str) -> bool:
    words = set(re.split(r"[^a-z0-9]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()))
    return bool(words & _SECRET_WORDS)


class Redactor:
    """Replace credentials (in `storage_options`, URL user info, the environment) with `***`.

    Every message the remote tier logs or raises passes through one, so no secret reaches a
    log line, including the text of a backend's exception.
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any],
        url: str = "",
        environ: Mapping[str, str] | None = None,
    ) -> None:
        _check_nesting(storage_options, "storage_options")
        secrets = _collect(storage_options)
        # Credentials a backend may take from the environment (AWS_SECRET_ACCESS_KEY...).
        env = os.environ if environ is None else environ
        secrets.update(
            v for k, v in env.items() if len(v) >= _MIN_ENV_SECRET_CHARS and _is_secret_name(k)
        )
        userinfo = urllib.parse.urlsplit(url).netloc.rpartition("@")[0]
        secrets.update(s for s in userinfo.split(":") if s)
        self._secrets = sorted(
            (s for s in secrets if len(s) >= _MIN_SECRET_CHARS), key=len, reverse=True
        )

    def __call__(self, text: str) -> str:
        """Return `text` with every known secret replaced."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


def _check_nesting(value: object, where: str) -> None:
    """Raise a `ConfigError` naming `where` if `value` contains itself or nests too deep.

    Tables and lists count as levels; more than `_MAX_STORAGE_DEPTH` are refused. A value
    shared by several parents (a YAML anchor used twice) is walked again only when reached
    deeper than before, so the walk costs at most `_MAX_STORAGE_DEPTH` times its size.
    """
    walked: dict[int, int] = {}  # container id -> the greatest depth it was walked at
    # NOTE: an explicit stack, so no input can exhaust Python's; `path` holds the ids of
    # the containers being walked (the ancestors), which a cycle meets again.
    path: list[int] = []
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if item is _WALKED:  # the container on top of `path` is walked
            walked[path.pop()] = depth
        elif isinstance(item, Mapping | list | tuple) and walked.get(id(item), 0) < depth:
            if id(item) in path:
                raise ConfigError(f"{where}: contains itself (a YAML anchor inside itself?)")
            if depth > _MAX_STORAGE_DEPTH:
                raise ConfigError(f"{where}: nested more than {_MAX_STORAGE_DEPTH} levels deep")
            path.append(id(item))
            stack.append((_WALKED, depth))
            children = item.values() if isinstance(item, Mapping) else item
            stack.extend((child, depth + 1) for child in children)


def _collect(storage_options: Mapping[str, Any]) -> set[str]:
    """Return the secrets in `storage_options`, which passed `_check_nesting`.

    A string is a secret below a secret name at any depth; an endpoint's user info is one.
    """
    out: set[str] = set()
    # NOTE: a shared container is walked once for each way it is reached (under a secret
    # name or not), so a tree of shared anchors costs its size, not its number of paths.
    seen: set[tuple[int, bool]] = set()

    def walk(value: object, secret: bool) -> None:
        if isinstance(value, Mapping | list | tuple):
            if (id(value), secret) in seen:
                return
            seen.add((id(value), secret))
        if isinstance(value, Mapping):
            for key, item in value.items():
                name = key if isinstance(key, str) else describe(key)
                walk(item, secret or _is_secret_name(name))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item, secret)
        elif isinstance(value, str):
            if secret:
                out.add(value)
            elif "@" in value and "://" in value:  # an endpoint with user info
                userinfo = urllib.parse.urlsplit(value).netloc.rpartition("@")[0]
                out.update(s for s in userinfo.split(":") if s)

    walk(storage_options, False)
    return out
