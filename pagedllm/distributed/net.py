"""Loopback ports: `free_port()` is a TCP port free on 127.0.0.1 now (the OS picks it; another process may take it
before it is bound again, so callers that can fail on a taken port say so)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
