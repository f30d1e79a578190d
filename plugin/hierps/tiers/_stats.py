"""Per-pass statistics: from which tier each pass's rows were loaded, SSD traffic, rows per tier.

Each finished pass leaves one :class:`PassRecord` in :attr:`PassStats.history`; the record is what
the demo and the bench print, what ``hierps.deepspeed`` hands to DeepSpeed's monitor and what
``hierps.metrics`` serves to Prometheus, and what ``hierps.planning`` predicts.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hierps.errors import ConfigError
from hierps.tiers._memory import MemoryTier
from hierps.tiers._ssd import SsdTier

__all__ = ["PassRecord", "PassStats"]


@dataclass(frozen=True)
class PassRecord:
    """What one pass did, recorded when it closed (:meth:`hierps.Store.end_pass`); or, for a loop
    that announces no passes, what its steps did since the last record (:meth:`hierps.Store.record_stats`,
    ``on_demand`` True: rows loaded as the gathers asked for them).

    Rows "loaded" are the rows of the pass's working set that were not resident in the device tier
    already (with the pipeline on, rows shared with the previous pass stay there): each came from
    the RAM tier, from the SSD tier, or was new (never stored: the initializer's row). The rates
    are fractions of ``rows_loaded``. SSD bytes count row bytes the tier asked of the disk (before
    page caching), from the previous record to this one, compaction included.
    """

    pass_index: int
    """Index of the pass (0 for the store's first), the clock of the rows' counters."""
    seconds: float
    """Wall time from ``begin_pass`` to ``end_pass``."""
    rows_loaded: int
    """Rows brought into the device tier for the pass: ``ram_rows + ssd_rows + new_rows``."""
    ram_rows: int
    """Rows loaded that the RAM tier held."""
    ssd_rows: int
    """Rows loaded that the SSD tier held (a RAM miss)."""
    new_rows: int
    """Rows loaded that no tier held: keys never stored, started by the initializer."""
    ram_hit_rate: float
    """``ram_rows / rows_loaded`` (0 when nothing was loaded)."""
    ssd_hit_rate: float
    """``ssd_rows / rows_loaded`` (0 when nothing was loaded)."""
    ssd_bytes_read: int
    """Row bytes read from the SSD tier since the previous record."""
    ssd_bytes_written: int
    """Bytes of segments written (rows and their keys) since the previous record."""
    rows_memory: int
    """Rows cached in the RAM tier when the pass closed."""
    rows_ssd: int
    """Live rows (the newest of their key) in the SSD tier when the pass closed."""
    memory_bytes: int
    """Bytes the RAM tier charges against its budget (rows and their bookkeeping)."""
    index_ram_bytes: int
    """RAM the SSD tier holds to find keys (fences and filters of the segments loaded so far)."""
    steps: int = 0
    """Optimizer steps (``store.step``) the record covers."""
    on_demand: bool = False
    """No pass was open: the record covers the steps since the previous record, their rows loaded on demand."""

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-able dict, one key per field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PassRecord:
        """The record of :meth:`to_json`; ``ConfigError`` naming a missing or unknown field."""
        fields = dataclasses.fields(cls)
        names = [f.name for f in fields]
        required = {f.name for f in fields if f.default is dataclasses.MISSING}  # later fields have defaults
        missing, unknown = sorted(required - set(data)), sorted(set(data) - set(names))
        if missing or unknown:
            raise ConfigError(
                f"a pass record needs exactly the fields {names}; missing {missing}, unknown {unknown}."
            )
        record = cls(**{n: data[n] for n in names if n in data})
        record.check()
        return record

    def check(self) -> None:
        """``ConfigError`` when the figures contradict each other (counts that do not add up, a
        rate outside [0, 1], a negative count)."""
        counts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type == "int"}
        negative = [n for n, v in counts.items() if v < 0]
        if negative:
            raise ConfigError(f"pass record: {negative[0]} is negative ({counts[negative[0]]}).")
        if self.ram_rows + self.ssd_rows + self.new_rows != self.rows_loaded:
            raise ConfigError(
                f"pass record: ram_rows + ssd_rows + new_rows = "
                f"{self.ram_rows + self.ssd_rows + self.new_rows}, not rows_loaded = {self.rows_loaded}."
            )
        for name in ("ram_hit_rate", "ssd_hit_rate"):
            value = getattr(self, name)
            if not (0.0 <= value <= 1.0) or math.isnan(value):
                raise ConfigError(f"pass record: {name} = {value} lies outside [0, 1].")

    @property
    def metrics(self) -> dict[str, float]:
        """The figures by field name, as numbers (what the monitors are given)."""
        return {name: float(value) for name, value in self.to_json().items()}


@dataclass
class PassStats:
    """Counters of the current pass and the records of finished ones (``history``, oldest first).

    ``listeners`` are called with each new record as it is appended, on the thread that closed the
    pass (the training thread): ``hierps.deepspeed`` hands records to DeepSpeed's monitor this way,
    at the global step the pass closed at. A listener that raises fails that ``end_pass``.
    """

    history: list[PassRecord] = field(default_factory=list)
    listeners: list[Callable[[PassRecord], None]] = field(default_factory=list)
    _loads: dict[str, list[int]] = field(default_factory=dict)
    _ahead: dict[str, list[int]] = field(default_factory=dict)  # read ahead for the next pass
    _pass: int = 0
    _t0: float = field(default_factory=time.perf_counter)  # when the pass (or what a record covers) began
    _ssd0: tuple[int, int] = (0, 0)
    on_demand_rebuilds: int = 0  # times rows fetched on demand overflowed the device tier and it was rebuilt
    on_demand_evictions: int = 0  # times they overflowed it and it let its least recently used rows go
    _steps: int = 0  # optimizer steps since the last record

    @property
    def last(self) -> PassRecord | None:
        """The record of the last finished pass (None before the first)."""
        return self.history[-1] if self.history else None

    def begin_pass(self, index: int) -> None:
        self._pass, self._t0 = index, time.perf_counter()
        self._loads, self._ahead = self._ahead, {}
        self._steps = 0

    def count_load(self, table: str, *, ram: int, ssd: int, new: int, ahead: bool = False) -> None:
        c = (self._ahead if ahead else self._loads).setdefault(table, [0, 0, 0])
        c[0] += ram
        c[1] += ssd
        c[2] += new

    def count_on_demand_rebuild(self) -> None:
        self.on_demand_rebuilds += 1

    def count_on_demand_eviction(self) -> None:
        self.on_demand_evictions += 1

    def count_step(self) -> None:
        self._steps += 1

    @property
    def steps_unrecorded(self) -> int:
        """Optimizer steps since the last record."""
        return self._steps

    def record_on_demand(
        self, ssd: SsdTier, memory: MemoryTier, tables: list[str], pass_index: int
    ) -> PassRecord | None:
        """A record of the steps since the last one, no pass open (the rows they loaded on demand);
        None when nothing happened since (no step, no row loaded)."""
        if not self._steps and not self._loads:
            return None
        self._pass = pass_index
        return self._record(ssd, memory, tables, on_demand=True)

    def end_pass(self, ssd: SsdTier, memory: MemoryTier, tables: list[str]) -> PassRecord:
        # No lock: each figure is one length or counter read (atomic under the GIL), so the training
        # thread never waits here for the pipeline's worker; figures may be a write-back apart.
        return self._record(ssd, memory, tables)

    def _record(
        self,
        ssd: SsdTier,
        memory: MemoryTier,
        tables: list[str],
        on_demand: bool = False,
    ) -> PassRecord:
        """A record of the rows loaded since the last one (``_loads``), appended and handed to the listeners."""
        ram, ssd_rows, new = (sum(c[i] for c in self._loads.values()) for i in range(3))
        loaded = ram + ssd_rows + new
        read, written = ssd.bytes_read, ssd.bytes_written
        record = PassRecord(
            pass_index=self._pass,
            seconds=time.perf_counter() - self._t0,
            rows_loaded=loaded,
            ram_rows=ram,
            ssd_rows=ssd_rows,
            new_rows=new,
            ram_hit_rate=ram / max(loaded, 1),
            ssd_hit_rate=ssd_rows / max(loaded, 1),
            ssd_bytes_read=read - self._ssd0[0],
            ssd_bytes_written=written - self._ssd0[1],
            rows_memory=sum(memory.num_rows(t) for t in tables),
            rows_ssd=sum(ssd.num_rows(t) for t in tables),
            memory_bytes=memory.bytes_used,
            index_ram_bytes=ssd.index_ram_bytes,
            steps=self._steps,
            on_demand=on_demand,
        )
        self._ssd0 = (read, written)
        self._steps, self._t0 = 0, time.perf_counter()
        self.history.append(record)
        self._loads = {}
        for listener in list(self.listeners):
            listener(record)
        return record
