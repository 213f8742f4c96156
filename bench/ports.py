"""A free TCP port on the loopback, for the benches that start services on their own ports."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS's pick; another process may take it before use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
