"""The export format (version 4): a directory any Zarr v3 reader opens, that hierps serves from disk.

Layout of an export directory::

    manifest.json          written last (the export is then renamed into place): see below
    zarr.json              the root group
    <table>/keys           (n,) int64, sorted, unique; inner chunks of R keys
    <table>/values         (n, dim) float32, or float16 for an export with dtype "fp16": the weights;
                           inner chunks of R rows, page-aligned, so that chunk i of ``keys`` and
                           chunk i of ``values`` hold the same rows
    <table>/fences         (ceil(n / R),) int64: the first key of each chunk (``keys[::R]``)
    <table>/deleted        (m,) int64, sorted, unique: keys deleted since ``since`` (empty in a full export)
    <table>/deleted_fences the first key of each chunk of ``deleted``
    <table>/filter         (w,) uint64: a blocked Bloom filter of ``keys`` and ``deleted``

Every array is one shard of small inner chunks, each with its crc32c and a binding tag naming the
export (its ``uid``), the array and the chunk's position (:mod:`hierps.storage._arrays`): an array,
chunk or manifest of another export copied over this one's is refused.
``R`` is the most rows of ``dim`` values that fit a 4 KiB page with their checksum and binding tag (63
at dim 16 in float32, more in float16; at least 16), so that finding a row reads one page of values and about one of keys, and the fences
and filter, the only part kept in RAM, take under 2 bytes per key.

``manifest.json``::

    {"format": "hierps-export", "format_version": 4, "checkpoint": 7, "since": null, "seed": 0,
     "ranks": 1, "source": "/ssd/store", "created": 1700000000.0, "uid": "9f0c...",
     "store": "41d7...", "checkpoint_created": 1699999000.0, "since_created": null,
     "tables": {"user": {"dim": 16, "dtype": "fp32", "weights_dtype": "fp32", "rows": 1000,
                         "deleted": 0, "total_rows": 1000,
                         "initializer": {"type": "normal", "params": {...}}, "unknown": "initializer",
                         "checks": {"keys": 123, "values": 456, ...}}},
     "crc32": 789}

``store`` is the uid of the store the export was taken from (its ``hierps.json``; rank 0's for a
directory of rank stores, whose checkpoints are numbered by rank 0's), and ``checkpoint_created``
and ``since_created`` when checkpoints ``checkpoint`` and ``since`` were taken (a store reuses the
ids of checkpoints it rolled back): together with ``ranks`` they say which rows an export gives
and which rows a delta applies to (:class:`CheckpointRef`), so that a delta of another store, or
of a checkpoint rolled back, is never applied. ``dtype`` is the values' precision, ``"fp32"`` or
``"fp16"`` (``"fp32"`` when absent: exports written before it existed); ``weights_dtype`` the
precision the store kept the table's weights in (unknown keys are served as its initializer's rows
at that precision, as the store reads them);
``rows`` and ``deleted`` count the arrays; ``total_rows`` is the table's rows as of ``checkpoint``
(what a server holding this export and everything before it serves). ``checks`` holds the crc32c
of the content of each array (its rows' bytes, little endian, in order), ``crc32`` the CRC-32 of
the manifest's other fields (``json.dumps(..., sort_keys=True, indent=1)``). Every field is
checked for type and range on open (:func:`read_manifest`).
"""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hierps.config import UNADMITTED_VALUES, WEIGHTS_DTYPES, InitializerConfig
from hierps.errors import ConfigError, CorruptStoreError, StoreFormatError
from hierps.storage._arrays import TRAILER
from hierps.storage._names import valid_table_name

__all__ = [
    "ARRAYS",
    "BULK_CHUNK_ROWS",
    "CheckpointRef",
    "EXPORT_DTYPES",
    "DELETED_CHUNK_ROWS",
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "MANIFEST",
    "PAGE",
    "ExportManifest",
    "array_identity",
    "ExportTableEntry",
    "chunk_rows_for",
    "key_align",
    "manifest_text",
    "read_manifest",
]

