"""Per-pass statistics: from which tier each pass's rows were loaded, SSD traffic, rows per tier."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hierps.tiers._memory import MemoryTier
from hierps.tiers._ssd import SsdTier

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
    on_demand_rebuilds: int = 0  # times rows fetched on demand overflowed the device tier (all passes)

    def begin_pass(self, index: int) -> None:
        self._pass, self._t0 = index, time.perf_counter()
        self._loads, self._ahead = self._ahead, {}

    def count_load(self, table: str, *, ram: int, ssd: int, new: int, ahead: bool = False) -> None:
        c = (self._ahead if ahead else self._loads).setdefault(table, [0, 0, 0])
        c[0] += ram
        c[1] += ssd
        c[2] += new

    def count_on_demand_rebuild(self) -> None:
        self.on_demand_rebuilds += 1

    def end_pass(self, ssd: SsdTier, memory: MemoryTier, tables: list[str]) -> dict[str, Any]:
        ram = sum(c[0] for c in self._loads.values())
        ssd_rows = sum(c[1] for c in self._loads.values())
        new = sum(c[2] for c in self._loads.values())
        # No lock: each figure is one length or counter read (atomic under the GIL), so the training
        # thread never waits here for the pipeline's worker; figures may be a write-back apart.
        return self._record(ssd, memory, tables, ram, ssd_rows, new)

    def _record(
        self, ssd: SsdTier, memory: MemoryTier, tables: list[str], ram: int, ssd_rows: int, new: int
    ) -> dict[str, Any]:
        loaded = max(ram + ssd_rows + new, 1)
        read, written = ssd.bytes_read, ssd.bytes_written
        record = {
            "pass": self._pass,
            "seconds": time.perf_counter() - self._t0,
            "rows_loaded": ram + ssd_rows + new,
            "ram_hit_rate": ram / loaded,
            "ssd_hit_rate": ssd_rows / loaded,
            "new_rows": new,
            "ssd_bytes_read": read - self._ssd0[0],
            "ssd_bytes_written": written - self._ssd0[1],
            "rows_memory": sum(memory.num_rows(t) for t in tables),
            "rows_ssd": sum(ssd.num_rows(t) for t in tables),
            "memory_bytes": memory.bytes_used,
        }
        self._ssd0 = (read, written)
        self.history.append(record)
        self._loads = {}
        return record
