"""What the machine allows, measured in the same run as the trainers, and how the SSD tier scales.

- :func:`ram_copy` — numpy copy bandwidth of a few hundred MB;
- :func:`disk_read` — sequential read bandwidth of a freshly written file, dropped from the page
  cache first (``posix_fadvise(DONTNEED)`` after ``fsync``);
- :func:`ssd_tier_read` — the SSD tier reading each pass's rows of the bench workload, cold:
  row bytes delivered (and device bytes fetched) per second spent in ``SsdTier.read_many``;
- :func:`ssd_scaling` — the time of a pass over a fixed working set with ``n`` rows on SSD, and
  the key-index memory per row resident only on SSD.

Bytes actually fetched from the block device come from ``/proc/self/io`` (``read_bytes``), which
shows both whether a drop from the page cache worked and how many bytes a read pulled in.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hierps
from hierps.rows import splitmix64

__all__ = ["disk_read", "drop_from_page_cache", "io_read_bytes", "ram_copy", "ssd_scaling", "ssd_tier_read"]

_MiB = 1 << 20


def io_read_bytes() -> int:
    """Bytes this process has caused to be fetched from storage (0 where /proc/self/io is missing)."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def drop_from_page_cache(root: Path, start: int = 0) -> int:
    """fsync and drop every file under ``root`` (or ``root`` itself, from byte ``start`` on) from the
    page cache; returns files."""
    paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, start, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(paths)


