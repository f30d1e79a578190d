"""Device tier: the working set of the current pass, as torch tensors on the training device.

Rows of every table of one width (in 4-byte words: rows are stored as their table's layout says,
:mod:`hierps.rows._layout`) live in one ``(capacity, width)`` float32 *arena* tensor, so a
training step updates the rows of all its tables with one gather, one optimizer call and one
scatter. Per table, a sorted key tensor and its slot tensor (both on the device) translate a
mini-batch's ids into arena slots with one ``searchsorted``; on the CPU, where the compiled core
serves, a hash index does (:mod:`hierps.tiers._slot_index`), so that making rows resident on demand
costs in proportion to those rows, not to every resident one. :meth:`DeviceTier.rebuild` lays each
table out contiguously and in key order (see :meth:`DeviceTier.layout`), so the slots of a pass's
ids can be computed ahead, off the training thread, and so can the moves from one pass's working
set to the next (:mod:`hierps.tiers._working_set`). The byte budget is shared by all tables. Draining
the tier (end of a pass) hands rows back to the store and bumps ``generation``, which
invalidates slots held by callers. Outside passes the tier is a cache: rows that do not fit let the
least recently used ones go in place (:meth:`DeviceTier.evict`), never those gathered since the last
step, so the slots of pending gradients stay valid (``step_generation``) and a step costs its own
rows, not a rebuild of the tier.

Sightings of keys (the counters of :mod:`hierps.rows._counters`) may be recorded lazily with
:meth:`DeviceTier.defer_seen`; they are applied, fused over tables, before any row leaves the
tier or is read whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hierps._tensors import joined
from hierps.rows._counters import record_seen
from hierps.rows._ids import distinct_order, lowest_scored
from hierps.rows._layout import RowLayout
from hierps.storage._native import find_sorted
from hierps.tiers._slot_index import SlotIndex, distinct_ids, hashed
from hierps.tiers._working_set import Relayout, ResidentKeys

__all__ = ["DeviceTier", "DrainedRows", "Sightings", "Staged", "staged_rows"]

# Bytes per resident row besides its floats: sorted key (8) + slot (8) + host key (8) + dirty (1).
ROW_OVERHEAD = 25
_EMPTY = np.empty(0, np.int64)
_EMPTY_T = torch.empty(0, dtype=torch.int64)


class DrainedRows:
    """Rows leaving the device tier: keys (n,) int64, rows (n, width) float32, dirty (n,) bool.

    With ``source`` (an arena's rows the tier let go, which nothing writes any more, and the slots
    of these rows in it) instead of ``rows``, the rows are copied out when ``rows`` is first read:
    a relayout on the CPU leaves that copy to the write-back, on the pipeline's worker.
    """

    __slots__ = ("keys", "dirty", "_rows", "_source")

    def __init__(
        self,
        keys: np.ndarray,
        rows: np.ndarray | None,
        dirty: np.ndarray,
        source: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if (rows is None) == (source is None):
            raise ValueError("DrainedRows: give either rows or their source")
        self.keys, self.dirty = keys, dirty
        self._rows, self._source = rows, source

    @property
    def rows(self) -> np.ndarray:
        return self._rows if self._rows is not None else self._copy()

    def copy_out(self) -> None:
        """Copy the rows out of their source now if any is dirty (the write-back reads only those)."""
        if self._source is not None and self.dirty.any():
            self._copy()

    def _copy(self) -> np.ndarray:
        assert self._source is not None
        arena_rows, slots = self._source
        self._rows, self._source = arena_rows.index_select(0, slots).numpy(), None
        return self._rows


class _Arena:
    """The rows of every table of one width: slots ``[0, n)`` of ``rows`` are taken.

    ``used[s]``: the tier's clock when slot ``s`` was last gathered for training (or loaded).
    ``free``: slots below ``n`` whose rows were evicted in place (:meth:`DeviceTier.evict`), taken
    again before the arena grows.
    """

    def __init__(self, width: int, device: torch.device, capacity: int = 0, clock: int = 0) -> None:
        self.width = width
        self.device = device
        self.n = 0
        self.rows = torch.empty((capacity, width), dtype=torch.float32, device=device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.used = torch.full((capacity,), clock, dtype=torch.int64, device=device)
        self.free = _EMPTY
        # Built when an eviction first needs them (DeviceTier._owners), then kept: for each slot,
        # the number of the table whose row it holds (-1: none) and that row's key.
        self.owner: np.ndarray | None = None
        self.key_of: np.ndarray | None = None

    def take(self, m: int) -> np.ndarray:
        """``m`` slots for new rows (m,) int64: free ones first, then appended ones."""
        reuse = self.free[len(self.free) - min(m, len(self.free)) :]
        self.free = self.free[: len(self.free) - len(reuse)]
        if len(reuse) == m:
            return reuse
        start = self.append(m - len(reuse))
        fresh = np.arange(start, start + m - len(reuse), dtype=np.int64)
        return np.concatenate([reuse, fresh]) if len(reuse) else fresh

    def own(self, slots: np.ndarray, table: int, keys: np.ndarray) -> None:
        """``keys`` of table number ``table`` now at ``slots``: kept in :attr:`owner` / :attr:`key_of`
        once an eviction has built them (see :meth:`DeviceTier._owners`)."""
        if self.owner is None or self.key_of is None:
            return
        if len(self.owner) < self.n:
            grow = self.rows.shape[0] - len(self.owner)
            self.owner = np.concatenate([self.owner, np.full(grow, -1, np.int32)])
            self.key_of = np.concatenate([self.key_of, np.zeros(grow, np.int64)])
        self.owner[slots] = table
        self.key_of[slots] = keys

    def append(self, m: int) -> int:
        """Take ``m`` more slots (growing the tensors); returns the first."""
        if self.n + m > self.rows.shape[0]:
            cap = max(self.n + m, 2 * self.rows.shape[0], 64)
            rows = torch.empty((cap, self.width), dtype=torch.float32, device=self.device)
            rows[: self.n] = self.rows[: self.n]
            dirty = torch.zeros(cap, dtype=torch.bool, device=self.device)
            dirty[: self.n] = self.dirty[: self.n]
            used = torch.zeros(cap, dtype=torch.int64, device=self.device)
            used[: self.n] = self.used[: self.n]
            self.rows, self.dirty, self.used = rows, dirty, used
        start = self.n
        self.n += m
        return start


Staged = dict[int, _Arena]  # per width, an arena built ahead (DeviceTier.stage)


class _Resident:
    """One table's rows in its arena: ``keys[i]`` lives at arena slot ``slots[i]``.

    Found by a :class:`~hierps.tiers._slot_index.SlotIndex` on the CPU where the compiled core serves,
    else by the keys sorted and their slots, tensors on the device. Either is built when a search first
    needs it (:meth:`_searchable`): a pass whose mini-batches were all translated ahead searches none,
    and its layout (``DeviceTier.apply_relayout``, on the training thread) builds none. ``keys_at`` on
    the CPU reads the host arrays and builds nothing.
    """

    def __init__(self, arena: _Arena, keys: np.ndarray = _EMPTY, slots: np.ndarray = _EMPTY) -> None:
        self.arena = arena
        self.n = len(keys)
        self._keys, self._slots = keys, slots  # host: the first n are the resident rows' keys and slots
        self._hashed = arena.device.type == "cpu" and hashed()
        self._built = False  # the index below, from the resident keys, once a search asked for it
        self._index: SlotIndex | None = None
        self._skeys = self._sslots = _EMPTY_T

    def _searchable(self) -> SlotIndex | None:
        """The index of the resident keys, built if no search has yet: the hash index where
        the compiled core serves on the CPU, else None (the sorted keys and slots are built)."""
        if self._built:
            return self._index
        if self._hashed:
            self._index = SlotIndex(self.keys, self.slots)
        else:
            order = distinct_order(self.keys)
            self._skeys = torch.from_numpy(self.keys[order]).to(self.arena.device)
            self._sslots = torch.from_numpy(self.slots[order]).to(self.arena.device)
        self._built = True
        return self._index

    @property
    def keys(self) -> np.ndarray:
        """Key of each resident row (host)."""
        return self._keys[: self.n]

    @property
    def slots(self) -> np.ndarray:
        """Arena slot of each resident row (host), in the order of :attr:`keys`."""
        return self._slots[: self.n]

    @property
    def width(self) -> int:
        return self.arena.width

    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (n,) int64 on the device -> (found (n,) bool, slots (n,) int64; valid where found)."""
        index = self._searchable()
        if index is not None:
            found, slots = index.find(ids.numpy())
            return torch.from_numpy(found), torch.from_numpy(slots)
        if self.n == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        at = torch.searchsorted(self._skeys, ids).clamp_(max=self.n - 1)
        return self._skeys[at] == ids, self._sslots[at]

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids (n,) int64 on the device -> (slots (n,) int64, valid where found; found (n,) bool, or
        None when every id is resident)."""
        index = self._searchable()
        if index is not None:
            at, held = index.locate(ids.numpy())
            return torch.from_numpy(at), None if held is None else torch.from_numpy(held)
        found, slots = self.find(ids)
        return slots, None if bool(found.all()) else found

    def add(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Make sorted unique ``keys`` (absent here) resident at ``slots``."""
        m, n = len(keys), self.n
        if n + m > len(self._keys):  # the host arrays grow by doubling: adding m rows costs O(m)
            cap = max(n + m, 2 * len(self._keys), 64)
            self._keys = np.concatenate([self._keys[:n], np.empty(cap - n, np.int64)])
            self._slots = np.concatenate([self._slots[:n], np.empty(cap - n, np.int64)])
        self._keys[n : n + m], self._slots[n : n + m] = keys, slots
        self.n = n + m
        if not self._built:  # built from keys and slots when first needed
            return
        if self._index is not None:
            self._index.put(keys, slots)
            return
        # Merge the sorted new keys into the sorted resident ones: their places, then the old ones'.
        device = self.arena.device
        new_keys = torch.from_numpy(keys).to(device)
        at = torch.searchsorted(self._skeys, new_keys) + torch.arange(m, device=device)
        is_new = torch.zeros(self.n, dtype=torch.bool, device=device)
        is_new[at] = True
        skeys = torch.empty(self.n, dtype=torch.int64, device=device)
        sslots = torch.empty(self.n, dtype=torch.int64, device=device)
        skeys[at], sslots[at] = new_keys, torch.from_numpy(slots).to(device)
        skeys[~is_new], sslots[~is_new] = self._skeys, self._sslots
        self._skeys, self._sslots = skeys, sslots

    def remove(self, gone: np.ndarray, stay: np.ndarray) -> None:
        """Let go of the resident rows of distinct keys ``gone``; ``stay`` (n,) bool: which of
        :attr:`keys` stay. The host arrays are replaced, not changed in place
        (:meth:`DeviceTier.resident_keys` hands them out)."""
        keys, slots = self.keys[stay], self.slots[stay]
        self._keys, self._slots, self.n = keys, slots, len(keys)
        if not self._built:
            return
        if self._index is not None:
            self._index.drop(gone)
            return
        device = self.arena.device
        held = torch.ones(self._skeys.numel(), dtype=torch.bool, device=device)
        held[torch.searchsorted(self._skeys, torch.from_numpy(np.sort(gone)).to(device))] = False
        self._skeys, self._sslots = self._skeys[held], self._sslots[held]

    def keys_at(self, slots: torch.Tensor) -> torch.Tensor:
        """slots (U,) int64 of resident rows -> (U,) int64 their keys (on the device). On the CPU from
        the host arrays, with no index built for it."""
        if self._hashed:
            order = np.argsort(self.slots)
            where = np.searchsorted(self.slots[order], slots.numpy())
            return torch.from_numpy(self.keys[order[where]])
        self._searchable()
        by_slot = torch.argsort(self._sslots)
        at = torch.searchsorted(self._sslots[by_slot], slots)
        return self._skeys[by_slot[at]]


