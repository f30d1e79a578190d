"""``hierps bench --core``: the CPU the SSD tier spends on each 4 KiB chunk it reads, compiled core
against numpy, in one process.

One array laid out as a segment's rows (dim-16 Adagrad rows with their key: 39 float32, 26 rows in
each page-aligned 4 KiB chunk) is written to a temporary directory and kept in the page cache, so
that reads cost CPU only. It is read as the store reads its segments:

- **lookup**: one row in every 16th chunk (64 KiB apart: one read each), as a pass of fresh keys
  asks them of a large table, 2,520 rows a request;
- **scan**: every row, in requests of 512 KiB (a merge's buffer: compaction, export, scans);
- **quarter**: a sorted quarter of the rows of each 2^20, in requests of 2^18 (the scale bench's wide
  phase);
- **whole**: every row in one request, where the cost of a request (planning it, handing its tasks
  to the threads) is spread over 40,000 chunks: what is left is the check and the gather.

For each, with the compiled core and with the numpy code (:func:`hierps.storage.numpy_kernels`):
the process's CPU time (every thread) per chunk read, and the wall time. The reads themselves are
measured alone too, as plain ``os.preadv`` calls of the same bytes on one thread, so that the CPU
hierps adds to each chunk on top of its read (planning, checking the crc32c and binding tag,
gathering the rows, handing work to the read threads) is the difference; and so is the first touch
of a fresh output of each request's size (allocating it, the kernel zeroing its pages), which every
read pays and the difference includes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from zarr.storage import LocalStore

from hierps.storage import (
    ArrayWriter,
    OpenFiles,
    compiled_core,
    crc32c,
    numpy_kernels,
    open_array,
    read_arrays,
)

__all__ = ["run_core_bench", "run_from_args"]

_WIDTH = 39  # a dim-16 Adagrad row (37 floats) and its key (2)
_CHUNK_ROWS = (4096 - 8) // (4 * _WIDTH)  # as hierps.storage._segment lays them out: 26
_PAGE = 4096


def _patterns(n: int) -> dict[str, list[np.ndarray]]:
    """Each pattern's requests: (k,) int64 sorted positions."""
    rng = np.random.default_rng(0)
    n_chunks = -(-n // _CHUNK_ROWS)
    lookup = np.arange(0, n_chunks, 16, dtype=np.int64) * _CHUNK_ROWS + 3
    lookup = lookup[lookup < n]
    step = (512 << 10) // (4 * _WIDTH)
    scan = [np.arange(s, min(s + step, n), dtype=np.int64) for s in range(0, n, step)]
    quarter = []
    for start in range(0, n, 1 << 20):
        size = min(1 << 20, n - start)
        batch = start + np.sort(rng.choice(size, size // 4, replace=False)).astype(np.int64)
        quarter += np.array_split(batch, max(1, len(batch) >> 18))
    return {"lookup": [lookup], "scan": scan, "quarter": quarter, "whole": [np.arange(n, dtype=np.int64)]}


def _bare_reads(path: Path, requests: list[np.ndarray], stride: int) -> Callable[[], None]:
    """The same bytes as the store's reads, as plain ``os.preadv`` calls on one thread into one reused
    buffer: one per chunk for chunks far apart, else each request's span in pieces of 512 KiB."""
    piece = 512 << 10
    reads: list[tuple[int, int]] = []
    for pos in requests:
        chunks = np.unique(pos // _CHUNK_ROWS)
        if len(chunks) > 1 and np.all(np.diff(chunks) >= 8):
            reads += [(int(c) * stride, stride) for c in chunks]
        else:
            first, end = int(chunks[0]) * stride, (int(chunks[-1]) + 1) * stride
            reads += [(at, min(piece, end - at)) for at in range(first, end, piece)]
    buf = bytearray(piece)

    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            view = memoryview(buf)
            for offset, length in reads:
                os.preadv(fd, [view[:length]], offset)
        finally:
            os.close(fd)

    return read


def _timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median CPU seconds of the process, median wall seconds) of ``fn`` over ``repeats`` runs."""
    fn()  # warm: page cache, threads, allocator
    cpu, wall = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(cpu), statistics.median(wall)


def _crc_rates(repeats: int) -> dict[str, Any]:
    """crc32c (the store's, :func:`hierps.storage.crc32c`) of one chunk's payload, a call each, and of
    1 MiB at once (in the cache), with each kernel: microseconds a chunk, GB/s."""
    rng = np.random.default_rng(2)
    chunk, big = rng.integers(0, 256, 4088, np.uint8), rng.integers(0, 256, 1 << 20, np.uint8)
    out: dict[str, Any] = {}
    for kernel in ["compiled", "numpy"] if compiled_core() else ["numpy"]:
        with numpy_kernels() if kernel == "numpy" else contextlib.nullcontext():
            small = min(_timed(lambda: [crc32c(chunk) for _ in range(10_000)], repeats)) / 10_000
            large = min(_timed(lambda: [crc32c(big) for _ in range(64)], repeats)) / 64
        out[kernel] = {"us_per_4088_bytes": small * 1e6, "gb_per_s": len(big) / large / 1e9}
    return out


def run_core_bench(rows: int = 1 << 20, repeats: int = 7, tmp: str | None = None) -> dict[str, Any]:
    """Write the array, then time every pattern with both kernels; the results as a dict."""
    root = Path(tempfile.mkdtemp(prefix="hierps-core-", dir=tmp))
    try:
        zstore = LocalStore(str(root))
        data = np.random.default_rng(1).random((rows, _WIDTH), dtype=np.float32)
        kernels = ["compiled", "numpy"] if compiled_core() else ["numpy"]
        write_s = {}
        for kernel in kernels:
            with numpy_kernels() if kernel == "numpy" else contextlib.nullcontext():
                t0 = time.perf_counter()
                writer = ArrayWriter(
                    zstore, f"rows-{kernel}", (_WIDTH,), "float32", _CHUNK_ROWS, align=_PAGE, identity="rows"
                )
                for start in range(0, rows, 1 << 16):
                    writer.append(data[start : start + (1 << 16)])
                writer.close()
                write_s[kernel] = time.perf_counter() - t0
        arr = open_array(zstore, root, f"rows-{kernels[0]}", "float32", 2, identity="rows")
        shard = arr.files[0]
        results: dict[str, Any] = {
            "rows": rows,
            "row_bytes": 4 * _WIDTH,
            "chunk_rows": _CHUNK_ROWS,
            "repeats": repeats,
            "cpus": os.cpu_count(),
            "write_seconds": write_s,
            "write_mb_per_s": {k: rows * 4 * _WIDTH / s / 1e6 for k, s in write_s.items()},
            "crc32c": _crc_rates(repeats),
            "patterns": {},
        }
        for name, requests in _patterns(rows).items():
            chunks = sum(len(np.unique(p // _CHUNK_ROWS)) for p in requests)
            bare_cpu, bare_wall = _timed(_bare_reads(shard, requests, arr.stride), repeats)

            def touch(requests: list[np.ndarray] = requests) -> None:
                for pos in requests:  # a fresh output as each read returns: allocated, every page written
                    np.empty((len(pos), _WIDTH), np.float32).fill(0)

            touch_cpu, _ = _timed(touch, repeats)
            record: dict[str, Any] = {
                "requests": len(requests),
                "chunks": chunks,
                "rows_read": int(sum(len(p) for p in requests)),
                "bare_read_cpu_us_per_chunk": bare_cpu / chunks * 1e6,
                "output_touch_cpu_us_per_chunk": touch_cpu / chunks * 1e6,
            }
            files = OpenFiles()  # descriptors kept open between reads, as the store keeps them
            for kernel in kernels:

                def read(requests: list[np.ndarray] = requests, files: OpenFiles = files) -> None:
                    for pos in requests:
                        next(read_arrays([(arr, pos)], files))

                with numpy_kernels() if kernel == "numpy" else contextlib.nullcontext():
                    got = next(read_arrays([(arr, requests[0])]))
                    if not np.array_equal(got, data[requests[0]]):
                        raise AssertionError(f"{name}, {kernel}: the rows read differ from the rows written")
                    cpu, wall = _timed(read, repeats)
                record[kernel] = {  # (files stay open: the bare reads open the file once too)
                    "cpu_us_per_chunk": cpu / chunks * 1e6,
                    "added_cpu_us_per_chunk": (cpu - bare_cpu) / chunks * 1e6,
                    "wall_us_per_chunk": wall / chunks * 1e6,
                    "read_gb_per_s": chunks * _PAGE / wall / 1e9,
                }
            files.close()
            results["patterns"][name] = record
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(results: dict[str, Any]) -> str:
    lines = [
        f"hierps bench --core: {results['rows']:,} rows of {results['row_bytes']} B, {results['chunk_rows']} a "
        f"4 KiB chunk, from the page cache; medians of {results['repeats']}; {results['cpus']} CPUs",
        "pattern  kernel    chunks  CPU us/chunk  of it, over the bare read  wall us/chunk  GB/s",
    ]
    for name, rec in results["patterns"].items():
        lines.append(
            f"{name:8s} {'preadv':8s} {rec['chunks']:7,d}  {rec['bare_read_cpu_us_per_chunk']:12.2f}"
            f"  (the reads alone, one thread; a fresh output's pages: {rec['output_touch_cpu_us_per_chunk']:.2f})"
        )
        for kernel in ("compiled", "numpy"):
            if kernel in rec:
                k = rec[kernel]
                lines.append(
                    f"{name:8s} {kernel:8s} {rec['chunks']:7,d}  {k['cpu_us_per_chunk']:12.2f}"
                    f"  {k['added_cpu_us_per_chunk']:25.2f}  {k['wall_us_per_chunk']:13.2f}  {k['read_gb_per_s']:4.2f}"
                )
    writes = ", ".join(f"{k} {v:,.0f} MB/s" for k, v in results["write_mb_per_s"].items())
    lines.append(f"writing the array (encode + crc32c + tag + write): {writes}")
    crcs = ", ".join(
        f"{k} {v['us_per_4088_bytes']:.2f} us a 4088-byte chunk (one Python call each), {v['gb_per_s']:.1f} GB/s on 1 MiB"
        for k, v in results["crc32c"].items()
    )
    lines.append(f"crc32c: {crcs}")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    results = run_core_bench(rows=args.rows or 1 << 20, repeats=args.repeats or 7)
    print(report(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0
