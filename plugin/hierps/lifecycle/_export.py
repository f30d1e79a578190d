"""Exports for serving: the weights of a checkpoint, or what changed since an earlier one, as plain Zarr v3.

The layout of an export directory (any Zarr v3 reader opens it; hierps is not needed) is
:mod:`hierps.storage._export_format`: per table, ``keys`` (n,) int64 sorted unique, ``values``
(n, dim) float32 or float16 (``dtype``; the weights: no optimizer state, no counters), ``deleted`` (m,) int64 (keys
deleted since ``since``; deltas only), and what finds a key from RAM (``fences``, ``filter``); a
``manifest.json`` with the counts, the initializer and the checksums of every array.

A full export (``since`` null) holds every row of checkpoint ``checkpoint``. A delta holds the
rows whose weights differ from checkpoint ``since`` (new rows included) and the keys deleted since
then; applied to the rows as of ``since`` (delete, then insert or replace) it gives the rows as
of ``checkpoint``. ``unknown`` says what a key without a row reads as in training:
``"initializer"`` (the row :func:`hierps.rows._initializers.initial_rows` gives from ``seed``, the table
name and the key) or ``"zeros"``.

Which rows changed comes from one merge of the two checkpoints' rows, by key (both are sorted
runs): rows are compared by weights, so a delta holds only rows whose served value changed. Both
checkpoints must still be kept by the store. Every export streams: its memory is a few buffers
and the fences (8 bytes per 63 rows at dim 16), whatever the table's size; a delta also holds its
deleted keys. It is written into ``.<name>.tmp-<pid>`` beside ``out`` and renamed into place
when complete, so a reader never sees half of one; what a killed export left there is removed by
the next export into that directory (or :func:`hierps.serving.open` of it).

A directory of per-rank stores (``rank-00000/``, ``rank-00001/``... as :class:`hierps.ShardedStore`
and the DeepSpeed integration write them) exports as one: the same table names, the ranks' disjoint
keys merged, taken at a checkpoint committed for all ranks (:mod:`hierps.storage._commit_log`),
each rank's store at its part of it: never a part that did not commit, nor a rank directory the
checkpoint does not name. A delta needs both checkpoints written by the same number of ranks. One
rank's directory (``rank-00001/``) is refused: alone it would pass for the whole store. Read from one
process, every part must be on its disk; where the parts lie on each host's own disk, the job
exports with :meth:`hierps.ShardedStore.export` (:mod:`hierps.sharding._export`), which streams
each part's rows to one rank through :func:`write_export` (each part an :class:`ExportPart`).

Every export names the store it was taken from (its uid; rank 0's for a directory of rank stores)
and when its checkpoints were taken, so that :mod:`hierps.serving` applies a delta only to the rows
it was taken since (:class:`~hierps.storage._export_format.CheckpointRef`).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import zarr
from zarr.storage import LocalStore

from hierps.errors import ConfigError, MissingPartsError, StoreFormatError
from hierps.rows._ids import distinct
from hierps.rows._table import TableInfo
from hierps.storage._checkpoint import CheckpointCatalog
from hierps.storage._commit_log import (
    check_not_a_part,
    find_snapshot,
    rank_dir,
    snapshots,
    store_uid,
)
from hierps.storage._export_format import (
    EXPORT_DTYPES,
    EXPORT_FORMAT,
    EXPORT_VERSION,
    MANIFEST,
    manifest_text,
)
from hierps.storage._export_tables import TableWriter
from hierps.storage._files import (
    append_all,
    disk_full_as_error,
    fsync_dir,
    fsync_tree,
    remove_stale_temp_dirs,
    temp_dir_for,
)
from hierps.storage._manifest import Manifest
from hierps.storage._marker import MARKER, check_marker
from hierps.storage._merge import first_of_each, merged_sources
from hierps.tiers._reader import CheckpointReader

__all__ = [
    "ExportPart",
    "LocalPart",
    "check_dtype",
    "check_export_path",
    "check_since",
    "checkpoint_sources",
    "export_manifest",
    "export_store",
    "resolve_checkpoint",
    "store_dirs",
    "write_export",
]

_MARKER = MARKER


def store_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """The store directories under ``path``: ``[path]`` for a store, its ``rank-*`` stores otherwise."""
    root = Path(path)
    if (root / _MARKER).exists():
        return [root]
    ranks = sorted(p for p in root.glob("rank-*") if (p / _MARKER).exists()) if root.is_dir() else []
    if not ranks:
        raise StoreFormatError(
            f"{root}: neither a hierps store (no {_MARKER}) nor a directory of per-rank stores "
            "(rank-00000/ ...). Point at a store directory."
        )
    return ranks


def resolve_checkpoint(store: Path, ref: int | str | None, what: str = "checkpoint") -> int:
    """The id of checkpoint ``ref`` (id, tag, or None for the latest) of one store directory."""
    catalog = _catalog(store)
    ckpt = None if catalog is None else catalog.latest() if ref is None else catalog.find(ref)
    if ckpt is None:
        held = catalog.ids() if catalog is not None else []
        raise ConfigError(
            f"{store}: no {what} {'at all' if ref is None else repr(ref)} (it holds {held}); a retired "
            "checkpoint cannot be exported from. Checkpoint the store first, export in full, or raise "
            "keep_checkpoints."
        )
    return ckpt


def checkpoint_sources(
    path: str | os.PathLike[str], ref: int | str | None, what: str = "checkpoint"
) -> tuple[list[tuple[Path, int]], int]:
    """Where checkpoint ``ref`` (id, tag, or None for the latest) of ``path`` keeps its rows:
    ``([(store directory, its checkpoint id), ...], the checkpoint's id)``, one pair per rank for a
    directory of per-rank stores (at a checkpoint committed for all of them)."""
    root = Path(path)
    if store_dirs(root) == [root]:
        ckpt = resolve_checkpoint(root, ref, what)
        return [(root, ckpt)], ckpt
    snap = find_snapshot(root, ref)
    if snap is None:
        held = [(s.id, s.tag) for s in snapshots(root)]
        raise ConfigError(
            f"{root}: no {what} {'at all' if ref is None else repr(ref)} committed for all ranks (it has "
            f"{held}, as (id, tag)); a retired checkpoint cannot be exported from. Checkpoint the store "
            "first, export in full, or raise keep_checkpoints."
        )
    return [(rank_dir(root, q), part) for q, part in enumerate(snap.parts)], snap.id


def _catalog(store: Path) -> CheckpointCatalog | None:
    """The checkpoints of a store directory, read without opening the store (no lock); None if none."""
    root = store / "checkpoints"
    return CheckpointCatalog(root, check_marker(store / MARKER).uid) if root.is_dir() else None


class ExportPart(Protocol):
    """One part of an export: one store's rows at the exported checkpoint (one rank's, for a
    directory of rank stores), or those changed since the ``since`` checkpoint.

    ``path`` names it in messages; ``meta`` and ``infos`` are its checkpoint's manifest and table
    settings. :class:`LocalPart` reads a store directory; :mod:`hierps.sharding._export` offers the
    parts another rank reads, over the transport.
    """

    path: Path
    meta: Manifest
    infos: dict[str, TableInfo]

    def rows(self, table: str, dim: int, dtype: str) -> Rows:
        """``(keys (b,) int64 sorted, weights (b, dim) float32)`` batches: every row (a full export) or
        the rows whose served weights changed (a delta), each weight exactly representable in ``dtype``."""
        ...

    def gone(self, table: str) -> np.ndarray:
        """(m,) int64: the keys the ``since`` checkpoint held and the exported one does not (after
        :meth:`rows` of ``table`` was read to its end; deltas only)."""
        ...

    def holds(self, table: str, keys: np.ndarray) -> np.ndarray:
        """keys (n,) int64 sorted unique -> (n,) bool: True where the exported checkpoint has a row."""
        ...


class LocalPart:
    """The :class:`ExportPart` of a store directory this process reads: checkpoint ``now`` (and
    ``old``, the ``since`` checkpoint, for a delta)."""

    def __init__(self, now: CheckpointReader, old: CheckpointReader | None = None) -> None:
        self.now, self.old = now, old
        self.path, self.meta, self.infos = now.path, now.meta, now.infos
        self._gone: dict[str, list[np.ndarray]] = {}

    def rows(self, table: str, dim: int, dtype: str) -> Rows:
        if self.old is None:
            return _weights(self.now, table, dim, dtype)
        return _changed(self.old, self.now, table, dim, dtype, self._gone.setdefault(table, []))

    def gone(self, table: str) -> np.ndarray:
        found = self._gone.pop(table, [])
        return np.concatenate(found) if found else np.empty(0, np.int64)

    def holds(self, table: str, keys: np.ndarray) -> np.ndarray:
        if table not in self.meta.tables or not len(keys):
            return np.zeros(len(keys), bool)
        return self.now.read(table, keys)[0]

    def close(self) -> None:
        for reader in (self.now, self.old):
            if reader is not None:
                reader.close()


def export_store(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    since: int | str | None = None,
    checkpoint: int | str | None = None,
    dtype: str = "fp32",
) -> dict[str, Any]:
    """Export a store directory (or a directory of rank stores) to ``out``; returns the manifest.

    ``checkpoint``: id or tag to export (default: the latest); ``since``: id or tag of an earlier
    checkpoint, for a delta. ``out`` must not exist (or be empty) and lie outside the store
    directory (whose files the store manages); it appears whole or not at all.
    A full disk raises :class:`~hierps.errors.StoreFullError` naming the path (nothing is left).
    ``dtype``: the precision of the exported weights, ``"fp32"`` or ``"fp16"`` (half the bytes,
    rounded to nearest; a weight beyond fp16's range, 65504, raises ``ConfigError``).
    A directory of rank stores whose parts are not all on this disk raises
    :class:`~hierps.errors.MissingPartsError` (export from the job: :meth:`hierps.ShardedStore.export`).
    """
    check_dtype(dtype)
    out = check_export_path(path, out)
    root = Path(path)
    if (root / _MARKER).exists():
        check_not_a_part(root)
    sources, ckpt = checkpoint_sources(path, checkpoint)
    base_sources: list[tuple[Path, int]] = []
    base = None
    if since is not None:
        base_sources, base = checkpoint_sources(path, since, what="since")
        check_since(since, base, ckpt, len(base_sources), len(sources))
    if store_dirs(root) != [root]:
        _check_parts_here(root, ckpt, [*sources, *base_sources])
    parts = [
        LocalPart(CheckpointReader(store, part), CheckpointReader(*base_sources[q]) if base_sources else None)
        for q, (store, part) in enumerate(sources)
    ]
    try:
        stores = [store for store, _ in sources]
        old = parts[0].old
        uid = check_marker(stores[0] / MARKER).uid
        manifest = export_manifest(
            root, ckpt, base, parts, uid, old.meta.created if old is not None else None
        )
        return write_export(out, manifest, parts, dtype)
    finally:
        for p in parts:
            p.close()


def check_dtype(dtype: str) -> None:
    """``ConfigError`` unless ``dtype`` is a precision exports are written in."""
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(
            f"dtype: expected one of {', '.join(EXPORT_DTYPES)} for an export. Got {dtype!r} instead"
            + (" (bf16 has no Zarr v3 data type that a plain reader knows)." if dtype == "bf16" else ".")
        )


def check_export_path(store: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """``out`` checked to be a new (or empty) directory outside the store directory ``store``."""
    target = _export_path(store, out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(
            f"{target}: already exists and is not empty; export to a new directory (exports are "
            "never overwritten, so a reader never sees half of one)."
        )
    return target


def check_since(since: int | str, base: int, ckpt: int, base_ranks: int, ranks: int) -> None:
    """``ConfigError`` unless checkpoint ``base`` (``since``) can be the start of a delta to ``ckpt``."""
    if base > ckpt:
        raise ConfigError(
            f"since {since!r}: checkpoint {base} is newer than the exported checkpoint {ckpt}; a delta "
            "goes from an older checkpoint to a newer one."
        )
    if base_ranks != ranks:
        raise ConfigError(
            f"since {since!r}: checkpoint {base} was written by {base_ranks} ranks and checkpoint "
            f"{ckpt} by {ranks}: their rows are sharded differently, so no delta is taken "
            "between them. Export in full."
        )


def _check_parts_here(root: Path, ckpt: int, sources: list[tuple[Path, int]]) -> None:
    """:class:`MissingPartsError` for the rank directories of ``sources`` this process does not see
    (each host's own disk holds its ranks' parts)."""
    missing = sorted({int(store.name.split("-")[1]) for store, _ in sources if store_uid(store) is None})
    if missing:
        names = ", ".join(f"part {q} (rank {q}: {rank_dir(root, q).name})" for q in missing)
        raise MissingPartsError(
            f"{root}: checkpoint {ckpt} has parts that are not on this disk: {names}; they are on "
            "other hosts' disks (node-local storage). Export from the job, whose ranks reach every "
            "part (hierps.ShardedStore.export; with DeepSpeed, engine.hierps_store.export), or copy "
            "the missing rank directories here. Nothing was written.",
            parts=tuple(missing),
            checkpoint=ckpt,
        )


def export_manifest(
    source: Path,
    ckpt: int,
    base: int | None,
    parts: Sequence[ExportPart],
    store: str,
    since_created: float | None,
) -> dict[str, Any]:
    """The manifest of an export of checkpoint ``ckpt`` (since ``base``, taken at ``since_created``)
    of ``parts``, named by ``store`` (the uid of rank 0's store: checkpoints are numbered by it);
    tables are filled in by :func:`write_export`."""
    return {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "checkpoint": ckpt,
        "since": base,
        "seed": _one({p.meta.seed for p in parts}, "seed", parts),
        "ranks": len(parts),
        "source": str(source.resolve()),
        "created": time.time(),
        "uid": uuid.uuid4().hex,
        # Which rows it gives (and a delta applies to): checkpoints are numbered by rank 0's store.
        "store": store,
        "checkpoint_created": parts[0].meta.created,
        "since_created": since_created,
        "tables": {},
    }


def write_export(
    out: Path,
    manifest: dict[str, Any],
    parts: Sequence[ExportPart],
    dtype: str,
    ready: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Write the rows of ``parts`` (disjoint keys), merged by key, as the export ``out`` described
    by ``manifest`` (its ``since`` set: a delta); returns the manifest with its tables.

    Written into a temporary directory beside ``out``; ``ready(manifest)``, called once it is
    complete and durable, may raise to abandon it; then it is renamed into place.
    """
    ckpt = manifest["checkpoint"]
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(out.parent)
    tmp = temp_dir_for(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with disk_full_as_error(
            tmp, f"the export of checkpoint {ckpt}", _bytes(parts, dtype), then=_AFTER_FULL
        ):
            tmp.mkdir(parents=True)
            zstore = LocalStore(str(tmp))
            zarr.open_group(zstore, mode="w", attributes={"format": EXPORT_FORMAT})
            delta = manifest["since"] is not None
            for name, info in _tables(parts).items():
                manifest["tables"][name] = _export_table(
                    zstore, name, info, parts, delta, manifest["uid"], dtype
                )
            (tmp / MANIFEST).write_text(manifest_text(manifest), encoding="utf-8")
            fsync_tree(tmp)
        if ready is not None:
            ready(manifest)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


_AFTER_FULL = "export again; nothing of this export was left behind."


def _export_path(store: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """``out`` checked to be a path outside the store directory ``store``: ``ConfigError`` otherwise."""
    for what, value in (("store path", store), ("export path", out)):
        if "\0" in os.fspath(value):
            raise ConfigError(
                f"{what} {os.fspath(value)!r}: not a valid path (it holds a NUL byte); pass a path without one."
            )
    root, target = Path(store).resolve(), Path(out).resolve()
    if target == root or root in target.parents:
        raise ConfigError(
            f"export path {os.fspath(out)!r}: is inside the store directory {str(root)!r}, whose files the "
            "store manages (and may delete); export to a directory outside the store."
        )
    return Path(out)


def _bytes(parts: Sequence[ExportPart], dtype: str) -> int:
    """About the bytes a full export of ``parts``' tables takes: keys and weights of every row."""
    value_bytes = np.dtype(EXPORT_DTYPES[dtype]).itemsize
    return sum(e.rows * (8 + value_bytes * p.infos[t].dim) for p in parts for t, e in p.meta.tables.items())


def _export_table(
    zstore: LocalStore,
    name: str,
    info: TableInfo,
    parts: Sequence[ExportPart],
    delta: bool,
    export_id: str,
    dtype: str,
) -> dict[str, Any]:
    """Write table ``name`` of ``parts`` (what changed, for a ``delta``) in ``dtype``; its manifest entry."""
    dim = info.dim
    writer = TableWriter(zstore, name, dim, export_id, dtype)
    try:
        _write_rows(writer, parts, [p.rows(name, dim, dtype) for p in parts])
        deleted = _deleted(parts, name) if delta else np.empty(0, np.int64)
        checks = writer.close(deleted)
    except BaseException:
        writer.abort()  # no descriptor of the removed export stays open
        raise
    return {
        "dim": dim,
        "dtype": dtype,
        "weights_dtype": info.weights_dtype,
        "rows": writer.rows,
        "deleted": int(len(deleted)),
        "total_rows": sum(p.meta.tables[name].rows for p in parts if name in p.meta.tables),
        "initializer": info.initializer.to_json(),
        "unknown": info.admission.unknown_rows,
        "checks": checks,
    }


def _one(values: set[Any], what: str, parts: Sequence[ExportPart]) -> Any:
    if len(values) != 1:
        raise StoreFormatError(
            f"{parts[0].path.parent}: the rank stores disagree on {what} ({sorted(values)}); they "
            "are not shards of one model. Export them one by one."
        )
    return values.pop()


def _tables(parts: Sequence[ExportPart]) -> dict[str, TableInfo]:
    """Table name -> its settings, checked to agree over the rank stores."""
    out: dict[str, TableInfo] = {}
    for p in parts:
        for name, info in p.infos.items():
            first = out.setdefault(name, info)
            if first.dim != info.dim or first.initializer != info.initializer:
                raise StoreFormatError(
                    f"{p.path}: table {name!r} has dim {info.dim} / initializer "
                    f"{info.initializer.to_json()} there and dim {first.dim} / initializer "
                    f"{first.initializer.to_json()} in another rank store; they are not shards of one "
                    "model. Export them one by one."
                )
    return out


Rows = Iterator[tuple[np.ndarray, np.ndarray]]


def _weights(reader: CheckpointReader, table: str, dim: int, dtype: str) -> Rows:
    """Every stored row's weights as served in ``dtype``: ``(keys (b,) int64 sorted, weights (b, dim)
    float32, each exactly representable in dtype)`` batches."""
    if table in reader.meta.tables:
        for keys, rows in reader.iter_rows(table):
            yield keys, _served(rows[:, :dim], table, dtype)


def _served(weights: np.ndarray, table: str, dtype: str) -> np.ndarray:
    """weights (b, dim) float32 rounded to nearest in ``dtype`` (as float32); ``ConfigError`` for a
    weight beyond its range (it would be served as inf)."""
    if dtype == "fp32":
        return weights
    with np.errstate(over="ignore"):  # checked just below
        out = weights.astype(EXPORT_DTYPES[dtype])
    if not np.all(np.isfinite(out[np.isfinite(weights)])):
        big = float(np.abs(weights[np.isfinite(weights)]).max())
        raise ConfigError(
            f"table {table!r}: a weight of magnitude {big:g} is beyond the range of {dtype} "
            f"(+-{float(np.finfo(out.dtype).max):g}); export it in fp32."
        )
    return out.astype(np.float32)


def _changed(
    old: CheckpointReader, now: CheckpointReader, table: str, dim: int, dtype: str, gone: list[np.ndarray]
) -> Rows:
    """The rows of ``table`` whose weights in ``now``, as served in ``dtype``, differ from ``old`` (or are new), in key order;
    the keys ``old`` held and ``now`` does not go to ``gone``. One merge of the two checkpoints'
    rows, in bounded memory."""
    sources = [_weights(old, table, dim, dtype), _weights(now, table, dim, dtype)]
    for keys, rows, src in merged_sources(sources, dim):
        first = first_of_each(keys)
        paired = np.zeros(len(keys), bool)
        paired[:-1] = first[:-1] & ~first[1:]  # a key in both: now's entry (source 1) comes first
        at = np.flatnonzero(paired)
        # Bitwise: a NaN that stayed a NaN is unchanged, and -0.0 differs from 0.0.
        differ = (rows[at].view(np.uint32) != rows[at + 1].view(np.uint32)).any(axis=1)
        single = first.copy()
        single[at] = False
        new = single & (src == 1)
        take = np.sort(np.concatenate([np.flatnonzero(new), at[differ]]))
        gone.append(keys[single & (src == 0)])
        if len(take):
            yield keys[take], rows[take]


def _deleted(parts: Sequence[ExportPart], table: str) -> np.ndarray:
    """(m,) int64 sorted: keys a part's old checkpoint held and no part's new checkpoint holds."""
    gone = [p.gone(table) for p in parts]
    keys = distinct(np.concatenate(gone)) if gone else np.empty(0, np.int64)
    if len(parts) > 1:  # (moved to another rank: not deleted)
        for p in parts:
            if len(keys):
                keys = keys[~p.holds(table, keys)]
    return keys


def _write_rows(writer: TableWriter, parts: Sequence[ExportPart], sources: list[Rows]) -> None:
    """Write the rows of ``sources[r]`` (part r's, by key), merged by key, as they come: each batch
    encoded and written beside the reads and the merge of the next."""

    def batches() -> Rows:
        for keys, rows, src in merged_sources(sources, writer.dim):
            twice = np.flatnonzero(keys[1:] == keys[:-1])
            if len(twice):
                holders = sorted(parts[int(r)].path.name for r in src[twice[0] : twice[0] + 2])
                raise StoreFormatError(
                    f"table {writer.name!r}: key {int(keys[twice[0]])} is stored in both {holders[0]} and "
                    f"{holders[1]}; rank stores of one model hold disjoint keys. Export them one by one."
                )
            yield keys, rows

    append_all(writer.append, batches())
