"""A training run with three checkpoints, killed at fault points by the crash tests.

Two tables (adam and adagrad rows), a RAM tier of a few rows (so rows are evicted to SSD segments
during every pass), compaction after every pass (``max_segments=3``) and one kept checkpoint
(so every checkpoint retires the previous one and garbage-collects its segments). Segments use
1 KiB chunks written one chunk per block, so a segment write can stop half way.

Runs happen in processes forked from a server that imported torch and hierps once
(``multiprocessing`` forkserver): a run costs a fork, not a fresh interpreter. ``run_forked``
returns the exit code; a run killed at its fault point returns ``-SIGKILL``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hierps
import hierps.storage._arrays
from hierps import _faults
from hierps._store import store_parts

TABLES = {
    "user": (4, {"type": "adam", "params": {"lr": 0.01}}),
    "item": (3, {"type": "adagrad", "params": {"lr": 0.05}}),
}
VOCAB = 300
KEYS = (np.arange(VOCAB, dtype=np.int64) - VOCAB // 2) * 7919
TAGS = ("c1", "c2", "c3")
SETTINGS: dict[str, Any] = {
    "memory_budget": "2KiB",
    "device_budget": "64KiB",
    "device": "cpu",
    "max_segments": 3,
    "keep_checkpoints": 1,
    "seed": 5,
}
_BAG = 24
_OFFSETS = torch.arange(0, _BAG, 4)


def open_store(path: Path) -> tuple[hierps.Store, dict[str, hierps.EmbeddingBag]]:
    store = hierps.Store(path, **SETTINGS)
    store_parts(store).core.ssd._chunk_bytes = 1024  # several chunks per segment
    bags = {
        t: hierps.EmbeddingBag(None, dim, mode="sum", store=store, name=t, optimizer=opt)
        for t, (dim, opt) in TABLES.items()
    }
    return store, bags


def train(store: hierps.Store, bags: dict[str, hierps.EmbeddingBag], seed: int, passes: int = 2) -> None:
    """``passes`` passes of 4 mini-batches, ids drawn (zipf) from KEYS with ``seed``."""
    rng = np.random.default_rng(seed)
    for _ in range(passes):
        batches = [
            {t: torch.from_numpy(KEYS[(rng.zipf(1.2, size=_BAG) - 1) % VOCAB]) for t in TABLES}
            for _ in range(4)
        ]
        with store.run_pass(batches):
            for batch in batches:
                loss = sum((bags[t](batch[t], _OFFSETS) ** 2).sum() for t in TABLES)
                loss.backward()
                store.step()


def rows_of(store: hierps.Store) -> dict[str, np.ndarray]:
    """Every row (weights and optimizer state) of KEYS, per table."""
    return {t: store.read_rows(t, KEYS).copy() for t in TABLES}


def steps_of(store: hierps.Store) -> dict[str, int]:
    return {t: store.tables[t].step for t in TABLES}


def scenario(store_path: str, out: str, fault: str, record: bool) -> None:
    """The run: train, checkpoint c1; train, c2; train, c3. ``record``: save what each checkpoint holds.

    Recording writes OUT/trace.json (every fault point reached, and ``returned:<tag>`` after each
    checkpoint), OUT/<tag>.npz (rows) and OUT/snap-<tag>/ (a copy of the store as it stood).
    """
    _faults.arm(fault)
    trace: list[str] | None = [] if record else None
    _faults.trace(trace)
    store, bags = open_store(Path(store_path))
    for i, tag in enumerate(TAGS, start=1):
        train(store, bags, seed=i)
        store.checkpoint(tag)
        if trace is not None:
            trace.append(f"returned:{tag}")
            _faults.trace(None)  # reading the rows back is not part of the run
            np.savez(Path(out) / f"{tag}.npz", **rows_of(store))
            shutil.copytree(store_path, Path(out) / f"snap-{tag}", ignore=shutil.ignore_patterns("LOCK"))
            _faults.trace(trace)
    store.close()
    if trace is not None:
        (Path(out) / "trace.json").write_text(json.dumps(trace))


def open_only(store_path: str, out: str, fault: str, record: bool) -> None:
    """Just open the store (recovery: drop incomplete checkpoints, collect garbage) and close it."""
    _faults.arm(fault)
    store, _ = open_store(Path(store_path))
    store.close()


@contextmanager
def tmpfs_dir(prefix: str, fallback: Path) -> Iterator[Path]:
    """A fresh directory on tmpfs when there is one (no fsync cost; SIGKILL tests do not need
    fsync), else ``fallback``; removed afterwards."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and shm.stat().st_mode & 0o002):
        yield fallback
        return
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def digest(keys: np.ndarray, rows: np.ndarray) -> str:
    return hashlib.sha256(
        np.ascontiguousarray(keys).tobytes() + np.ascontiguousarray(rows).tobytes()
    ).hexdigest()


