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
checkpoint does not name. A delta needs both checkpoints written by the same number of ranks.

Every export names the store it was taken from (its uid; rank 0's for a directory of rank stores)
and when its checkpoints were taken, so that :mod:`hierps.serving` applies a delta only to the rows
it was taken since (:class:`~hierps.storage._export_format.CheckpointRef`).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

from hierps.errors import ConfigError, StoreFormatError
from hierps.rows._table import TableInfo
from hierps.storage._checkpoint import CheckpointCatalog
from hierps.storage._commit_log import find_snapshot, rank_dir, snapshots
from hierps.storage._export_format import (
    EXPORT_DTYPES,
    EXPORT_FORMAT,
    EXPORT_VERSION,
    MANIFEST,
    manifest_text,
)
from hierps.storage._export_tables import TableWriter
from hierps.storage._files import (
    disk_full_as_error,
    fsync_dir,
    fsync_tree,
    remove_stale_temp_dirs,
    temp_dir_for,
)
from hierps.storage._marker import MARKER, check_marker
from hierps.storage._merge import first_of_each, merged_sources
from hierps.tiers._reader import CheckpointReader

__all__ = ["checkpoint_sources", "export_store", "resolve_checkpoint", "store_dirs"]

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
    """
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(
            f"dtype: expected one of {', '.join(EXPORT_DTYPES)} for an export. Got {dtype!r} instead"
            + (" (bf16 has no Zarr v3 data type that a plain reader knows)." if dtype == "bf16" else ".")
        )
    out = _export_path(path, out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"{out}: already exists and is not empty; export to a new directory (exports are "
            "never overwritten, so a reader never sees half of one)."
        )
    sources, ckpt = checkpoint_sources(path, checkpoint)
    stores = [store for store, _ in sources]
    base = None
    if since is not None:
        base_sources, base = checkpoint_sources(path, since, what="since")
        if base > ckpt:
            raise ConfigError(
                f"since {since!r}: checkpoint {base} is newer than the exported checkpoint {ckpt}; a delta "
                "goes from an older checkpoint to a newer one."
            )
        if len(base_sources) != len(sources):
            raise ConfigError(
                f"since {since!r}: checkpoint {base} was written by {len(base_sources)} ranks and checkpoint "
                f"{ckpt} by {len(sources)}: their rows are sharded differently, so no delta is taken "
                "between them. Export in full."
            )
    now = [CheckpointReader(store, part) for store, part in sources]
    old = [CheckpointReader(s, part) for s, part in base_sources] if since is not None else None
    manifest = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "checkpoint": ckpt,
        "since": base,
        "seed": _one({r.meta.seed for r in now}, "seed", stores),
        "ranks": len(stores),
        "source": str(Path(path).resolve()),
        "created": time.time(),
        "uid": uuid.uuid4().hex,
        # Which rows it gives (and a delta applies to): checkpoints are numbered by rank 0's store.
        "store": check_marker(stores[0] / MARKER).uid,
        "checkpoint_created": now[0].meta.created,
        "since_created": old[0].meta.created if old is not None else None,
        "tables": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(out.parent)
    tmp = temp_dir_for(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with disk_full_as_error(
            tmp, f"the export of checkpoint {ckpt}", _bytes(now, dtype), then=_AFTER_FULL
        ):
            tmp.mkdir(parents=True)
            zstore = LocalStore(str(tmp))
            zarr.open_group(zstore, mode="w", attributes={"format": EXPORT_FORMAT})
            for name, info in _tables(now).items():
                manifest["tables"][name] = _export_table(zstore, name, info, now, old, manifest["uid"], dtype)
            (tmp / MANIFEST).write_text(manifest_text(manifest), encoding="utf-8")
            fsync_tree(tmp)
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


def _bytes(readers: list[CheckpointReader], dtype: str) -> int:
    """About the bytes a full export of ``readers``' tables takes: keys and weights of every row."""
    value_bytes = np.dtype(EXPORT_DTYPES[dtype]).itemsize
    return sum(e.rows * (8 + value_bytes * r.infos[t].dim) for r in readers for t, e in r.meta.tables.items())


def _export_table(
    zstore: LocalStore,
    name: str,
    info: TableInfo,
    now: list[CheckpointReader],
    old: list[CheckpointReader] | None,
    export_id: str,
    dtype: str,
) -> dict[str, Any]:
    """Write table ``name`` (of ``now``, or what changed since ``old``) in ``dtype``; its manifest entry."""
    dim = info.dim
    gone: list[np.ndarray] = []
    if old is None:
        sources = [_weights(r, name, dim, dtype) for r in now]
    else:
        sources = [_changed(o, r, name, dim, dtype, gone) for o, r in zip(old, now)]
    writer = TableWriter(zstore, name, dim, export_id, dtype)
    try:
        _write_rows(writer, now, sources)
        deleted = _deleted(now, name, gone) if old is not None else np.empty(0, np.int64)
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
        "total_rows": sum(r.meta.tables[name].rows for r in now if name in r.meta.tables),
        "initializer": info.initializer.to_json(),
        "unknown": info.admission.unknown_rows,
        "checks": checks,
    }


def _one(values: set[Any], what: str, stores: list[Path]) -> Any:
    if len(values) != 1:
        raise StoreFormatError(
            f"{stores[0].parent}: the rank stores disagree on {what} ({sorted(values)}); they "
            "are not shards of one model. Export them one by one."
        )
    return values.pop()


def _tables(readers: list[CheckpointReader]) -> dict[str, TableInfo]:
    """Table name -> its settings, checked to agree over the rank stores."""
    out: dict[str, TableInfo] = {}
    for r in readers:
        for name, info in r.infos.items():
            first = out.setdefault(name, info)
            if first.dim != info.dim or first.initializer != info.initializer:
                raise StoreFormatError(
                    f"{r.path}: table {name!r} has dim {info.dim} / initializer "
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


def _deleted(now: list[CheckpointReader], table: str, gone: list[np.ndarray]) -> np.ndarray:
    """(m,) int64 sorted: keys a rank's old checkpoint held and no rank's new checkpoint holds."""
    keys = np.unique(np.concatenate(gone)) if gone else np.empty(0, np.int64)
    for reader in now:
        if len(keys) and table in reader.meta.tables and len(now) > 1:  # (moved to another rank: not deleted)
            found, _ = reader.read(table, keys)
            keys = keys[~found]
    return keys


def _write_rows(writer: TableWriter, readers: list[CheckpointReader], sources: list[Rows]) -> None:
    """Write the rows of ``sources[r]`` (reader r's, by key), merged by key, as they come."""
    for keys, rows, src in merged_sources(sources, writer.dim):
        twice = np.flatnonzero(keys[1:] == keys[:-1])
        if len(twice):
            holders = sorted(readers[int(r)].path.name for r in src[twice[0] : twice[0] + 2])
            raise StoreFormatError(
                f"table {writer.name!r}: key {int(keys[twice[0]])} is stored in both {holders[0]} and "
                f"{holders[1]}; rank stores of one model hold disjoint keys. Export them one by one."
            )
        writer.append(keys, rows)
