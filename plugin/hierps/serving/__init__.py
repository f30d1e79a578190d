"""Read-only embedding tables for serving, read from exports (:mod:`hierps.lifecycle._export`) on demand.

::

    tables = hierps.serving.open("/models/ads/base", deltas=["/models/ads/d1", "/models/ads/d2"])
    tables.lookup("user", ids)        # ids (...) int64 -> (..., dim) float32 (numpy, or torch for torch ids)

    tables = hierps.serving.open("/models/ads", follow=30)   # a directory of exports: base + chain of
                                                             # deltas, polled for new ones every 30 s

Opening reads the exports' manifests and, per table, a small key index (the first key of each
chunk of rows, and a Bloom filter: under 2 bytes per key), not the rows: it takes well under a
second at any size. A lookup sorts its ids, finds the chunks that may hold them, reads them in one
batch of reads (each chunk checked against its crc32c, its keys against the index), applies the
deltas newest first, and keeps the rows it read in a bounded cache (``cache_bytes``). Memory:
the cache, the key index, and a fixed overhead, whatever the tables' size.

Keys that no export holds (or that a delta deleted) read as the manifest's ``unknown`` (what they
read as in training: the initializer's row for (seed, table, key), or zeros), unless
``open(..., unknown="zeros")``.

:meth:`ServingTables.refresh` (or ``follow``) serves deltas written after open: a new chain is
opened and checked whole before it replaces the old one in one step, so a lookup sees one
generation, never half of one; a damaged or incomplete delta, a delta of another store (or since
a checkpoint rolled back), or one after a missing delta is refused with an error and the previous
generation keeps serving (:mod:`hierps.serving._chain`). Exports are immutable: new ones go under new names (``hierps export`` writes them under a temporary
name and renames them when whole); do not modify a served export in place. Damaged, foreign or
incomplete exports raise
:class:`~hierps.errors.CorruptStoreError` (or :class:`~hierps.errors.StoreFormatError`) naming the
file; no lookup returns rows of a chunk that is missing or fails its checksum.
"""

from hierps.serving._tables import DEFAULT_CACHE_BYTES, ServingTables, open

__all__ = ["DEFAULT_CACHE_BYTES", "ServingTables", "open"]
