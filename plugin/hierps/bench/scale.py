"""``hierps bench --scale``: the store at 10^6 and 10^7 rows (``--full``: also 10^8), phase by phase.

Per table size N, one table ``"t"`` (dim 16, adagrad) under a RAM budget (``--memory-budget``,
default 256MiB) and a 64MiB device budget, the pipeline on, goes through five phases, each in a
fresh process (the ``--worker`` of :mod:`hierps.bench.run`), so that each phase's peak RSS is its own:

1. ``write``: keys 0..N-1 through ``Store.write_rows`` in chunks of 2^20 rows, then a checkpoint;
2. ``train``: ``--passes`` passes of 4 mini-batches of 4096 keys never trained before (the store's
   files dropped from the page cache before each pass), each pass followed by a checkpoint;
3. ``reopen``: ``hierps.Store(path)`` and ``num_rows``, cold;
4. ``export``: ``hierps export``'s :func:`~hierps.lifecycle._export.export_store`, cold;
5. ``serving``: :func:`hierps.serving.open` of the export, cold, and a lookup of 16384 random ids
   (read from disk on demand: ``hierps bench --serving`` measures serving in detail);
6. ``reshard``: keys 0..N-1 written into a :class:`hierps.ShardedStore` of 2 ranks (threads of
   one process: each rank writes the keys it owns) and checkpointed, in a process of its own; then
   that checkpoint opened at 1 rank, cold, which reshards it: first a copy of it whose parts cannot
   be linked into one another (as on separate file systems: every row read from the 2 parts and
   written into the new one, then committed), then the store itself, whose rank 1 part the one rank
   adopts (1 divides 2: its segments hard-linked in, no row read or written); then opened again (a
   restore at the resharded checkpoint, cold). The streamed reshard's rows/s and GB/s of rows go
   against the sequential read bandwidth.

Each phase reports its seconds, peak RSS (``VmHWM``), the ``/proc/self/io`` deltas over the phase,
the SSD tier's key-index RAM, the files and bytes under the store directory, and whether its peak
RSS stays under ``memory_budget + device_budget + 2 B * N + 700 MiB``. A probe process measures
the disk in the same run: random 4 KiB reads at queue depth 16 (:func:`random_read`) and the cold
sequential read bandwidth (:func:`hierps.bench.machine.disk_read`); the train phase's rows read
from SSD per second are reported against the random read rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from hierps.bench._worker import spawn
from hierps.tiers import CheckpointReader

__all__ = [
    "FULL_SIZE",
    "PHASES",
    "RUNNERS",
    "BenchKind",
    "ScaleConfig",
    "StoreBenchConfig",
    "bare_import_rss",
    "check_goals",
    "config_from_args",
    "format_report",
    "io_counters",
    "peak_rss",
    "phase_config",
    "plot",
    "random_read",
    "rss_limit",
    "run_cli",
    "run_phase",
    "run_scale",
    "run_sizes",
    "spawn_phase",
]

_MiB = 1 << 20
FULL_SIZE = 100_000_000
PHASES = ("write", "train", "reopen", "wide", "export", "serving", "reshard")
# Phases that read the store the write phase leaves.
_READ_WRITTEN = frozenset(PHASES) - {"write", "reshard"}
_IO_FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes")
_RSS_SLACK = 700 * _MiB  # the allowance beyond the budgets and 2 B per key
_CHECKPOINT_SLACK = 1 * _MiB  # a checkpoint may write 4x its dirty rows' bytes + this
GOALS = [
    ("rss", "every phase's peak RSS <= memory budget + device budget + 2 B/key + 700 MiB", 1.0),
    ("checkpoint", "a checkpoint after a pass writes <= 4x the dirty rows' bytes + 1 MiB", 1.0),
    ("ssd_rows", "fresh-key pass reads rows at >= 50% of the random 4 KiB read rate", 0.5),
    ("wide", "reading a quarter of the rows runs at >= 50% of the sequential read bandwidth", 0.5),
    ("reshard", "a reshard 2 -> 1 rank moves rows at >= 50% of the sequential read bandwidth", 0.5),
]


@dataclass
class StoreBenchConfig:
    """Settings every bench of a large table shares: the table, the store it is written to, the disk
    probes, where and how each phase runs."""

    sizes: tuple[int, ...] = (1_000_000, 10_000_000)
    dim: int = 16
    memory_budget: str = "256MiB"
    device_budget: str = "64MiB"
    write_chunk: int = 1 << 20  # rows per write_rows call
    disk_bytes: int = 1 << 30  # size of each disk probe file
    probe_threads: int = 16  # random reads in flight
    seed: int = 0
    threads: int = 1  # torch intra-op threads of each phase
    tmp: str | None = None  # directory for stores and probe files (default: the system temp dir)
    keep: bool = False  # keep each size's store and export
    timeout: float = 4 * 3600.0  # per phase

    def __post_init__(self) -> None:
        from hierps.config import parse_size

        parse_size(self.memory_budget, "memory_budget")  # a ConfigError (a ValueError) when malformed
        parse_size(self.device_budget, "device_budget")


@dataclass
class ScaleConfig(StoreBenchConfig):
    """Settings of one ``hierps bench --scale`` run."""

    passes: int = 8
    batches: int = 4  # mini-batches per pass
    batch_keys: int = 4096  # distinct keys per mini-batch
    lookups: int = 16_384  # random ids looked up in the serving phase
    phases: tuple[str, ...] = PHASES  # which phases run (write first: the others read its store)
    # Also the wide and export phases with the numpy kernels instead of the compiled core, each right
    # after its compiled run, on the same store and disk: "wide-numpy", "export-numpy".
    numpy_too: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        fresh = self.passes * self.batches * self.batch_keys
        small = [n for n in self.sizes if n < fresh]
        if small:
            raise ValueError(
                f"{self.passes} passes of {self.batches} x {self.batch_keys} fresh keys need {fresh:,} rows; "
                f"size(s) {small} are smaller: give fewer --passes or larger --sizes."
            )


def phase_config(cfg: StoreBenchConfig) -> dict[str, Any]:
    """The JSON-ready settings a phase process gets (``threads`` also sets its OMP_NUM_THREADS)."""
    conf = asdict(cfg)
    conf["sizes"] = list(cfg.sizes)
    return conf


def rss_limit(conf: dict[str, Any], rows: int) -> int:
    """The peak RSS a phase on ``rows`` rows may reach: the budgets + 2 B per key + 700 MiB."""
    from hierps.config import parse_size

    return (
        parse_size(conf["memory_budget"], "memory_budget")
        + parse_size(conf["device_budget"], "device_budget")
        + 2 * rows
        + _RSS_SLACK
    )


# -- what a process measures of itself ------------------------------------------------------------
def peak_rss(status: str | None = None) -> int:
    """Bytes of ``VmHWM`` (peak resident set) in ``status`` (default: this process's /proc/self/status)."""
    text = Path("/proc/self/status").read_text(encoding="ascii") if status is None else status
    found = re.search(r"^VmHWM:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


def reset_peak_rss() -> int:
    """Reset this process's ``VmHWM`` to what it holds now (``/proc/self/clear_refs`` 5) -> that, in bytes."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return peak_rss()


def io_counters() -> dict[str, int]:
    """``rchar``, ``wchar``, ``read_bytes``, ``write_bytes`` of this process (zeros without /proc/self/io)."""
    try:
        words = Path("/proc/self/io").read_text(encoding="ascii").split()
    except OSError:
        words = []
    found = {name.rstrip(":"): int(value) for name, value in zip(words[::2], words[1::2])}
    return {name: found.get(name, 0) for name in _IO_FIELDS}


def _io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in _IO_FIELDS}


def _measured(fn: Callable[[], object], sync: bool = False) -> tuple[float, dict[str, int]]:
    """Seconds of ``fn()`` and its /proc/self/io deltas; with ``sync``, ``os.sync()`` (untimed) before and
    after, so that what it wrote has reached the block layer when ``write_bytes`` is read."""
    if sync:
        os.sync()
    io0, t0 = io_counters(), time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    if sync:
        os.sync()
    return seconds, _io_delta(io0, io_counters())


def _tree(path: str | None) -> dict[str, int]:
    """Files and bytes under ``path`` (zeros when it is missing)."""
    files = nbytes = 0
    for root, _, names in os.walk(path or ""):
        for name in names:
            try:
                nbytes += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
            files += 1
    return {"files": files, "bytes": nbytes}


def bare_import_rss() -> int:
    """Peak RSS of a fresh process that only runs ``import hierps, torch``: what every phase starts from."""
    code = "import hierps, torch; print(open('/proc/self/status').read())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return peak_rss(proc.stdout)


# -- the disk -------------------------------------------------------------------------------------
def _fill(path: Path, nbytes: int) -> None:
    """Write ``nbytes`` of incompressible bytes to ``path`` and fsync."""
    block = np.random.default_rng(1).integers(0, 256, 16 * _MiB, dtype=np.uint8)
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(block[: nbytes - start].data)
        f.flush()
        os.fsync(f.fileno())


def _pread_all(fd: int, block: int, offsets: np.ndarray) -> int:
    return sum(len(os.pread(fd, block, int(offset))) for offset in offsets)


def random_read(
    directory: Path, nbytes: int = 1 << 30, threads: int = 16, block: int = 4096, reads: int = 65_536
) -> dict[str, Any]:
    """Reads of ``block`` bytes at distinct random aligned offsets of a fresh ``nbytes`` file, ``threads``
    in flight (each thread one ``os.pread`` after another), the file dropped from the page cache and
    advised ``POSIX_FADV_RANDOM`` (no read-ahead) first; ``device_bytes_per_read`` shows that each read
    reached the device (4 KiB, not a page-cache hit nor a read-ahead)."""
    from hierps.bench.machine import drop_from_page_cache, io_read_bytes

    path = directory / "random-probe.bin"
    pages = nbytes // block
    offsets = np.random.default_rng(0).choice(pages, size=max(1, min(reads, pages // 2)), replace=False)
    try:
        _fill(path, nbytes)
        drop_from_page_cache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            io0, t0 = io_read_bytes(), time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                got = sum(pool.map(partial(_pread_all, fd, block), np.array_split(offsets * block, threads)))
            seconds, fetched = time.perf_counter() - t0, io_read_bytes() - io0
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return {
        "file_bytes": nbytes,
        "block": block,
        "threads": threads,
        "reads": len(offsets),
        "seconds": seconds,
        "reads_per_s": len(offsets) / seconds,
        "bytes_per_s": got / seconds,
        "device_bytes_per_read": fetched / len(offsets),
    }


def _disk_phase(spec: dict[str, Any]) -> dict[str, Any]:
    from hierps.bench.machine import disk_read

    conf, tmp = spec["config"], Path(spec["tmp"])
    t0 = time.perf_counter()
    rand = random_read(tmp, conf["disk_bytes"], threads=conf["probe_threads"])
    return {
        "random_4k": rand,
        "sequential": disk_read(tmp, conf["disk_bytes"]),
        "seconds": time.perf_counter() - t0,
    }


# -- the phases (each in its own process) ---------------------------------------------------------
def _open(spec: dict[str, Any]) -> Any:
    import hierps

    conf = spec["config"]
    return hierps.Store(
        spec["store"], memory_budget=conf["memory_budget"], device_budget=conf["device_budget"], pipeline=True
    )


def _write_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """Keys 0..N-1, rows of seeded random weights, zero optimizer state and counters; a checkpoint."""
    conf, n = spec["config"], spec["rows"]
    rng = np.random.default_rng(conf["seed"])
    t0 = time.perf_counter()
    with _open(spec) as store:
        info = store.table("t", conf["dim"], optimizer="adagrad")
        for start in range(0, n, conf["write_chunk"]):
            keys = np.arange(start, min(n, start + conf["write_chunk"]), dtype=np.int64)
            rows = np.zeros((len(keys), info.width), np.float32)
            for a in range(0, len(keys), 1 << 16):  # weights drawn in small blocks: no chunk-sized temporary
                rows[a : a + (1 << 16), : info.dim] = rng.standard_normal(
                    (min(1 << 16, len(keys) - a), info.dim), dtype=np.float32
                )
            store.write_rows("t", keys, rows)
            del rows  # before the next chunk is allocated: one chunk of rows at a time
        t1 = time.perf_counter()
        store.checkpoint()
        t2 = time.perf_counter()
        index = store.usage().index_ram_bytes
    return {
        "seconds": t2 - t0,
        "write_seconds": t1 - t0,
        "checkpoint_seconds": t2 - t1,
        "index_ram_bytes": index,
    }


def _fresh_keys(conf: dict[str, Any], rows: int) -> np.ndarray:
    """(passes, batches, batch_keys) distinct keys of 0..rows-1: disjoint slices of a seeded permutation."""
    shape = (conf["passes"], conf["batches"], conf["batch_keys"])
    rng = np.random.default_rng(conf["seed"] + 1)
    return rng.choice(rows, size=int(np.prod(shape)), replace=False).reshape(shape)


def _run_pass(store: Any, ids: list[Any], load: list[float]) -> None:
    """begin_pass (its seconds appended to ``load``: the reads of the pass's rows), per mini-batch
    gather / backward of sum(w^2) / step, end_pass."""
    t0 = time.perf_counter()
    store.begin_pass([{"t": k} for k in ids])
    load.append(time.perf_counter() - t0)
    for k in ids:
        w = store.gather("t", k, requires_grad=True)
        (w * w).sum().backward()
        store.step()
    store.end_pass()


def _train_pass(store: Any, batches: np.ndarray) -> dict[str, Any]:
    """One pass over ``batches`` (store files cold), then a checkpoint, each with its own I/O."""
    import torch

    from hierps.bench.machine import drop_from_page_cache

    ids = [torch.from_numpy(np.sort(b)).to(store.device) for b in batches]
    drop_from_page_cache(store.path)
    load: list[float] = []
    seconds, io = _measured(lambda: _run_pass(store, ids, load))
    stats = store.stats.history[-1]
    # The pass's background work (its compaction, on the pipeline's worker) ends before the checkpoint
    # is measured: num_rows waits for it. Its bytes are reported apart, as the pass's.
    background_seconds, background_io = _measured(lambda: store.num_rows("t"), sync=True)
    checkpoint_seconds, checkpoint_io = _measured(store.checkpoint, sync=True)
    return {
        "seconds": seconds,
        "load_seconds": load[0],
        "background_seconds": background_seconds,
        "background_io": background_io,
        "checkpoint_seconds": checkpoint_seconds,
        "io": io,
        "checkpoint_io": checkpoint_io,
        "dirty_bytes": batches.size * store.info("t").width * 4,
        "rows_loaded": stats.rows_loaded,
        "ssd_rows": stats.ssd_rows,
        "ssd_bytes_read": stats.ssd_bytes_read,
    }


def _train_phase(spec: dict[str, Any]) -> dict[str, Any]:
    keys = _fresh_keys(spec["config"], spec["rows"])
    t0 = time.perf_counter()
    with _open(spec) as store:
        opened = time.perf_counter() - t0
        passes = [_train_pass(store, group) for group in keys]
        index = store.usage().index_ram_bytes
        row_bytes = 4 * store.info("t").width
    pass_seconds = sum(p["seconds"] for p in passes)
    ssd_rows = sum(p["ssd_rows"] for p in passes)
    return {
        "seconds": pass_seconds + sum(p["checkpoint_seconds"] for p in passes),
        "open_seconds": opened,
        "passes": passes,
        # A pass's load is when its rows are read; the median pass (the first also loads the filters).
        "ssd_rows_per_s": statistics.median(p["ssd_rows"] / p["load_seconds"] for p in passes),
        "first_load_seconds": passes[0]["load_seconds"],
        "pass_rows_per_s": ssd_rows / pass_seconds,
        "index_ram_bytes": index,
        "row_bytes": row_bytes,
    }


def _wide_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """The SSD tier reading a quarter of the table's rows (store files cold), in sorted batches of
    2^18 keys as a pass's load of a large working set asks them: seconds of the reads (drawing the
    keys is not timed), bytes from the device."""
    rng = np.random.default_rng(spec["config"]["seed"] + 7)
    rows, block = spec["rows"], 1 << 20
    with _open(spec) as store, CheckpointReader(store.path) as reader:
        found = keys = 0
        seconds = 0.0
        ssd = reader.ssd  # the store's segments, read as the store's SSD tier reads them

        def read() -> None:
            nonlocal found, keys, seconds
            for start in range(0, rows, block):  # a quarter of each block: no table-sized key array
                size = min(block, rows - start)
                batch = start + np.sort(rng.choice(size, size // 4, replace=False)).astype(np.int64)
                t0 = time.perf_counter()
                for part in np.array_split(batch, max(1, len(batch) >> 18)):
                    found += int(ssd.read("t", part)[0].sum())
                seconds += time.perf_counter() - t0
                keys += len(batch)

        _, io = _measured(read)
        width = store.info("t").width
    return {"seconds": seconds, "keys": keys, "found": found, "read_io": io, "row_bytes": 4 * width}


def _reopen_phase(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    store = _open(spec)
    try:
        t1 = time.perf_counter()
        rows = store.num_rows("t")
        t2 = time.perf_counter()
        index = store.usage().index_ram_bytes
    finally:
        store.close()
    return {
        "seconds": t2 - t0,
        "open_seconds": t1 - t0,
        "num_rows_seconds": t2 - t1,
        "num_rows": rows,
        "index_ram_bytes": index,
    }


def _export_phase(spec: dict[str, Any]) -> dict[str, Any]:
    from hierps.lifecycle import export_store

    t0 = time.perf_counter()
    manifest = export_store(spec["store"], spec["export"])
    return {
        "seconds": time.perf_counter() - t0,
        "exported_rows": manifest["tables"]["t"]["rows"],
        "export": _tree(spec["export"]),
    }


def _serving_phase(spec: dict[str, Any]) -> dict[str, Any]:
    import hierps.serving

    ids = np.random.default_rng(spec["config"]["seed"] + 2).integers(
        0, spec["rows"], spec["config"]["lookups"]
    )
    t0 = time.perf_counter()
    tables = hierps.serving.open(spec["export"])
    t1 = time.perf_counter()
    tables.lookup("t", ids)
    t2 = time.perf_counter()
    return {
        "seconds": t2 - t0,
        "open_seconds": t1 - t0,
        "lookup_seconds": t2 - t1,
        "lookups": len(ids),
        "index_ram_bytes": tables.index_bytes,
    }


def _sharded_open(path: str, transport: Any, conf: dict[str, Any]) -> Any:
    import hierps

    return hierps.ShardedStore(
        path,
        transport,
        memory_budget=conf["memory_budget"],
        device_budget=conf["device_budget"],
        pipeline=True,
    )


def _shard_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """The reshard phase's checkpoint: keys 0..N-1 (rows as the write phase makes them) in a sharded
    store of ``spec["ranks"]`` ranks, threads of this process, each writing the keys it owns a chunk
    at a time (bulk loads, as the write phase's); a checkpoint of all ranks."""
    from hierps.bench._threads import ThreadTransport, run_ranks
    from hierps.sharding import owner_of

    conf, n, world = spec["config"], spec["rows"], spec["ranks"]

    def rank_main(transport: ThreadTransport) -> None:
        store = _sharded_open(spec["sharded"], transport, conf)
        try:
            info = store.table("t", conf["dim"], optimizer="adagrad")
            for start in range(0, n, conf["write_chunk"]):
                keys = np.arange(start, min(n, start + conf["write_chunk"]), dtype=np.int64)
                keys = keys[owner_of(keys, world) == transport.rank]
                rows = np.zeros((len(keys), info.width), np.float32)
                rng = np.random.default_rng([conf["seed"], start, transport.rank])
                rows[:, : info.dim] = rng.standard_normal((len(keys), info.dim), dtype=np.float32)
                store.local.write_rows("t", keys, rows)
                del rows
            store.checkpoint()
        finally:
            store.close()

    t0 = time.perf_counter()
    run_ranks(world, rank_main, timeout=None)
    return {"seconds": time.perf_counter() - t0, "ranks": world}


def _reshard_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of 2 ranks (written by a ``shard`` process) opened at 1 rank, cold, twice: a copy
    of it with the old parts' files not linkable (as on another file system: every row read from
    the 2 parts, sent to its owner and written into the new part, then committed), and the store
    itself, whose rank 1 part is adopted (its segments hard-linked in); their seconds and I/O. Then
    the store opened again at 1 rank, cold: a restore (its seconds, and the bytes it reads). The
    sharded stores are deleted after, unless kept."""
    from hierps.bench._threads import one_rank
    from hierps.bench.machine import drop_from_page_cache
    from hierps.sharding import streamed_reshards

    conf, n, tmp = spec["config"], spec["rows"], Path(spec["tmp"])
    sharded, streamed = tmp / "sharded", tmp / "sharded-streamed"
    setup = spawn_phase("shard", conf, tmp / "shard", rows=n, sharded=str(sharded), ranks=2)
    if "error" in setup:
        raise RuntimeError(f"writing the 2-rank store failed: {setup['error']}")
    opened: list[Any] = []

    def reshard(path: Path) -> tuple[float, dict[str, int], int, int, list[dict[str, Any]]]:
        drop_from_page_cache(path)
        seconds, io = _measured(lambda: opened.append(_sharded_open(str(path), one_rank(), conf)), sync=True)
        store = opened.pop()
        try:  # every row, once the reshard's checkpoint is written
            return seconds, io, store.num_rows("t")["ssd"], store.tables["t"].width, store.list_checkpoints()
        finally:
            store.close()

    try:
        shutil.copytree(sharded, streamed)
        with streamed_reshards():
            stream_seconds, stream_io, stream_rows, _, _ = reshard(streamed)
        shutil.rmtree(streamed, ignore_errors=True)
        seconds, io, rows, width, parts = reshard(sharded)
        drop_from_page_cache(sharded)
        restore_seconds, restore_io = _measured(
            lambda: opened.append(_sharded_open(str(sharded), one_rank(), conf))
        )
        opened.pop().close()
    finally:
        if not conf["keep"]:
            shutil.rmtree(sharded, ignore_errors=True)
        shutil.rmtree(streamed, ignore_errors=True)
    if stream_rows != rows:
        raise RuntimeError(f"the streamed reshard holds {stream_rows} rows, the adopting one {rows}")
    return {
        "seconds": stream_seconds,
        "setup": setup,
        "rows": rows,
        "row_bytes": 8 + 4 * width,  # a key and its decoded row
        "reshard_io": stream_io,
        "adopted_seconds": seconds,
        "adopted_io": io,
        "restore_seconds": restore_seconds,
        "restore_io": restore_io,
        "checkpoints": parts,
    }


Runner = tuple[Callable[[dict[str, Any]], dict[str, Any]], str | None]
# phase -> (what it runs, the directory dropped from the page cache before it: "store" / "export")
RUNNERS: dict[str, Runner] = {
    "disk": (_disk_phase, None),
    "write": (_write_phase, None),
    "train": (_train_phase, None),
    "reopen": (_reopen_phase, "store"),
    "wide": (_wide_phase, "store"),
    "export": (_export_phase, "store"),
    "serving": (_serving_phase, "export"),
    "shard": (_shard_phase, None),  # run by the reshard phase, in a process of its own
    "reshard": (_reshard_phase, None),
}


def run_phase(spec: dict[str, Any], runners: dict[str, Runner] | None = None) -> dict[str, Any]:
    """Run one phase of ``runners`` (default :data:`RUNNERS`) in this process (the worker's ``"scale"``
    task): its record with what it cost."""
    from hierps.bench.machine import drop_from_page_cache
    from hierps.storage import numpy_kernels

    body, cold = (RUNNERS if runners is None else runners)[spec["phase"]]
    if cold is not None:
        drop_from_page_cache(Path(spec[cold]))
    io0 = io_counters()
    with numpy_kernels() if spec["config"].get("kernels") == "numpy" else contextlib.nullcontext():
        record = body(spec)
    record["io"] = _io_delta(io0, io_counters())
    record["peak_rss_bytes"] = peak_rss()
    record["store"] = _tree(spec.get("store"))
    return record


# -- the run --------------------------------------------------------------------------------------
def spawn_phase(
    phase: str, conf: dict[str, Any], workdir: Path, task: str = "scale", **paths: Any
) -> dict[str, Any]:
    """Run ``phase`` of ``task`` (``"scale"`` or ``"serving"``) in a fresh worker process (``rows``,
    ``store``, ``export`` in ``paths``); its record, or ``{"error": ...}``."""
    spec = {"task": task, "phase": phase, "config": conf, "tmp": str(workdir), **paths}
    return spawn(spec, conf["timeout"])


def _judge(record: dict[str, Any], limit: int) -> dict[str, Any]:
    if "peak_rss_bytes" in record:
        record["rss_limit_bytes"] = limit
        record["rss_ok"] = record["peak_rss_bytes"] <= limit
    return record


def _run_size(conf: dict[str, Any], rows: int, root: Path, out: Callable[[str], Any]) -> dict[str, Any]:
    """Every phase on a table of ``rows`` rows under ``root``, in order; stops at the first that fails."""
    paths: dict[str, Any] = {"rows": rows, "store": str(root / "store"), "export": str(root / "export")}
    limit = rss_limit(conf, rows)
    phases: dict[str, dict[str, Any]] = {}
    try:
        for i, phase in enumerate(p for p in PHASES if p in conf["phases"]):
            t0 = time.perf_counter()
            phases[phase] = _judge(spawn_phase(phase, conf, root / f"{i}-{phase}", **paths), limit)
            state = "failed" if "error" in phases[phase] else f"{phases[phase]['seconds']:.1f} s"
            out(f"  {rows:,} rows, {phase}: {state} ({time.perf_counter() - t0:.0f} s with the process)")
            if "error" in phases[phase]:
                break
            if conf.get("numpy_too") and phase in ("wide", "export"):
                t0 = time.perf_counter()
                again = {**paths, "export": str(root / "export-numpy")}
                numpy_conf = {**conf, "kernels": "numpy"}
                record = _judge(spawn_phase(phase, numpy_conf, root / f"{i}-{phase}-numpy", **again), limit)
                phases[f"{phase}-numpy"] = record
                state = "failed" if "error" in record else f"{record['seconds']:.1f} s"
                out(
                    f"  {rows:,} rows, {phase} with the numpy kernels: {state} ({time.perf_counter() - t0:.0f} s)"
                )
    finally:
        if not conf["keep"]:
            shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "rss_limit_bytes": limit, "phases": phases}


SizeRunner = Callable[[dict[str, Any], int, Path, Callable[[str], Any]], dict[str, Any]]


@dataclass(frozen=True)
class BenchKind:
    """What a bench of a large table runs per size, and how it judges and reports the results."""

    task: str  # the worker task of its phases ("scale", "serving")
    run_size: SizeRunner  # (conf, rows, directory, out) -> that size's record
    check_goals: Callable[[dict[str, Any]], list[dict[str, Any]]]
    format_report: Callable[[dict[str, Any], Callable[[str], Any]], None]


def run_sizes(conf: dict[str, Any], kind: BenchKind, out: Callable[[str], Any]) -> dict[str, Any]:
    """In a fresh work directory (under ``conf["tmp"]``, removed unless ``conf["keep"]``): the peak RSS
    of a bare import, the disk probes (a ``"disk"`` phase of ``kind.task``), then ``kind.run_size``
    for each of ``conf["sizes"]``; then the goals and the report. The JSON-ready results."""
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix=f"hierps-{kind.task}-", dir=conf["tmp"]))
    out(f"  working under {root}")
    results: dict[str, Any] = {
        "config": conf,
        "cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg(),
    }
    try:
        results["bare_import_rss_bytes"] = bare_import_rss()
        results["disk"] = spawn_phase("disk", conf, root / "disk", task=kind.task)
        out("  disk probes: " + ("failed" if "error" in results["disk"] else "done"))
        results["sizes"] = [kind.run_size(conf, n, root / f"rows-{n}", out) for n in conf["sizes"]]
    finally:
        if conf["keep"]:
            out(f"stores and exports kept under {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    results["goals"] = kind.check_goals(results)
    results["seconds"] = time.perf_counter() - started
    kind.format_report(results, out)
    out(f"bench --{kind.task} took {results['seconds']:.0f} s")
    return results


def run_scale(cfg: ScaleConfig, out: Callable[[str], Any] = print) -> dict[str, Any]:
    """Probe the disk, then run every phase per size of ``cfg``; print the report; the JSON-ready results."""
    out(
        f"hierps bench --scale: table 't', dim {cfg.dim}, adagrad; RAM budget {cfg.memory_budget}, device budget "
        f"{cfg.device_budget}; {cfg.passes} passes of {cfg.batches} x {cfg.batch_keys} fresh keys; sizes "
        f"{', '.join(f'{n:,}' for n in cfg.sizes)}"
    )
    return run_sizes(phase_config(cfg), BenchKind("scale", _run_size, check_goals, format_report), out)


# -- the report -----------------------------------------------------------------------------------
def _finished(results: dict[str, Any], phase: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(rows, record) of every size whose ``phase`` finished."""
    for size in results.get("sizes", []):
        record = size["phases"].get(phase, {})
        if "seconds" in record:
            yield size["rows"], record


def _random_rate(results: dict[str, Any]) -> float | None:
    return results.get("disk", {}).get("random_4k", {}).get("reads_per_s")


def _checkpoint_ratio(p: dict[str, Any]) -> float:
    """A pass's checkpoint bytes over what the bound allows it (<= 1 meets it)."""
    return p["checkpoint_io"]["write_bytes"] / (4 * p["dirty_bytes"] + _CHECKPOINT_SLACK)


def check_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per goal: ``{"key", "goal", "value", "met", "note"}`` (value None: not measured)."""
    records = [
        (s["rows"], ph, r) for s in results.get("sizes", []) for ph, r in s["phases"].items() if "rss_ok" in r
    ]
    trained = list(_finished(results, "train"))
    rate = _random_rate(results)
    values: dict[str, tuple[float | None, str]] = {"rss": (None, "no phase finished")}
    if records:
        n, ph, r = max(records, key=lambda x: x[2]["peak_rss_bytes"] / x[2]["rss_limit_bytes"])
        values["rss"] = (
            r["peak_rss_bytes"] / r["rss_limit_bytes"],
            f"peak RSS / limit, worst: {ph} at {n:,} rows",
        )
    passes = [p for _, r in trained for p in r["passes"]]
    values["checkpoint"] = (
        (max(map(_checkpoint_ratio, passes)), "write_bytes / (4x dirty rows' bytes + 1 MiB), worst pass")
        if passes
        else (None, "train phase not run")
    )
    values["ssd_rows"] = (
        (
            min(r["ssd_rows_per_s"] for _, r in trained) / rate,
            "SSD rows/s of the train phase / random reads/s, worst",
        )
        if trained and rate
        else (None, "train phase or disk probe not run")
    )
    seq = results.get("disk", {}).get("sequential", {}).get("bytes_per_s")
    wides = list(_finished(results, "wide"))
    values["wide"] = (
        (
            min(w["read_io"]["read_bytes"] / w["seconds"] for _, w in wides) / seq,
            "device bytes/s reading a quarter of the rows / sequential bytes/s, worst",
        )
        if wides and seq
        else (None, "train phase or disk probe not run")
    )
    reshards = list(_finished(results, "reshard"))
    values["reshard"] = (
        (
            min(_reshard_rate(r) for _, r in reshards) / seq,
            "bytes of rows (key + decoded row) moved per s / sequential bytes/s, worst, streamed; "
            "adopted (old parts linked in): "
            + ", ".join(
                f"{r['rows'] * r['row_bytes'] / r['adopted_seconds'] / seq:.0f}x" for _, r in reshards
            ),
        )
        if reshards and seq
        else (None, "reshard phase or disk probe not run")
    )
    report = []
    for key, goal, threshold in GOALS:
        value, note = values[key]
        met = (
            None
            if value is None
            else (value >= threshold if key in ("ssd_rows", "wide", "reshard") else value <= threshold)
        )
        report.append({"key": key, "goal": goal, "value": value, "met": met, "note": note})
    return report


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / _MiB:.1f}"


def _phase_row(rows: int, phase: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{rows:>11,} {phase:8s} failed: {(r['error'].strip().splitlines() or ['?'])[-1]}"
    index = r.get("index_ram_bytes")
    io = r["io"]
    return (
        f"{rows:>11,} {phase:8s} {r['seconds']:8.2f} {_mib(r['peak_rss_bytes']):>8s} {_mib(r['rss_limit_bytes']):>8s} "
        f"{'ok' if r['rss_ok'] else 'OVER':>4s} {_mib(io['read_bytes']):>8s} {_mib(io['write_bytes']):>8s} "
        f"{_mib(io['rchar']):>8s} {_mib(io['wchar']):>8s} {'-' if index is None else f'{index / rows:.1f}':>7s} "
        f"{r['store']['files']:>6d} {_mib(r['store']['bytes']):>9s}"
    )


def _train_line(rows: int, r: dict[str, Any], rate: float | None) -> str:
    ps = r["passes"]
    ckpt = statistics.median(p["checkpoint_io"]["write_bytes"] for p in ps)
    dirty = ps[0]["dirty_bytes"]
    vs = f" = {r['ssd_rows_per_s'] / rate:.2f}x the random 4 KiB read rate" if rate else ""
    return (
        f"train, {rows:,} rows (medians of {len(ps)} passes): pass {statistics.median(p['seconds'] for p in ps):.3f} s, "
        f"{statistics.median(p['io']['read_bytes'] for p in ps) / _MiB:.1f} MiB read from the device; checkpoint "
        f"{statistics.median(p['checkpoint_seconds'] for p in ps):.3f} s, writes {ckpt / _MiB:.2f} MiB = "
        f"{ckpt / dirty:.1f}x the {dirty / _MiB:.2f} MiB of dirty rows (wchar "
        f"{statistics.median(p['checkpoint_io']['wchar'] for p in ps) / _MiB:.2f} MiB); background compaction "
        f"{statistics.mean(p['background_io']['write_bytes'] for p in ps) / _MiB:.2f} MiB a pass (mean); "
        f"{r['ssd_rows_per_s']:,.0f} rows/s from SSD while loading a pass (median; the first, which also "
        f"loads the segments' filters, {r['first_load_seconds']:.2f} s){vs} "
        f"({r['pass_rows_per_s']:,.0f} rows/s over whole passes)"
        + _amplification(
            statistics.median(p["io"]["read_bytes"] / max(p["ssd_rows"], 1) for p in ps),
            1,
            r.get("row_bytes"),
        )
    )


def _amplification(device_bytes: float, rows: float, row_bytes: int | None) -> str:
    """Read amplification: device bytes per byte of the rows asked for."""
    if not row_bytes or not rows:
        return ""
    return f"; read amplification {device_bytes / (rows * row_bytes):.2f} device bytes per row byte"


def _wide_line(rows: int, w: dict[str, Any], seq: float | None = None) -> str:
    rate = w["read_io"]["read_bytes"] / w["seconds"]
    vs = f" = {rate / seq:.2f}x the sequential read" if seq else ""
    return (
        f"wide, {rows:,} rows: a quarter of the rows ({w['keys']:,}) read in {w['seconds']:.2f} s: "
        f"{rate / 1e6:,.0f} MB/s from the device{vs}, {w['keys'] * w['row_bytes'] / w['seconds'] / 1e6:,.0f} "
        f"MB/s of rows" + _amplification(w["read_io"]["read_bytes"], w["keys"], w["row_bytes"])
    )


def _export_line(rows: int, e: dict[str, Any], disk: dict[str, Any]) -> str:
    seq = disk.get("sequential", {})
    read, write = e["io"]["read_bytes"] / e["seconds"], e["io"]["write_bytes"] / e["seconds"]
    vs_read = f" = {read / seq['bytes_per_s']:.2f}x the sequential read" if seq.get("bytes_per_s") else ""
    vs_write = (
        f" = {write / seq['write_bytes_per_s']:.2f}x the sequential write"
        if seq.get("write_bytes_per_s")
        else ""
    )
    return (
        f"export, {rows:,} rows in {e['seconds']:.2f} s: reads {read / 1e6:,.0f} MB/s from the device{vs_read}, "
        f"writes {write / 1e6:,.0f} MB/s{vs_write}"
    )


def _reshard_rate(r: dict[str, Any]) -> float:
    """Bytes of rows (a key and its decoded row each) a reshard moved per second."""
    return r["rows"] * r["row_bytes"] / r["seconds"]


def _reshard_line(rows: int, r: dict[str, Any], seq: float | None = None) -> str:
    rate, io = _reshard_rate(r), r["reshard_io"]
    vs = f" = {rate / seq:.2f}x the sequential read" if seq else ""
    return (
        f"reshard 2 -> 1 rank streamed, {rows:,} rows (written at 2 ranks in {r['setup']['seconds']:.1f} s): "
        f"{r['seconds']:.2f} s, {r['rows'] / r['seconds']:,.0f} rows/s, {rate / 1e9:.3f} GB/s of rows{vs}; "
        f"the device read {io['read_bytes'] / _MiB:,.0f} MiB and wrote {io['write_bytes'] / _MiB:,.0f} MiB "
        f"({io['write_bytes'] / (r['rows'] * r['row_bytes']):.2f}x the rows' bytes); peak RSS "
        f"{_mib(r['peak_rss_bytes'])} MiB of {_mib(r['rss_limit_bytes'])} MiB; where rank 1's part can be "
        f"linked in (adopted): {r['adopted_seconds']:.2f} s, the device reading "
        f"{r['adopted_io']['read_bytes'] / _MiB:.1f} MiB and writing {r['adopted_io']['write_bytes'] / _MiB:.1f} MiB; "
        f"restore at the resharded checkpoint (cold) {r['restore_seconds']:.2f} s, reading "
        f"{r['restore_io']['read_bytes'] / _MiB:.1f} MiB"
    )


def _disk_lines(results: dict[str, Any]) -> list[str]:
    d = results.get("disk", {})
    if "error" in d or not d:
        return [f"disk probes: {'failed: ' + d['error'].strip().splitlines()[-1] if d else 'not run'}"]
    r, s = d["random_4k"], d["sequential"]
    return [
        f"disk random 4 KiB reads, {r['threads']} in flight: {r['reads_per_s']:,.0f} reads/s "
        f"({r['bytes_per_s'] / 1e6:.0f} MB/s; {r['device_bytes_per_read'] / 1024:.1f} KiB from the device per read)",
        f"disk sequential read (cold): {s['bytes_per_s'] / 1e9:.2f} GB/s; sequential write (with fsync): "
        f"{s['write_bytes_per_s'] / 1e9:.2f} GB/s",
    ]


def format_report(results: dict[str, Any], out: Callable[[str], Any] = print) -> None:
    """Print the table (one row per size x phase), the train phase per size, the disk and the goals."""
    out("")
    for line in _disk_lines(results):
        out(line)
    if "bare_import_rss_bytes" in results:
        out(f"a bare `import hierps, torch` process: peak RSS {_mib(results['bare_import_rss_bytes'])} MiB")
    out("")
    out(
        f"{'rows':>11s} {'phase':8s} {'seconds':>8s} {'RSS MiB':>8s} {'limit':>8s} {'RSS':>4s} {'read MiB':>8s} "
        f"{'writ MiB':>8s} {'rchar':>8s} {'wchar':>8s} {'idx B/k':>7s} {'files':>6s} {'store MiB':>9s}"
    )
    for size in results.get("sizes", []):
        for phase, record in size["phases"].items():
            out(_phase_row(size["rows"], phase, record))
    out("")
    for rows, record in _finished(results, "train"):
        out(_train_line(rows, record, _random_rate(results)))
    seq = results.get("disk", {}).get("sequential", {}).get("bytes_per_s")
    for phase in ("wide", "wide-numpy"):
        for rows, record in _finished(results, phase):
            out(_wide_line(rows, record, seq).replace("wide,", f"{phase},", 1))
    for phase in ("export", "export-numpy"):
        for rows, record in _finished(results, phase):
            out(_export_line(rows, record, results.get("disk", {})).replace("export,", f"{phase},", 1))
    for rows, record in _finished(results, "reshard"):
        out(_reshard_line(rows, record, seq))
    for g in results.get("goals", []):
        state = {True: "MET    ", False: "NOT MET", None: "n/a    "}[g["met"]]
        value = "-" if g["value"] is None else f"{g['value']:.2f}"
        out(f"{state} {g['goal']}: {value} ({g['note']})")


def _label(ax: Any, ylabel: str, title: str, log_rows: bool = True) -> None:
    """Rows on the x axis (log scale unless told), ``ylabel`` from 0, ``title``, a legend."""
    if log_rows:
        ax.set_xscale("log")
    ax.set_xlabel("rows", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def _plot_rss(ax: Any, results: dict[str, Any]) -> None:
    for phase in PHASES:
        points = list(_finished(results, phase))
        ax.plot(
            [n for n, _ in points], [r["peak_rss_bytes"] / _MiB for _, r in points], marker="o", label=phase
        )
    sizes = [s["rows"] for s in results.get("sizes", [])]
    limits = [s["rss_limit_bytes"] / _MiB for s in results.get("sizes", [])]
    ax.plot(sizes, limits, "k--", marker="_", markersize=16, label="limit")
    _label(ax, "peak RSS, MiB", "peak RSS per phase (fresh process each)")


def _plot_checkpoint(ax: Any, results: dict[str, Any]) -> None:
    trained = list(_finished(results, "train"))
    x = np.arange(len(trained))
    ckpt = [
        statistics.median(p["checkpoint_io"]["write_bytes"] for p in r["passes"]) / _MiB for _, r in trained
    ]
    dirty = [r["passes"][0]["dirty_bytes"] / _MiB for _, r in trained]
    ax.bar(x - 0.2, dirty, 0.4, label="dirty rows", color="#55a868")
    ax.bar(x + 0.2, ckpt, 0.4, label="checkpoint write_bytes", color="#c44e52")
    ax.plot(
        x, [4 * d + _CHECKPOINT_SLACK / _MiB for d in dirty], "k_", markersize=20, label="4x dirty + 1 MiB"
    )
    ax.set_xticks(x)
    ax.set_xticklabels([f"{n:.0e}" for n, _ in trained])
    _label(ax, "MiB per checkpoint (median)", "checkpoint after a pass vs its dirty rows", log_rows=False)


def _plot_reopen(ax: Any, results: dict[str, Any]) -> None:
    points = list(_finished(results, "reopen"))
    ax.plot([n for n, _ in points], [r["seconds"] for _, r in points], marker="o", label="Store() + num_rows")
    _label(ax, "seconds (cold)", "reopen")


def plot(results: dict[str, Any], path: str) -> None:
    """A PNG: peak RSS per phase vs rows with the limit, checkpoint vs dirty bytes, reopen seconds vs rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13.8, 3.8))
    for ax, panel in zip(axes, (_plot_rss, _plot_checkpoint, _plot_reopen)):
        panel(ax, results)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------------------