EXPORT_FORMAT = "hierps-export"
EXPORT_VERSION = 4
MANIFEST = "manifest.json"
PAGE = 4096
_MIN_CHUNK_ROWS = 16  # wide rows: chunks of 16 rows (a few pages), so fences stay at 0.5 B per key
DELETED_CHUNK_ROWS = (PAGE - TRAILER) // 8  # a page of deleted keys
BULK_CHUNK_ROWS = 8192  # fences and filter: read whole at open, in 64 KiB chunks
# The arrays of a table, with their data type and number of dimensions.
ARRAYS = {
    "keys": ("int64", 1),
    "values": ("float32", 2),
    "fences": ("int64", 1),
    "deleted": ("int64", 1),
    "deleted_fences": ("int64", 1),
    "filter": ("uint64", 1),
}
# Precisions of exported values: name -> Zarr data type. bf16 has no Zarr v3 data type that a plain
# reader knows, so it is not offered.
EXPORT_DTYPES = {"fp32": "float32", "fp16": "float16"}
# Bounds of manifest fields: far above any real table, low enough that no shape built from them
# asks for absurd memory before the arrays' own metadata is compared with them.
MAX_DIM = 1 << 16
MAX_ROWS = 1 << 40
_MAX_RANKS = 1 << 20
_MAX_U32 = (1 << 32) - 1
_INT64 = (-(1 << 63), (1 << 63) - 1)

_V1 = (
    "Version 1 (an earlier hierps) has no key index, so serving it means reading every row into "
    "RAM. Export the checkpoint again with this hierps (hierps export STORE OUT, or "
    "store.export(out)); the store keeps its checkpoints."
)
_V2 = (
    "Version 2 (an earlier hierps) did not bind its chunks' checksums to the export, so a file "
    "copied over another would be served. Export the checkpoint again with this hierps (hierps "
    "export STORE OUT, or store.export(out)); the store keeps its checkpoints."
)
_V3 = (
    "Version 3 (an earlier hierps) did not record which store and which of its checkpoints an "
    "export was taken from, so a delta of another store could be applied to it. Export the "
    "checkpoint again with this hierps (hierps export STORE OUT, or store.export(out)); the store "
    "keeps its checkpoints."
)
_OLDER: dict[object, str] = {1: _V1, 2: _V2, 3: _V3}


def chunk_rows_for(dim: int, value_bytes: int = 4) -> int:
    """Rows per inner chunk of ``values`` (and ``keys``) for rows of ``dim`` values of ``value_bytes``
    each: as many as fit a page with the chunk's checksum and binding tag, or, for rows so wide that
    fewer than 16 fit, the most that fit the fewest whole pages holding 16."""
    row = value_bytes * dim
    pages = math.ceil((_MIN_CHUNK_ROWS * row + TRAILER) / PAGE)
    return (pages * PAGE - TRAILER) // row


def key_align(chunk_rows: int) -> int:
    """Where chunks of ``keys`` start: at multiples of the power of two that holds one (at most a
    page), so that no chunk of keys straddles two pages."""
    return min(PAGE, 1 << (8 * chunk_rows + TRAILER - 1).bit_length())


@dataclass(frozen=True)
class ExportTableEntry:
    """One table of an export's manifest, checked."""

    name: str
    dim: int
    dtype: str  # "fp32" or "fp16": the precision of values
    weights_dtype: str  # the precision of the table's weights in the store
    rows: int
    deleted: int
    total_rows: int
    initializer: InitializerConfig
    unknown: str
    checks: dict[str, int]  # array name -> crc32c of its content
    export_id: str  # the export's uid: its arrays' chunks are bound to it

    def identity(self, array: str) -> str:
        """What ``array`` of this table is, for the binding tags of its chunks."""
        return array_identity(self.export_id, self.name, array)

    @property
    def arrays(self) -> dict[str, tuple[str, int]]:
        """The table's arrays with their data type and number of dimensions."""
        return {**ARRAYS, "values": (EXPORT_DTYPES[self.dtype], 2)}


