"""One table of an export (format: :mod:`hierps.storage._export_format`): written as a stream of sorted
rows, and read back a few chunks at a time, checked.

:class:`TableWriter` streams keys and values into their arrays as rows come (memory: a block of
chunks and the fences, 8 bytes per 63 rows at dim 16), then writes the fences, the deleted keys and
the filter. :class:`ExportTable` opens a table from its manifest entry, keeping in RAM only the
fences and the filter, and finds ids with them: :meth:`ExportTable.plan` says which chunks to read,
:meth:`ExportTable.resolve` checks what was read (crc32c of every chunk by the reader; keys sorted,
unique and agreeing with the fences here) and says which ids it holds, which it deletes.
:meth:`ExportTable.verify` reads everything and compares each array's content with its checksum.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np
import zarr
from zarr.storage import LocalStore

from hierps.errors import CorruptStoreError
from hierps.storage._arrays import Array, ArrayWriter, open_array
from hierps.storage._export_format import (
    BULK_CHUNK_ROWS,
    DELETED_CHUNK_ROWS,
    EXPORT_DTYPES,
    PAGE,
    ExportTableEntry,
    array_identity,
    chunk_rows_for,
    key_align,
)
from hierps.storage._files import OpenFiles
from hierps.storage._filter import bloom_add, bloom_may_contain, filter_words
from hierps.storage._reads import chunk_positions, read_array

__all__ = ["ExportTable", "Probe", "TableWriter"]

_SCAN_ROWS = 1 << 18  # rows per read when a whole array is scanned


def _write(
    zstore: LocalStore, name: str, data: np.ndarray, chunk_rows: int, identity: str, align: int = 1
) -> int:
    """Write the 1-d ``data`` as array ``name`` (its chunks bound to ``identity``); the crc32c of its content."""
    out = ArrayWriter(
        zstore, name, (), data.dtype.name, chunk_rows, align=align, checksum=True, identity=identity
    )
    out.append(data)
    out.close()
    return out.crc


class TableWriter:
    """Writes one table of an export from runs of rows appended in increasing key order."""

    def __init__(self, zstore: LocalStore, name: str, dim: int, export_id: str, dtype: str = "fp32") -> None:
        """``dtype``: the precision of values, ``"fp32"`` or ``"fp16"`` (appended values are cast to it)."""
        self.name, self.dim, self.dtype = name, dim, dtype
        self._export_id = export_id
        value_type = np.dtype(EXPORT_DTYPES[dtype])
        self.chunk_rows = chunk_rows_for(dim, value_type.itemsize)
        self._zstore = zstore
        zarr.create_group(zstore, path=name)  # so that a plain Zarr reader finds the table's arrays
        rows = self.chunk_rows
        self._keys = ArrayWriter(
            zstore,
            f"{name}/keys",
            (),
            "int64",
            rows,
            align=key_align(rows),
            checksum=True,
            identity=self._identity("keys"),
        )
        self._values = ArrayWriter(
            zstore,
            f"{name}/values",
            (dim,),
            value_type.name,
            rows,
            align=PAGE,
            checksum=True,
            identity=self._identity("values"),
        )
        self._fences: list[np.ndarray] = []
        self._last: int | None = None

    def _identity(self, array: str) -> str:
        return array_identity(self._export_id, self.name, array)

    @property
    def rows(self) -> int:
        return self._keys.n

    def append(self, keys: np.ndarray, values: np.ndarray) -> None:
        """keys (k,) int64, strictly increasing and above those appended before; values (k, dim) float32
        (exactly representable in the export's dtype)."""
        if len(keys) == 0:
            return
        if (self._last is not None and keys[0] <= self._last) or np.any(keys[1:] <= keys[:-1]):
            raise ValueError(f"table {self.name!r}: keys must be appended in strictly increasing order")
        first = -self._keys.n % self.chunk_rows  # the first of these keys that starts a chunk
        self._fences.append(np.array(keys[first :: self.chunk_rows], np.int64))
        self._keys.append(keys)
        self._values.append(values.astype(EXPORT_DTYPES[self.dtype], copy=False))
        self._last = int(keys[-1])

    def abort(self) -> None:
        """Close the files of keys and values without finishing them, after a failure: a descriptor
        left open would keep the space of the removed files in use."""
        self._keys.abort()
        self._values.abort()

    def close(self, deleted: np.ndarray) -> dict[str, int]:
        """Finish keys and values, then write the fences, ``deleted`` (m,) int64 sorted unique and the
        filter of both; returns the crc32c of each array's content, by name."""
        try:
            self._keys.close()
            self._values.close()
        except BaseException:
            self.abort()
            raise
        deleted = np.ascontiguousarray(deleted, np.int64)
        fences = np.concatenate(self._fences) if self._fences else np.empty(0, np.int64)
        z = self._zstore
        n, ident = self.name, self._identity
        checks = {
            "keys": self._keys.crc,
            "values": self._values.crc,
            "fences": _write(z, f"{n}/fences", fences, BULK_CHUNK_ROWS, ident("fences")),
            "deleted": _write(z, f"{n}/deleted", deleted, DELETED_CHUNK_ROWS, ident("deleted"), align=PAGE),
            "deleted_fences": _write(
                z,
                f"{n}/deleted_fences",
                deleted[::DELETED_CHUNK_ROWS],
                BULK_CHUNK_ROWS,
                ident("deleted_fences"),
            ),
        }
        checks["filter"] = _write(z, f"{n}/filter", self._filter(deleted), BULK_CHUNK_ROWS, ident("filter"))
        return checks

    def _filter(self, deleted: np.ndarray) -> np.ndarray:
        """A filter sized for the keys and deleted keys now that their number is known: the keys are
        read back (just written, so from the page cache) a block at a time."""
        words = np.zeros(filter_words(self.rows + len(deleted), self.chunk_rows), np.uint64)
        root = Path(self._zstore.root)
        keys = open_array(
            self._zstore, root, f"{self.name}/keys", "int64", 1, identity=self._identity("keys")
        )
        for block in _blocks(keys, root, f"{self.name}/keys"):
            bloom_add(words, block)
        bloom_add(words, deleted)
        return words


@dataclass(eq=False)
class Probe:
    """Where the ids of one lookup may lie in one table of an export: the reads to make."""

    ids: np.ndarray  # (k,) int64 sorted unique: the ids asked
    maybe: np.ndarray  # (k,) bool: ids the filter lets through
    chunks: np.ndarray  # (c,) sorted chunks of keys / values that may hold them
    positions: np.ndarray  # (p,) every row of those chunks
    deleted_chunks: np.ndarray
    deleted_positions: np.ndarray


@dataclass(eq=False)
class ExportTable:
    """One table of one export, open for lookups: arrays located, fences and filter in RAM."""

    path: Path  # the export directory
    entry: ExportTableEntry
    keys: Array
    values: Array
    deleted: Array
    fences: np.ndarray  # (ceil(rows / R),) int64
    deleted_fences: np.ndarray
    filter: np.ndarray  # (w,) uint64
    files: OpenFiles

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def ram_bytes(self) -> int:
        """Bytes held in RAM: fences and filter."""
        return self.fences.nbytes + self.deleted_fences.nbytes + self.filter.nbytes

    @classmethod
    def open(cls, path: Path, entry: ExportTableEntry, files: OpenFiles) -> ExportTable:
        """Open table ``entry`` of the export at ``path``: check each array's layout and shape against the
        manifest, read the fences and filter and check them (content checksum, fences strictly
        increasing, one per chunk). O(chunks); reads no row."""
        zstore = LocalStore(str(path), read_only=True)
        arrays = {
            name: open_array(
                zstore, path, f"{entry.name}/{name}", dtype, ndim, files, identity=entry.identity(name)
            )
            for name, (dtype, ndim) in entry.arrays.items()
        }
        table = cls(
            path,
            entry,
            arrays["keys"],
            arrays["values"],
            arrays["deleted"],
            np.empty(0, np.int64),
            np.empty(0, np.int64),
            np.empty(0, np.uint64),
            files,
        )
        table._check_shapes(arrays)
        table.fences = table._read_checked(arrays["fences"], "fences")
        table.deleted_fences = table._read_checked(arrays["deleted_fences"], "deleted_fences")
        table.filter = table._read_checked(arrays["filter"], "filter")
        table._check_index()
        return table

    def _damaged(self, what: str) -> CorruptStoreError:
        return CorruptStoreError(
            f"{self.path / self.name}: {what}; the export is damaged or incomplete. Export it again "
            "(or copy it again from where it was written)."
        )

    def _check_shapes(self, arrays: dict[str, Array]) -> None:
        e = self.entry
        expected = {
            "keys": (e.rows,),
            "values": (e.rows, e.dim),
            "deleted": (e.deleted,),
            "fences": (math.ceil(e.rows / max(self.keys.chunk_rows, 1)),),
            "deleted_fences": (math.ceil(e.deleted / max(self.deleted.chunk_rows, 1)),),
        }
        for name, shape in expected.items():
            if arrays[name].shape != shape:
                raise self._damaged(f"{name} has shape {arrays[name].shape} where the manifest gives {shape}")
        if self.keys.chunk_rows != self.values.chunk_rows:
            raise self._damaged(
                f"keys come in chunks of {self.keys.chunk_rows} rows and values in chunks of "
                f"{self.values.chunk_rows}; they must match"
            )

    def _read_checked(self, arr: Array, name: str) -> np.ndarray:
        """All of the array ``name`` (fences or filter), its content checked against the manifest; read
        a block at a time into its place (no second copy of it in RAM)."""
        data = np.empty(arr.shape, arr.dtype.newbyteorder("="))
        crc = at = 0
        for block in _blocks(arr, self.path, f"{self.name}/{name}", self.files):
            data[at : at + len(block)] = block
            crc = _crc(block, crc)
            at += len(block)
        if crc != self.entry.checks[name]:
            raise self._damaged(f"the content of {name} does not match its checksum in the manifest")
        return data

    def _check_index(self) -> None:
        for name, fences in (("fences", self.fences), ("deleted_fences", self.deleted_fences)):
            if len(fences) > 1 and not np.all(fences[1:] > fences[:-1]):
                raise self._damaged(f"{name} are not strictly increasing")
        if len(self.filter) == 0:
            raise self._damaged("the key filter is empty")

    # -- lookups -------------------------------------------------------------------------------
    def plan(self, ids: np.ndarray) -> Probe:
        """ids (k,) int64 sorted unique -> the chunks of keys, values and deleted that may hold them."""
        maybe = bloom_may_contain(self.filter, ids) if len(ids) else np.zeros(0, bool)
        chunks = _chunks(self.fences, ids[maybe])
        deleted = _chunks(self.deleted_fences, ids[maybe])
        return Probe(
            ids,
            maybe,
            chunks,
            chunk_positions(chunks, self.keys.chunk_rows, self.entry.rows),
            deleted,
            chunk_positions(deleted, self.deleted.chunk_rows, self.entry.deleted),
        )

    def requests(self, probe: Probe) -> list[tuple[Array, np.ndarray]]:
        """The reads of ``probe`` for :func:`read_arrays`: keys, values, deleted keys."""
        return [
            (self.keys, probe.positions),
            (self.values, probe.positions),
            (self.deleted, probe.deleted_positions),
        ]

    def resolve(
        self, probe: Probe, keys: np.ndarray, values: np.ndarray, deleted: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What the reads of ``probe`` say: (held (k,) bool, their rows (h, dim) in the export's dtype,
        deleted (k,) bool).

        The keys read are checked: sorted, unique, and each chunk's first key its fence, its last key
        below the next chunk's fence."""
        self._check_chunks("keys", keys, probe.chunks)
        self._check_chunks("deleted", deleted, probe.deleted_chunks)
        held, at = _members(probe.ids, keys)
        gone, _ = _members(probe.ids, deleted)
        return held, values[at[held]], gone & ~held

    def _run(self, name: str) -> tuple[Array, np.ndarray, int]:
        """The sorted array ``name`` (keys or deleted): (array, its fences, its rows)."""
        if name == "keys":
            return self.keys, self.fences, self.entry.rows
        return self.deleted, self.deleted_fences, self.entry.deleted

    def _check_chunks(self, name: str, keys: np.ndarray, chunks: np.ndarray) -> None:
        """``keys``: every key of ``chunks`` (sorted) of the sorted array ``name``, as read."""
        if len(chunks) == 0:
            return
        arr, fences, rows = self._run(name)
        sizes = np.minimum((chunks + 1) * arr.chunk_rows, rows) - chunks * arr.chunk_rows
        first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        last = first + sizes - 1
        nxt = chunks + 1 < len(fences)
        if (
            len(keys) != int(sizes.sum())
            or np.any(keys[1:] <= keys[:-1])
            or np.any(keys[first] != fences[chunks])
            or np.any(keys[last[nxt]] >= fences[chunks[nxt] + 1])
        ):
            raise self._damaged(
                f"{name} of chunk(s) {chunks[:4].tolist()} are not sorted and unique, or disagree with "
                "the fences"
            )

    # -- whole arrays --------------------------------------------------------------------------
    def scan(self, name: str) -> Iterator[np.ndarray]:
        """Every row of array ``name`` (keys, values or deleted), in blocks of whole chunks, in order."""
        arr = {"keys": self.keys, "values": self.values, "deleted": self.deleted}[name]
        yield from _blocks(arr, self.path, f"{self.name}/{name}", self.files)

    def sorted_keys(self, name: str) -> Iterator[np.ndarray]:
        """The blocks of ``keys`` or ``deleted``, each checked as a lookup checks it (so the whole array
        is strictly increasing and agrees with its fences)."""
        chunk_rows = self._run(name)[0].chunk_rows
        at = 0
        for block in self.scan(name):
            first = at // chunk_rows
            self._check_chunks(name, block, np.arange(first, first + math.ceil(len(block) / chunk_rows)))
            at += len(block)
            yield block

    def verify(self) -> None:
        """Read every array whole and compare its content with its checksum in the manifest (and the
        keys with the fences): ``CorruptStoreError`` naming the table and the array otherwise."""
        for name in ("keys", "values", "deleted"):
            crc = 0
            blocks = self.sorted_keys(name) if name != "values" else self.scan(name)
            for block in blocks:
                crc = _crc(block, crc)
            if crc != self.entry.checks[name]:
                raise self._damaged(f"the content of {name} does not match its checksum in the manifest")


def _blocks(arr: Array, root: Path, name: str, files: OpenFiles | None = None) -> Iterator[np.ndarray]:
    """Every row of ``arr`` in order, in blocks of whole chunks of about ``_SCAN_ROWS`` rows."""
    n = arr.shape[0]
    step = max(arr.chunk_rows, _SCAN_ROWS - _SCAN_ROWS % arr.chunk_rows)
    for start in range(0, n, step):
        positions = np.arange(start, min(start + step, n), dtype=np.int64)
        yield read_array(arr, root, name, positions, files)


def _crc(data: np.ndarray, crc: int = 0) -> int:
    """crc32c of ``data``'s bytes, little endian, continuing ``crc``."""
    raw = np.ascontiguousarray(data, data.dtype.newbyteorder("<"))
    return int(crc32c.crc32c(raw.view(np.uint8).data, crc))


def _chunks(fences: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids (k,) sorted -> the sorted unique chunks that may hold them (ids below the first fence: none)."""
    if len(fences) == 0 or len(ids) == 0:
        return np.empty(0, np.int64)
    chunk = np.searchsorted(fences, ids, side="right") - 1
    return np.unique(chunk[chunk >= 0]).astype(np.int64)


def _members(ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids (k,) sorted, keys (n,) sorted -> (ids in keys (k,) bool, where each lies in keys (k,) int64)."""
    at = np.searchsorted(keys, ids)
    clipped = np.minimum(at, max(len(keys) - 1, 0))
    found = (at < len(keys)) & (keys[clipped] == ids) if len(keys) else np.zeros(len(ids), bool)
    return found, clipped
