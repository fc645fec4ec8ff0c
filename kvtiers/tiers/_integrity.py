"""Authenticated entries for shared tiers: the `integrity` and `integrity_key_env` options.

A shared tier (lmdb, remote, or any other that other processes or nodes write) trusts
whoever can write its store. Its xxh3 checksums catch accidents, not attacks: a writer with
access could plant a forged chunk under a key other prompts will look up, and the model
would then attend to KV it never computed. With `integrity = "hmac-sha256"` every value
carries an HMAC-SHA256 tag under a secret read from the environment variable that
`integrity_key_env` names; values without a valid tag are misses (deleted and counted as
`forged`, and as `corrupt`).

A tier adopts it in three steps: accept the two option names (`OPTION_NAMES`), call
`auth_key_from_config` when it is built (a bad setting is then a `ConfigError` at load),
and pass the key to `pack_value` / `check_value` of `_chunk_format` (`auth_key=`), sizing
values with `tagged=auth_key is not None`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvtiers.core.checks import describe
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError

__all__ = ["INTEGRITY_SCHEMES", "MIN_KEY_BYTES", "OPTION_NAMES", "auth_key_from_config"]

INTEGRITY_SCHEMES = ("none", "hmac-sha256")
"""Values of the `integrity` option."""
OPTION_NAMES = ("integrity", "integrity_key_env")
"""The tier options this module reads."""
MIN_KEY_BYTES = 16
"""Shortest secret accepted: 128 bits, if the secret is random."""


def auth_key_from_config(
    config: TierConfig, environ: Mapping[str, str] | None = None
) -> bytes | None:
    """Return the integrity secret a tier's options ask for, or `None` when off.

    Args:
        config: the tier's config; its `options` may hold `integrity` and
            `integrity_key_env`.
        environ: where to read the variable; `os.environ` by default.

    Raises:
        ConfigError: an unknown scheme, a missing or unset variable, or a secret shorter
            than `MIN_KEY_BYTES` bytes; the message names the field.
    """
    where, options = config.where, config.options
    scheme = options.get("integrity", "none")
    if scheme not in INTEGRITY_SCHEMES:
        raise ConfigError(
            f"{where}.integrity: expected one of {', '.join(INTEGRITY_SCHEMES)}, "
            f"got {describe(scheme)}"
        )
    env_name = options.get("integrity_key_env")
    if scheme == "none":
        if env_name is not None:
            raise ConfigError(
                f"{where}.integrity_key_env: set, but integrity is 'none'; "
                f"set integrity = 'hmac-sha256' or remove it"
            )
        return None
    if not isinstance(env_name, str) or not env_name or "=" in env_name or "\0" in env_name:
        raise ConfigError(
            f"{where}.integrity_key_env: required with integrity = {scheme!r}; expected the "
            f"name of an environment variable holding the secret, got {describe(env_name)}"
        )
    env = os.environ if environ is None else environ
    value = env.get(env_name)
    if value is None:
        raise ConfigError(
            f"{where}.integrity_key_env: environment variable {env_name!r} is not set"
        )
    secret = value.encode("utf-8", "surrogateescape")
    if len(secret) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{where}.integrity_key_env: the secret in {env_name!r} has {len(secret)} bytes; "
            f"expected at least {MIN_KEY_BYTES} (a random string, e.g. `openssl rand -hex 32`)"
        )
    return secret
