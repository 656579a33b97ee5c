"""A free TCP port on this machine, for a rendezvous that must not collide with another job's.

Floor layer: imports nothing of zerodp, so the process-group code, the launchers, `zerodp compare`
and the tests can all take their port from here.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` (default the loopback address), found by binding port 0.

    The port is released before this returns, so another process could take it before the caller's
    rendezvous binds it: good enough for a local job's MASTER_PORT, where a collision shows as an
    "address already in use" error rather than as two jobs joined.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
