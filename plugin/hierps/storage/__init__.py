"""The on-disk format, below every tier: checksummed Zarr v3 arrays, checkpoints, the key index.

- :mod:`._arrays` / :mod:`._reads`: single-shard Zarr v3 arrays of small checksummed chunks,
  written and read with plain file I/O;
- :mod:`._files`: atomic JSON, fsync, full-disk errors;
- :class:`Segment` / :class:`SegmentWriter`: a sorted run of rows with its fences and key filter
  (:mod:`._filter`; what finds a key: under 2 bytes of RAM per key), and :mod:`._merge`: merging runs
  in bounded memory;
- :mod:`._native`: the compiled core of the loops over bytes (crc32c, checking and gathering what
  was read, encoding chunks; :func:`crc32c`), or the numpy code it replaces: :func:`compiled_core` says which serves,
  and :func:`numpy_kernels` runs the numpy code inside a block (``hierps bench --core`` compares them);
- :class:`CheckpointCatalog`: the checkpoints of a store directory, each committed by its
  :class:`Manifest` (:mod:`._manifest`; the marker :mod:`._marker`, the format version
  :mod:`._format`, table names :mod:`._names`).
"""

from hierps.storage._arrays import ArrayWriter, open_array
from hierps.storage._checkpoint import CheckpointCatalog
from hierps.storage._files import OpenFiles
from hierps.storage._format import FORMAT_VERSION
from hierps.storage._manifest import Manifest, SegmentRef, TableEntry
from hierps.storage._marker import MARKER
from hierps.storage._native import crc32c
from hierps.storage._native import disabled as numpy_kernels
from hierps.storage._native import enabled as compiled_core
from hierps.storage._reads import read_arrays
from hierps.storage._segment import Segment, SegmentWriter

__all__ = [
    "FORMAT_VERSION",
    "MARKER",
    "ArrayWriter",
    "CheckpointCatalog",
    "Manifest",
    "OpenFiles",
    "Segment",
    "SegmentRef",
    "SegmentWriter",
    "TableEntry",
    "compiled_core",
    "crc32c",
    "numpy_kernels",
    "open_array",
    "read_arrays",
]
