"""Per-pass statistics: where rows came from, SSD traffic, rows per tier."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hierps.store import Store

__all__ = ["PassStats"]


@dataclass
class PassStats:
    """Counters of the current pass and the record of finished ones (``history``)."""

    history: list[dict[str, Any]] = field(default_factory=list)
    _loads: dict[str, list[int]] = field(default_factory=dict)
    _ahead: dict[str, list[int]] = field(default_factory=dict)  # read ahead for the next pass
    _pass: int = 0
    _t0: float = 0.0
    _ssd0: tuple[int, int] = (0, 0)

    def begin_pass(self, index: int) -> None:
        self._pass, self._t0 = index, time.perf_counter()
        self._loads, self._ahead = self._ahead, {}

    def count_load(self, table: str, *, ram: int, ssd: int, new: int, ahead: bool = False) -> None:
        c = (self._ahead if ahead else self._loads).setdefault(table, [0, 0, 0])
        c[0] += ram
        c[1] += ssd
        c[2] += new

    def end_pass(self, store: Store) -> dict[str, Any]:
        ram = sum(c[0] for c in self._loads.values())
        ssd = sum(c[1] for c in self._loads.values())
        new = sum(c[2] for c in self._loads.values())
        # No lock: each figure is one length or counter read (atomic under the GIL), so the training
        # thread never waits here for the pipeline's worker; figures may be a write-back apart.
        return self._record(store, ram, ssd, new)

    def _record(self, store: Store, ram: int, ssd: int, new: int) -> dict[str, Any]:
        loaded = max(ram + ssd + new, 1)
        read, written = store.ssd.bytes_read, store.ssd.bytes_written
        record = {
            "pass": self._pass,
            "seconds": time.perf_counter() - self._t0,
            "rows_loaded": ram + ssd + new,
            "ram_hit_rate": ram / loaded,
            "ssd_hit_rate": ssd / loaded,
            "new_rows": new,
            "ssd_bytes_read": read - self._ssd0[0],
            "ssd_bytes_written": written - self._ssd0[1],
            "rows_memory": sum(store.memory.num_rows(t) for t in store.tables),
            "rows_ssd": sum(store.ssd.num_rows(t) for t in store.tables),
            "memory_bytes": store.memory.bytes_used,
        }
        self._ssd0 = (read, written)
        self.history.append(record)
        self._loads = {}
        return record
