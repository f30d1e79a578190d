"""What a store's tiers hold and have moved so far: one typed snapshot, for dashboards and benches."""

from __future__ import annotations

from dataclasses import dataclass

from hierps.tiers._device import DeviceTier
from hierps.tiers._memory import MemoryTier
from hierps.tiers._ssd import SsdTier

__all__ = ["StoreUsage", "usage_of"]


@dataclass(frozen=True)
class StoreUsage:
    """Bytes and rows of each tier now; the SSD traffic and the pipeline's stage times since the
    store opened (:meth:`hierps.Store.usage`).

    Rows are counted per tier (a row may be in several). ``index_ram_bytes`` is the RAM the SSD
    tier holds to find keys (fences and filters: under 2 bytes per key). ``ssd_bytes_read`` /
    ``ssd_bytes_written`` count row bytes (what the tier asked of the disk, before page caching);
    ``ssd_read_seconds`` / ``ssd_write_seconds`` the wall time of its reads and writes (compaction
    included), on whatever thread. ``prepare_seconds`` / ``writeback_seconds`` are the background
    read-ahead and write-back of passes, ``wait_seconds`` the training thread's waits for them (0
    without the pipeline).
    """

    device_bytes: int
    device_budget: int
    memory_bytes: int
    memory_budget: int
    memory_rows: int
    evicted_rows: int
    ssd_rows: int
    segments: int
    disk_bytes: int
    index_ram_bytes: int
    ssd_bytes_read: int
    ssd_bytes_written: int
    ssd_rows_written: int
    ssd_read_seconds: float
    ssd_write_seconds: float
    prepare_seconds: float
    writeback_seconds: float
    wait_seconds: float


def usage_of(
    device: DeviceTier,
    memory: MemoryTier,
    ssd: SsdTier,
    tables: list[str],
    stages: tuple[float, float, float],
) -> StoreUsage:
    """The usage of the three tiers of one store over its ``tables``; ``stages``: the pipeline's
    (prepare, write-back, wait) seconds."""
    return StoreUsage(
        device_bytes=device.bytes_used,
        device_budget=device.budget,
        memory_bytes=memory.bytes_used,
        memory_budget=memory.budget,
        memory_rows=sum(memory.num_rows(t) for t in tables),
        evicted_rows=memory.evicted_rows,
        ssd_rows=sum(ssd.num_rows(t) for t in tables),
        segments=len(ssd.segments()),
        disk_bytes=ssd.disk_bytes(),
        index_ram_bytes=ssd.index_ram_bytes,
        ssd_bytes_read=ssd.bytes_read,
        ssd_bytes_written=ssd.bytes_written,
        ssd_rows_written=ssd.rows_written,
        ssd_read_seconds=ssd.read_seconds,
        ssd_write_seconds=ssd.write_seconds,
        prepare_seconds=stages[0],
        writeback_seconds=stages[1],
        wait_seconds=stages[2],
    )
