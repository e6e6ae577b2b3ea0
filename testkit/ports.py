"""Ports for the servers tests and benches start on this machine."""

from __future__ import annotations

import random
import socket

FREE_PORTS = range(21000, 32000)
"""Where `free_port` looks: below Linux's ephemeral range (32768-60999), whose ports any outgoing connection or
server starting beside may take between the check and a server's bind (a NIXL side channel and a vLLM server
each died of "Address already in use" so), and above the fixed `cluster.port_base` ranges of the tests' local
and lab runs (18000-20700 with their offsets)."""


def free_port() -> int:
    """A port nothing listens on now, at random in FREE_PORTS."""
    for port in random.Random().sample(FREE_PORTS, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FREE_PORTS.start}-{FREE_PORTS.stop - 1}")
