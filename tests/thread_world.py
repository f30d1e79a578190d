"""Several ranks of a sharded store in one process, one thread per rank: see :mod:`hierps.bench._threads`."""

from hierps.bench._threads import ThreadTransport, run_ranks

__all__ = ["ThreadTransport", "run_ranks"]