def ram_copy(nbytes: int = 256 * _MiB, repeats: int = 5) -> dict[str, Any]:
    """Median bytes/s of ``np.copyto`` between two arrays of ``nbytes`` (each byte read once, written once)."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return {"bytes": nbytes, "seconds": times, "bytes_per_s": nbytes / statistics.median(times)}


def disk_read(
    directory: Path, nbytes: int = 1 << 30, repeats: int = 3, block: int = 8 * _MiB
) -> dict[str, Any]:
    """Write ``nbytes`` to a file in ``directory``, fsync, then time cold sequential reads (and one warm)."""
    path = directory / "disk-probe.bin"
    chunk = np.random.default_rng(0).integers(0, 256, 16 * _MiB, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, chunk[: min(len(chunk), nbytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    write_seconds = time.perf_counter() - t0
    buf = bytearray(block)

    def read_all() -> tuple[float, int]:
        io0 = io_read_bytes()
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return time.perf_counter() - t, io_read_bytes() - io0

    try:
        cold, fetched = [], []
        for _ in range(repeats):
            drop_from_page_cache(path)
            seconds, from_device = read_all()
            cold.append(seconds)
            fetched.append(from_device)
        warm, _ = read_all()
    finally:
        path.unlink(missing_ok=True)
    return {
        "bytes": nbytes,
        "write_bytes_per_s": nbytes / write_seconds,
        "cold_seconds": cold,
        "bytes_per_s": nbytes / statistics.median(cold),
        "warm_bytes_per_s": nbytes / warm,
        "device_bytes_per_read": fetched,
    }


def ssd_tier_read(
    cfg: dict[str, Any], tmp: Path, passes: int = 3, disk_bytes_per_s: float | None = None
) -> dict[str, Any]:
    """Rows of the bench workload on SSD only; time cold reads of each of the first passes' rows.

    ``bytes_per_s`` counts row bytes delivered, ``device_bytes_per_s`` bytes fetched from the
    device (their ratio is ``read_amplification``); given the disk's cold sequential read bandwidth
    (:func:`disk_read`), both are also reported as fractions of it.

    Every distinct id of the workload is written through ``Store.write_rows`` with no RAM
    budget (so it lands in SSD segments), checkpointed, and then, per pass, the segment files are
    dropped from the page cache and one ``read_many`` of a :class:`hierps.CheckpointReader`'s SSD
    tier (the same reads as the store's) fetches the pass's sorted keys of
    every table, as the store asks for a pass's missing rows.
    """
    from hierps.bench.variants import make_workload
    from hierps.demo.app import table_names

    work = make_workload(cfg)
    names = table_names(len(work.spec.resolved_vocab_sizes))
    store = hierps.Store(tmp / "store", memory_budget=0, device_budget=cfg["device_budget"], pipeline=False)
    rng = np.random.default_rng(0)
    try:
        for i, name in enumerate(names):
            info = store.table(name, cfg["dim"])
            keys = np.unique(work.data.sparse[:, i])
            rows = rng.standard_normal((len(keys), info.width), dtype=np.float32)
            rows[:, info.dim :] = np.abs(rows[:, info.dim :])  # optimizer state sums squares: >= 0
            store.write_rows(name, keys, rows)
        store.checkpoint()
        reader = hierps.CheckpointReader(store.path)  # its SSD tier reads the store's segments
        ssd = reader.ssd
        runs = []
        for group in work.passes[:passes]:
            wanted = {
                n: np.unique(np.concatenate([s[:, i].numpy() for _, s, _ in group]))
                for i, n in enumerate(names)
            }
            drop_from_page_cache(store.path / "segments")
            r0, io0 = ssd.bytes_read, io_read_bytes()
            t0 = time.perf_counter()
            ssd.read_many(wanted)
            seconds = time.perf_counter() - t0
            runs.append(
                {
                    "seconds": seconds,
                    "row_bytes": ssd.bytes_read - r0,
                    "device_bytes": io_read_bytes() - io0,
                    "rows": int(sum(len(k) for k in wanted.values())),
                }
            )
        reader.close()
        disk = store.usage().disk_bytes
    finally:
        store.close()
    best = sorted(runs, key=lambda r: r["row_bytes"] / r["seconds"])[len(runs) // 2]
    return {
        "runs": runs,
        "bytes_per_s": best["row_bytes"] / best["seconds"],
        "device_bytes_per_s": best["device_bytes"] / best["seconds"],
        "rows_per_pass": best["rows"],
        "read_amplification": best["device_bytes"] / max(best["row_bytes"], 1),
        **(
            {
                "disk_bytes_per_s": disk_bytes_per_s,
                "fraction_of_disk": best["row_bytes"] / best["seconds"] / disk_bytes_per_s,
                "device_fraction_of_disk": best["device_bytes"] / best["seconds"] / disk_bytes_per_s,
            }
            if disk_bytes_per_s
            else {}
        ),
        "segment_bytes": disk,
        "rows_stored": work.distinct_ids,
    }


def _keys(n: int) -> np.ndarray:
    """``n`` distinct raw-looking int64 keys; the first ``m`` are the same for every ``n``."""
    return splitmix64(np.arange(n, dtype=np.uint64) + np.uint64(12345)).view(np.int64)


def _timed_pass(
    store: hierps.Store, bag: hierps.EmbeddingBag, keys: np.ndarray, batches: int, prefetch: bool = False
) -> dict[str, Any]:
    """One pass over ``keys`` (split into ``batches`` mini-batches), segments dropped from the page cache
    first; with ``prefetch``, the same keys are announced as the next pass (a recurring working set)."""
    mini = list(torch.from_numpy(keys.copy()).chunk(batches))
    drop_from_page_cache(store.path / "segments")
    io0 = io_read_bytes()
    t1 = time.perf_counter()
    store.begin_pass([{"t": ids} for ids in mini])
    if prefetch:
        store.prefetch([{"t": ids} for ids in mini])
    t2 = time.perf_counter()
    for ids in mini:
        bag(ids, torch.arange(ids.numel())).sum().backward()
        store.step()
    t3 = time.perf_counter()
    store.end_pass()
    t4 = time.perf_counter()
    return {
        "seconds": t4 - t1,
        "begin_seconds": t2 - t1,
        "train_seconds": t3 - t2,
        "end_seconds": t4 - t3,
        "device_bytes": io_read_bytes() - io0,
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": runs,
        **{k: statistics.median(r[k] for r in runs) for k in ("seconds", "begin_seconds", "device_bytes")},
    }


def ssd_scaling(
    n_rows: int,
    cfg: dict[str, Any],
    tmp: Path,
    working_set: int = 16_384,
    batches: int = 4,
    timed_passes: int = 5,
) -> dict[str, Any]:
    """Pass times over a working set of keys drawn from the first 100k keys, with ``n_rows`` rows on SSD.

    The rows are written through ``Store.write_rows`` with a 1 MiB RAM budget and checkpointed.
    Every pass starts with the segments dropped from the page cache and runs begin_pass /
    ``batches`` training steps / end_pass. ``fixed``: the same working set pass after pass (one
    untimed pass first, which also lets compaction of the bulk write settle), the steady state of
    a pipeline whose passes share their keys. ``fresh``: keys never read before in each pass, the
    worst case (every row comes out of the bulk segments). The keys are the same whatever ``n_rows``.
    """
    dim = cfg["dim"]

    def open_store(pipeline: bool) -> hierps.Store:
        return hierps.Store(
            tmp / "store", memory_budget="1MiB", device_budget=cfg["device_budget"], pipeline=pipeline
        )

    def make_bag(store: hierps.Store) -> hierps.EmbeddingBag:
        return hierps.EmbeddingBag(
            None,
            dim,
            mode="sum",
            store=store,
            name="t",
            optimizer={"type": "adagrad", "params": {"lr": 0.05}},
        )

    store = open_store(pipeline=False)
    try:
        bag = make_bag(store)
        width = store.tables["t"].width
        rng = np.random.default_rng(cfg["seed"])
        t0 = time.perf_counter()
        all_keys, step = _keys(n_rows), 1 << 21
        for start in range(0, n_rows, step):
            keys = all_keys[start : start + step]
            store.write_rows("t", keys, rng.random((len(keys), width), dtype=np.float32))
        store.checkpoint()
        write_seconds = time.perf_counter() - t0
        pool = rng.permutation(all_keys[:100_000])
        if (timed_passes + 1) * working_set > len(pool):
            raise ValueError(
                f"ssd scaling: {timed_passes + 1} working sets of {working_set} keys need "
                f"{(timed_passes + 1) * working_set} keys; n_rows={n_rows} gives {len(pool)}."
            )
        fixed = pool[:working_set]
        for _ in range(3):  # untimed: the compaction of the bulk write settles
            _timed_pass(store, bag, fixed, batches)
        fixed_runs = [_timed_pass(store, bag, fixed, batches) for _ in range(timed_passes)]
        fresh_runs = [
            _timed_pass(store, bag, pool[(p + 1) * working_set : (p + 2) * working_set], batches)
            for p in range(timed_passes)
        ]
        # The default mode: the pipeline on, the working set recurring. A store's settings are fixed
        # when it is built, so the same store is checkpointed (every row made durable) and reopened
        # with the pipeline on, between passes; the untimed passes below bring the working set back.
        store.checkpoint()
        store.close()
        store = open_store(pipeline=True)
        bag = make_bag(store)
        for _ in range(2):  # untimed: the working set comes back from SSD, then stays resident
            _timed_pass(store, bag, fixed, batches, prefetch=True)
        piped_runs = [_timed_pass(store, bag, fixed, batches, prefetch=True) for _ in range(timed_passes)]
        usage = store.usage()
        index_bytes, rows = usage.index_ram_bytes, usage.ssd_rows
        result = {
            "rows": n_rows,
            "rows_on_ssd": rows,
            "working_set": working_set,
            "write_seconds": write_seconds,
            "fixed": _summary(fixed_runs),
            "fresh": _summary(fresh_runs),
            "pipelined": _summary(piped_runs),
            "seconds": statistics.median(r["seconds"] for r in fixed_runs),
            "index_bytes": index_bytes,
            "index_bytes_per_row": index_bytes / max(rows, 1),
            "segments": usage.segments,
            "segment_bytes": usage.disk_bytes,
        }
    finally:
        store.close()
    return result
