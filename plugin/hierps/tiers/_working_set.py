"""How the device tier's working set changes between passes, worked out on the host.

:meth:`DeviceTier.resident_keys` hands out what is resident (:class:`ResidentKeys`: the tier's own
key and slot arrays, which it replaces instead of changing in place), so that the pipeline's
worker can compute the next pass's :class:`Relayout` (pure numpy, no tier touched) while the
current pass trains; the tier then carries it out with a few whole-arena copies
(:meth:`DeviceTier.apply_relayout`), provided it has not changed since (same ``version``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hierps.storage._native import find_sorted

__all__ = ["Relayout", "ResidentKeys"]

_EMPTY = np.empty(0, np.int64)


@dataclass
class Relayout:
    """How the tier goes from :class:`ResidentKeys` to a new working set (see :meth:`ResidentKeys.relayout_to`).

    Per width (arena): the slots of rows that stay and where they go, where the rows of missing
    keys go, and the slots of rows that leave; index arrays joined over the arena's tables.
    """

    version: int  # of the tier this was computed for
    keep: dict[str, np.ndarray]  # per table: the new working set, sorted unique keys
    first_slot: dict[str, int]  # per table: arena slot of its first row (see ResidentKeys.layout)
    missing: dict[str, np.ndarray]  # per table: sorted keys to read from the tiers below
    capacity: dict[int, int] = field(default_factory=dict)
    stay_from: dict[int, np.ndarray] = field(default_factory=dict)
    stay_to: dict[int, np.ndarray] = field(default_factory=dict)
    new_to: dict[int, np.ndarray] = field(default_factory=dict)
    new_tables: dict[int, list[str]] = field(default_factory=dict)
    leave_from: dict[int, np.ndarray] = field(default_factory=dict)
    leave_keys: dict[int, list[tuple[str, np.ndarray]]] = field(default_factory=dict)


@dataclass(frozen=True)
class ResidentKeys:
    """The resident keys of each table (in the order tables were added) at tier ``version``."""

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

    def relayout_to(self, keep: dict[str, np.ndarray]) -> Relayout:
        """How to make the working set exactly ``keep`` (sorted unique keys per table).

        Rows already resident stay (never re-read: they may be newer than every tier below); each
        table ends up at the slots :meth:`layout` gives, in key order.
        """
        first_slot = self.layout({t: len(k) for t, k in keep.items()})
        out = Relayout(self.version, {}, first_slot, {})
        parts: dict[int, dict[str, list[Any]]] = {}
        for table, width, keys, slots in self.tables:
            want = keep.get(table, _EMPTY)
            out.keep[table] = want
            p = parts.setdefault(width, {"stay_from": [], "stay_to": [], "new_to": [], "leave": []})
            out.capacity[width] = out.capacity.get(width, 0) + len(want)
            out.new_tables.setdefault(width, [])
            out.leave_keys.setdefault(width, [])
            # Positions in ``want`` of the resident keys (both unique): they stay, or else leave.
            carry, at = find_sorted(want, keys)
            if not carry.all():
                leave = np.flatnonzero(~carry)
                p["leave"].append(slots[leave])
                out.leave_keys[width].append((table, keys[leave]))
            stay_at = at[carry]
            p["stay_from"].append(slots[carry])
            p["stay_to"].append(first_slot[table] + stay_at)
            is_missing = np.ones(len(want), bool)
            is_missing[stay_at] = False
            missing_at = np.flatnonzero(is_missing)
            if len(missing_at):
                out.missing[table] = want[missing_at]
                out.new_tables[width].append(table)
                p["new_to"].append(first_slot[table] + missing_at)
        for width, p in parts.items():
            out.stay_from[width] = _cat(p["stay_from"])
            out.stay_to[width] = _cat(p["stay_to"])
            out.new_to[width] = _cat(p["new_to"])
            out.leave_from[width] = _cat(p["leave"])
        return out


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64, copy=False) if arrays else _EMPTY
