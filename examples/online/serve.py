"""The serving side: follow the directory the trainer publishes into, and say how fresh its rows are.

Opens ``hierps.serving.open(directory, follow=...)`` once the first export is there, looks up a few
ids of each table in a loop, and prints a line for every new checkpoint it serves: the generation,
the checkpoint, and the staleness (the time from the checkpoint the trainer made right after the
pass's last step to the moment these lookups return its rows)::

    python examples/online/serve.py /tmp/serve --seconds 60
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import hierps.serving
from hierps.errors import HierpsError


def made_at(tables: hierps.serving.ServingTables) -> float:
    """When the checkpoint the served rows are of was made (from the newest export's manifest)."""
    return float(json.loads((Path(tables.applied[-1]) / "manifest.json").read_text())["checkpoint_created"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--seconds", type=float, default=60.0, help="serve this long, then stop")
    p.add_argument("--poll", type=float, default=0.2, help="seconds between looks for a new delta")
    p.add_argument("--json", default=None, help="write every generation's staleness here at the end")
    args = p.parse_args()
    deadline, tables, seen, served = time.monotonic() + args.seconds, None, None, []
    ids = np.arange(64, dtype=np.int64)
    while time.monotonic() < deadline:
        if tables is None:
            try:
                tables = hierps.serving.open(args.directory, follow=args.poll)
            except (HierpsError, OSError):  # nothing published yet
                time.sleep(args.poll)
                continue
        rows = {name: tables.lookup(name, ids) for name in tables.tables}  # what a request would read
        if tables.checkpoint != seen:
            seen, now = tables.checkpoint, time.time()
            staleness = now - made_at(tables)
            served.append({"generation": tables.generation, "checkpoint": seen, "staleness_s": staleness})
            norm = float(np.mean([np.abs(r).mean() for r in rows.values()]))
            print(
                f"generation {tables.generation:3d}  checkpoint {seen:4d}  {len(tables.applied)} exports in the "
                f"chain  staleness {staleness:.2f}s  mean |row| {norm:.5f}",
                flush=True,
            )
        time.sleep(0.05)
    if tables is not None:
        tables.close()
    if args.json:
        Path(args.json).write_text(json.dumps(served))


if __name__ == "__main__":
    main()
