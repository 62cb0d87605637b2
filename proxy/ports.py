"""A free local TCP port, for the servers the benchmarks and tests start (vLLM's ``get_open_port``)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that was free a moment ago: bind port 0, read what the OS chose, close.

    Another process may take it before the caller binds it (the usual race of this idiom); the
    callers start one server on it right away.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
