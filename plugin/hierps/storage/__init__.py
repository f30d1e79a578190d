"""The on-disk format, below every tier: checksummed Zarr v3 arrays, checkpoints, the key index.

- :mod:`._arrays` / :mod:`._reads`: single-shard Zarr v3 arrays of small checksummed chunks,
  written and read with plain file I/O;
- :mod:`._files`: atomic JSON, fsync, full-disk errors;
- :class:`Segment` / :class:`SegmentWriter`: a sorted run of rows with its fences and key filter
  (:mod:`._filter`; what finds a key: under 2 bytes of RAM per key), and :mod:`._merge`: merging runs
  in bounded memory;
- :class:`CheckpointCatalog`: the checkpoints of a store directory, committed by manifest.
"""

from hierps.storage._checkpoint import FORMAT_VERSION, MARKER, CheckpointCatalog
from hierps.storage._segment import Segment, SegmentWriter

__all__ = ["FORMAT_VERSION", "MARKER", "CheckpointCatalog", "Segment", "SegmentWriter"]
