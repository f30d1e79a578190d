"""The pass pipeline: while pass N trains, pass N+1 is read ahead and pass N-1 is written back.

One background worker runs, in order: the write-back of the rows that left the working set at
the start of pass N, then the read-ahead of pass N+1's rows that are not resident. That order,
and carrying rows shared by consecutive passes over in the device tier instead of re-reading
them, is what makes pipelined training give bit for bit the parameters of unpipelined training:
no row is ever read from a tier below while a newer copy is on its way down.

Tier access (RAM and SSD) from the worker and from the training thread is serialised by
``lock``; a read from the training thread first waits for pending write-backs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from hierps.batchplan import Batch, translate
from hierps.tiers.device import DrainedRows

if TYPE_CHECKING:
    from hierps.store import Store

__all__ = ["PassPipeline"]

Prepared = dict[str, tuple[np.ndarray, np.ndarray]]
Plans = list[Batch]
T = TypeVar("T")


class PassPipeline:
    """Background write-back and read-ahead for one :class:`~hierps.store.Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.lock = threading.RLock()
        self._executor: ThreadPoolExecutor | None = None
        self._writebacks: list[Future[None]] = []
        # the announced group, the device-tier layout its plans assume, the read-ahead
        self._prepared: (
            tuple[dict[str, np.ndarray], dict[str, int], Future[tuple[Prepared, Plans]]] | None
        ) = None
        self._background: list[Future[object]] = []
        self.prepare_seconds = 0.0
        self.writeback_seconds = 0.0
        self.wait_seconds = 0.0

    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hierps-pass")
        # Keep failed tasks so that drain() re-raises their error; forget finished ones.
        self._background = [f for f in self._background if not f.done() or f.exception() is not None]
        fut = self._executor.submit(fn, *args)
        self._background.append(fut)
        return fut

    def run_in_background(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the worker, after everything submitted before it."""
        self._submit(fn)

    # -- write-back ----------------------------------------------------------------------------
    def submit_writeback(self, drained: dict[str, DrainedRows]) -> None:
        if any(d.dirty.any() for d in drained.values()):
            self._writebacks.append(self._submit(self._writeback, drained))

    def _writeback(self, drained: dict[str, DrainedRows]) -> None:
        t0 = time.perf_counter()
        with self.lock:
            self.store._put_dirty(drained)
        self.writeback_seconds += time.perf_counter() - t0

    def wait_writebacks(self) -> None:
        """Block until every submitted write-back reached the RAM tier (re-raising its error)."""
        if not self._writebacks:
            return
        t0 = time.perf_counter()
        pending, self._writebacks = self._writebacks, []
        for fut in pending:
            fut.result()
        self.wait_seconds += time.perf_counter() - t0

    # -- read-ahead ----------------------------------------------------------------------------
    def submit_prepare(
        self,
        group: dict[str, np.ndarray],
        resident: dict[str, np.ndarray],
        batches: list[dict[str, np.ndarray]],
        base: dict[str, int],
    ) -> None:
        """Read ahead the rows of ``group`` (sorted unique keys per table) not in ``resident``, and
        translate the mini-batches ``batches`` into the slots the device tier will give them
        (``base``: its :meth:`~hierps.tiers.DeviceTier.layout` of ``group``)."""
        wanted = {
            t: np.setdiff1d(k, resident.get(t, np.empty(0, np.int64)), assume_unique=True)
            for t, k in group.items()
        }
        self._prepared = (group, base, self._submit(self._prepare, wanted, group, batches, base))

    def _prepare(
        self,
        wanted: dict[str, np.ndarray],
        group: dict[str, np.ndarray],
        batches: list[dict[str, np.ndarray]],
        base: dict[str, int],
    ) -> tuple[Prepared, Plans]:
        t0 = time.perf_counter()
        with self.lock:
            out = {
                t: (k, self.store._fetch(t, k, touch=True, ahead=True)) for t, k in wanted.items() if len(k)
            }
        plans = translate(batches, group, base, self.store.device)
        self.prepare_seconds += time.perf_counter() - t0
        return out, plans

    def take(
        self, group: dict[str, np.ndarray], base: dict[str, int] | None = None
    ) -> tuple[Prepared | None, Plans | None]:
        """The read-ahead of ``group`` if it is the one announced, else None (and it is dropped),
        and its translated mini-batches if they were made for the layout ``base``, else None."""
        if self._prepared is None:
            return None, None
        announced, announced_base, fut = self._prepared
        self._prepared = None
        t0 = time.perf_counter()
        rows, plans = fut.result()
        self.wait_seconds += time.perf_counter() - t0
        same = announced.keys() == group.keys() and all(np.array_equal(announced[t], group[t]) for t in group)
        if not same:
            return None, None
        return rows, plans if base == announced_base else None

    def drain(self) -> None:
        """Wait for every background task; the tiers below are then quiet."""
        pending, self._background = self._background, []
        self._writebacks = []
        for fut in pending:
            fut.result()
        self._prepared = None

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
