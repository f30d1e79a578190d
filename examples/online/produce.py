"""Write click logs as Parquet files into a directory, one file at a time, the way a log shipper does.

Each file holds ``--rows`` examples of the demo's synthetic Criteo-format clicks (13 dense features
``d0..d12``, 26 categorical ids ``c0..c25``, ``label``) and an event-time column ``ts`` (seconds,
non-decreasing: ``--seconds-per-file`` of logs per file). A file is written under a name starting
with ``_`` and renamed into place once complete, so a reader that ignores such names
(:class:`hierps.online.ParquetStream`) never sees half a file::

    python examples/online/produce.py /tmp/logs --files 12 --rows 8192 --interval 2
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from hierps.demo.data import CriteoSpec, generate

T0 = 1_800_000_000  # the first example's event time (seconds since the epoch)


def write_file(directory: Path, index: int, rows: int, seconds: float, seed: int) -> Path:
    """Part ``index`` of the log: examples ``index * rows ..``, event times spread over ``seconds``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = generate(CriteoSpec(seed=seed), rows, seed=seed * 100_003 + index)
    ts = T0 + index * seconds + np.arange(rows) * (seconds / rows)
    columns = {"ts": pa.array(ts.astype(np.float64))}
    columns |= {f"d{j}": pa.array(data.dense[:, j]) for j in range(data.dense.shape[1])}
    columns |= {f"c{j}": pa.array(data.sparse[:, j]) for j in range(data.sparse.shape[1])}
    columns["label"] = pa.array(data.labels)
    final = directory / f"part-{index:05d}.parquet"
    tmp = directory / f"_tmp-{final.name}"
    pq.write_table(pa.table(columns), tmp, row_group_size=4096)
    os.replace(tmp, final)  # complete: now the stream may read it
    return final


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
        path = write_file(directory, k, args.rows, args.seconds_per_file, args.seed)
        print(f"wrote {path.name}: {args.rows} examples", flush=True)
        if k + 1 < args.start + args.files:
            time.sleep(args.interval)


if __name__ == "__main__":
    main()
