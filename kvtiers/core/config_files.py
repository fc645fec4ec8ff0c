"""Reading a config file: TOML or YAML text into plain tables, or a one-line `ConfigError`.

`load_config` validates what this returns; here only the file itself is checked: that it
can be read, is not huge, is UTF-8 (a byte-order mark is allowed) and parses, and that a
YAML mapping names no key twice (TOML refuses that itself).
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtiers.core.checks import describe
from kvtiers.core.errors import ConfigError

__all__ = ["MAX_FILE_BYTES", "read_config_file"]

MAX_FILE_BYTES = 16 * 2**20
"""The largest config file read (a config is a few KiB; `/dev/zero` never ends)."""


def read_config_file(path: Path) -> Mapping[str, Any]:
    """Return the top-level table of the TOML (`.toml`, no suffix) or YAML file `path`.

    Raises:
        ConfigError: it cannot be read, is larger than `MAX_FILE_BYTES`, is not UTF-8,
            does not parse, or holds no table at the top level; the message is one line
            that names the file.
    """
    text = _read_text(path)
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        data = _parse_yaml(text, path)
    elif suffix in (".toml", ""):
        data = _parse_toml(text, path)
    else:
        raise ConfigError(f"config: {path.name}: expected a .toml, .yaml or .yml file")
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: {path} must hold a table at the top level")
    return data


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # a NUL byte in the path
        raise ConfigError(f"config: cannot read {str(path)!r:.200}: {exc}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(
            f"config: cannot read {path}: larger than {MAX_FILE_BYTES // 2**20} MiB "
            "(a config is a few KiB)"
        )
    try:
        # NOTE: utf-8-sig drops one byte-order mark, which Windows editors write; YAML
        # allows it, TOML's parser does not.
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config: cannot read {path}: not UTF-8 ({exc})") from exc


def _parse_toml(text: str, path: Path) -> object:
    try:
        return tomllib.loads(text)
    except RecursionError:  # arrays nested thousands deep
        raise ConfigError(f"config: cannot parse {path}: nested too deep") from None
    except ValueError as exc:  # TOMLDecodeError, or an integer past Python's digit limit
        raise ConfigError(f"config: cannot parse {path}: {_one_line(exc)}") from exc


def _parse_yaml(text: str, path: Path) -> object:
    try:
        import yaml
    except ImportError as exc:
        raise ConfigError("config: YAML needs PyYAML; install kvtiers[yaml]") from exc
    try:
        return yaml.load(text, Loader=_unique_key_loader())  # NOTE: a SafeLoader
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(f"config: cannot parse {path}: {_marked(exc)}") from exc
    except RecursionError:  # flow collections nested thousands deep
        raise ConfigError(f"config: cannot parse {path}: nested too deep") from None
    except Exception as exc:  # other YAMLErrors; a constructor's ValueError (a bad date)
        raise ConfigError(f"config: cannot parse {path}: {_one_line(exc)}") from exc


def _marked(exc: Any) -> str:
    """Return a YAML error as one line: what went wrong, and where (1-based)."""
    what = "; ".join(str(p) for p in (exc.context, exc.problem) if p) or _one_line(exc)
    mark = exc.problem_mark or exc.context_mark
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return _one_line(what) + where


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())


@functools.cache
def _unique_key_loader() -> type[Any]:
    """Return a YAML `SafeLoader` that refuses a mapping naming one key twice.

    PyYAML keeps the last value of a repeated key, silently: a second `tiers:` would
    replace the first. A merge (`<<: *base`) may still be overridden by the keys beside it.
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            if isinstance(node, yaml.MappingNode):
                seen: set[Any] = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=deep)
                    try:
                        repeated = key in seen
                    except TypeError:  # unhashable: the base class refuses it, with its mark
                        continue
                    if repeated:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping",
                            node.start_mark,
                            f"found duplicate key {describe(key)}",
                            key_node.start_mark,
                        )
                    seen.add(key)
            mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
            return mapping

    return UniqueKeyLoader