@dataclass
class Sightings:
    """Sightings of resident rows not yet added to their counters."""

    arena: _Arena
    slots: torch.Tensor  # (U,) int64 arena slots
    counts: torch.Tensor | None  # (U,) float32; None: one sighting per entry of slots, repeats included
    start: int  # first counter column
    now: int  # pass index
    decay: float


def _per_slot(s: Sightings) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique slots (U,), their counts (U,) float32) of ``s`` (one sighting per entry of its slots
    when it has no counts)."""
    if s.counts is not None:
        return s.slots, s.counts
    slots, _, counts = distinct_ids(s.slots)
    return slots, counts.to(torch.float32)


class DeviceTier:
    """Byte-bounded working set of rows for many tables on one torch device."""

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        self.budget = int(budget_bytes)
        self.device = device
        self._arenas: dict[int, _Arena] = {}
        self._tables: dict[str, _Resident] = {}
        self._numbers: dict[str, int] = {}  # each table's place in the order tables were added
        self._seen: list[Sightings] = []
        self._touched: list[tuple[_Arena, torch.Tensor]] = []  # rows gathered, their clock not yet set
        self._looked_up: set[int] = set()  # numbers of the tables touched since the last step
        self.generation = 0  # changes when slots handed out may have become invalid
        # Changes when slots of rows gathered since the last step (see :meth:`touch`) may have: as
        # ``generation``, but for an eviction in place, which never lets those rows go (:meth:`evict`).
        self.step_generation = 0
        self.version = 0  # changes whenever any table's resident keys change
        self.clock = 0  # advanced by every optimizer step: rows gathered since have used == clock
        self._bytes = 0  # bytes_used, kept as rows come and go

    def add_table(self, table: str, width: int) -> None:
        if table not in self._tables:
            arena = self._arenas.setdefault(width, _Arena(width, self.device))
            self._tables[table] = _Resident(arena)
            self._numbers[table] = len(self._numbers)
            self.version += 1

    def row_bytes(self, table: str) -> int:
        return self._tables[table].width * 4 + ROW_OVERHEAD

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def _count_bytes(self) -> None:
        self._bytes = sum(r.n * (r.width * 4 + ROW_OVERHEAD) for r in self._tables.values())

    def num_rows(self, table: str) -> int:
        return self._tables[table].n

    def bytes_for(self, counts: dict[str, int]) -> int:
        return sum(n * self.row_bytes(t) for t, n in counts.items())

    def rows(self, table: str) -> torch.Tensor:
        """(slots, width) float32 arena holding ``table``'s rows, indexed by the slots of :meth:`resolve`."""
        self.flush_seen()
        arena = self._tables[table].arena
        return arena.rows[: arena.n]

    def arena(self, table: str) -> _Arena:
        """The arena of ``table``'s rows (shared with every table of its width)."""
        return self._tables[table].arena

    def weights(self, table: str, slots: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """slots (U,) int64 -> (U, dim) float32 copy of those rows' weights, decoded with ``layout``."""
        return layout.gather_weights(self._tables[table].arena.rows, slots)

    def keys_at(self, table: str, slots: torch.Tensor) -> torch.Tensor:
        """slots (U,) int64 of resident rows of ``table`` -> (U,) int64 their keys (on the device)."""
        return self._tables[table].keys_at(slots)

    def resolve(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: (n,) int64 on the device -> (found (n,) bool, slots (n,) int64; valid where found)."""
        return self._tables[table].find(ids)

    def locate(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids: (n,) int64 on the device -> (slots (n,) int64, valid where found; found (n,) bool,
        or None when all are resident): one probe each, all resident or not."""
        return self._tables[table].locate(ids)

    def insert(self, table: str, keys: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """Make sorted unique ``keys`` (absent here) resident with ``rows`` (n, width) float32 -> their
        slots (n,) int64 on the device."""
        m = len(keys)
        if m == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        r = self._tables[table]
        arena = r.arena
        slots = arena.take(m)
        at: slice | np.ndarray = slots
        if m == 1 or bool((np.diff(slots) == 1).all()):  # appended (or freed together): a slice
            at = slice(int(slots[0]), int(slots[0]) + m)
        if self.device.type == "cpu":  # numpy views of the arena: a slice assigned at memory speed
            arena.rows.numpy()[at] = rows
            arena.dirty.numpy()[at] = False
            arena.used.numpy()[at] = self.clock
        else:
            idx = torch.from_numpy(slots).to(self.device)
            arena.rows[idx] = torch.from_numpy(np.ascontiguousarray(rows)).to(self.device)
            arena.dirty[idx] = False
            arena.used[idx] = self.clock
        r.add(keys, slots)
        arena.own(slots, self._numbers[table], keys)
        self._bytes += m * self.row_bytes(table)
        self.version += 1
        return torch.from_numpy(slots).to(self.device)

    def mark_dirty(self, table: str, slots: torch.Tensor) -> None:
        self._tables[table].arena.dirty[slots] = True

    # -- recency (the tier as a cache, outside passes) ----------------------------------------
    def touch(self, table: str, slots: torch.Tensor) -> None:
        """Mark rows as gathered for training now (see :meth:`recent`): recorded here, written into
        their arena's clock column by one call per arena before the clock moves or is read."""
        self._touched.append((self._tables[table].arena, slots))
        self._looked_up.add(self._numbers[table])

    def _flush_touched(self) -> None:
        if not self._touched:
            return
        touched, self._touched = self._touched, []
        by_arena: dict[int, tuple[_Arena, list[torch.Tensor]]] = {}
        for arena, slots in touched:
            by_arena.setdefault(id(arena), (arena, []))[1].append(slots)
        for arena, slots_list in by_arena.values():
            arena.used.index_fill_(0, joined(slots_list), self.clock)

    def tick(self) -> None:
        """An optimizer step ran: rows gathered from now on are newer than all before."""
        self._flush_touched()
        self._looked_up = set()
        self.clock += 1

    def recent(self, budget_bytes: int) -> dict[str, np.ndarray]:
        """The most recently used resident rows that fit in ``budget_bytes``: sorted keys per table.

        Rows gathered since the last step come first (their gradients are pending), then by the
        step they were last used at; rows used at the same step are taken table by table.
        """
        self._flush_touched()
        tables = [(t, r) for t, r in self._tables.items() if r.n]
        if not tables:
            return {}
        used = [
            r.arena.used.index_select(0, torch.from_numpy(r.slots).to(self.device)).cpu().numpy()
            for _, r in tables
        ]
        cost = np.concatenate([np.full(r.n, self.row_bytes(t), np.int64) for t, r in tables])
        order = np.argsort(-np.concatenate(used), kind="stable")
        take = np.zeros(len(order), bool)
        take[order[np.cumsum(cost[order]) <= budget_bytes]] = True
        out, at = {}, 0
        for (table, r), _ in zip(tables, used):
            chosen = r.keys[take[at : at + r.n]]
            at += r.n
            out[table] = np.sort(chosen)
        return out

    def evict(
        self, nbytes: int, least: int, protect: list[tuple[str, torch.Tensor]]
    ) -> dict[str, DrainedRows] | None:
        """Free ``nbytes`` (at least ``least``) by letting go of the least recently used rows: the tier
        as a cache, outside passes. Returns the rows that leave, per table, for write-back; None
        (nothing changed) when those that may leave free less than ``least``.

        Rows gathered since the last step (:meth:`touch`; their gradients are pending) and the rows
        at ``protect``'s slots never leave, so slots handed out for them stay valid (see
        :attr:`step_generation`); the freed slots are taken by the next rows inserted. Costs a look
        at each arena's clock column, not a rebuild of the tier.
        """
        self._flush_touched()
        arenas = [a for a in self._arenas.values() if a.n]
        held: dict[int, np.ndarray] = {}
        for table, kept in protect:
            arena = self._tables[table].arena
            held.setdefault(id(arena), np.zeros(arena.n, bool))[kept.cpu().numpy()] = True
        # Of rows last used at the same step, those of tables looked up since the last step go first:
        # a model looks each table up once a step, so they are not asked for again before the next.
        later = np.ones(len(self._numbers), np.int64)
        later[list(self._looked_up)] = 0
        owners = [self._owners(arena) for arena in arenas]
        used, slot, which, cost = [], [], [], []
        for j, arena in enumerate(arenas):
            owner = owners[j][0]
            clock = arena.used[: arena.n].cpu().numpy()
            may = (owner >= 0) & (clock < self.clock)
            if id(arena) in held:
                may &= ~held[id(arena)]
            at = np.flatnonzero(may)
            used.append(2 * clock[at] + later[owner[at]])
            slot.append(at)
            which.append(np.full(len(at), j, np.int32))
            cost.append(np.full(len(at), arena.width * 4 + ROW_OVERHEAD, np.int64))
        if not used:
            return None
        used_all, cost_all = np.concatenate(used), np.concatenate(cost)
        total = int(cost_all.sum())
        if not len(used_all) or total < least:
            return None
        # The least recently used first (a stable order: slots in order within a clock), until
        # nbytes are freed: counted, not sorted (the clocks span about the steps since the start).
        go = lowest_scored(used_all, cost_all, min(nbytes, total))
        slot_all, which_all = np.concatenate(slot), np.concatenate(which)
        names = list(self._tables)
        # Per arena: the leaving slots grouped by table, and where each table's run begins.
        leaving: list[
            tuple[int, np.ndarray, np.ndarray, np.ndarray]
        ] = []  # (arena's j, slots, tables, firsts)
        for j in range(len(arenas)):
            slots = slot_all[go & (which_all == j)]  # increasing: each arena's candidates are
            if len(slots):
                tid = owners[j][0][slots]
                by_table = np.argsort(tid, kind="stable")
                ranked = tid[by_table]
                first = np.flatnonzero(np.concatenate([[True], ranked[1:] != ranked[:-1]]))
                leaving.append((j, slots[by_table], ranked[first], first))
        self._flush_seen_of([(arenas[j], s) for j, s, _, _ in leaving])
        out: dict[str, DrainedRows] = {}
        for j, slots, tids, first in leaving:
            arena, (owner, key_of) = arenas[j], owners[j]
            idx = torch.from_numpy(slots).to(self.device)
            rows = arena.rows.index_select(0, idx).cpu().numpy()  # one gather for all its tables
            dirty = arena.dirty.index_select(0, idx).cpu().numpy()
            keys_all = key_of[slots]
            owner[slots] = -1  # a view of arena.owner: the slots are free from now on
            arena.free = np.concatenate([arena.free, slots])
            bounds = [*first.tolist(), len(slots)]
            for t, lo, hi in zip(tids.tolist(), bounds[:-1], bounds[1:]):
                table = names[t]
                r = self._tables[table]
                out[table] = DrainedRows(keys_all[lo:hi], rows[lo:hi], dirty[lo:hi])
                r.remove(keys_all[lo:hi], owner[r.slots] == t)
                self._bytes -= (hi - lo) * self.row_bytes(table)
        self.generation += 1
        self.version += 1
        return out

    def _owners(self, arena: _Arena) -> tuple[np.ndarray, np.ndarray]:
        """(owner (n,) int32: the number of the table whose row each slot of ``arena`` holds (in the
        order tables were added), -1 for none; key_of (n,) int64: that row's key), kept from then on
        by :meth:`insert` (:meth:`_Arena.own`) and :meth:`evict`."""
        if arena.owner is None:
            arena.owner = np.full(arena.rows.shape[0], -1, np.int32)
            arena.key_of = np.zeros(arena.rows.shape[0], np.int64)
            for i, r in enumerate(self._tables.values()):
                if r.arena is arena and r.n:
                    arena.owner[r.slots] = i
                    arena.key_of[r.slots] = r.keys
        assert arena.key_of is not None
        return arena.owner[: arena.n], arena.key_of[: arena.n]

    def _flush_seen_of(self, leaving: list[tuple[_Arena, np.ndarray]]) -> None:
        """Apply the deferred sightings before the rows at these slots leave, if any is theirs."""
        if not self._seen:
            return
        gone: dict[int, np.ndarray] = {}
        for arena, slots in leaving:
            gone.setdefault(id(arena), np.zeros(arena.n, bool))[slots] = True
        for s in self._seen:
            mask = gone.get(id(s.arena))
            if mask is not None and bool(mask[s.slots.cpu().numpy()].any()):
                self.flush_seen()
                return

    # -- counters -----------------------------------------------------------------------------
    def defer_seen(
        self, table: str, slots: torch.Tensor, counts: torch.Tensor | None, start: int, now: int, decay: float
    ) -> None:
        """Count sightings of resident rows (see :func:`hierps.rows._counters.record_seen`) later, fused:
        ``counts`` (U,) of unique ``slots`` (U,), or None for one per entry of ``slots``, repeats included."""
        self._seen.append(Sightings(self._tables[table].arena, slots, counts, start, now, decay))

    def take_seen(self, arena: object, slots: list[torch.Tensor]) -> list[Sightings | None]:
        """The deferred sightings of ``arena`` recorded with each of these very ``slots`` tensors (or
        None), no longer deferred: for a step that gathers those rows anyway and counts them there
        (:func:`hierps.rows._counters.record_seen_rows`)."""
        wanted = {id(s): i for i, s in enumerate(slots)}
        out: list[Sightings | None] = [None] * len(slots)
        kept = []
        for s in self._seen:
            i = wanted.get(id(s.slots))
            if i is not None and s.arena is arena and out[i] is None and slots[i] is s.slots:
                out[i] = s
            else:
                kept.append(s)
        self._seen = kept
        return out

    def flush_seen(self) -> None:
        """Add every deferred sighting to its rows' counters (and mark those rows dirty)."""
        if not self._seen:
            return
        seen, self._seen = self._seen, []
        groups: dict[tuple[int, int, int], list[tuple[Sightings, torch.Tensor, torch.Tensor]]] = {}
        for s in seen:
            slots, counts = _per_slot(s)
            if s.decay == 1.0:
                groups.setdefault((id(s.arena), s.start, s.now), []).append((s, slots, counts))
            else:  # decay needs each sighting's age: one at a time, in order
                record_seen(s.arena.rows, slots, s.start, counts, s.now, s.decay)
                s.arena.dirty[slots] = True
        for items in groups.values():  # without decay, sightings add up: one call for all of them
            first = items[0][0]
            slots = joined([slots for _, slots, _ in items])
            record_seen(
                first.arena.rows, slots, first.start, joined([c for _, _, c in items]), first.now, 1.0
            )
            first.arena.dirty[slots] = True

    # -- leaving the tier ---------------------------------------------------------------------
    def _taken(self, r: _Resident) -> tuple[np.ndarray, np.ndarray]:
        """(rows (n, width), dirty (n,)) of ``r``'s resident rows, on the host."""
        idx = torch.from_numpy(r.slots).to(self.device)
        return r.arena.rows.index_select(0, idx).cpu().numpy(), r.arena.dirty.index_select(
            0, idx
        ).cpu().numpy()

    def drain(self) -> dict[str, DrainedRows]:
        """Empty the tier; returns every resident row with its dirty bit."""
        self.flush_seen()
        out: dict[str, DrainedRows] = {}
        for table, r in self._tables.items():
            if r.n:
                rows, dirty = self._taken(r)
                out[table] = DrainedRows(keys=r.keys.copy(), rows=rows, dirty=dirty)
        self._reset()
        return out

    def take_dirty(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Copies of the dirty rows of each table, which then count as clean (for checkpoints)."""
        self.flush_seen()
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for table, r in self._tables.items():
            if r.n == 0:
                continue
            rows, dirty = self._taken(r)
            if dirty.any():
                out[table] = (r.keys[dirty].copy(), rows[dirty])
                r.arena.dirty[torch.from_numpy(r.slots).to(self.device)] = False
        return out

    def discard(self, table: str | None = None) -> None:
        """Forget resident rows without writing them anywhere."""
        self.flush_seen()
        if table is None:
            self._reset()
            return
        old = self._tables[table]
        old.arena.free = np.concatenate([old.arena.free, old.slots])  # taken again by the next rows
        old.arena.owner = None
        self._tables[table] = _Resident(old.arena)
        self._count_bytes()
        self._invalidate()

    def _reset(self) -> None:
        self._touched, self._looked_up = [], set()
        self._arenas = {w: _Arena(w, self.device, clock=self.clock) for w in self._arenas}
        self._tables = {t: _Resident(self._arenas[r.width]) for t, r in self._tables.items()}
        self._bytes = 0
        self._invalidate()

    def _invalidate(self) -> None:
        """Every slot handed out may have changed."""
        self.generation += 1
        self.step_generation += 1
        self.version += 1

    def valid(self, generation: int, touched: bool) -> bool:
        """Whether slots handed out at ``generation`` (:attr:`step_generation` for ``touched`` rows,
        gathered since the last step) still hold the same rows."""
        return generation == (self.step_generation if touched else self.generation)

    # -- the working set between passes (see :mod:`hierps.tiers._working_set`) -----------------
    def layout(self, sizes: dict[str, int]) -> dict[str, int]:
        """First arena slot of each table when :meth:`rebuild` makes ``sizes[t]`` rows resident."""
        return self.resident_keys().layout(sizes)

    def resident_keys(self) -> ResidentKeys:
        """What is resident now, for working out the next pass's relayout off the training thread."""
        return ResidentKeys(self.version, [(t, r.width, r.keys, r.slots) for t, r in self._tables.items()])

    def rebuild(
        self,
        keep: dict[str, np.ndarray],
        prepared: dict[str, tuple[np.ndarray, np.ndarray]] | None,
        fetch: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    ) -> dict[str, DrainedRows]:
        """Make the working set exactly ``keep`` (sorted unique keys per table), moving as little as possible.

        Rows already resident are carried over; the others come from ``prepared`` (``{table: (sorted
        keys, rows)}`` read ahead in the background) or else from one ``fetch({table: keys})`` for
        all tables. Returns the rows that leave the tier, with their dirty bits, for write-back.
        Nothing changes if ``fetch`` fails.
        """
        self.flush_seen()
        relayout = self.resident_keys().relayout_to(keep)
        rows, lacking = {}, {}
        for table, missing in relayout.missing.items():
            got = np.empty((len(missing), self._tables[table].width), dtype=np.float32)
            have = np.zeros(len(missing), bool)
            if prepared is not None and table in prepared:
                pk, pr = prepared[table]
                have, at = find_sorted(pk, missing)
                got[have] = pr[at[have]]
            rows[table] = got
            if not have.all():
                lacking[table] = np.flatnonzero(~have)
        if lacking:
            fetched = fetch({t: relayout.missing[t][at] for t, at in lacking.items()})
            for table, at in lacking.items():
                rows[table][at] = fetched[table]
        return self.apply_relayout(relayout, rows)

    def stage(self, relayout: Relayout, rows: dict[str, np.ndarray]) -> Staged | None:
        """On the CPU, the arenas ``relayout`` makes, with ``rows[t]`` (the rows of
        ``relayout.missing[t]``) in their slots already; None elsewhere.

        Nothing of the tier is read or changed, so the pipeline's worker builds them while the
        current pass trains; :meth:`apply_relayout` then only copies the rows that stay. On a GPU
        that would hold a second working set in device memory, so the rows are copied in there.
        """
        if self.device.type != "cpu":
            return None
        out = {}
        for width, capacity in relayout.capacity.items():
            arena = out[width] = _Arena(width, self.device, capacity)
            arena.n = capacity
            _put_rows(arena, relayout, width, rows)
        return out

    def apply_relayout(
        self, relayout: Relayout, rows: dict[str, np.ndarray], staged: Staged | None = None
    ) -> dict[str, DrainedRows]:
        """Carry out ``relayout`` (worked out at the tier's current version) with ``rows[t]``, the rows
        of ``relayout.missing[t]``, or the arenas :meth:`stage` built with them. A few whole-arena
        copies; returns the rows that leave, for write-back (on the CPU, copied when first read)."""
        if relayout.version != self.version:
            raise RuntimeError("device tier changed since the relayout was worked out")  # callers check first
        self.flush_seen()
        self._flush_touched()
        arenas = {}
        out: dict[str, DrainedRows] = {}
        for width, old in self._arenas.items():
            new = (staged or {}).get(width)
            if new is None:
                new = _Arena(width, self.device, relayout.capacity.get(width, 0), self.clock)
                new.n = new.rows.shape[0]
                _put_rows(new, relayout, width, rows)
            else:
                new.used.fill_(self.clock)
            arenas[width] = new
            out.update(self._leaving(old, relayout, width))
            stay = relayout.stay_from.get(width, _EMPTY)
            if len(stay):
                src = torch.from_numpy(stay).to(self.device)
                dst = torch.from_numpy(relayout.stay_to[width]).to(self.device)
                new.rows.index_copy_(0, dst, old.rows.index_select(0, src))
                new.dirty.index_copy_(0, dst, old.dirty.index_select(0, src))
                new.used.index_copy_(0, dst, old.used.index_select(0, src))
        tables = {}
        for table, r in self._tables.items():
            want, first = relayout.keep.get(table, _EMPTY), relayout.first_slot[table]
            tables[table] = _Resident(
                arenas[r.width], want, np.arange(first, first + len(want), dtype=np.int64)
            )
        self._arenas, self._tables = arenas, tables
        self._count_bytes()
        self._invalidate()
        return out

    def _leaving(self, arena: _Arena, relayout: Relayout, width: int) -> dict[str, DrainedRows]:
        """The rows of ``arena`` that ``relayout`` lets go, per table: copied to the host, or on the
        CPU left in ``arena`` (which the tier lets go too) for the write-back to copy."""
        leave = relayout.leave_from.get(width, _EMPTY)
        if not len(leave):
            return {}
        idx = torch.from_numpy(leave).to(self.device)
        dirty = arena.dirty.index_select(0, idx).cpu().numpy()
        left = arena.rows.index_select(0, idx).cpu().numpy() if self.device.type != "cpu" else None
        out, at = {}, 0
        for table, keys in relayout.leave_keys[width]:
            n = len(keys)
            if left is None:
                out[table] = DrainedRows(
                    keys, None, dirty[at : at + n], source=(arena.rows, idx[at : at + n])
                )
            else:
                out[table] = DrainedRows(keys, left[at : at + n], dirty[at : at + n])
            at += n
        return out


def _put_rows(arena: _Arena, relayout: Relayout, width: int, rows: dict[str, np.ndarray]) -> None:
    """Copy ``rows[t]`` of each table of ``width`` missing from the tier into its slots of ``arena``
    (the relayout's new arena; its dirty bits are clear)."""
    fresh = relayout.new_to.get(width, _EMPTY)
    if not len(fresh):
        return
    dst = torch.from_numpy(fresh).to(arena.device)
    parts = [rows[t] for t in relayout.new_tables[width]]
    if arena.device.type == "cpu":  # each table's rows straight into its slots: no joined copy
        at = 0
        for part in parts:
            arena.rows.index_copy_(0, dst[at : at + len(part)], torch.from_numpy(part))
            at += len(part)
    else:  # one transfer
        arena.rows.index_copy_(0, dst, torch.from_numpy(np.concatenate(parts)).to(arena.device))


def staged_rows(relayout: Relayout, staged: Staged) -> dict[str, np.ndarray]:
    """The rows of ``relayout.missing[t]`` back out of the arenas :meth:`DeviceTier.stage` built."""
    out = {}
    for width, arena in staged.items():
        fresh, at = relayout.new_to.get(width, _EMPTY), 0
        for table in relayout.new_tables.get(width, []):
            n = len(relayout.missing[table])
            out[table] = arena.rows.index_select(0, torch.from_numpy(fresh[at : at + n])).numpy()
            at += n
    return out
