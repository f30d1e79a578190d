"""Where the ranks of a job meet: a free TCP port for ``MASTER_PORT``.

Launchers (``torchrun``, the Horovod glue of :mod:`hierps.integrations.horovod`, the benchmarks and
tests that start ranks themselves) need a port nobody listens on; the OS picks one.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (``""``: on every interface, for ranks on other hosts).

    The port is released before it is returned, so another process may take it first: use it at once.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
