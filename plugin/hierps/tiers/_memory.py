"""RAM tier: a bounded cache of rows in mmap-backed numpy slabs, below the device tier.

Each table has a slab (an anonymous ``mmap`` viewed as a ``(capacity, width)`` float32 array)
and a vectorised key index (sorted keys -> slot). The byte budget is shared by all tables;
when it is exceeded, the least recently (``lru``: by pass) or least frequently (``lfu``) used
rows of all tables are evicted in one batch, down to half the budget, dirty ones handed to the
tier's *sink* in one sorted batch per table; a table that would hand it only a few rows keeps them
where the other tables can give their bytes instead (each batch is a segment on SSD, whose fixed
costs a few rows do not pay for). Rows that do not fit even in an empty cache go straight through.

The tier knows nothing below it: the store gives it the sink (:class:`RowSink`, the SSD tier) when
it builds the hierarchy, just as it reads the tiers one after the other itself
(:meth:`hierps._core.StoreCore.fetch_many`). A sink takes a batch whole or raises ``OSError`` and
takes none of it; the rows of a batch it refused stay here, dirty, over budget if need be, and the
error reaches the caller: a full disk loses no row.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from hierps._faults import fault_point
from hierps.rows._ids import distinct, lowest_scored
from hierps.storage._native import find_sorted, insert_sorted

__all__ = ["MemoryTier", "RowSink", "ram_row_bytes"]

# Bytes of bookkeeping per cached row besides its floats: key (8) + slot (8) + score (8) + dirty (1).
_ROW_OVERHEAD = 25


def ram_row_bytes(words: int) -> int:
    """Bytes the RAM tier charges a row of ``words`` 4-byte words against its budget: the row and
    its bookkeeping (key, slot, dirty bit, recency or frequency)."""
    return 4 * words + _ROW_OVERHEAD


# Evict down to this fraction of the budget, so eviction runs in batches, not per row. Dirty rows
# that leave go to the SSD tier as one segment per table and eviction, whose fixed costs (its files,
# the merges of small runs it leads to) outweigh its bytes for a few thousand rows: evicting down to
# half the budget writes half as many segments as evicting down to 7/8 of it, and merges a fifth
# fewer (the demo DLRM's and the wide model's long runs at a 25% budget: the pipeline worker's CPU
# 15-25% lower, the wide model's examples/s 1.2-1.4x), for 8% more bytes read from the SSD tier.
_EVICT_TO = 0.5
# An eviction that would hand the sink fewer dirty bytes of a table than this takes the other
# tables' next rows instead where it can (see MemoryTier._evict): a segment's fixed costs are worth
# about this many bytes of rows. Tried this many times (a table spared may bring in another's few).
_FEW_DIRTY_BYTES = 128 << 10
_SPARE_ROUNDS = 3
# Within deferred_writes, rows held (as the tier charges them) beyond which they go down at once:
# large write-backs gain nothing from fewer segments, and the copies held stay bounded.
_HELD_BYTES = 16 << 20


class RowSink(Protocol):
    """Where the RAM tier's dirty rows go when they leave it or are flushed (the SSD tier)."""

    def write(self, table: str, keys: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None) -> None:
        """Take rows of unique ``keys`` (n,) int64: ``rows`` (n, width) float32, or with ``at`` (n,)
        int64 ``rows[at]``. All of them, or raise ``OSError`` having taken none."""


