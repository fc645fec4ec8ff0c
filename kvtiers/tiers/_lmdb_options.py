"""The lmdb tier's own config keys, and the environment they open."""

from __future__ import annotations

import os
from dataclasses import dataclass

import lmdb

from kvtiers.core.checks import check_int, describe
from kvtiers.core.config import TierConfig, parse_size
from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.core.layout import KVLayout
from kvtiers.tiers import _lmdb_format as fmt
from kvtiers.tiers._files import FILE_MODE, allocate_whole, check_path, make_private_dirs
from kvtiers.tiers._integrity import OPTION_NAMES as _INTEGRITY_OPTIONS
from kvtiers.tiers._lmdb_format import Databases
from kvtiers.tiers.base import check_option_keys

__all__ = [
    "LMDBOptions",
    "MapSizes",
    "check_length",
    "open_env",
    "writemap_hint",
]

_MIB = 2**20
# NOTE: from values this large on, writemap wrote about twice as fast (docs/benchmarks.md).
_WRITEMAP_HINT_BYTES = 4 * _MIB
# NOTE: py-lmdb refuses more than 2**31 - 1 readers when the environment opens; refused
# at load, so the config's error names the field.
_MAX_READERS = 2**31 - 1
_OPTIONS = (
    "map_size",
    "max_readers",
    "path",
    "read_threads",
    "readahead",
    "sync",
    "writemap",
    *_INTEGRITY_OPTIONS,
)


@dataclass(frozen=True, slots=True)
class LMDBOptions:
    """The lmdb tier's own config keys."""

    path: str
    """Directory of the environment; created if missing."""
    read_threads: int = 4
    """Threads that run the blocking LMDB calls; a batch of large values is read in parts
    across them, in no more parts than there are cores (see `read_parts`)."""
    map_size: int | None = None
    """Size of the memory map; `None` sizes it from the capacity."""
    sync: bool = False
    """Whether each commit is flushed to disk before it returns."""
    max_readers: int = 256
    """Concurrent read transactions, over all processes sharing the environment."""
    readahead: bool = True
    """Let the OS read ahead in the map; a chunk is one large value read whole, so on by
    default (off, each cold 4 KiB page is its own synchronous disk read)."""
    writemap: bool = False
    """Write values straight into the memory map (`MDB_WRITEMAP`): no per-commit buffers
    and one copy less, so big chunks store several times faster. The data file is then
    allocated to the map's full size when opened (a full disk can never strike a write
    into the map), and every process on the path must use the same setting (checked)."""

    @classmethod
    def from_config(cls, config: TierConfig) -> LMDBOptions:
        """Validate the kind options of `config`.

        Args:
            config: the tier's config; its `options` hold the keys.

        Returns:
            The options, defaults filled in.

        Raises:
            ConfigError: an option is missing, unknown or invalid; the message names it.
        """
        where, raw = config.where, dict(config.options)
        check_option_keys(config, "lmdb", _OPTIONS)
        path = raw.get("path")
        path = os.fspath(path) if isinstance(path, os.PathLike) else path
        if not isinstance(path, str) or not path:
            raise ConfigError(
                f"{where}.path: required; expected a directory path, got {describe(path)}"
            )
        check_path(path, f"{where}.path")
        map_size = raw.get("map_size")
        if map_size is not None:
            map_size = parse_size(map_size, where=f"{where}.map_size")
            if map_size < _MIB:
                raise ConfigError(f"{where}.map_size: expected at least 1MiB, got {map_size}")
        sync = raw.get("sync", False)
        if not isinstance(sync, bool):
            raise ConfigError(f"{where}.sync: expected true or false, got {describe(sync)}")
        flags = {name: raw.get(name, name == "readahead") for name in ("readahead", "writemap")}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.{name}: expected true or false, got {describe(value)}")
        return cls(
            path=path,
            read_threads=check_int(f"{where}.read_threads", raw.get("read_threads", 4), 1),
            map_size=map_size,
            sync=sync,
            max_readers=check_int(
                f"{where}.max_readers", raw.get("max_readers", 256), 1, _MAX_READERS
            ),
            readahead=flags["readahead"],
            writemap=flags["writemap"],
        )


