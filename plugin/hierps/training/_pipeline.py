"""The pass pipeline: while pass N trains, pass N+1 is read ahead and pass N-1 is written back.

One background worker runs, in order: the write-back of the rows that left the working set at
the start of pass N, then the read-ahead of pass N+1's rows that are not resident. That order,
and carrying rows shared by consecutive passes over in the device tier instead of re-reading
them, is what makes pipelined training give bit for bit the parameters of unpipelined training:
no row is ever read from a tier below while a newer copy is on its way down.

Tier access (RAM and SSD) from the worker and from the training thread is serialised by
``lock``; a read from the training thread first waits for pending write-backs.

A task that fails (a full disk during a write-back or a merge, a damaged segment met by a read-ahead)
is reported once, by the first call that waits for it: that call first waits for every other task,
so none is still running behind the error (a retried ``checkpoint()`` never races a merge or a
write-back left behind), then raises it, noting the others that failed too. Every failure is then
forgotten: the next call starts clean.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hierps._core import StoreCore
from hierps.tiers._device import DrainedRows, Staged, staged_rows
from hierps.tiers._working_set import Relayout, ResidentKeys
from hierps.training._batchplan import Batch, same_batches, translate, union_positions

__all__ = ["PassPipeline", "ReadAhead"]

Ids = dict[str, np.ndarray]  # {table: int64 ids}

T = TypeVar("T")


@dataclass
class ReadAhead:
    """A pass prepared in the background: everything but the copies into the device tier."""

    group: dict[str, np.ndarray]  # its working set: sorted distinct keys per table
    relayout: Relayout  # of the device tier as it was when the pass was announced
    # Rows of relayout.missing, read from RAM / SSD / the initializer: as arrays, or already in the
    # arenas the relayout makes (``staged``, on the CPU; then ``rows`` is empty)
    rows: dict[str, np.ndarray]
    plans: list[Batch]  # its mini-batches, translated for relayout.first_slot
    staged: Staged | None = None

    def missing_rows(self) -> dict[str, np.ndarray]:
        """The rows of ``relayout.missing``, as arrays, wherever they are."""
        return staged_rows(self.relayout, self.staged) if self.staged is not None else self.rows


class PassPipeline:
    """Background write-back and read-ahead for one store; reads and writes through its core."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self.lock = threading.RLock()
        self._executor: ThreadPoolExecutor | None = None
        self._writebacks: list[Future[None]] = []
        # The pass announced, and its read-ahead (None: its working set is over the device budget).
        self._prepared: tuple[list[dict[str, np.ndarray]], Future[ReadAhead | None]] | None = None
        self._tasks: list[Future[Any]] = []  # every task not known to have succeeded
        self.prepare_seconds = 0.0
        self.writeback_seconds = 0.0
        self.wait_seconds = 0.0

    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hierps-pass")
        # Forget the tasks that succeeded; a failed one stays until a wait reports it.
        self._tasks = [f for f in self._tasks if not f.done() or f.exception() is not None]
        fut = self._executor.submit(fn, *args)
        self._tasks.append(fut)
        return fut

    def _wait(self, futures: list[Future[Any]]) -> None:
        """Block until ``futures`` are done; if one of them failed, :meth:`_raise_failures`."""
        wait(futures)
        if any(f.exception() is not None for f in futures):
            self._raise_failures()

    def _raise_failures(self) -> None:
        """Wait for every task, forget them all, and raise the first failure among them (the others
        noted on it): reported once, with nothing left running behind it."""
        tasks, self._tasks = self._tasks, []
        self._writebacks, self._prepared = [], None
        wait(tasks)
        failures = [exc for exc in (f.exception() for f in tasks) if exc is not None]
        if failures:
            first = failures[0]
            for other in failures[1:]:
                first.add_note(f"another background task of the pass pipeline failed too: {other!r}")
            raise first

    def run_in_background(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the worker, after everything submitted before it; its future (a failure is
        also raised at the pipeline's next wait)."""
        return self._submit(fn)

    # -- write-back ----------------------------------------------------------------------------
    def submit_writeback(self, drained: dict[str, DrainedRows]) -> None:
        if any(d.dirty.any() for d in drained.values()):
            # The RAM tier scores the rows at the clock of now, however late the worker gets to them.
            self._writebacks.append(self._submit(self._writeback, drained, self._core.memory.tick))

    def _writeback(self, drained: dict[str, DrainedRows], tick: int) -> None:
        t0 = time.perf_counter()
        for d in drained.values():  # out of the arena the device tier let go: no lock needed
            d.copy_out()
        with self.lock:
            self._core.put_dirty(drained, tick)
        self.writeback_seconds += time.perf_counter() - t0

    def wait_writebacks(self) -> None:
        """Block until every submitted write-back reached the RAM tier (raising its error, once every
        task finished)."""
        if not self._writebacks:
            return
        t0 = time.perf_counter()
        pending, self._writebacks = self._writebacks, []
        try:
            self._wait(pending)
        finally:
            self.wait_seconds += time.perf_counter() - t0

    # -- read-ahead ----------------------------------------------------------------------------
    def submit_prepare(self, batches: list[Ids], resident: ResidentKeys) -> None:
        """Prepare the pass of ``batches`` ({table: ids} per mini-batch) in the background.

        Its working set (the union of the batches' ids), the relayout of the device tier from
        ``resident`` to it, the rows not in ``resident``, and the mini-batches translated into the
        slots they will have: see :class:`ReadAhead`. A working set over the device budget is
        prepared no further (:meth:`take` gives None: the pass is split into groups when it begins).
        """
        tick = self._core.memory.tick  # its RAM hits are scored now, however late the worker reads them
        self._prepared = (batches, self._submit(self._prepare, batches, resident, tick))

    def _prepare(self, batches: list[Ids], resident: ResidentKeys, tick: int) -> ReadAhead | None:
        t0 = time.perf_counter()
        group, positions = union_positions(batches)
        tier = self._core.device_tier
        if tier.bytes_for({t: len(k) for t, k in group.items()}) > tier.budget:
            return None
        relayout = resident.relayout_to(group)
        with self.lock:
            rows = self._core.fetch_many(relayout.missing, touch=True, ahead=True, tick=tick)
        plans = translate(
            batches, group, relayout.first_slot, self._core.device, positions, self._core.coalesced
        )
        staged = tier.stage(relayout, rows)  # the new arenas but for the rows that stay (on the CPU)
        self.prepare_seconds += time.perf_counter() - t0
        return ReadAhead(group, relayout, rows if staged is None else {}, plans, staged)

    def take(self, batches: list[dict[str, np.ndarray]]) -> ReadAhead | None:
        """The read-ahead of ``batches`` if they are the ones announced, else None (and it is dropped)."""
        if self._prepared is None:
            return None
        announced, fut = self._prepared
        self._prepared = None
        t0 = time.perf_counter()
        try:
            self._wait([fut])
        finally:
            self.wait_seconds += time.perf_counter() - t0
        return fut.result() if same_batches(announced, batches) else None

    def settle(self) -> None:
        """Wait until the worker is idle (every task submitted so far finished), keeping what was
        read ahead. A process about to fork calls it, so that no task of this store is mid-way in
        the parent when the child is made (its threads, and whatever they hold, are not copied)."""
        if self._tasks:
            self._wait(list(self._tasks))

    def drain(self) -> None:
        """Wait for every background task; the tiers below are then quiet. Raises the first failure
        among them (once)."""
        self._wait(self._tasks)
        self._tasks, self._writebacks, self._prepared = [], [], None

    def close(self) -> None:
        try:
            self.drain()
        finally:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
