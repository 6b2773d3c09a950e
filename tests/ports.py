"""A free TCP port for a test's server or torchrun rendezvous (fixed ports collide with other runs)."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
