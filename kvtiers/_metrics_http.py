"""The HTTP side of the metrics endpoint: a threaded WSGI server that closes idle scrapes.

`serve` starts it in a daemon thread; `MetricsHTTPServer.drop_connections` ends the threads of
connections still open when the endpoint closes.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from kvtiers.core.config import MetricsConfig

__all__ = ["MetricsHTTPServer", "ScrapeHandler", "serve"]

_IDLE_TIMEOUT_S = 30.0  # a connection that sends or reads nothing for this long is dropped


class ScrapeHandler(WSGIRequestHandler):
    """Serve one scrape; log nothing."""

    # NOTE: without a timeout a client that connects and then sends or reads nothing
    # holds its thread and socket for as long as the process lives.
    timeout = _IDLE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsHTTPServer(ThreadingMixIn, WSGIServer):
    """A thread per connection; remembers open connections, so that closing drops them."""

    daemon_threads = True

    def __init__(self, family: int, address: tuple[str, int]) -> None:
        self.address_family = family
        self._guard = threading.Lock()
        self._open: set[socket.socket] = set()
        super().__init__(address, ScrapeHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._guard:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._guard:
            self._open.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # the client timed out or went away: nothing to report
        super().handle_error(request, client_address)

    def drop_connections(self) -> None:
        """Shut every open connection down, which ends the threads serving them."""
        with self._guard:
            connections = list(self._open)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


def serve(config: MetricsConfig, app: Any) -> tuple[MetricsHTTPServer, threading.Thread]:
    """Start serving `app` on the configured address, in a daemon thread.

    Raises:
        OSError: the host does not resolve, or the address cannot be bound.
    """
    family = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)[0][0]
    server = MetricsHTTPServer(family, (config.host, config.port))
    server.set_app(app)
    thread = threading.Thread(target=server.serve_forever, name="kvtiers-metrics", daemon=True)
    thread.start()
    return server, thread
