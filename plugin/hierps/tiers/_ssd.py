"""SSD tier: every row that is not newer in a tier above, as append-only Zarr v3 segments.

Layout under ``<store>/segments`` (a Zarr v3 hierarchy; each array one shard of small inner
chunks checksummed with crc32c, see :mod:`hierps.storage._arrays`)::

    <table>/<segment id, 8 digits>/keys   (n,) int64, sorted
    <table>/<segment id, 8 digits>/rows   (n, dim + state) float32

A segment is written once, whole, from a batch of rows sorted by key, and never modified: that is
what makes checkpoints cheap (a checkpoint is the key index plus the list of segments it points
to) and crashes harmless (a segment no checkpoint names is garbage). The key index maps each key
to (segment, position) with sorted numpy arrays: 16 bytes per key. Compaction rewrites the live
rows of many small or mostly-stale segments into one.
"""

from __future__ import annotations

import errno
import shutil
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from zarr.storage import LocalStore

from hierps._faults import fault_point
from hierps.errors import CorruptStoreError, StoreFullError
from hierps.storage._arrays import Array, create_array, encoded_bytes, make_dir, open_array
from hierps.storage._files import OpenFiles, disk_full_as_error, fsync_dir, fsync_tree
from hierps.storage._index import TableIndex
from hierps.storage._reads import read_array, read_arrays

__all__ = ["SsdTier"]

# Inner chunks of ~4 KiB: a read of a few rows fetches about one page each, not a 1 MiB chunk.
_CHUNK_BYTES = 4 << 10


def _segment_name(table: str, seg: int) -> str:
    return f"{table}/{seg:08d}"


