"""Device tier: the working set of the current pass, as torch tensors on the training device.

Rows of every table of one width live in one ``(capacity, width)`` float32 *arena* tensor, so a
training step updates the rows of all its tables with one gather, one optimizer call and one
scatter. Per table, a sorted key tensor and its slot tensor (both on the device) translate a
mini-batch's ids into arena slots with one ``searchsorted``. :func:`rebuild` lays each table out
contiguously and in key order (see :meth:`DeviceTier.layout`), so the slots of a pass's ids can
be computed ahead, off the training thread. The byte budget is shared by all tables. Draining
the tier (end of a pass) hands rows back to the store and bumps ``generation``, which
invalidates slots held by callers.

Sightings of keys (the counters of :mod:`hierps.counters`) may be recorded lazily with
:meth:`DeviceTier.defer_seen`; they are applied, fused over tables, before any row leaves the
tier or is read whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hierps._tensors import joined
from hierps.counters import COUNT, DECAYED, LAST_PASS, record_seen

__all__ = ["DeviceTier", "DrainedRows", "rebuild"]

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
    """The rows of every table of one width: slots ``[0, n)`` of ``rows`` are taken."""

    def __init__(self, width: int, device: torch.device, capacity: int = 0) -> None:
        self.width = width
        self.device = device
        self.n = 0
        self.rows = torch.empty((capacity, width), dtype=torch.float32, device=device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=device)

    def append(self, m: int) -> int:
        """Take ``m`` more slots (growing the tensors); returns the first."""
        if self.n + m > self.rows.shape[0]:
            cap = max(self.n + m, 2 * self.rows.shape[0], 64)
            rows = torch.empty((cap, self.width), dtype=torch.float32, device=self.device)
            rows[: self.n] = self.rows[: self.n]
            dirty = torch.zeros(cap, dtype=torch.bool, device=self.device)
            dirty[: self.n] = self.dirty[: self.n]
            self.rows, self.dirty = rows, dirty
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
        self.generation = 0

    def add_table(self, table: str, width: int) -> None:
        if table not in self._tables:
            arena = self._arenas.setdefault(width, _Arena(width, self.device))
            self._tables[table] = _Resident(arena)

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

    def weights(self, table: str, slots: torch.Tensor, dim: int) -> torch.Tensor:
        """slots (U,) int64 -> (U, dim) float32 copy of the first ``dim`` columns of those rows."""
        return self._tables[table].arena.rows[:, :dim].index_select(0, slots)

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
        new_slots = np.arange(start, start + m, dtype=np.int64)
        r.keys = np.concatenate([r.keys, keys])
        r.slots = np.concatenate([r.slots, new_slots])
        skeys = torch.cat([r.skeys, torch.from_numpy(keys).to(self.device)])
        order = torch.argsort(skeys, stable=True)
        r.skeys = skeys[order]
        r.sslots = torch.cat([r.sslots, torch.from_numpy(new_slots).to(self.device)])[order]

    def resident_keys(self, table: str) -> np.ndarray:
        """Sorted keys resident for ``table``."""
        return np.sort(self._tables[table].keys)

    def mark_dirty(self, table: str, slots: torch.Tensor) -> None:
        self._tables[table].arena.dirty[slots] = True

    # -- counters -----------------------------------------------------------------------------
    def defer_seen(
        self, table: str, slots: torch.Tensor, counts: torch.Tensor, start: int, now: int, decay: float
    ) -> None:
        """Count sightings of resident rows (see :func:`hierps.counters.record_seen`) later, fused."""
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
        for items in groups.values():
            first = items[0]
            slots = joined([s.slots for s in items])
            counts = joined([s.counts for s in items])
            rows = first.arena.rows
            rows[:, first.start + COUNT].index_add_(0, slots, counts)
            rows[:, first.start + DECAYED].index_add_(0, slots, counts)
            rows[:, first.start + LAST_PASS].index_fill_(0, slots, float(first.now))
            first.arena.dirty[slots] = True

    # -- leaving the tier ---------------------------------------------------------------------
    def _taken(self, r: _Resident, at: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(rows (k, width), dirty (k,)) of ``r``'s resident rows ``at`` (positions; None: all), on the host."""
        slots = r.slots if at is None else r.slots[at]
        idx = torch.from_numpy(slots).to(self.device)
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

    def _reset(self) -> None:
        self._arenas = {w: _Arena(w, self.device) for w in self._arenas}
        self._tables = {t: _Resident(self._arenas[r.width]) for t, r in self._tables.items()}
        self.generation += 1

    def layout(self, sizes: dict[str, int]) -> dict[str, int]:
        """First arena slot of each table when :func:`rebuild` makes ``sizes[t]`` rows resident.

        Tables follow in the order they were added, each in key order, within its width's arena.
        """
        nxt: dict[int, int] = {}
        out = {}
        for table, r in self._tables.items():
            out[table] = nxt.get(r.width, 0)
            nxt[r.width] = out[table] + sizes.get(table, 0)
        return out