@dataclass(frozen=True, slots=True)
class MapSizes:
    """How much an lmdb tier's map and values take, from its config and layout."""

    value_len: int
    """Bytes of one stored value (header and payload)."""
    map_size: int
    """Bytes of the memory map: the option, or sized from the capacity."""
    limit: int
    """Bytes of values held at most: the capacity, or less where the map is smaller."""

    @classmethod
    def of(
        cls, config: TierConfig, options: LMDBOptions, layout: KVLayout, *, tagged: bool
    ) -> MapSizes:
        """Size a tier of `config` for chunks of `layout` (`tagged`: with integrity tags).

        Raises:
            ConfigError: the capacity or the map holds no chunk.
        """
        value_len = fmt.value_bytes(layout.fingerprint, layout.chunk_bytes, tagged=tagged)
        capacity = config.capacity_bytes
        if capacity < value_len:
            raise ConfigError(
                f"{config.where}.capacity: capacity too small for one chunk; a stored chunk "
                f"takes {value_len} bytes (header and payload), got {capacity}"
            )
        map_size = options.map_size or fmt.default_map_size(capacity, value_len)
        limit = min(capacity, fmt.map_capacity(map_size, value_len))
        if limit < value_len:
            raise ConfigError(
                f"{config.where}.map_size: a map of {map_size} bytes holds no chunk of "
                f"{value_len} bytes (header and payload) beside LMDB's own pages; "
                "raise it, or leave it out to size the map from the capacity"
            )
        return cls(value_len, map_size, limit)


def open_env(
    options: LMDBOptions, map_size: int, name: str, layout: KVLayout
) -> tuple[lmdb.Environment, Databases]:
    """Open the environment at `options.path`, creating what is missing, and note `layout`.

    Blocks; the tier runs it in its thread pool.

    Raises:
        TierIOError: it cannot be opened, or was created with the other `writemap`
            setting; the message names tier `name`.
    """
    path, env = options.path, None
    data = os.path.join(path, "data.mdb")
    try:
        make_private_dirs(path)
        fresh = not os.path.exists(data)
        env = _open_lmdb(options, map_size)
        # NOTE: free the reader slots of processes that died mid-read (a killed cache or
        # `kvtiers inspect`): each pins its snapshot's pages, and writes only grow the file.
        env.reader_check()
        check_length(env, data)
        if options.writemap:  # before any write into the map
            try:
                allocate_whole(data, env.info()["map_size"])
            except OSError:
                env.close()
                env = None
                if fresh:  # give back what was allocated: nothing is stored yet
                    os.truncate(data, 0)
                raise
        dbs = fmt.open_databases(env)
        fmt.check_writemap(env, dbs, options.writemap)
        fmt.record_layout(env, dbs, layout)
        return env, dbs
    except fmt.ModeMismatch as exc:
        if env is not None:
            env.close()
        raise TierIOError(f"{name}: lmdb at {path!r}: {exc}") from None
    except (OSError, OverflowError, lmdb.Error) as exc:  # overflow: a size past the C types
        if env is not None:
            env.close()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TierIOError(f"{name}: cannot open lmdb at {path!r}: {reason}") from exc


def check_length(env: lmdb.Environment, data: str) -> None:
    """Raise `lmdb.Error` if the file `data` ends before the environment's last page.

    A truncated file (a copy cut short, a full disk) would otherwise be a SIGBUS, which
    kills the process, the first time a read touches a page past its end.
    """
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    have = os.stat(data).st_size
    if have < need:
        raise lmdb.CorruptedError(
            f"{data} is {have} bytes, shorter than its {need} bytes of pages (truncated?)"
        )


def _open_lmdb(options: LMDBOptions, map_size: int) -> lmdb.Environment:
    return lmdb.open(
        options.path,
        mode=FILE_MODE,
        map_size=map_size,
        subdir=True,
        max_dbs=4,
        lock=True,
        readahead=options.readahead,
        # NOTE: with writemap a full disk would be a SIGBUS on a map write, not an
        # error that declines the batch; so the file is allocated whole first.
        writemap=options.writemap,
        meminit=False,
        max_readers=options.max_readers,
        # NOTE: without sync a crash may lose the last transactions, but LMDB's
        # copy-on-write never corrupts the tree, and checksums guard every payload.
        sync=options.sync,
        metasync=options.sync,
    )


def writemap_hint(options: LMDBOptions, chunk_bytes: int) -> list[str]:
    """Return `kvtiers explain`'s hint to turn `writemap` on, where it would pay."""
    if options.writemap or chunk_bytes < _WRITEMAP_HINT_BYTES:
        return []
    return [
        "  hint        writemap = true writes chunks this large about twice as fast",
        "              (the map's file is then allocated whole, to its map size, at open)",
    ]
