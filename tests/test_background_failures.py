"""A task of the pass pipeline that fails is reported once, with nothing left running behind it.

The pipeline's worker runs three kinds of task: the write-back of the rows leaving the device tier
(``_writeback``), the read-ahead of the next pass (``_prepare``) and the compaction after a pass
(``_compact``). Each case makes one task fail at one place it reaches (a fault point, or for the
read-ahead, which writes nothing, its read of the SSD tier), in the second of four pipelined
passes, and checks what ``docs/reliability.md`` promises:

- the error reaches the caller once, the very exception the task raised, from a call that waits
  for the pipeline, and only after every task submitted so far has finished;
- the first ``checkpoint()`` after it returns, and the store reopens at it with exactly the rows
  (weights and optimizer state) it served right after it returned.

The table of cases is checked against the points a run without failures reaches on the worker,
so it cannot drift from the code.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hierps
from hierps import _faults
from hierps._store import store_parts

TABLES = {
    "user": (4, {"type": "adam", "params": {"lr": 0.01}}),
    "item": (3, {"type": "adagrad", "params": {"lr": 0.05}}),
}
KEYS = (np.arange(400, dtype=np.int64) - 200) * 7919
PASSES = 4
FAIL_IN_PASS = 1  # the failing task is one of those submitted from this pass on
_BAG = 24
_OFFSETS = torch.arange(0, _BAG, 4)

# (task, where it fails): every fault point each kind of task reaches, and the read-ahead's read.
CASES = [
    ("_writeback", "pass.write_back"),
    ("_writeback", "memory.evict"),
    ("_writeback", "ssd.segment_begin"),
    ("_writeback", "ssd.segment_rows_block"),
    ("_writeback", "ssd.segment_rows_written"),
    ("_writeback", "ssd.segment_written"),
    ("_prepare", "read"),
    ("_compact", "ssd.compaction_begin"),
    ("_compact", "ssd.segment_begin"),
    ("_compact", "ssd.segment_rows_block"),
    ("_compact", "ssd.segment_rows_written"),
    ("_compact", "ssd.segment_written"),
    ("_compact", "ssd.compaction"),
    ("_compact", "ssd.gc_segment"),
]


class Injected(OSError):
    """The failure a case makes a task raise (an ``OSError``, as a failing disk raises)."""


class Worker:
    """Watches one store's pipeline: which kind of task the worker runs, every task submitted (to
    check they are done) and every place each kind reaches; once armed, it fails the first time
    task ``fail[0]`` reaches ``fail[1]``."""

    def __init__(self, store: hierps.Store, fail: tuple[str, str] | None) -> None:
        self.pipe = store_parts(store).pipe
        self.tasks: list[Future[Any]] = []
        self.reached: set[tuple[str, str]] = set()
        self.fail = fail
        self.armed: tuple[str, str] | None = None
        self.raised: Injected | None = None
        self._running = threading.local()
        submit = self.pipe._submit

        def watched(fn: Callable[..., Any], *args: object) -> Future[Any]:
            fut = submit(self._as(fn.__name__, fn), *args)
            self.tasks.append(fut)
            return fut

        self.pipe._submit = watched  # type: ignore[method-assign]
        ssd = store_parts(store).core.ssd
        read_many = ssd.read_many

        def read(requests: dict[str, np.ndarray]) -> Any:
            self.reach("read")
            return read_many(requests)

        ssd.read_many = read  # type: ignore[method-assign]

    def _as(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: object) -> Any:
            self._running.kind = kind
            try:
                return fn(*args)
            finally:
                self._running.kind = None

        return run

    def reach(self, where: str) -> None:
        kind = getattr(self._running, "kind", None)
        if kind is None:
            return  # the training thread
        self.reached.add((kind, where))
        if self.armed == (kind, where) and self.raised is None:
            self.raised = Injected(errno.EIO, f"injected failure of {kind} at {where}")
            raise self.raised

    def arm(self) -> None:
        self.armed = self.fail

    def all_done(self) -> bool:
        return all(f.done() for f in self.tasks)


class _Points(list[str]):
    """What ``hierps._faults.trace`` appends each fault point reached to: hands it to ``worker``."""

    def __init__(self, worker: Worker) -> None:
        super().__init__()
        self.worker = worker

    def append(self, name: str) -> None:
        self.worker.reach(name)


@contextmanager
def watching(store: hierps.Store, fail: tuple[str, str] | None = None) -> Iterator[Worker]:
    worker = Worker(store, fail)
    _faults.trace(_Points(worker))
    try:
        yield worker
    finally:
        _faults.trace(None)


def _open(path: Path) -> tuple[hierps.Store, dict[str, hierps.EmbeddingBag]]:
    # A RAM tier of a few rows (evictions in every write-back) and compaction after every pass.
    store = hierps.Store(path, memory_budget="2KiB", device="cpu", max_segments=2, keep_checkpoints=1, seed=5)
    bags = {
        t: hierps.EmbeddingBag(None, dim, mode="sum", store=store, name=t, optimizer=opt)
        for t, (dim, opt) in TABLES.items()
    }
    return store, bags


def _batches(seed: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    return [
        {t: torch.from_numpy(KEYS[(rng.zipf(1.2, size=_BAG) - 1) % len(KEYS)]) for t in TABLES}
        for _ in range(4)
    ]


def _train(store: hierps.Store, bags: dict[str, hierps.EmbeddingBag], worker: Worker | None) -> None:
    """PASSES pipelined passes, each announcing the next; the failure is armed from FAIL_IN_PASS on."""
    for i in range(PASSES):
        if worker is not None and i == FAIL_IN_PASS:
            worker.arm()
        batches = _batches(i)
        store.begin_pass(batches)
        store.prefetch(_batches(i + 1))
        for batch in batches:
            sum((bags[t](batch[t], _OFFSETS) ** 2).sum() for t in TABLES).backward()
            store.step()
        store.end_pass()


def _rows(store: hierps.Store) -> dict[str, np.ndarray]:
    return {t: store.read_rows(t, KEYS).copy() for t in TABLES}


def test_the_cases_are_every_place_a_background_task_can_fail(tmp_path):
    store, bags = _open(tmp_path / "store")
    try:
        with watching(store) as worker:
            _train(store, bags, worker)
            store.checkpoint()
    finally:
        store.close()
    assert sorted(worker.reached) == sorted(CASES)


@pytest.mark.parametrize(("kind", "where"), CASES, ids=[f"{k[1:]}-{w}" for k, w in CASES])
def test_a_failed_task_is_raised_once_with_nothing_left_running(tmp_path, kind, where):
    store, bags = _open(tmp_path / "store")
    try:
        with watching(store, (kind, where)) as worker:
            with pytest.raises(Injected) as info:
                try:
                    _train(store, bags, worker)
                    store.checkpoint()
                finally:
                    done = worker.all_done()  # as the error reaches the caller
            assert info.value is worker.raised
            assert done, "the error was raised while tasks of the pipeline were still running"
            store.checkpoint()  # the failure was reported: the next checkpoint succeeds
            served = _rows(store)
            steps = {t: store.tables[t].step for t in TABLES}
    finally:
        store.close()
    again, _ = _open(tmp_path / "store")
    try:
        for t in TABLES:
            np.testing.assert_array_equal(again.read_rows(t, KEYS), served[t])
            assert again.tables[t].step == steps[t]
    finally:
        again.close()