def rebuild(
    tier: DeviceTier,
    keep: dict[str, np.ndarray],
    prepared: dict[str, tuple[np.ndarray, np.ndarray]] | None,
    fetch: Callable[[str, np.ndarray], np.ndarray],
) -> dict[str, DrainedRows]:
    """Make the working set exactly ``keep`` (sorted unique keys per table), moving as little as possible.

    Rows already resident are carried over (never re-read: they may be newer than every tier below);
    the others come from ``prepared`` (read ahead in the background) or else from ``fetch``. Each
    table ends up at the slots :meth:`DeviceTier.layout` gives, in key order. Returns the rows
    that leave the tier, with their dirty bits, for write-back. Nothing changes if ``fetch`` fails.
    """
    tier.flush_seen()
    base = tier.layout({t: len(k) for t, k in keep.items()})
    arenas = {
        w: _Arena(
            w, tier.device, sum(len(keep.get(t, _EMPTY)) for t, r in tier._tables.items() if r.width == w)
        )
        for w in tier._arenas
    }
    for arena in arenas.values():
        arena.n = arena.rows.shape[0]
    tables: dict[str, _Resident] = {}
    out: dict[str, DrainedRows] = {}
    for table, r in tier._tables.items():
        want = keep.get(table, _EMPTY)
        # Positions in ``want`` of the resident keys (both sorted unique): which stay, which leave.
        at = np.minimum(np.searchsorted(want, r.keys), max(len(want) - 1, 0))
        carry = want[at] == r.keys if len(want) else np.zeros(r.n, bool)
        if not carry.all():
            leave = np.flatnonzero(~carry)
            rows, dirty = tier._taken(r, leave)
            out[table] = DrainedRows(keys=r.keys[leave].copy(), rows=rows, dirty=dirty)
        stay_at = at[carry]
        is_missing = np.ones(len(want), bool)
        is_missing[stay_at] = False
        missing_at = np.flatnonzero(is_missing)
        missing = want[missing_at]
        new_rows = np.empty((len(missing), r.width), dtype=np.float32)
        have = np.zeros(len(missing), bool)
        if prepared is not None and table in prepared and len(missing):
            pk, pr = prepared[table]
            got = np.minimum(np.searchsorted(pk, missing), max(len(pk) - 1, 0))
            have = (pk[got] == missing) if len(pk) else have
            new_rows[have] = pr[got[have]]
        if (~have).any():
            new_rows[~have] = fetch(table, missing[~have])
        arena, first = arenas[r.width], base[table]
        fresh = _Resident(arena)
        if len(stay_at):
            to = torch.from_numpy(first + stay_at).to(tier.device)
            src = torch.from_numpy(r.slots[carry]).to(tier.device)
            arena.rows.index_copy_(0, to, r.arena.rows.index_select(0, src))
            arena.dirty.index_copy_(0, to, r.arena.dirty.index_select(0, src))
        if len(missing):
            to = torch.from_numpy(first + missing_at).to(tier.device)
            arena.rows.index_copy_(0, to, torch.from_numpy(new_rows).to(tier.device))
            arena.dirty.index_fill_(0, to, False)
        fresh.keys = want
        fresh.slots = np.arange(first, first + len(want), dtype=np.int64)
        fresh.skeys = torch.from_numpy(want).to(tier.device)
        fresh.sslots = torch.from_numpy(fresh.slots).to(tier.device)
        tables[table] = fresh
    tier._arenas, tier._tables = arenas, tables
    tier.generation += 1
    return out