def config_from_args(args: argparse.Namespace) -> ScaleConfig:
    """The :class:`ScaleConfig` of parsed ``hierps bench --scale`` options; ValueError when they clash."""
    from hierps.config import parse_size

    sizes = tuple(args.sizes or ScaleConfig.sizes)
    given = {
        "sizes": (*sizes, FULL_SIZE) if args.full and FULL_SIZE not in sizes else sizes,
        "passes": args.passes,
        "memory_budget": args.memory_budget,
        "threads": args.threads,
        "tmp": args.tmp,
        "keep": args.keep or None,
        "phases": _phases(args.phases) if args.phases else None,
        "disk_bytes": parse_size(args.disk_bytes, "--disk-bytes") if args.disk_bytes else None,
        "numpy_too": getattr(args, "numpy_too", False) or None,
    }
    return ScaleConfig(**{k: v for k, v in given.items() if v is not None})


def _phases(text: str) -> tuple[str, ...]:
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(set(chosen) - set(PHASES))
    if unknown or not chosen or ("write" not in chosen and _READ_WRITTEN & set(chosen)):
        raise ValueError(
            f"--phases: a comma-separated subset of {','.join(PHASES)}, including write unless only "
            f"reshard; got {text!r}"
        )
    return chosen


def run_cli(
    args: argparse.Namespace,
    name: str,
    make_config: Callable[[argparse.Namespace], Any],
    run: Callable[[Any], dict[str, Any]],
) -> dict[str, Any] | None:
    """``hierps bench --<name>``: the config from ``args`` (None, with the reason on stderr, when its
    options clash), the run, its results written to ``--json``."""
    try:
        cfg = make_config(args)
    except ValueError as e:
        print(f"hierps bench --{name}: {e}", file=sys.stderr)
        return None
    results = run(cfg)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return results


def run_from_args(args: argparse.Namespace) -> int:
    """``hierps bench --scale``: run, print the report, write ``--json`` / ``--plot``."""
    results = run_cli(args, "scale", config_from_args, run_scale)
    if results is None:
        return 2
    if args.plot:
        plot(results, args.plot)
    return 0
