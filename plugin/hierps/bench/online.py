"""Staleness of the freshness loop: a pass's last step to its rows served, and the cost per delta.

A store of ``tables`` tables of ``rows`` rows (dim ``dim``, adagrad), written whole first, trains
``passes`` passes of ``batches`` mini-batches of ``batch_size`` ids per table (uniform over the
rows; the loss is the rows' squares summed, so every gathered row changes). After each pass the
trainer checkpoints the store and publishes it (:class:`hierps.online.Publisher`: the first time a
base, then deltas, a new base every ``compact_every`` deltas) into a serving directory that
:func:`hierps.serving.open` follows at ``follow`` seconds. Per pass:

- ``pass_s``: the pass's training time (begin_pass to its last step);
- ``staleness_s``: from the pass's last step to the moment the follower serves its rows: lookups of
  the last mini-batch's ids are polled until they equal the trained values (a checkpoint, the
  export's write and up to one poll of the follower);
- ``checkpoint_s``, and what the publish wrote: its kind, ``bytes``, ``seconds``, ``rows`` changed.

Run: ``python -m hierps.bench.online [--rows 100000 --tables 2 --passes 6 ...]`` (prints one line a
pass, then the summary as JSON).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hierps
import hierps.serving
from hierps.config import parse_int, parse_number
from hierps.online import Publisher

__all__ = ["measure_staleness"]

_CHUNK = 1 << 16  # rows written at a time when the store is filled


def measure_staleness(
    *,
    tables: int = 2,
    rows: int = 100_000,
    dim: int = 16,
    passes: int = 6,
    batches: int = 16,
    batch_size: int = 1024,
    compact_every: int = 4,
    follow: float = 0.2,
    timeout: float = 60.0,
    directory: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Train, checkpoint, publish and serve ``passes`` passes; per-pass records and their medians.

    Returns ``{"config": {...}, "passes": [{"pass", "pass_s", "checkpoint_s", "kind", "bytes",
    "seconds", "staleness_s"}, ...], "summary": {...}}`` (the summary's medians are over the deltas;
    the first pass's base is reported apart). ``directory``: where the store and the serving
    directory go (default: a temporary one, removed after).
    """
    counts = {"tables": tables, "rows": rows, "dim": dim, "passes": passes, "batches": batches}
    counts |= {"batch_size": batch_size, "compact_every": compact_every}
    for name, count in counts.items():
        parse_int(name, count, 1)
    for name, seconds in (("follow", follow), ("timeout", timeout)):
        parse_number(name, seconds, low=0.0, low_open=True)
    tmp = tempfile.TemporaryDirectory(prefix="hierps-bench-online-") if directory is None else None
    root = Path(tmp.name if tmp is not None else str(directory))
    names = [f"t{i}" for i in range(tables)]
    rng = np.random.default_rng(seed)
    store = hierps.Store(root / "store", seed=seed)
    served: hierps.serving.ServingTables | None = None
    records: list[dict[str, Any]] = []
    try:
        for name in names:
            store.table(name, dim)
            for lo in range(0, rows, _CHUNK):
                keys = np.arange(lo, min(rows, lo + _CHUNK), dtype=np.int64)
                store.write(name, keys, rng.standard_normal((len(keys), dim)).astype(np.float32))
        publisher = Publisher(store, root / "serve", compact_every=compact_every)
        for p in range(passes):
            ids = [
                {n: rng.integers(0, rows, batch_size, dtype=np.int64) for n in names} for _ in range(batches)
            ]
            started = time.perf_counter()
            store.begin_pass(ids)
            for batch in ids:
                loss = torch.zeros(())
                for name in names:
                    unique = torch.from_numpy(np.unique(batch[name]))
                    loss = loss + (store.gather(name, unique, requires_grad=True) ** 2).sum()
                loss.backward()
                store.step()
            trained = time.perf_counter()  # the pass's last step
            last = {n: np.unique(ids[-1][n]) for n in names}
            want = {n: store.lookup(n, last[n]).cpu().numpy() for n in names}
            store.end_pass()
            ckpt = store.checkpoint(f"pass{p + 1}")
            checkpointed = time.perf_counter()
            done = publisher.publish()
            if done is None:
                raise RuntimeError(f"pass {p + 1}: the publisher wrote nothing for checkpoint {ckpt}")
            if served is None:
                served = hierps.serving.open(root / "serve", follow=follow)
            while not all(np.array_equal(np.asarray(served.lookup(n, last[n])), want[n]) for n in names):
                if time.perf_counter() - trained > timeout:
                    raise RuntimeError(f"pass {p + 1}: its rows were not served within {timeout} s")
                time.sleep(0.005)
            seen = time.perf_counter()
            records.append(
                {
                    "pass": p + 1,
                    "pass_s": trained - started,
                    "checkpoint_s": checkpointed - trained,
                    "kind": done.kind,
                    "bytes": done.bytes,
                    "seconds": done.seconds,
                    "staleness_s": seen - trained,
                }
            )
    finally:
        if served is not None:
            served.close()
        store.close()
        if tmp is not None:
            tmp.cleanup()
    config = {
        "tables": tables,
        "rows": rows,
        "dim": dim,
        "passes": passes,
        "batches": batches,
        "batch_size": batch_size,
        "compact_every": compact_every,
        "follow": follow,
    }
    return {"config": config, "passes": records, "summary": _summary(records)}


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    deltas = [r for r in records if r["kind"] == "delta"]
    bases = [r for r in records if r["kind"] == "base"]

    def median(rs: list[dict[str, Any]], key: str) -> float | None:
        return float(np.median([r[key] for r in rs])) if rs else None

    return {
        "pass_s": median(records, "pass_s"),
        "staleness_s": median(records, "staleness_s"),
        "staleness_max_s": max(r["staleness_s"] for r in records) if records else None,
        "delta_bytes": median(deltas, "bytes"),
        "delta_seconds": median(deltas, "seconds"),
        "delta_seconds_per_pass_s": (
            float(np.median([r["seconds"] / r["pass_s"] for r in deltas])) if deltas else None
        ),
        "base_bytes": median(bases, "bytes"),
        "base_seconds": median(bases, "seconds"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hierps.bench.online", description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=int, default=2)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--passes", type=int, default=6)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--compact-every", type=int, default=4)
    parser.add_argument("--follow", type=float, default=0.2)
    parser.add_argument("--directory", default=None)
    args = parser.parse_args(argv)
    result = measure_staleness(
        tables=args.tables,
        rows=args.rows,
        dim=args.dim,
        passes=args.passes,
        batches=args.batches,
        batch_size=args.batch_size,
        compact_every=args.compact_every,
        follow=args.follow,
        directory=args.directory,
    )
    for r in result["passes"]:
        print(
            f"pass {r['pass']:2d}  trained in {r['pass_s']:.2f}s  checkpoint {r['checkpoint_s']:.2f}s  "
            f"{r['kind']:5s} {r['bytes'] / 2**20:6.2f} MiB in {r['seconds']:.2f}s  "
            f"served {r['staleness_s']:.2f}s after its last step"
        )
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
