"""A real S3 endpoint on loopback: moto's server mode, reached over HTTP through s3fs."""

from __future__ import annotations

import functools
import logging
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

BUCKET = "kvtiers-test"
KEY_ID = "kvtiers-test-key-id"
SECRET = "kvtiers-test-secret-3f9a0c"  # tests assert that it is never logged
_CREATED: set[str] = set()  # buckets created in this process


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class MotoS3:
    """A moto S3 server on `port`, which a test may stop and start again on the same port.

    All servers of one process share moto's in-memory state, so objects outlive a restart.
    """

    port: int
    server: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def storage_options(self, *, shared_session: bool = True, **extra: Any) -> dict[str, Any]:
        """Return s3fs options for this server with dummy credentials.

        Args:
            shared_session: reuse one botocore session in this process, which saves each
                tier reloading botocore's endpoint data (most of a second); leave it out of
                configs sent to another process.
            extra: more options.
        """
        options = {
            "key": KEY_ID,
            "secret": SECRET,
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
            **extra,
        }
        if shared_session:
            options["session"] = _botocore_session()
        return options

    def url(self, name: str = "") -> str:
        """Return a fresh `s3://` prefix in the test bucket."""
        return f"s3://{BUCKET}/{name or 'run'}-{uuid.uuid4().hex[:12]}"


@functools.cache
def _botocore_session() -> Any:
    from aiobotocore.session import AioSession

    return AioSession()


def _speed_up_moto() -> None:
    """Cache moto's list of its service modules, which it re-reads from disk per request."""
    from moto import backends

    if not hasattr(backends.list_of_moto_modules, "cache_info"):
        modules = tuple(backends.list_of_moto_modules())
        backends.list_of_moto_modules = functools.cache(lambda: modules)  # type: ignore[assignment]


def _start(port: int | None = None) -> MotoS3:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    _speed_up_moto()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    s3 = MotoS3(port or free_port())
    s3.start()
    if BUCKET in _CREATED:  # every server of this process shares moto's state
        return s3
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    finally:
        client.close()
    _CREATED.add(BUCKET)
    return s3


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """Yield one S3 server for the whole session (tests use distinct prefixes)."""
    s3 = _start()
    yield s3
    s3.stop()


@pytest.fixture
def own_moto_s3() -> Iterator[MotoS3]:
    """Yield an S3 server of this test's own, which it may stop and restart."""
    s3 = _start()
    yield s3
    s3.stop()
