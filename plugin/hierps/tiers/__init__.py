"""The three tiers of the store, from fastest to largest (the paper's HBM-PS, MEM-PS, SSD-PS).

- :class:`DeviceTier`: the working set of the current pass, on the training device; how it moves
  from one pass's working set to the next is worked out apart (:mod:`hierps.tiers._working_set`);
- :class:`MemoryTier`: a bounded RAM cache of rows (mmap-backed slabs, LRU / LFU by pass);
- :class:`SsdTier`: every row, in append-only segments on disk, with the key index;
- :class:`CheckpointReader`: a read-only view of the SSD tier as of one checkpoint;
- :class:`StoreUsage`: what the tiers hold and have moved (``Store.usage()``), and
  :func:`ram_row_bytes`, what the RAM tier charges a row.

No tier holds another: the store (:class:`hierps._core.StoreCore`) reads them one after the other,
and hands the RAM tier the sink its dirty rows leave through (:class:`RowSink`: the SSD tier).
"""

from hierps.tiers._device import DeviceTier
from hierps.tiers._memory import MemoryTier, RowSink, ram_row_bytes
from hierps.tiers._reader import CheckpointReader
from hierps.tiers._ssd import SsdTier
from hierps.tiers._usage import StoreUsage

__all__ = [
    "CheckpointReader",
    "DeviceTier",
    "MemoryTier",
    "RowSink",
    "SsdTier",
    "StoreUsage",
    "ram_row_bytes",
]