class _Slab:
    """Rows of one table: slot storage, key -> slot index, scores and dirty bits per slot."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.capacity = 0
        self._mm: mmap.mmap | None = None
        self.rows = np.empty((0, width), np.float32)
        self.keys = np.empty(0, np.int64)  # sorted
        self.slots = np.empty(0, np.int64)  # slot of keys[i]
        self.score = np.empty(0, np.int64)  # per slot
        self.dirty = np.empty(0, bool)  # per slot
        self.free: list[np.ndarray] = []
        self.n_free = 0

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys (n,) int64 -> (cached (n,) bool, index position (n,) int64; valid where cached)."""
        return find_sorted(self.keys, keys)

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity, 64)
        mm = mmap.mmap(-1, cap * self.width * 4)
        rows = np.frombuffer(mm, dtype=np.float32).reshape(cap, self.width)
        rows[: self.capacity] = self.rows
        self.free.append(np.arange(self.capacity, cap, dtype=np.int64))
        self.n_free += cap - self.capacity
        self.score = np.concatenate([self.score, np.zeros(cap - self.capacity, np.int64)])
        self.dirty = np.concatenate([self.dirty, np.zeros(cap - self.capacity, bool)])
        # The old map is not closed here: views of its rows may still be alive (rows handed to the
        # sink, held by the frames of an error it raised), and closing a map they export fails. It
        # is unmapped when the last of them goes.
        self.rows, self._mm, self.capacity = rows, mm, cap

    def take_slots(self, n: int) -> np.ndarray:
        if n > self.n_free:
            self._grow(len(self) + n)
        pool = np.concatenate(self.free) if len(self.free) != 1 else self.free[0]
        taken, rest = pool[:n], pool[n:]
        self.free = [rest]
        self.n_free = len(rest)
        return taken

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Add sorted new ``keys`` (absent from the index) at ``slots``."""
        if not len(self.keys) or len(keys) and keys[0] > self.keys[-1]:  # after every key held (copy-in)
            self.keys = np.concatenate([self.keys, keys])
            self.slots = np.concatenate([self.slots, slots])
            return
        self.keys, self.slots = insert_sorted(self.keys, self.slots, keys, slots)

    def remove(self, positions: np.ndarray) -> None:
        """Drop index entries at ``positions`` and free their slots."""
        freed = self.slots[positions]
        keep = np.ones(len(self.keys), bool)
        keep[positions] = False
        self.keys, self.slots = self.keys[keep], self.slots[keep]
        self.dirty[freed] = False
        self.free.append(freed)
        self.n_free += len(freed)


class MemoryTier:
    """Byte-bounded row cache; its dirty rows leave through ``sink`` (see :class:`RowSink`)."""

    def __init__(self, budget_bytes: int, sink: RowSink, policy: str = "lru") -> None:
        self.budget = int(budget_bytes)
        self._sink = sink
        self.policy = policy
        self._slabs: dict[str, _Slab] = {}
        self.tick = 0  # advanced per pass by the store; the LRU clock
        self.changes = 0  # moves whenever a row read from this tier may read otherwise
        self.hits = 0
        self.misses = 0
        self.evicted_rows = 0
        # Within deferred_writes(): the dirty rows that left, per table, in the order they left.
        self._held: dict[str, list[tuple[np.ndarray, np.ndarray]]] | None = None
        self._held_bytes = 0

    def add_table(self, table: str, width: int) -> None:
        if table not in self._slabs:
            self._slabs[table] = _Slab(width)

    def row_bytes(self, table: str) -> int:
        return ram_row_bytes(self._slabs[table].width)

    @property
    def bytes_used(self) -> int:
        return sum(len(s) * ram_row_bytes(s.width) for s in self._slabs.values())

    def num_rows(self, table: str) -> int:
        return len(self._slabs[table])

    def num_dirty(self, table: str) -> int:
        s = self._slabs[table]
        return int(s.dirty[s.slots].sum()) if len(s) else 0

    def contains(self, table: str, keys: np.ndarray) -> np.ndarray:
        """keys: (n,) int64 -> (n,) bool, True where the row is cached."""
        return self._slabs[table].find(keys)[0]

    def holds_between(self, table: str, lo: int, hi: int) -> bool:
        """True when a row of a key in ``[lo, hi]`` is cached."""
        keys = self._slabs[table].keys
        return bool(np.searchsorted(keys, hi, side="right") > np.searchsorted(keys, lo))

    def scores(self, table: str, keys: np.ndarray) -> np.ndarray:
        """keys: (n,) int64 sorted unique, all cached -> (n,) int64: their eviction scores (the
        clock of their last use under LRU, their uses under LFU)."""
        slab = self._slabs[table]
        hit, at = slab.find(keys)
        if not hit.all():
            raise KeyError(f"table {table!r}: {int((~hit).sum())} of the keys are not cached")
        return slab.score[slab.slots[at]].copy()

    def columns(self, table: str, columns: slice) -> tuple[np.ndarray, np.ndarray]:
        """Every cached row's ``columns``: (keys (n,) int64 sorted, values (n, k) float32 copy)."""
        slab = self._slabs[table]
        return slab.keys.copy(), slab.rows[slab.slots, columns]

    def _touch(self, slab: _Slab, slots: np.ndarray, tick: int | None) -> None:
        if self.policy == "lru":
            slab.score[slots] = self.tick if tick is None else tick
        else:
            slab.score[slots] += 1

    # -- reads --------------------------------------------------------------------------------
    def get(
        self, table: str, keys: np.ndarray, touch: bool = True, tick: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) int64 sorted unique -> (hit (n,) bool, rows (hit.sum(), width) float32 copy).
        ``tick``: the LRU clock the touch scores (default :attr:`tick`; work done in the background
        passes the clock of when it was asked for, so that its scores do not depend on its timing)."""
        slab = self._slabs[table]
        hit, at = slab.find(keys)
        slots = slab.slots[at[hit]]
        if touch:
            self._touch(slab, slots, tick)
            self.hits += len(slots)
            self.misses += len(keys) - len(slots)
        return hit, slab.rows[slots]

    # -- writes -------------------------------------------------------------------------------
    def put(
        self,
        table: str,
        keys: np.ndarray,
        rows: np.ndarray,
        dirty: bool = True,
        tick: int | None = None,
        at: np.ndarray | None = None,
    ) -> None:
        """Cache rows (newer than the sink's when ``dirty``), evicting others to stay in budget;
        ``tick`` as for :meth:`get`.

        keys: (n,) int64 sorted unique; rows: (n, width) float32, or with ``at`` (n,) int64
        ``rows[at]`` (each row is then copied once, into the cache). When the sink refuses rows
        (``OSError``, e.g. a full disk), every row given stays cached and the error is raised.
        """
        slab = self._slabs[table]
        if not len(keys):
            return
        self.changes += 1
        if not len(slab) or keys[0] > slab.keys[-1]:  # none cached yet (a table copied in): no search
            n_new, new_keys, new_rows = len(keys), keys, rows if at is None else rows[at]
        else:
            hit, where = slab.find(keys)
            slots = slab.slots[where[hit]]
            slab.rows[slots] = rows[hit] if at is None else rows[at[hit]]
            slab.dirty[slots] |= dirty
            self._touch(slab, slots, tick)
            new = ~hit
            n_new = int(new.sum())
            new_keys, new_rows = keys[new], rows[new] if at is None else rows[at[new]]
        if n_new == 0:
            return
        row_bytes = self.row_bytes(table)
        want = min(n_new, self.budget // row_bytes)
        overflow = self.bytes_used + want * row_bytes - self.budget
        try:
            if overflow > 0:
                self._evict(overflow + int((1 - _EVICT_TO) * self.budget))
            fit = min(n_new, max(0, self.budget - self.bytes_used) // row_bytes)
            if fit < n_new and dirty:
                # More than the cache holds: the surplus goes straight to the sink.
                self._to_sink(table, new_keys[fit:], new_rows[fit:])
        except OSError:
            # The sink took nothing (e.g. the disk is full): keep every row here, over budget,
            # so that none is lost, and let the caller see the error.
            self._insert(slab, new_keys, new_rows, dirty, tick)
            raise
        self._insert(slab, new_keys[:fit], new_rows[:fit], dirty, tick)

    def _insert(self, slab: _Slab, keys: np.ndarray, rows: np.ndarray, dirty: bool, tick: int | None) -> None:
        if len(keys) == 0:
            return
        slots = slab.take_slots(len(keys))
        # Slots in one run (a slab grown for them) are written as a slice: at memory speed.
        at: slice | np.ndarray = slots
        if len(slots) > 1 and slots[-1] - slots[0] == len(slots) - 1 and bool((np.diff(slots) == 1).all()):
            at = slice(int(slots[0]), int(slots[-1]) + 1)
        slab.rows[at] = rows
        slab.dirty[at] = dirty
        if self.policy == "lru":  # as _touch scores a fresh row
            slab.score[at] = self.tick if tick is None else tick
        else:
            slab.score[at] = 1
        slab.insert(keys, slots)

    def _evict(self, nbytes: int) -> None:
        """Evict at least ``nbytes`` of the lowest-scored rows across tables, in one batch.

        A table that would hand the sink fewer than ``_FEW_DIRTY_BYTES`` of dirty rows keeps its
        rows when the other tables can give those bytes instead (their next lowest-scored rows): its
        few rows would cost the sink a segment of their own (its files, its lookups, its merges).
        Only which rows go changes, never how many bytes: a table is spared only where the tables
        not spared hold the bytes to free."""
        tables = [t for t, s in self._slabs.items() if len(s)]
        if not tables:
            return
        sizes = [len(self._slabs[t]) for t in tables]
        row_bytes = [self.row_bytes(t) for t in tables]
        scores = np.concatenate([self._slabs[t].score[self._slabs[t].slots] for t in tables])
        costs = np.concatenate([np.full(n, rb) for n, rb in zip(sizes, row_bytes)])
        ends = np.cumsum(sizes).tolist()
        spans = [(end - n, end) for end, n in zip(ends, sizes)]
        dirty = np.concatenate([self._slabs[t].dirty[self._slabs[t].slots] for t in tables])
        victims = lowest_scored(scores, costs, nbytes)
        held = [n * rb for n, rb in zip(sizes, row_bytes)]  # each table's bytes here
        room, spared = sum(held), set()  # what the tables not spared hold
        top = int(scores.max()) + 1  # a spared table's rows score this: above every row
        for _ in range(_SPARE_ROUNDS):
            # The tables about to send a few dirty rows, the fewest first, spared while the others
            # still hold the bytes to free.
            few = []
            for i, (a, b) in enumerate(spans):
                out = int(np.count_nonzero(victims[a:b] & dirty[a:b])) * row_bytes[i]
                if i not in spared and 0 < out < _FEW_DIRTY_BYTES:
                    few.append((out, i))
            more = False
            for _, i in sorted(few):
                if room - held[i] >= nbytes:
                    spared.add(i)
                    room -= held[i]
                    more = True
            if not more:
                break
            kept = scores.copy()
            for i in spared:
                kept[spans[i][0] : spans[i][1]] = top
            victims = lowest_scored(kept, costs, nbytes)
        for t, (a, b) in zip(tables, spans):
            positions = np.flatnonzero(victims[a:b])
            if len(positions):
                self._drop(t, positions, write_dirty=True)

    def _drop(self, table: str, positions: np.ndarray, write_dirty: bool) -> None:
        slab = self._slabs[table]
        slots = slab.slots[positions]
        if write_dirty:
            dirty = slab.dirty[slots]
            if dirty.any():
                fault_point("memory.evict")
                self._to_sink(table, slab.keys[positions[dirty]], slab.rows, at=slots[dirty])
        slab.remove(positions)
        self.evicted_rows += len(positions)

    def _to_sink(self, table: str, keys: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None) -> None:
        """Hand dirty rows that leave the tier to the sink, or hold them (a copy) within :meth:`deferred_writes`."""
        if self._held is None:
            self._sink.write(table, keys, rows, at=at)
        else:
            held = rows[at] if at is not None else rows.copy()
            self._held.setdefault(table, []).append((keys.copy(), held))
            self._held_bytes += len(keys) * self.row_bytes(table)
            if self._held_bytes > _HELD_BYTES:
                held_now, self._held, self._held_bytes = self._held, {}, 0
                self._hand_down(held_now)

    @contextmanager
    def deferred_writes(self) -> Iterator[None]:
        """Within it, the dirty rows that leave the tier (evicted, or more than it holds) are held, and
        handed to the sink at its end as one batch per table: a key that left twice with its last row.
        Which rows stay and which leave is decided as without it; only fewer, larger writes reach the
        sink (one segment per table per write-back instead of one per table per eviction). Past
        ``_HELD_BYTES`` of rows held (as the tier charges them), those go down at once.

        Nothing may read the tier's sink meanwhile (the caller holds the tiers' lock). When the sink
        refuses a table's rows (``OSError``), those whose key the tier does not hold again are cached
        again, dirty, over budget if need be (a key it holds again was put back since, newer); the
        other tables' rows are handed down all the same, and the first error is raised."""
        if self._held is not None:  # within another: that one hands the rows down
            yield
            return
        self._held, self._held_bytes = {}, 0
        try:
            yield
        finally:
            held, self._held = self._held, None
            self._hand_down(held)

    def _hand_down(self, held: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> None:
        failed: OSError | None = None
        for table, parts in held.items():
            keys = np.concatenate([k for k, _ in parts])
            rows = np.concatenate([r for _, r in parts])
            # The last row of each key: a stable sort keeps each key's rows in the order they left.
            order = np.argsort(keys, kind="stable")
            keys = keys[order]
            last = np.ones(len(keys), bool)
            last[:-1] = keys[1:] != keys[:-1]
            keys, at = keys[last], order[last]
            try:
                self._sink.write(table, keys, rows, at=at)
            except OSError as exc:
                failed = failed or exc
                slab = self._slabs[table]
                back = ~slab.find(keys)[0]
                self.changes += 1
                self._insert(slab, keys[back], rows[at[back]], True, None)
        if failed is not None:
            raise failed

    def flush(self) -> None:
        """Hand every dirty row to the sink; rows stay cached, now clean."""
        for table, slab in self._slabs.items():
            if not len(slab):
                continue
            dirty = slab.dirty[slab.slots]
            if dirty.any():
                self._sink.write(table, slab.keys[dirty], slab.rows, at=slab.slots[dirty])
                slab.dirty[slab.slots[dirty]] = False
                fault_point("memory.flush_table")

    def discard(self, table: str, keys: np.ndarray | None = None) -> None:
        """Forget rows without writing them anywhere (all of the table when ``keys`` is None)."""
        self.changes += 1
        slab = self._slabs[table]
        if keys is None:
            self._slabs[table] = _Slab(slab.width)
            return
        hit, at = slab.find(distinct(keys))
        if hit.any():
            slab.remove(np.sort(at[hit]))

    def clear(self) -> None:
        for table in list(self._slabs):
            self.discard(table)
