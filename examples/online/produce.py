"""Write click logs as Parquet files into a directory, one file at a time, the way a log shipper does.

Each file holds ``--rows`` examples of the demo's synthetic Criteo-format clicks (13 dense features
``d0..d12``, 26 categorical ids ``c0..c25``, ``label``) and an event-time column ``ts`` (seconds,
non-decreasing: ``--seconds-per-file`` of logs per file). A file is written under a name starting
with ``_`` and renamed into place once complete, so a reader that ignores such names
(:class:`hierps.online.ParquetStream`) never sees half a file (:func:`hierps.demo.online.write_log_file`)::

    python examples/online/produce.py /tmp/logs --files 12 --rows 8192 --interval 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hierps.demo.online import write_log_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--files", type=int, default=12)
    p.add_argument("--rows", type=int, default=8192, help="examples per file")
    p.add_argument("--seconds-per-file", type=float, default=60.0, help="event time each file covers")
    p.add_argument("--interval", type=float, default=1.0, help="wall seconds between files")
    p.add_argument("--start", type=int, default=0, help="index of the first file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    directory = Path(args.directory)
    directory.mkdir(parents=True, exist_ok=True)
    for k in range(args.start, args.start + args.files):
        path = write_log_file(directory, k, args.rows, args.seconds_per_file, args.seed)
        print(f"wrote {path.name}: {args.rows} examples", flush=True)
        if k + 1 < args.start + args.files:
            time.sleep(args.interval)


if __name__ == "__main__":
    main()
