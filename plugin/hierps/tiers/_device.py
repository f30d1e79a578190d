"""Device tier: the working set of the current pass, as torch tensors on the training device.

Rows of every table of one width (in 4-byte words: rows are stored as their table's layout says,
:mod:`hierps.rows._layout`) live in one ``(capacity, width)`` float32 *arena* tensor, so a
training step updates the rows of all its tables with one gather, one optimizer call and one
scatter. Per table, a sorted key tensor and its slot tensor (both on the device) translate a
mini-batch's ids into arena slots with one ``searchsorted``. :func:`rebuild` lays each table out
contiguously and in key order (see :meth:`DeviceTier.layout`), so the slots of a pass's ids can
be computed ahead, off the training thread. The byte budget is shared by all tables. Draining
the tier (end of a pass) hands rows back to the store and bumps ``generation``, which
invalidates slots held by callers.

Sightings of keys (the counters of :mod:`hierps.rows._counters`) may be recorded lazily with
:meth:`DeviceTier.defer_seen`; they are applied, fused over tables, before any row leaves the
tier or is read whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hierps._tensors import joined
from hierps.rows._counters import record_seen
from hierps.rows._layout import RowLayout

__all__ = ["DeviceTier", "DrainedRows", "Moves", "Snapshot", "apply_moves", "plan_moves", "rebuild"]

# Bytes per resident row besides its floats: sorted key (8) + slot (8) + host key (8) + dirty (1).
ROW_OVERHEAD = 25
_EMPTY = np.empty(0, np.int64)


@dataclass
class DrainedRows:
    """Rows leaving the device tier: keys (n,) int64, rows (n, width) float32, dirty (n,) bool."""

    keys: np.ndarray
    rows: np.ndarray
    dirty: np.ndarray


class _Arena:
    """The rows of every table of one width: slots ``[0, n)`` of ``rows`` are taken.

    ``used[s]``: the tier's clock when slot ``s`` was last gathered for training (or loaded).
    """

    def __init__(self, width: int, device: torch.device, capacity: int = 0, clock: int = 0) -> None:
        self.width = width
        self.device = device
        self.n = 0
        self.rows = torch.empty((capacity, width), dtype=torch.float32, device=device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.used = torch.full((capacity,), clock, dtype=torch.int64, device=device)

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


class _Resident:
    """One table's rows in its arena: ``keys[i]`` lives at arena slot ``slots[i]``."""

    def __init__(self, arena: _Arena) -> None:
        self.arena = arena
        self.keys = _EMPTY  # host: key of each resident row
        self.slots = _EMPTY  # host: its arena slot
        self.skeys = torch.empty(0, dtype=torch.int64, device=arena.device)  # sorted keys
        self.sslots = torch.empty(0, dtype=torch.int64, device=arena.device)  # slot of skeys[i]

    @property
    def n(self) -> int:
        return len(self.keys)

    @property
    def width(self) -> int:
        return self.arena.width


@dataclass
class _Seen:
    """Sightings of resident rows not yet added to their counters."""

    arena: _Arena
    slots: torch.Tensor  # (U,) int64 arena slots
    counts: torch.Tensor  # (U,) float32
    start: int  # first counter column
    now: int  # pass index
    decay: float


