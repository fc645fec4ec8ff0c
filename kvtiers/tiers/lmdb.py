"""The lmdb tier: chunks in one LMDB environment shared by processes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import lmdb
import numpy as np

from kvtiers.core.config import TierConfig, parse_size
from kvtiers.core.errors import CacheStateError, ConfigError, InvalidInputError, TierIOError
from kvtiers.core.keys import KEY_BYTES, ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierUsage
from kvtiers.tiers import _lmdb_format as fmt
from kvtiers.tiers._files import FILE_MODE, allocate_whole, check_path, make_private_dirs
from kvtiers.tiers._integrity import OPTION_NAMES as _INTEGRITY_OPTIONS
from kvtiers.tiers._integrity import auth_key_from_config
from kvtiers.tiers._lmdb_format import Databases, Verdict, Writer
from kvtiers.tiers._lmdb_health import WriteHealth
from kvtiers.tiers.base import Buffer, Tier, check_option_keys

__all__ = ["LMDBOptions", "LMDBTier"]

_T = TypeVar("_T")
logger = logging.getLogger("kvtiers")
_MIB = 2**20
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
_MAX_TOUCHED = 4096  # touched keys held in memory before a read flushes them itself


@dataclass(frozen=True, slots=True)
class LMDBOptions:
    """The lmdb tier's own config keys."""

    path: str
    """Directory of the environment; created if missing."""
    read_threads: int = 4
    """Threads that run the blocking LMDB calls; a batch's reads are split across them, in
    no more parts than there are cores."""
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
            raise ConfigError(f"{where}.path: required; expected a directory path, got {path!r}")
        check_path(path, f"{where}.path")
        map_size = raw.get("map_size")
        if map_size is not None:
            map_size = parse_size(map_size, where=f"{where}.map_size")
            if map_size < _MIB:
                raise ConfigError(f"{where}.map_size: expected at least 1MiB, got {map_size}")
        sync = raw.get("sync", False)
        if not isinstance(sync, bool):
            raise ConfigError(f"{where}.sync: expected true or false, got {sync!r}")
        flags = {name: raw.get(name, name == "readahead") for name in ("readahead", "writemap")}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.{name}: expected true or false, got {value!r}")
        return cls(
            path=path,
            read_threads=_int_option(raw, "read_threads", 4, where),
            map_size=map_size,
            sync=sync,
            max_readers=_int_option(raw, "max_readers", 256, where),
            readahead=flags["readahead"],
            writemap=flags["writemap"],
        )


def _int_option(raw: dict[str, Any], name: str, default: int, where: str) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}.{name}: expected an integer >= 1, got {value!r}")
    return value