def array_identity(export_id: str, table: str, array: str) -> str:
    return f"{export_id}:{table}/{array}"


@dataclass(frozen=True)
class CheckpointRef:
    """Which rows: checkpoint ``id`` of the store ``store`` (a uid), as taken at ``created`` (ids are
    reused after a rollback), over ``ranks`` rank stores. Two exports give the same rows only if
    their refs are equal."""

    store: str
    id: int
    created: float
    ranks: int

    def describe(self) -> str:
        taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        ranks = f", {self.ranks} ranks" if self.ranks > 1 else ""
        return f"checkpoint {self.id} of store {self.store} (taken {taken}{ranks})"


@dataclass(frozen=True)
class ExportManifest:
    """An export's ``manifest.json``, checked: where it is, what it holds."""

    path: Path  # the export directory
    checkpoint: int
    since: int | None
    seed: int
    tables: dict[str, ExportTableEntry]
    store: str  # the uid of the store it was taken from
    checkpoint_created: float
    since_created: float | None
    ranks: int

    @property
    def state(self) -> CheckpointRef:
        """The rows it gives (a delta: applied to those of :attr:`applies_to`)."""
        return CheckpointRef(self.store, self.checkpoint, self.checkpoint_created, self.ranks)

    @property
    def applies_to(self) -> CheckpointRef | None:
        """For a delta, the rows it applies to; None for a full export."""
        if self.since is None or self.since_created is None:
            return None
        return CheckpointRef(self.store, self.since, self.since_created, self.ranks)


def manifest_text(body: dict[str, Any]) -> str:
    """``manifest.json`` for ``body`` (the fields above but ``crc32``), with its CRC-32 added."""
    crc = zlib.crc32(json.dumps(body, sort_keys=True, indent=1).encode("utf-8"))
    return json.dumps({**body, "crc32": crc}, sort_keys=True, indent=1)


def read_manifest(export: Path) -> ExportManifest:
    """The checked manifest of the export directory ``export``.

    ``StoreFormatError`` when there is none, or it is not a hierps export of version 4;
    ``CorruptStoreError`` naming the file and the field when it is damaged or out of bounds.
    """
    path = export / MANIFEST
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise StoreFormatError(
            f"{export}: no readable {MANIFEST} ({exc}); it is not a hierps export."
        ) from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise CorruptStoreError(
            f"{path}: cannot be read as JSON ({exc}); the export is damaged or incomplete. Export it again."
        ) from None
    _check_format(path, doc)
    body = {k: v for k, v in doc.items() if k != "crc32"}
    crc = zlib.crc32(json.dumps(body, sort_keys=True, indent=1).encode("utf-8"))
    if doc.get("crc32") != crc:
        raise CorruptStoreError(
            f"{path}: checksum mismatch (crc32 {doc.get('crc32')!r}, the content gives {crc}); the manifest "
            "was modified or damaged. Export it again."
        )
    return _parse(export, path, body)


def _check_format(path: Path, doc: Any) -> None:
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise StoreFormatError(f"{path}: not a hierps export manifest (format {found!r}).")
    version = doc.get("format_version")
    if version != EXPORT_VERSION:
        advice = _OLDER.get(version, "Read it with the hierps release that wrote it.")
        raise StoreFormatError(
            f"{path}: an export of format version {version!r}; this hierps serves version {EXPORT_VERSION}. {advice}"
        )


