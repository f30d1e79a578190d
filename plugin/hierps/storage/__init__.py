"""The on-disk format, below every tier: checksummed Zarr v3 arrays, checkpoints, the key index.

- :mod:`._arrays` / :mod:`._reads`: single-shard Zarr v3 arrays of small checksummed chunks,
  written and read with plain file I/O;
- :mod:`._files`: atomic JSON, fsync, full-disk errors;
- :class:`TableIndex`: where each key's row lies (segment, position);
- :class:`CheckpointCatalog`: the checkpoints of a store directory, committed by manifest.
"""

from hierps.storage._checkpoint import FORMAT_VERSION, MARKER, CheckpointCatalog
from hierps.storage._index import TableIndex

__all__ = ["FORMAT_VERSION", "MARKER", "CheckpointCatalog", "TableIndex"]