class LMDBTier(Tier):
    """A tier in one LMDB environment on local disk, shared by processes.

    Several processes may open the same `path` at once; LMDB's locks serialize their writers.
    Because no single process's policy sees every entry, the tier evicts by capacity itself,
    least recently used first, with a chain's deepest chunk before its prefix. Blocking LMDB
    calls run in a pool of `read_threads` threads, never on the event loop; a batch's reads
    are split across the pool (in no more parts than there are cores), and a batch's writes
    are one transaction, all or nothing.

    `used_bytes` counts whole stored values (header and payload), so it matches the disk.

    Args:
        config: capacity, eviction (only `"lru"`) and the options of `LMDBOptions`.
        layout: the KV layout of the chunks it holds.

    Raises:
        ConfigError: an option is invalid, or the capacity cannot hold one chunk.
    """

    kind = "lmdb"
    shared = True
    manages_eviction = True

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self.options = LMDBOptions.from_config(config)
        self._fingerprint = layout.fingerprint
        self._auth_key = auth_key_from_config(config)
        self._value_len = fmt.value_bytes(
            self._fingerprint, layout.chunk_bytes, tagged=self._auth_key is not None
        )
        if self.capacity_bytes < self._value_len:
            raise ConfigError(
                f"{config.where}.capacity: capacity too small for one chunk; a stored chunk "
                f"takes {self._value_len} bytes (header and payload), got {self.capacity_bytes}"
            )
        self.map_size = self.options.map_size or fmt.default_map_size(
            self.capacity_bytes, self._value_len
        )
        self._env: lmdb.Environment | None = None
        self._dbs: Databases | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards counters and _touched across the pool's threads
        self._local = threading.local()  # per thread: a reused buffer to pack a value into
        self._touched: list[list[ChunkKey]] = []  # hit batches, flushed by the next write
        self._last_usage = TierUsage(self.capacity_bytes, 0, 0)  # reported while not open
        self._limit = min(self.capacity_bytes, fmt.map_capacity(self.map_size, self._value_len))
        """Bytes of values held at most: the capacity, or less where the map is smaller."""
        self._health = WriteHealth(self.name, self.options.path)
        # NOTE: a batch is split into no more parts than there are cores: on 2 vCPUs, 128
        # warm 64 KiB reads took 46 us a chunk split four ways and 34 us split two ways (the
        # threads' Python work contends for the interpreter lock), and cold reads gained
        # nothing from more parts. More threads still serve concurrent calls.
        self._parts = max(1, min(self.options.read_threads, os.cpu_count() or 1))

    async def _open(self) -> None:
        # docstring inherited
        pool = ThreadPoolExecutor(self.options.read_threads, f"kvtiers-lmdb-{self.name}")
        fut = asyncio.get_running_loop().run_in_executor(pool, self._open_env)
        try:
            self._env, self._dbs = await asyncio.shield(fut)
        except BaseException:
            await asyncio.wait({fut})
            if not fut.cancelled() and fut.exception() is None:
                fut.result()[0].close()  # opened after all, but this open was cancelled
            pool.shutdown(wait=False)
            raise
        self._pool = pool

    def _open_env(self) -> tuple[lmdb.Environment, Databases]:
        path, env = self.options.path, None
        data = os.path.join(path, "data.mdb")
        try:
            make_private_dirs(path)
            fresh = not os.path.exists(data)
            env = lmdb.open(
                path,
                mode=FILE_MODE,
                map_size=self.map_size,
                subdir=True,
                max_dbs=4,
                lock=True,
                readahead=self.options.readahead,
                # NOTE: with writemap a full disk would be a SIGBUS on a map write, not an
                # error that declines the batch; so the file is allocated whole first.
                writemap=self.options.writemap,
                meminit=False,
                max_readers=self.options.max_readers,
                # NOTE: without sync a crash may lose the last transactions, but LMDB's
                # copy-on-write never corrupts the tree, and checksums guard every payload.
                sync=self.options.sync,
                metasync=self.options.sync,
            )
            if self.options.writemap:  # before any write into the map
                try:
                    allocate_whole(data, env.info()["map_size"])
                except OSError:
                    env.close()
                    env = None
                    if fresh:  # give back what was allocated: nothing is stored yet
                        os.truncate(data, 0)
                    raise
            dbs = fmt.open_databases(env)
            fmt.check_writemap(env, dbs, self.options.writemap)
            return env, dbs
        except fmt.ModeMismatch as exc:
            if env is not None:
                env.close()
            raise TierIOError(f"{self.name}: lmdb at {path!r}: {exc}") from None
        except (OSError, lmdb.Error) as exc:
            if env is not None:
                env.close()
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise TierIOError(f"{self.name}: cannot open lmdb at {path!r}: {reason}") from exc

    def _handles(self) -> tuple[lmdb.Environment, Databases]:
        if self._env is None or self._dbs is None:
            raise CacheStateError(f"tier {self.name!r} is not open")
        return self._env, self._dbs

    async def _close(self) -> None:
        # docstring inherited
        await asyncio.to_thread(self._close_env)

    def _close_env(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        try:
            if self._touched:  # recency that reads recorded since the last write
                self._write(lambda w: None, threading.Event())
        except lmdb.Error as exc:  # a full or failing disk: recency is only a hint
            logger.warning(
                "kvtiers: lmdb tier %r: recency of recent reads not saved at close: %s",
                self.name,
                exc,
            )
        finally:
            if self._env is not None:
                with contextlib.suppress(lmdb.Error):
                    self.usage()  # remembered for stats taken after close
                self._env.close()
            self._env = self._dbs = None

    async def _run(self, jobs: Sequence[Callable[[threading.Event], _T]]) -> list[_T]:
        """Run blocking `jobs` in the pool and return their results.

        On cancellation, tell the jobs to stop (a write transaction then aborts) and wait for
        them before re-raising, so no thread still touches the caller's buffers afterwards.
        """
        loop, cancel = asyncio.get_running_loop(), threading.Event()
        try:
            futs = [loop.run_in_executor(self._pool, job, cancel) for job in jobs]
        except RuntimeError as exc:  # the pool was shut down by a concurrent close
            raise CacheStateError(f"tier {self.name!r} is closed") from exc
        try:
            results = await asyncio.shield(asyncio.gather(*futs, return_exceptions=True))
        except asyncio.CancelledError:
            cancel.set()
            await asyncio.wait(futs)
            raise
        for result in results:
            if isinstance(result, lmdb.Error):
                raise TierIOError(
                    f"{self.name}: lmdb at {self.options.path!r}: {result}"
                ) from result
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]  # no exceptions left

    def _write(self, fn: Callable[[Writer], _T], cancel: threading.Event) -> _T | None:
        """Run `fn` in one write transaction; `None` if it was cancelled.

        Recency that reads recorded is flushed first, in the same transaction.
        """
        env, dbs = self._handles()
        if cancel.is_set():
            return None
        with self._lock:
            touched, self._touched = self._touched, []
        committed = False
        txn = env.begin(write=True, buffers=True)
        try:
            writer = Writer(txn, dbs, self._limit)
            for batch in _last_touches(touched):
                held = [(key, size) for key in batch if (size := writer.size(key)) is not None]
                writer.touch([key for key, _ in held], [size for _, size in held])
            result = fn(writer)
            writer.save()
            if not cancel.is_set():
                txn.commit()
                committed = True
        finally:
            if not committed:
                txn.abort()
                with self._lock:
                    self._touched[:0] = touched
        if not committed:
            return None
        with self._lock:
            self.counters.evictions += len(writer.evicted)
        self._note_evicted(writer.evicted)
        return result

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        _check_keys(keys)
        return (await self._run([functools.partial(self._contains, keys)]))[0]

    def _contains(self, keys: Sequence[ChunkKey], cancel: threading.Event) -> list[bool]:
        env, dbs = self._handles()
        # NOTE: `seqs` holds every stored key with a few bytes; asking `chunks` would fault
        # in each whole value (see `_lmdb_format`), a read from the disk when it is cold.
        with env.begin(db=dbs.seqs, buffers=True) as txn:
            return [txn.get(key) is not None for key in keys]

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        # docstring inherited
        # Kept in memory like a read's hits; the next write transaction records it first.
        if keys:
            with self._lock:
                self._touched.append(list(keys))

    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        _check_keys(keys)
        self._check_buffers(keys, dsts)
        step = max(1, -(-len(keys) // self._parts))
        jobs = [
            functools.partial(self._read, keys[i : i + step], dsts[i : i + step])
            for i in range(0, len(keys), step)
        ]
        hits = [hit for part in await self._run(jobs) for hit in part]
        touched = [key for key, hit in zip(keys, hits, strict=True) if hit]
        if touched:  # kept in memory, so reads need no write transaction
            with self._lock:
                self._touched.append(touched)
                flush = sum(map(len, self._touched)) >= _MAX_TOUCHED
            if flush:
                try:
                    await self._run([functools.partial(self._write, lambda w: None)])
                except TierIOError:  # a full or failing disk: recency is only a hint
                    with self._lock:
                        self._touched.clear()
        return hits

    def _read(
        self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer], cancel: threading.Event
    ) -> list[bool]:
        env, dbs = self._handles()
        hits, bad = [False] * len(keys), []
        chunk_bytes = self.layout.chunk_bytes
        with env.begin(db=dbs.chunks, buffers=True) as txn:
            for i, key in enumerate(keys):
                raw = None if cancel.is_set() else txn.get(key)
                if raw is None:
                    continue
                verdict, payload = fmt.check_value(
                    raw,
                    fingerprint=self._fingerprint,
                    key=key,
                    payload_len=chunk_bytes,
                    auth_key=self._auth_key,
                )
                if payload is not None:  # verified before a byte reaches the destination
                    dst = dsts[i]
                    np.copyto(dst, np.frombuffer(payload, np.uint8).reshape(dst.shape))
                    hits[i] = True
                else:
                    bad.append(key)
        num_hits = sum(hits)
        with self._lock:
            self.counters.hits += num_hits
            self.counters.misses += len(keys) - num_hits
            self.counters.bytes_read += num_hits * chunk_bytes
        if bad:
            self._write(functools.partial(self._discard, bad), cancel)
        return hits

    def _discard(self, keys: Sequence[ChunkKey], writer: Writer) -> None:
        """Delete the entries under `keys` that still fail their check."""
        verdicts = writer.discard(
            keys, self._fingerprint, self.layout.chunk_bytes, auth_key=self._auth_key
        )
        forged = verdicts.count(Verdict.FORGED)
        with self._lock:
            self.counters.corrupt += verdicts.count(Verdict.CORRUPT) + forged
            self.counters.forged += forged
            self.counters.foreign += verdicts.count(Verdict.FOREIGN)

    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        _check_keys(keys)
        self._check_buffers(keys, srcs)
        if not keys:
            return []
        return (await self._run([functools.partial(self._put, keys, srcs)]))[0]

    def _put(
        self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer], cancel: threading.Event
    ) -> list[bool]:
        plan = functools.partial(self._store, keys, srcs)
        try:
            done = self._write(plan, cancel)
        except lmdb.MapFullError:
            # NOTE: the map filled up before the capacity: free twice the batch's size, then
            # retry once. LMDB reuses the pages a transaction frees only two commits later
            # (it keeps the last two snapshots), hence the eviction's own commit and one more.
            # A map that fills up at all is smaller than the capacity assumes (another
            # process may share it with a larger capacity): hold less from now on.
            self._map_full()
            need = 2 * len(keys) * self._value_len
            try:
                # NOTE: even deletes need free pages (copy-on-write), so these can fail too.
                self._write(lambda w: w.evict(need, set(keys), limit=w.used), cancel)
                self._write(lambda w: None, cancel)
                done = self._write(plan, cancel)
            except lmdb.MapFullError:
                present = self._contains(keys, cancel)
                with self._lock:
                    self.counters.declined += present.count(False)
                return present
            except lmdb.Error as exc:
                return self._write_failed(keys, exc, cancel)
        except lmdb.Error as exc:
            return self._write_failed(keys, exc, cancel)
        if done is None:  # cancelled: nothing was written, and the caller is gone
            return [False] * len(keys)
        held, num_new, num_declined = done
        if num_new:
            self._health.stored()
        with self._lock:
            self.counters.puts += num_new
            self.counters.bytes_written += num_new * self.layout.chunk_bytes
            self.counters.declined += num_declined
        return [key in held for key in keys]

    def _store(
        self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer], writer: Writer
    ) -> tuple[set[bytes], int, int]:
        """Write the batch's new keys that fit, evicting the oldest entries first.

        Returns:
            The batch's keys held after the write, how many were new, how many declined.
        """
        srcs_by_key = dict(zip(keys, srcs, strict=True))
        kept: dict[bytes, int] = {}  # key -> its value's size
        new: list[bytes] = []
        held, full = 0, False
        for key in srcs_by_key:
            size = writer.size(key)
            if size is None:
                # NOTE: once a chunk does not fit, no deeper chunk is stored without it.
                full = full or held + self._value_len > self._limit
                if full:
                    continue
                new.append(key)
                size = self._value_len
            kept[key] = size
            held += size
        writer.evict(len(new) * self._value_len, keep=set(kept))
        while new and writer.used + len(new) * self._value_len > self._limit:
            del kept[new.pop()]  # what is left is held by this batch or unaccounted
        out = self._pack_buffer()
        for new_key in new:
            src = np.ascontiguousarray(srcs_by_key[ChunkKey(new_key)]).reshape(-1)
            value = fmt.pack_value_into(
                out, self._fingerprint, new_key, src.data, auth_key=self._auth_key
            )
            writer.insert(new_key, value)  # LMDB copies it: `out` is free again
            kept[new_key] = len(value)
        writer.touch(list(kept), list(kept.values()))
        return set(kept), len(new), len(srcs_by_key) - len(kept)

    def _pack_buffer(self) -> memoryview:
        """Return this thread's buffer for one value, made on its first write."""
        out: memoryview | None = getattr(self._local, "pack", None)
        if out is None:
            out = self._local.pack = memoryview(bytearray(self._value_len))
        return out

    def _write_failed(
        self, keys: Sequence[ChunkKey], exc: lmdb.Error, cancel: threading.Event
    ) -> list[bool]:
        """Decline a batch whose write failed (a full or failing disk); reads go on."""
        present = self._contains(keys, cancel)
        with self._lock:
            self.counters.errors += 1
            self.counters.declined += present.count(False)
        self._health.failed(exc)
        return present

    def _map_full(self) -> None:
        """Lower the limit below what the map held when it filled up."""
        env, dbs = self._handles()
        with env.begin(buffers=True) as txn:
            used = fmt.read_used_bytes(txn, dbs)
        with self._lock:
            self._limit = max(self._value_len, min(self._limit, used * 9 // 10))
        self._health.map_full(self.map_size, self._limit)

    async def delete(self, keys: Sequence[ChunkKey]) -> None:
        # docstring inherited
        self._ensure_open()
        _check_keys(keys)
        if keys:
            await self._run([functools.partial(self._delete, keys)])

    def _delete(self, keys: Sequence[ChunkKey], cancel: threading.Event) -> None:
        self._write(lambda w: [w.remove(key) for key in keys], cancel)

    def usage(self) -> TierUsage:
        """Return the tier's capacity and what it holds (as last seen, once closed)."""
        if self._env is None or self._dbs is None:
            return self._last_usage
        env, dbs = self._env, self._dbs
        # NOTE: a read transaction takes no lock and only reads mapped pages, so this one
        # runs on the caller's thread, the event loop included.
        with env.begin(buffers=True) as txn:
            used = fmt.read_used_bytes(txn, dbs)
            entries = txn.stat(dbs.chunks)["entries"]
        self._last_usage = TierUsage(self.capacity_bytes, used, entries)
        return self._last_usage


def _last_touches(batches: list[list[ChunkKey]]) -> list[list[ChunkKey]]:
    """Keep each key only in the last batch that touched it, in order.

    Touching batches in order leaves each key at the recency of its last touch; dropping its
    earlier touches leaves every key in the same relative order, with less to write (hot
    prefixes are read again and again between two writes).
    """
    seen: set[ChunkKey] = set()
    out: list[list[ChunkKey]] = []
    for batch in reversed(batches):
        kept: list[ChunkKey] = []
        for key in reversed(batch):
            if key not in seen:
                seen.add(key)
                kept.append(key)
        if kept:
            out.append(kept[::-1])
    return out[::-1]


def _check_keys(keys: Sequence[ChunkKey]) -> None:
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidInputError(f"keys[{i}]: expected a {KEY_BYTES}-byte key, got {key!r:.60}")
