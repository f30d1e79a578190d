"""``python -m hierps.bench_dist``: the sharded store against one store, and its scaling inputs.

The same as ``hierps bench --dist``; see :mod:`hierps.bench.dist`.
"""

from __future__ import annotations

import sys

from hierps.bench.dist import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