def checkpoint_loop(store_path: str, out: str, fault: str, record: bool) -> None:
    """Train and checkpoint round after round (``fault`` holds the number of rounds), logging to
    OUT/log.jsonl what each checkpoint holds: ``{"id", "tag", "digest": {table: sha256}}``."""
    store, bags = open_store(Path(store_path))
    with open(Path(out) / "log.jsonl", "a", encoding="utf-8") as log:
        for i in range(int(fault)):
            train(store, bags, seed=100 + i, passes=1)
            ckpt = store.checkpoint(f"r{i}")
            keys = {t: store_parts(store).core.ssd.keys(t) for t in TABLES}
            sums = {t: digest(keys[t], store.read_rows(t, keys[t])) for t in TABLES}
            log.write(json.dumps({"id": ckpt, "tag": f"r{i}", "digest": sums}) + "\n")
            log.flush()
    store.close()


def hold(store_path: str, out: str, fault: str, record: bool) -> None:
    """Open the store, checkpoint, say ``ready`` and keep it open until ``release`` appears (60 s at most)."""
    import time

    store = hierps.Store(store_path, device="cpu")
    store.checkpoint("held")
    (Path(out) / "ready").touch()
    deadline = time.monotonic() + 60
    while not (Path(out) / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    store.close()


def resume(path: Path) -> tuple[str | None, dict[str, np.ndarray], dict[str, np.ndarray], dict[str, int]]:
    """Open a store the way a restarted job does and train on: (tag opened, rows then, rows after, steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention
    store, bags = open_store(path)
    try:
        tags = store.list_checkpoints()
        opened = tags[-1]["tag"] if tags else None
        before = rows_of(store)
        train(store, bags, seed=99, passes=1)
        store.checkpoint("resumed")
        return opened, before, rows_of(store), steps_of(store)
    finally:
        store.close()
        torch.set_num_threads(threads)


# File-system calls counted as the fault point ``io`` (``io:<n>`` kills the run just before its n-th
# such call): a kill can then land between any two writes, renames, fsyncs or deletions, not only
# at the named fault points.
IO_CALLS = (
    "write",
    "pwrite",
    "fsync",
    "fdatasync",
    "replace",
    "rename",
    "unlink",
    "mkdir",
    "rmdir",
    "ftruncate",
)


def count_io() -> None:
    """Make every call of :data:`IO_CALLS` reach the fault point ``io`` first (in this process)."""
    for name in IO_CALLS:
        real = getattr(os, name)

        def counted(*args: Any, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            _faults.fault_point("io")
            return _real(*args, **kwargs)

        setattr(os, name, counted)


def _child(
    target: Callable[[str, str, str, bool], None], store: str, out: str, fault: str, record: bool
) -> None:
    torch.set_num_threads(1)
    count_io()
    hierps.storage._arrays._BLOCK_CHUNKS = (
        1  # segment rows written one chunk at a time, a fault point after each
    )
    try:
        target(store, out, fault, record)
    except BaseException:
        (Path(out) / "error.txt").write_text(traceback.format_exc())
        raise


def start_forked(
    target: Callable[[str, str, str, bool], None],
    store: Path,
    out: Path,
    fault: str = "",
    record: bool = False,
) -> multiprocessing.process.BaseProcess:
    """Start ``target(store, out, fault, record)`` in a process forked from the server."""
    ctx = multiprocessing.get_context("forkserver")
    # The server imports these once; this module (not on the server's sys.path in Python 3.11)
    # is then imported by each child cheaply.
    ctx.set_forkserver_preload(["hierps", "hierps.tiers._reader"])
    out.mkdir(parents=True, exist_ok=True)
    proc = ctx.Process(target=_child, args=(target, str(store), str(out), fault, record))
    proc.start()
    return proc


def run_forked(
    target: Callable[[str, str, str, bool], None], *args: Any, timeout: float = 120.0, **kwargs: Any
) -> int:
    """:func:`start_forked` (same arguments), then wait for it: its exit code (-9: killed)."""
    proc = start_forked(target, *args, **kwargs)
    fault, out = kwargs.get("fault", ""), Path(args[1])
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"{target.__name__} with fault {fault!r} did not finish in {timeout} s")
    error = out / "error.txt"
    if proc.exitcode not in (0, -9) and error.exists():
        raise AssertionError(f"{target.__name__} with fault {fault!r} failed:\n{error.read_text()}")
    return proc.exitcode
