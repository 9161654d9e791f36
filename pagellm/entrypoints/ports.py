"""TCP ports of the local servers: a listening socket for ``pagellm serve``, a free port for a
process about to start, and whether a port is taken. Standard library only (the replica
launcher and the benchmarks import it without the server's dependencies)."""

from __future__ import annotations

import socket


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (with SO_REUSEADDR, as uvicorn binds: closed connections
    in TIME_WAIT do not block it; another listener does). Raises OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (another process may take it before the caller
    binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port: int) -> bool:
    """Whether another socket listens on 127.0.0.1:port (listen_socket fails there)."""
    try:
        listen_socket("127.0.0.1", port).close()
    except OSError:
        return True
    return False
