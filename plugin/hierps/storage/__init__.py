"""The on-disk format, below every tier: checksummed Zarr v3 arrays, checkpoints, the key index.

- :mod:`._arrays` / :mod:`._reads`: single-shard Zarr v3 arrays of small checksummed chunks,
  written and read with plain file I/O;
- :mod:`._files`: atomic JSON, fsync, full-disk errors;
- :class:`Segment` / :class:`SegmentWriter`: a sorted run of rows with its fences and key filter
  (:mod:`._filter`; what finds a key: under 2 bytes of RAM per key), and :mod:`._merge`: merging runs
  in bounded memory;
- :class:`CheckpointCatalog`: the checkpoints of a store directory, each committed by its
  :class:`Manifest` (:mod:`._manifest`; the marker :mod:`._marker`, the format version
  :mod:`._format`, table names :mod:`._names`).
"""

from hierps.storage._checkpoint import CheckpointCatalog
from hierps.storage._format import FORMAT_VERSION
from hierps.storage._manifest import Manifest, SegmentRef, TableEntry
from hierps.storage._marker import MARKER
from hierps.storage._segment import Segment, SegmentWriter

__all__ = [
    "FORMAT_VERSION",
    "MARKER",
    "CheckpointCatalog",
    "Manifest",
    "Segment",
    "SegmentRef",
    "SegmentWriter",
    "TableEntry",
]