class _Fields:
    """Reads fields of one manifest, raising ``CorruptStoreError`` naming the file and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def bad(self, field: str, expected: str, value: Any) -> CorruptStoreError:
        return CorruptStoreError(
            f"{self.path}: field {field}: expected {expected}. Got {value!r} instead. The manifest is damaged "
            "or was not written by hierps; export it again."
        )

    def int(self, obj: dict[str, Any], key: str, field: str, low: int, high: int) -> int:
        value = obj.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise self.bad(field, f"an int in [{low}, {high}]", value)
        return value

    def text(self, obj: dict[str, Any], key: str) -> str:
        value = obj.get(key)
        if not isinstance(value, str) or not value:
            raise self.bad(key, "a non-empty str", value)
        return value

    def seconds(self, obj: dict[str, Any], key: str) -> float:
        value = obj.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise self.bad(key, "a time in seconds", value)
        return float(value)

    def obj(self, obj: dict[str, Any], key: str, field: str) -> dict[str, Any]:
        value = obj.get(key)
        if not isinstance(value, dict):
            raise self.bad(field, "an object", value)
        return value


def _parse(export: Path, path: Path, body: dict[str, Any]) -> ExportManifest:
    f = _Fields(path)
    checkpoint = f.int(body, "checkpoint", "checkpoint", 0, _INT64[1])
    since = None if body.get("since") is None else f.int(body, "since", "since", 0, checkpoint)
    seed = f.int(body, "seed", "seed", *_INT64)
    ranks = f.int(body, "ranks", "ranks", 1, _MAX_RANKS)
    if not isinstance(body.get("source"), str):
        raise f.bad("source", "a path", body.get("source"))
    f.seconds(body, "created")
    uid = f.text(body, "uid")
    store = f.text(body, "store")
    taken = f.seconds(body, "checkpoint_created")
    since_taken = None if since is None else f.seconds(body, "since_created")
    if since is None and body.get("since_created") is not None:
        raise f.bad("since_created", "null in a full export (since null)", body.get("since_created"))
    tables = {}
    for name in f.obj(body, "tables", "tables"):
        if not valid_table_name(name):
            raise f.bad("tables", "table names that are plain directory names", name)
        tables[name] = _table(f, name, f.obj(body["tables"], name, f"tables.{name}"), since, uid)
    return ExportManifest(export, checkpoint, since, seed, tables, store, taken, since_taken, ranks)


def _table(f: _Fields, name: str, meta: dict[str, Any], since: int | None, uid: str) -> ExportTableEntry:
    field = f"tables.{name}"
    dim = f.int(meta, "dim", f"{field}.dim", 1, MAX_DIM)
    dtype = meta.get("dtype", "fp32")
    if dtype not in EXPORT_DTYPES:
        raise f.bad(f"{field}.dtype", f"one of {tuple(EXPORT_DTYPES)}", dtype)
    weights_dtype = meta.get("weights_dtype", "fp32")
    if weights_dtype not in WEIGHTS_DTYPES:
        raise f.bad(f"{field}.weights_dtype", f"one of {WEIGHTS_DTYPES}", weights_dtype)
    rows = f.int(meta, "rows", f"{field}.rows", 0, MAX_ROWS)
    deleted = f.int(meta, "deleted", f"{field}.deleted", 0, MAX_ROWS if since is not None else 0)
    total = f.int(meta, "total_rows", f"{field}.total_rows", rows, MAX_ROWS if since is not None else rows)
    if meta.get("unknown") not in UNADMITTED_VALUES:
        raise f.bad(f"{field}.unknown", f"one of {UNADMITTED_VALUES}", meta.get("unknown"))
    try:
        initializer = InitializerConfig.parse(meta.get("initializer"))
    except ConfigError as exc:
        raise f.bad(f"{field}.initializer", f"an initializer ({exc})", meta.get("initializer")) from None
    checks = f.obj(meta, "checks", f"{field}.checks")
    if set(checks) != set(ARRAYS):
        raise f.bad(f"{field}.checks", f"a check of each of {sorted(ARRAYS)}", sorted(checks))
    for array in ARRAYS:
        f.int(checks, array, f"{field}.checks.{array}", 0, _MAX_U32)
    return ExportTableEntry(
        name, dim, dtype, weights_dtype, rows, deleted, total, initializer, meta["unknown"], dict(checks), uid
    )
