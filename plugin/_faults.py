"""Named fault points for crash-consistency tests.

``HIERPS_FAULT=<point>`` (optionally ``<point>:<n>`` to fire on the n-th time the point is
reached) makes the process kill itself with SIGKILL at that point, as a power cut or an OOM kill
would. Unset, a point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["fault_point"]

_spec = os.environ.get("HIERPS_FAULT", "")
_name, _, _nth = _spec.partition(":")
_remaining = int(_nth) if _nth.isdigit() else 1


def fault_point(name: str) -> None:
    """Die here when ``HIERPS_FAULT`` names this point."""
    global _remaining
    if name != _name:
        return
    _remaining -= 1
    if _remaining <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
