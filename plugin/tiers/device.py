"""Device tier: the working set of the current pass, as torch tensors on the training device.

Per table, rows live in one ``(capacity, width)`` float32 tensor; a sorted key tensor and its slot
tensor (both on the device) translate a mini-batch's ids into slots with one ``searchsorted``, so
a pass whose rows were loaded ahead needs no host round trip per mini-batch. The byte budget is
shared by all tables. Draining the tier (end of a pass) hands rows back to the store and bumps
``generation``, which invalidates slots held by callers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DeviceTier", "DrainedRows", "rebuild"]

# Bytes per resident row besides its floats: sorted key (8) + slot (8) + host key (8) + dirty (1).
ROW_OVERHEAD = 25


@dataclass
class DrainedRows:
    """Rows leaving the device tier: keys (n,) int64, rows (n, width) float32, dirty (n,) bool."""

    keys: np.ndarray
    rows: np.ndarray
    dirty: np.ndarray


class _Resident:
    def __init__(self, width: int, device: torch.device) -> None:
        self.width = width
        self.device = device
        self.n = 0
        self.rows = torch.empty((0, width), dtype=torch.float32, device=device)
        self.dirty = torch.zeros(0, dtype=torch.bool, device=device)
        self.slot_keys = np.empty(0, np.int64)  # host copy: key of each slot
        self.skeys = torch.empty(0, dtype=torch.int64, device=device)  # sorted keys
        self.sslots = torch.empty(0, dtype=torch.int64, device=device)  # slot of skeys[i]

    def reserve(self, n: int) -> None:
        if n <= self.rows.shape[0]:
            return
        cap = max(n, 2 * self.rows.shape[0], 64)
        rows = torch.empty((cap, self.width), dtype=torch.float32, device=self.device)
        rows[: self.n] = self.rows[: self.n]
        dirty = torch.zeros(cap, dtype=torch.bool, device=self.device)
        dirty[: self.n] = self.dirty[: self.n]
        self.rows, self.dirty = rows, dirty
        self.slot_keys = np.concatenate([self.slot_keys[: self.n], np.empty(cap - self.n, np.int64)])


class DeviceTier:
    """Byte-bounded working set of rows for many tables on one torch device."""

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        self.budget = int(budget_bytes)
        self.device = device
        self._tables: dict[str, _Resident] = {}
        self.generation = 0

    def add_table(self, table: str, width: int) -> None:
        if table not in self._tables:
            self._tables[table] = _Resident(width, self.device)

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
        """(n, width) float32 view of the resident rows of ``table``."""
        r = self._tables[table]
        return r.rows[: r.n]

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
        r.reserve(r.n + m)
        r.rows[r.n : r.n + m] = torch.from_numpy(np.ascontiguousarray(rows)).to(self.device)
        r.dirty[r.n : r.n + m] = False
        r.slot_keys[r.n : r.n + m] = keys
        new_keys = torch.from_numpy(keys).to(self.device)
        new_slots = torch.arange(r.n, r.n + m, dtype=torch.int64, device=self.device)
        skeys = torch.cat([r.skeys, new_keys])
        order = torch.argsort(skeys, stable=True)
        r.skeys = skeys[order]
        r.sslots = torch.cat([r.sslots, new_slots])[order]
        r.n += m

    def resident_keys(self, table: str) -> np.ndarray:
        """Sorted keys resident for ``table``."""
        r = self._tables[table]
        return np.sort(r.slot_keys[: r.n])

    def mark_dirty(self, table: str, slots: torch.Tensor) -> None:
        self._tables[table].dirty[slots] = True

    def drain(self) -> dict[str, DrainedRows]:
        """Empty the tier; returns every resident row with its dirty bit."""
        out: dict[str, DrainedRows] = {}
        for table, r in self._tables.items():
            if r.n:
                out[table] = DrainedRows(
                    keys=r.slot_keys[: r.n].copy(),
                    rows=r.rows[: r.n].cpu().numpy().copy(),
                    dirty=r.dirty[: r.n].cpu().numpy().copy(),
                )
            self._tables[table] = _Resident(r.width, self.device)
        self.generation += 1
        return out

    def take_dirty(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Copies of the dirty rows of each table, which then count as clean (for checkpoints)."""
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for table, r in self._tables.items():
            if r.n == 0:
                continue
            dirty = r.dirty[: r.n].cpu().numpy()
            if dirty.any():
                slots = np.flatnonzero(dirty)
                out[table] = (
                    r.slot_keys[slots].copy(),
                    r.rows[torch.from_numpy(slots).to(self.device)].cpu().numpy(),
                )
                r.dirty[: r.n] = False
        return out

    def discard(self, table: str | None = None) -> None:
        """Forget resident rows without writing them anywhere."""
        for t in [table] if table is not None else list(self._tables):
            self._tables[t] = _Resident(self._tables[t].width, self.device)
        self.generation += 1


def _sorted_index(keys: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    order = np.argsort(keys, kind="stable")
    return (
        torch.from_numpy(np.ascontiguousarray(keys[order])).to(device),
        torch.from_numpy(order.astype(np.int64)).to(device),
    )


def rebuild(
    tier: DeviceTier,
    keep: dict[str, np.ndarray],
    prepared: dict[str, tuple[np.ndarray, np.ndarray]] | None,
    fetch: Callable[[str, np.ndarray], np.ndarray],
) -> dict[str, DrainedRows]:
    """Make the working set exactly ``keep`` (sorted unique keys per table), moving as little as possible.

    Rows already resident are carried over (never re-read: they may be newer than every tier below);
    the others come from ``prepared`` (read ahead in the background) or else from ``fetch``.
    Returns the rows that leave the tier, with their dirty bits, for write-back.
    """
    out: dict[str, DrainedRows] = {}
    for table, r in list(tier._tables.items()):
        want = keep.get(table, np.empty(0, np.int64))
        cur = r.slot_keys[: r.n]
        carry = np.isin(cur, want)
        dirty = r.dirty[: r.n].cpu().numpy()
        if not carry.all():
            leave = np.flatnonzero(~carry)
            leave_t = torch.from_numpy(leave).to(tier.device)
            out[table] = DrainedRows(
                keys=cur[leave].copy(), rows=r.rows[leave_t].cpu().numpy(), dirty=dirty[leave]
            )
        stay = np.flatnonzero(carry)
        stay_keys = cur[stay]
        missing = np.setdiff1d(want, stay_keys, assume_unique=True)
        new_rows = np.empty((len(missing), r.width), dtype=np.float32)
        have = np.zeros(len(missing), bool)
        if prepared is not None and table in prepared and len(missing):
            pk, pr = prepared[table]
            at = np.minimum(np.searchsorted(pk, missing), max(len(pk) - 1, 0))
            have = (pk[at] == missing) if len(pk) else have
            new_rows[have] = pr[at[have]]
        if (~have).any():
            new_rows[~have] = fetch(table, missing[~have])
        fresh = _Resident(r.width, tier.device)
        n = len(stay) + len(missing)
        fresh.reserve(n)
        if len(stay):
            fresh.rows[: len(stay)] = r.rows[torch.from_numpy(stay).to(tier.device)]
            fresh.dirty[: len(stay)] = torch.from_numpy(dirty[stay]).to(tier.device)
        fresh.rows[len(stay) : n] = torch.from_numpy(new_rows).to(tier.device)
        fresh.slot_keys[:n] = np.concatenate([stay_keys, missing])
        fresh.n = n
        fresh.skeys, fresh.sslots = _sorted_index(fresh.slot_keys[:n], tier.device)
        tier._tables[table] = fresh
    tier.generation += 1
    return out