class SsdTier:
    """Append-only segment store of rows for many tables, with an in-memory key index per table."""

    def __init__(self, root: Path, chunk_bytes: int = _CHUNK_BYTES) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._zstore = LocalStore(str(self.root))
        self._chunk_bytes = chunk_bytes
        self.index: dict[str, TableIndex] = {}
        self.widths: dict[str, int] = {}
        self.next_segment = 1
        self._live: dict[tuple[str, int], int] = {}  # live rows per segment of the live index
        self._sizes: dict[tuple[str, int], int] = {}
        self._unsynced: list[tuple[str, int]] = []
        self._sync_error: OSError | None = None
        self._arrays: dict[tuple[str, int], tuple[Array, Array]] = {}
        self._files = OpenFiles()  # segment files stay open between reads
        weakref.finalize(self, self._files.close)
        self.bytes_read = 0
        self.bytes_written = 0
        self.rows_read = 0
        self.rows_written = 0

    # -- tables -------------------------------------------------------------------------------
    def add_table(self, table: str, width: int) -> None:
        self.index.setdefault(table, TableIndex())
        self.widths[table] = width

    def num_rows(self, table: str) -> int:
        return len(self.index[table])

    def segments(self, table: str | None = None) -> list[tuple[str, int]]:
        return sorted(s for s in self._live if table is None or s[0] == table)

    # -- reads --------------------------------------------------------------------------------
    def read(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) int64 sorted unique -> (found (n,) bool, rows (found.sum(), width) float32).

        The one-table case of :meth:`read_many`.
        """
        return self.read_many({table: keys})[table]

    def read_many(self, requests: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Rows of many tables at once, as :meth:`read` gives them table by table.

        ``{table: keys (n,) int64 sorted unique}`` -> ``{table: (found (n,) bool, rows
        (found.sum(), width) float32)}``. Every wanted chunk of every table's segments is read in
        one dispatch, so that the reads of different tables overlap on the device; then, segment by
        segment, the segment's own keys at the positions read must be the keys asked for (a damaged
        index or segment is reported instead of returning another key's row) before its rows are
        taken. Each segment is read once, at sorted positions (segments are sorted by key).
        """
        results: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        groups: list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray]] = []
        for table, keys in requests.items():
            found, seg_of, pos_of = self.index[table].lookup(keys)
            segs, pos_found, found_keys = seg_of[found], pos_of[found], keys[found]
            results[table] = (found, np.empty((len(segs), self.widths[table]), dtype=np.float32))
            order = np.argsort(segs, kind="stable")
            for group in np.split(order, np.flatnonzero(np.diff(segs[order])) + 1) if len(segs) else []:
                groups.append((table, int(segs[group[0]]), group, pos_found[group], found_keys[group]))
        fetched = read_arrays(
            [(arr, positions) for table, seg, _, positions, _ in groups for arr in self._open(table, seg)],
            self._files,
        )
        for table, seg, group, positions, wanted in groups:
            stored = next(fetched)
            if not np.array_equal(stored, wanted):
                bad = int(np.flatnonzero(stored != wanted)[0])
                raise CorruptStoreError(
                    f"{self.root / _segment_name(table, seg)}: holds key {int(stored[bad])} at position "
                    f"{int(positions[bad])} where the key index expects key {int(wanted[bad])}; the segment "
                    "or the index is damaged. Restore the store from a backup or open an earlier checkpoint."
                )
            results[table][1][group] = next(fetched)
        for _, out in results.values():
            self.rows_read += len(out)
            self.bytes_read += out.nbytes
        return results

    def scan(
        self, table: str, columns: slice, batch: int = 1 << 18
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys (b,) int64 sorted, values (b, k) float32)``: ``columns`` of every live row.

        Reads segment after segment, each in contiguous ranges of rows (live rows of a segment
        lie in key order, which is position order), never the whole table at once.
        """
        idx = self.index[table]
        if len(idx.keys) == 0:
            return
        order = np.argsort(idx.seg, kind="stable")
        bounds = np.flatnonzero(np.diff(idx.seg[order])) + 1
        for group in np.split(order, bounds):
            seg = int(idx.seg[group[0]])
            rows_arr = self._open(table, seg)[1]
            name = f"{_segment_name(table, seg)}/rows"
            for start in range(0, len(group), batch):
                part = group[start : start + batch]
                pos = idx.pos[part].astype(np.int64)
                self.rows_read += len(pos)
                yield idx.keys[part], read_array(rows_arr, self.root, name, pos, self._files)[:, columns]

    def segments_holding(self, table: str, keys: np.ndarray) -> set[int]:
        """Segments the live index points into for ``keys`` (n,) int64."""
        idx = self.index[table]
        found, at = idx.find(np.asarray(keys, dtype=np.int64))
        return {int(s) for s in np.unique(idx.seg[at[found]])}

    def _open(self, table: str, seg: int) -> tuple[Array, Array]:
        handles = self._arrays.get((table, seg))
        if handles is None:
            name = _segment_name(table, seg)
            handles = (
                open_array(self._zstore, self.root, f"{name}/keys", "int64", 1, self._files),
                open_array(self._zstore, self.root, f"{name}/rows", "float32", 2, self._files),
            )
            if handles[0].shape[0] != handles[1].shape[0] or handles[1].shape[1] != self.widths[table]:
                raise CorruptStoreError(
                    f"{self.root / name}: keys {handles[0].shape} and rows {handles[1].shape} do not form a "
                    f"segment of table {table!r} (width {self.widths[table]})."
                )
            self._arrays[(table, seg)] = handles
        return handles

    def _forget(self, key: tuple[str, int]) -> None:
        """Drop the open handles of a segment that leaves the live index or the disk."""
        for arr in self._arrays.pop(key, ()):
            self._files.forget(arr.files)

    def close(self) -> None:
        """Close the segment files kept open for reads (they reopen on the next read)."""
        self._files.close()
        self._arrays.clear()

    # -- writes -------------------------------------------------------------------------------
    def write(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """Append rows as one new segment; they supersede older rows of the same keys.

        keys: (n,) int64 unique (any order); rows: (n, width) float32.
        """
        if len(keys) == 0:
            return
        order = np.argsort(keys, kind="stable")
        keys = np.ascontiguousarray(keys[order])
        rows = np.ascontiguousarray(rows[order], dtype=np.float32)
        seg = self._write_segment(table, keys, rows)
        self._point_to(table, keys, seg, np.arange(len(keys), dtype=np.int32))

    def _write_segment(self, table: str, keys: np.ndarray, rows: np.ndarray) -> int:
        seg = self.next_segment
        self.next_segment += 1
        name = _segment_name(table, seg)
        n, width = rows.shape
        chunk_rows = max(1, min(n, self._chunk_bytes // (4 * width)))
        key_rows = max(1, min(n, self._chunk_bytes // 8))
        fault_point("ssd.segment_begin")
        needed = encoded_bytes(keys, key_rows) + encoded_bytes(rows, chunk_rows)
        try:
            with disk_full_as_error(self.root / name, f"segment {seg} of table {table!r}", needed):
                make_dir(self.root / name)
                create_array(self._zstore, f"{name}/keys", keys, key_rows)
                fault_point("ssd.segment_keys_written")
                create_array(
                    self._zstore, f"{name}/rows", rows, chunk_rows, block_point="ssd.segment_rows_block"
                )
        except BaseException:
            # Nothing names the segment yet: drop what was written of it (and the space it took).
            shutil.rmtree(self.root / name, ignore_errors=True)
            raise
        fault_point("ssd.segment_written")
        self._sizes[(table, seg)] = n
        self._live[(table, seg)] = 0
        self._unsynced.append((table, seg))
        self.rows_written += n
        self.bytes_written += int(rows.nbytes + keys.nbytes)
        return seg

    def _point_to(self, table: str, keys: np.ndarray, seg: int, positions: np.ndarray) -> None:
        """Make sorted unique ``keys`` point at ``seg``/``positions`` in the index."""
        self._unlive(table, self.index[table].assign(keys, seg, positions))
        self._live[(table, seg)] = self._live.get((table, seg), 0) + len(keys)

    def _unlive(self, table: str, old_segments: np.ndarray) -> None:
        if len(old_segments):
            segs, counts = np.unique(old_segments, return_counts=True)
            for s, c in zip(segs.tolist(), counts.tolist()):
                self._live[(table, s)] -= c

    def delete(self, table: str, keys: np.ndarray) -> int:
        """Drop keys from the index (their rows become garbage); returns how many were present."""
        old = self.index[table].remove(np.unique(keys))
        self._unlive(table, old)
        return int(len(old))

    # -- compaction ---------------------------------------------------------------------------
    def compact(
        self, table: str, max_segments: int = 16, min_live_fraction: float = 0.5, rewrite: Iterable[int] = ()
    ) -> int:
        """Rewrite segments that are mostly stale, or too many, into one; returns rows rewritten.

        ``rewrite`` names segments to rewrite whatever their live fraction (e.g. those that held
        deleted rows, so that the deleted rows leave the disk). Retired segments leave the live
        index only; their files go once no kept checkpoint names them (see :meth:`collect_garbage`).
        """
        forced = set(rewrite)
        segs = [s for (t, s) in self._live if t == table]
        chosen = [
            s
            for s in segs
            if s in forced or self._live[(table, s)] < min_live_fraction * self._sizes[(table, s)]
        ]
        if len(segs) - len(chosen) + 1 > max_segments:
            # Too many segments even after merging the stale ones: merge the smallest too.
            rest = sorted(set(segs) - set(chosen), key=lambda s: self._live[(table, s)])
            pick = rest[: len(segs) - len(chosen) + 1 - max_segments + 1]
            # Size-tiered: a merge that would mostly rewrite one large segment to absorb a few small
            # ones costs O(table) per pass; let small segments gather (up to twice max_segments)
            # and merge among themselves until they are worth a quarter of the large one.
            if len(segs) <= 2 * max_segments:
                while len(pick) > 1 and self._live[(table, pick[-1])] > 4 * sum(
                    self._live[(table, p)] for p in pick[:-1]
                ):
                    pick.pop()
                if len(pick) < 2:
                    pick = []
            chosen += pick
        if not chosen:
            return 0
        fault_point("ssd.compaction_begin")
        stale = chosen
        keys = self._live_keys(table, stale)
        rewritten = 0
        if len(keys):
            found, rows = self.read(table, keys)
            seg = self._write_segment(table, keys, rows)
            self._point_to(table, keys, seg, np.arange(len(keys), dtype=np.int32))
            rewritten = len(keys)
            fault_point("ssd.compaction")
        for s in stale:
            if self._live.get((table, s), 0) == 0:
                self._live.pop((table, s), None)
                self._forget((table, s))
        return rewritten

    def _live_keys(self, table: str, segments: list[int]) -> np.ndarray:
        """Sorted keys whose live rows are in ``segments``: read from the segments' own key arrays,
        so the cost follows the segments' size, not the table's."""
        idx = self.index[table]
        parts = [np.empty(0, np.int64)]
        for seg in segments:
            if self._live.get((table, seg), 0) == 0:
                continue
            name = _segment_name(table, seg)
            stored = read_array(self._open(table, seg)[0], self.root, f"{name}/keys", open_files=self._files)
            found, seg_of, _ = idx.lookup(stored)
            parts.append(stored[found & (seg_of == seg)])
        return np.sort(np.concatenate(parts))

    # -- durability ---------------------------------------------------------------------------
    def sync(self) -> None:
        """fsync every segment written since the last sync.

        A failed fsync may have lost written pages (the kernel reports a write-back error once and
        may drop the pages), so it is not retried: this and every later sync raise, and the store
        must be reopened, at its last checkpoint.
        """
        if self._sync_error is not None:
            raise self._sync_error
        try:
            for table, seg in self._unsynced:
                path = self.root / _segment_name(table, seg)
                if path.exists():
                    fsync_tree(path)
            for table in {t for t, _ in self._unsynced}:
                fsync_dir(self.root / table)
            fsync_dir(self.root)
        except OSError as exc:
            why = "no space left on the device" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else str(exc)
            message = (
                f"{self.root}: fsync of new segments failed ({why}); rows written since the last "
                "checkpoint may not be on disk. Close the store and open it again: it reopens at its "
                "last checkpoint."
            )
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self._sync_error = (
                StoreFullError(message, str(self.root)) if full else OSError(exc.errno, message)
            )
            raise self._sync_error from exc
        self._unsynced.clear()

    def live_segments(self) -> set[tuple[str, int]]:
        """Segments the live index points into."""
        return {s for s, n in self._live.items() if n > 0}

    def load_index(self, table: str, width: int, index: TableIndex, sizes: dict[int, int]) -> None:
        """Replace the live index of ``table`` (from a checkpoint)."""
        self.add_table(table, width)
        self.index[table] = index
        for key in [k for k in self._live if k[0] == table]:
            self._live.pop(key)
            self._sizes.pop(key, None)
        if len(index.seg):
            segs, counts = np.unique(index.seg, return_counts=True)
            for s, c in zip(segs.tolist(), counts.tolist()):
                self._live[(table, s)] = c
                self._sizes[(table, s)] = sizes.get(s, c)
        for key in [k for k in self._arrays if k[0] == table]:
            self._forget(key)

    def segment_size(self, table: str, seg: int) -> int:
        return self._sizes.get((table, seg), 0)

    def collect_garbage(self, keep: set[tuple[str, int]]) -> int:
        """Delete segment directories named neither in ``keep`` nor by the live index."""
        keep = keep | self.live_segments()
        removed = 0
        if not self.root.exists():
            return 0
        for tdir in self.root.iterdir():
            if not tdir.is_dir():
                continue
            for sdir in tdir.iterdir():
                if not (sdir.is_dir() and sdir.name.isdigit()):
                    continue
                key = (tdir.name, int(sdir.name))
                if key not in keep:
                    self._forget(key)
                    shutil.rmtree(sdir, ignore_errors=True)
                    self._sizes.pop(key, None)
                    removed += 1
                    fault_point("ssd.gc_segment")
        return removed

    def max_segment_on_disk(self) -> int:
        best = 0
        if self.root.exists():
            for tdir in self.root.iterdir():
                if tdir.is_dir():
                    for sdir in tdir.iterdir():
                        if sdir.name.isdigit():
                            best = max(best, int(sdir.name))
        return best

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())