class DeviceTier:
    """Byte-bounded working set of rows for many tables on one torch device."""

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        self.budget = int(budget_bytes)
        self.device = device
        self._arenas: dict[int, _Arena] = {}
        self._tables: dict[str, _Resident] = {}
        self._seen: list[_Seen] = []
        self.generation = 0  # changes when slots handed out may have become invalid
        self.version = 0  # changes whenever any table's resident keys change
        self.clock = 0  # advanced by every optimizer step: rows gathered since have used == clock

    def add_table(self, table: str, width: int) -> None:
        if table not in self._tables:
            arena = self._arenas.setdefault(width, _Arena(width, self.device))
            self._tables[table] = _Resident(arena)
            self.version += 1

    def row_bytes(self, table: str) -> int:
        return self._tables[table].width * 4 + ROW_OVERHEAD

    @property
    def bytes_used(self) -> int:
        return sum(r.n * (r.width * 4 + ROW_OVERHEAD) for r in self._tables.values())

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
        r = self._tables[table]
        by_slot = torch.argsort(r.sslots)
        at = torch.searchsorted(r.sslots[by_slot], slots)
        return r.skeys[by_slot[at]]

    def resolve(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: (n,) int64 on the device -> (found (n,) bool, slots (n,) int64; valid where found)."""
        r = self._tables[table]
        if r.n == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        at = torch.searchsorted(r.skeys, ids).clamp_(max=r.n - 1)
        return r.skeys[at] == ids, r.sslots[at]

    def insert(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """Make sorted unique ``keys`` (absent here) resident with ``rows`` (n, width) float32."""
        m = len(keys)
        if m == 0:
            return
        r = self._tables[table]
        start = r.arena.append(m)
        r.arena.rows[start : start + m] = torch.from_numpy(np.ascontiguousarray(rows)).to(self.device)
        r.arena.dirty[start : start + m] = False
        r.arena.used[start : start + m] = self.clock
        new_slots = np.arange(start, start + m, dtype=np.int64)
        r.keys = np.concatenate([r.keys, keys])
        r.slots = np.concatenate([r.slots, new_slots])
        # Merge the sorted new keys into the sorted resident ones: their places, then the old ones'.
        new_keys = torch.from_numpy(keys).to(self.device)
        at = torch.searchsorted(r.skeys, new_keys) + torch.arange(m, device=self.device)
        is_new = torch.zeros(r.n, dtype=torch.bool, device=self.device)
        is_new[at] = True
        skeys = torch.empty(r.n, dtype=torch.int64, device=self.device)
        sslots = torch.empty(r.n, dtype=torch.int64, device=self.device)
        skeys[at], sslots[at] = new_keys, torch.from_numpy(new_slots).to(self.device)
        skeys[~is_new], sslots[~is_new] = r.skeys, r.sslots
        r.skeys, r.sslots = skeys, sslots
        self.version += 1

    def mark_dirty(self, table: str, slots: torch.Tensor) -> None:
        self._tables[table].arena.dirty[slots] = True

    # -- recency (the tier as a cache, outside passes) ----------------------------------------
    def touch(self, table: str, slots: torch.Tensor) -> None:
        """Mark rows as gathered for training now (see :meth:`recent`)."""
        self._tables[table].arena.used.index_fill_(0, slots, self.clock)

    def tick(self) -> None:
        """An optimizer step ran: rows gathered from now on are newer than all before."""
        self.clock += 1

    def recent(self, budget_bytes: int) -> dict[str, np.ndarray]:
        """The most recently used resident rows that fit in ``budget_bytes``: sorted keys per table.

        Rows gathered since the last step come first (their gradients are pending), then by the
        step they were last used at; rows used at the same step are taken table by table.
        """
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

    # -- counters -----------------------------------------------------------------------------
    def defer_seen(
        self, table: str, slots: torch.Tensor, counts: torch.Tensor, start: int, now: int, decay: float
    ) -> None:
        """Count sightings of resident rows (see :func:`hierps.rows._counters.record_seen`) later, fused."""
        self._seen.append(_Seen(self._tables[table].arena, slots, counts, start, now, decay))

    def flush_seen(self) -> None:
        """Add every deferred sighting to its rows' counters (and mark those rows dirty)."""
        if not self._seen:
            return
        seen, self._seen = self._seen, []
        groups: dict[tuple[int, int, int], list[_Seen]] = {}
        for s in seen:
            if s.decay == 1.0:
                groups.setdefault((id(s.arena), s.start, s.now), []).append(s)
            else:  # decay needs each sighting's age: one at a time, in order
                record_seen(s.arena.rows, s.slots, s.start, s.counts, s.now, s.decay)
                s.arena.dirty[s.slots] = True
        for items in groups.values():  # without decay, sightings add up: one call for all of them
            first = items[0]
            slots = joined([s.slots for s in items])
            record_seen(
                first.arena.rows, slots, first.start, joined([s.counts for s in items]), first.now, 1.0
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
        self._tables[table] = _Resident(self._tables[table].arena)  # its slots stay unused until rebuilt
        self.generation += 1
        self.version += 1

    def _reset(self) -> None:
        self._arenas = {w: _Arena(w, self.device, clock=self.clock) for w in self._arenas}
        self._tables = {t: _Resident(self._arenas[r.width]) for t, r in self._tables.items()}
        self.generation += 1
        self.version += 1

    def layout(self, sizes: dict[str, int]) -> dict[str, int]:
        """First arena slot of each table when :func:`rebuild` makes ``sizes[t]`` rows resident."""
        return self.snapshot().layout(sizes)

    def snapshot(self) -> Snapshot:
        """What is resident now, for planning the next pass's moves off the training thread."""
        return Snapshot(self.version, [(t, r.width, r.keys, r.slots) for t, r in self._tables.items()])


@dataclass
class Snapshot:
    """The resident keys of each table (in the order tables were added) at tier ``version``.

    The arrays are the tier's own; the tier replaces them instead of changing them in place.
    """

    version: int
    tables: list[tuple[str, int, np.ndarray, np.ndarray]]  # (table, width, keys, their slots)

    def layout(self, sizes: dict[str, int]) -> dict[str, int]:
        """First arena slot of each table when ``sizes[t]`` of its rows are made resident.

        Tables follow in the order they were added, each in key order, within its width's arena.
        """
        nxt: dict[int, int] = {}
        out = {}
        for table, width, _, _ in self.tables:
            out[table] = nxt.get(width, 0)
            nxt[width] = out[table] + sizes.get(table, 0)
        return out


@dataclass
class Moves:
    """How the tier goes from a :class:`Snapshot` to a new working set (see :func:`plan_moves`).

    Per width (arena): the slots of rows that stay and where they go, where the rows of missing
    keys go, and the slots of rows that leave; index arrays joined over the arena's tables.
    """

    version: int
    keep: dict[str, np.ndarray]
    base: dict[str, int]
    missing: dict[str, np.ndarray]  # per table: sorted keys to read from the tiers below
    capacity: dict[int, int] = field(default_factory=dict)
    stay_from: dict[int, np.ndarray] = field(default_factory=dict)
    stay_to: dict[int, np.ndarray] = field(default_factory=dict)
    new_to: dict[int, np.ndarray] = field(default_factory=dict)
    new_tables: dict[int, list[str]] = field(default_factory=dict)
    leave_from: dict[int, np.ndarray] = field(default_factory=dict)
    leave_keys: dict[int, list[tuple[str, np.ndarray]]] = field(default_factory=dict)


def plan_moves(snap: Snapshot, keep: dict[str, np.ndarray]) -> Moves:
    """Plan making the working set exactly ``keep`` (sorted unique keys per table): pure numpy.

    Rows already resident stay (never re-read: they may be newer than every tier below); each
    table ends up at the slots :meth:`Snapshot.layout` gives, in key order.
    """
    base = snap.layout({t: len(k) for t, k in keep.items()})
    moves = Moves(snap.version, {}, base, {})
    parts: dict[int, dict[str, list[Any]]] = {}
    for table, width, keys, slots in snap.tables:
        want = keep.get(table, _EMPTY)
        moves.keep[table] = want
        p = parts.setdefault(width, {"stay_from": [], "stay_to": [], "new_to": [], "leave": []})
        moves.capacity[width] = moves.capacity.get(width, 0) + len(want)
        moves.new_tables.setdefault(width, [])
        moves.leave_keys.setdefault(width, [])
        # Positions in ``want`` of the resident keys (both unique; want sorted): stay or leave.
        at = np.minimum(np.searchsorted(want, keys), max(len(want) - 1, 0))
        carry = want[at] == keys if len(want) else np.zeros(len(keys), bool)
        if not carry.all():
            leave = np.flatnonzero(~carry)
            p["leave"].append(slots[leave])
            moves.leave_keys[width].append((table, keys[leave]))
        stay_at = at[carry]
        p["stay_from"].append(slots[carry])
        p["stay_to"].append(base[table] + stay_at)
        is_missing = np.ones(len(want), bool)
        is_missing[stay_at] = False
        missing_at = np.flatnonzero(is_missing)
        if len(missing_at):
            moves.missing[table] = want[missing_at]
            moves.new_tables[width].append(table)
            p["new_to"].append(base[table] + missing_at)
    for width, p in parts.items():
        moves.stay_from[width] = _cat(p["stay_from"])
        moves.stay_to[width] = _cat(p["stay_to"])
        moves.new_to[width] = _cat(p["new_to"])
        moves.leave_from[width] = _cat(p["leave"])
    return moves


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64, copy=False) if arrays else _EMPTY


def apply_moves(tier: DeviceTier, moves: Moves, rows: dict[str, np.ndarray]) -> dict[str, DrainedRows]:
    """Carry out ``moves`` (planned at the tier's current version) with ``rows[t]``, the rows of
    ``moves.missing[t]``. A few whole-arena copies; returns the rows that leave, for write-back."""
    if moves.version != tier.version:
        raise RuntimeError("device tier changed since the moves were planned")  # callers check first
    tier.flush_seen()
    dev = tier.device
    out: dict[str, DrainedRows] = {}
    arenas = {}
    for width, old in tier._arenas.items():
        new = _Arena(width, dev, moves.capacity.get(width, 0), tier.clock)
        new.n = new.rows.shape[0]
        arenas[width] = new
        leave = moves.leave_from.get(width, _EMPTY)
        if len(leave):
            idx = torch.from_numpy(leave).to(dev)
            left, dirty = (
                old.rows.index_select(0, idx).cpu().numpy(),
                old.dirty.index_select(0, idx).cpu().numpy(),
            )
            at = 0
            for table, keys in moves.leave_keys[width]:
                out[table] = DrainedRows(keys, left[at : at + len(keys)], dirty[at : at + len(keys)])
                at += len(keys)
        stay = moves.stay_from.get(width, _EMPTY)
        if len(stay):
            src, dst = torch.from_numpy(stay).to(dev), torch.from_numpy(moves.stay_to[width]).to(dev)
            new.rows.index_copy_(0, dst, old.rows.index_select(0, src))
            new.dirty.index_copy_(0, dst, old.dirty.index_select(0, src))
            new.used.index_copy_(0, dst, old.used.index_select(0, src))
        fresh = moves.new_to.get(width, _EMPTY)
        if len(fresh):
            dst = torch.from_numpy(fresh).to(dev)
            loaded = np.concatenate([rows[t] for t in moves.new_tables[width]])
            new.rows.index_copy_(0, dst, torch.from_numpy(loaded).to(dev))
            new.dirty.index_fill_(0, dst, False)
    tables = {}
    for table, r in tier._tables.items():
        fresh_r = _Resident(arenas[r.width])
        want, first = moves.keep.get(table, _EMPTY), moves.base[table]
        fresh_r.keys = want
        fresh_r.slots = np.arange(first, first + len(want), dtype=np.int64)
        fresh_r.skeys = torch.from_numpy(want).to(dev)
        fresh_r.sslots = torch.from_numpy(fresh_r.slots).to(dev)
        tables[table] = fresh_r
    tier._arenas, tier._tables = arenas, tables
    tier.generation += 1
    tier.version += 1
    return out


def rebuild(
    tier: DeviceTier,
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
    tier.flush_seen()
    moves = plan_moves(tier.snapshot(), keep)
    rows, lacking = {}, {}
    for table, missing in moves.missing.items():
        got = np.empty((len(missing), tier._tables[table].width), dtype=np.float32)
        have = np.zeros(len(missing), bool)
        if prepared is not None and table in prepared:
            pk, pr = prepared[table]
            at = np.minimum(np.searchsorted(pk, missing), max(len(pk) - 1, 0))
            have = (pk[at] == missing) if len(pk) else have
            got[have] = pr[at[have]]
        rows[table] = got
        if not have.all():
            lacking[table] = np.flatnonzero(~have)
    if lacking:
        fetched = fetch({t: moves.missing[t][at] for t, at in lacking.items()})
        for table, at in lacking.items():
            rows[table][at] = fetched[table]
    return apply_moves(tier, moves, rows)
