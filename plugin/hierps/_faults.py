"""Named fault points for crash-consistency tests.

``HIERPS_FAULT=<point>`` (optionally ``<point>:<n>`` to fire on the n-th time the point is
reached) makes the process kill itself with SIGKILL at that point, as a power cut or an OOM kill
would. Unset, a point costs one comparison.

Tests that fork workers from a pre-imported process set the fault with :func:`arm` instead of the
environment, and list the points a run reaches, in order, with :func:`trace`. The points and what
a kill at each leaves behind are listed in ``docs/reliability.md``.
"""

from __future__ import annotations

import os
import signal

__all__ = ["arm", "fault_point", "trace"]

_name = ""
_remaining = 0
_trace: list[str] | None = None


def arm(spec: str) -> None:
    """Fire at ``<point>`` or ``<point>:<n>`` (the n-th time it is reached); ``""`` disarms."""
    global _name, _remaining
    name, _, nth = spec.partition(":")
    _name = name
    _remaining = int(nth) if nth.isdigit() else 1


def trace(into: list[str] | None) -> None:
    """Append the name of every point reached from now on to ``into`` (``None`` stops)."""
    global _trace
    _trace = into


def fault_point(name: str) -> None:
    """Die here when the armed fault names this point."""
    global _remaining
    if _trace is not None:
        _trace.append(name)
    if name != _name:
        return
    _remaining -= 1
    if _remaining <= 0:
        os.kill(os.getpid(), signal.SIGKILL)


arm(os.environ.get("HIERPS_FAULT", ""))
