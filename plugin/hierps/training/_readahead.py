"""Read-ahead for evaluation: the rows of announced mini-batches that will not train, read in the
background while the ones before them run.

An evaluating forward (``torch.no_grad()`` or ``model.eval()``) reads the rows its device tier
lacks from RAM, SSD or the initializer and puts them in no tier
(:meth:`~hierps.training._trainer.SparseTrainer.read_weights`). With rows on SSD that read is on the
training thread, batch after batch. :meth:`ReadAhead.announce` (``store.read_ahead(batches)``; a
``PassLoader(..., evaluate=True)`` calls it a group of batches ahead) reads the distinct keys of
the mini-batches given on a worker thread, those the RAM tier does not hold (from SSD, else the
initializer's values, as the forward would), and keeps them beside the tiers: the last two announcements at most, each as many of
its first mini-batches' rows as half the device budget holds. :meth:`ReadAhead.rows` then gives an evaluating forward the rows it
finds there.

They are the rows it would have read: the read is used only while no row below the device tier
changed since it was announced (the RAM and SSD tiers count their changes; rows on their way down
from the device tier are waited for first, as the forward's own read does) and the device tier
holds the same keys; otherwise the forward reads for itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from hierps._core import StoreCore
from hierps.rows._ids import distinct
from hierps.storage._native import find_sorted

__all__ = ["ReadAhead"]

_KEPT = 2  # announcements kept: the group being evaluated and the one being read


@dataclass
class _Read:
    tables: set[str]
    # per table: sorted distinct keys, and their stored rows (n, words)
    result: Future[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]
    state: tuple[int, ...]  # the tiers' state it was announced in (see ReadAhead._state)


class ReadAhead:
    """Rows of announced evaluation mini-batches, read on a worker thread (module docstring)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self._reads: list[_Read] = []
        self._pool: ThreadPoolExecutor | None = None
        self.rows_given = 0  # rows evaluating forwards took from here

    def announce(self, batches: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Read the rows of ``batches`` (parsed: ``{table: (n,) int64}`` per mini-batch) in the
        background: as many of the first mini-batches as half the device budget holds."""
        if not batches:
            return
        self._core.pipe.wait_writebacks()  # rows on their way down are in no tier: read where they land
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hierps-read-ahead")
        tables = {t for b in batches for t in b}
        read = _Read(tables, self._pool.submit(self._read, list(batches)), self._state())
        self._reads = [*self._reads[-(_KEPT - 1) :], read]

    def _read(
        self, batches: list[Mapping[str, np.ndarray]]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """On the worker: the distinct keys of the first mini-batches whose rows fit their share of
        the device budget (the reads kept hold at most the budget), less those in the RAM tier, and
        their rows (from SSD, or the initializer's)."""
        tier = self._core.device_tier
        n = len(batches)
        while True:
            keys = {
                t: distinct(np.concatenate([b[t] for b in batches[:n] if t in b]))
                for t in {t for b in batches[:n] for t in b}
            }
            if n == 1 or sum(len(k) * tier.row_bytes(t) for t, k in keys.items()) <= tier.budget // _KEPT:
                break
            n //= 2
        core = self._core
        with core.pipe.lock:  # rows the RAM tier holds are a copy away for the forward: read the rest
            keys = {t: k[~core.memory.contains(t, k)] for t, k in keys.items()}
        return keys, core.fetch_many(keys, touch=False)

    def rows(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """keys (n,) int64 sorted unique that the device tier lacks -> (found (n,) bool, their stored
        rows (found.sum(), words)) from the reads announced, or None when none applies."""
        if not self._reads:
            return None
        self._core.pipe.wait_writebacks()
        state = self._state()
        self._reads = [r for r in self._reads if r.state == state]  # the others may read otherwise
        found = np.zeros(len(keys), bool)
        rows: np.ndarray | None = None
        for read in self._reads:  # all of one state: a key in two of them reads the same
            if table not in read.tables:
                continue
            held, read_rows = read.result.result()  # a failed read raises here, in the forward
            hit, at = find_sorted(held[table], keys)
            hit &= ~found
            if hit.any():
                if rows is None:
                    rows = np.empty((len(keys), read_rows[table].shape[1]), np.float32)
                rows[hit] = read_rows[table][at[hit]]
                found |= hit
        if rows is None:
            return None
        self.rows_given += int(found.sum())
        return found, rows[found]

    def settle(self) -> None:
        """Wait until the reads announced have finished (their failures stay for :meth:`rows` to raise)."""
        wait([read.result for read in self._reads])

    def forget(self) -> None:
        """Drop every read (e.g. when the store returns to a checkpoint)."""
        self._reads = []

    def close(self) -> None:
        self._reads = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _state(self) -> tuple[int, ...]:
        core = self._core
        return (
            id(core.memory),
            core.memory.changes,
            id(core.ssd),
            core.ssd.changes,
            core.device_tier.version,
        )
