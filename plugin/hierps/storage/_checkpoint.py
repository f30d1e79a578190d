"""Checkpoints of a store: the key index of every table plus an atomically written manifest.

Layout under ``<store>/checkpoints``::

    00000007/            Zarr v3 group: <table>/keys, <table>/seg, <table>/pos (checksummed)
    00000007.json        the manifest; written last, by atomic rename, so its presence is the
                         commit point. A checkpoint directory without a manifest is an
                         interrupted checkpoint and is removed on the next open.

Rows themselves are not copied: they live in immutable SSD segments, and a checkpoint only names
the segments it needs. A checkpoint therefore costs a flush of dirty rows and the index.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from zarr.storage import LocalStore

from hierps._faults import fault_point
from hierps.config import InitializerConfig, OptimizerConfig
from hierps.errors import ConfigError, CorruptStoreError, StoreFormatError
from hierps.storage._arrays import create_array, encoded_bytes, open_array
from hierps.storage._files import disk_full_as_error, fsync_tree, read_json_checked, write_json_atomic
from hierps.storage._index import TableIndex
from hierps.storage._reads import read_array

__all__ = ["FORMAT_VERSION", "MARKER", "CheckpointCatalog", "check_marker", "valid_table_name"]

FORMAT_VERSION = 2  # 2: rows carry counters (count, decayed count, shows, clicks, last pass)
MARKER = "hierps.json"
_INDEX_DTYPES = {"keys": "int64", "seg": "int32", "pos": "int32"}


def valid_table_name(name: object) -> bool:
    """A table name is also a directory name: non-empty, no '/', not starting with '_' or '.'."""
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith(("_", "."))


def check_marker(marker: Path) -> None:
    """Check the store marker file: a hierps store of this format version, else ``StoreFormatError``."""
    meta = read_json_checked(marker)
    if meta.get("format") != "hierps-store":
        raise StoreFormatError(f"{marker}: is not a hierps store marker (format={meta.get('format')!r}).")
    if meta.get("format_version") != FORMAT_VERSION:
        raise StoreFormatError(
            f"{marker.parent}: written by store format version {meta.get('format_version')!r}; this "
            f"hierps reads version {FORMAT_VERSION}. Open it with a matching hierps release."
        )


def _check_manifest(path: Path, ckpt: int, body: dict[str, Any]) -> None:
    """Every field a manifest must have, with its type; ``CorruptStoreError`` naming the field."""

    def bad(field: str, expected: str) -> CorruptStoreError:
        value: Any = body
        for part in field.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return CorruptStoreError(
            f"{path}: field {field}: expected {expected}. Got {value!r} instead. "
            "The manifest is damaged or was not written by hierps."
        )

    if body.get("format_version") != FORMAT_VERSION:
        raise StoreFormatError(
            f"{path}: checkpoint {ckpt} has format version {body.get('format_version')!r}; this hierps reads "
            f"{FORMAT_VERSION}. Open it with a matching hierps release."
        )
    if not _is_int(body.get("id")) or body["id"] != ckpt:
        raise bad("id", f"the checkpoint id {ckpt} of the file name")
    if body.get("tag") is not None and not isinstance(body.get("tag"), str):
        raise bad("tag", "a string or null")
    if not isinstance(body.get("created", 0.0), (int, float)):
        raise bad("created", "a time in seconds")
    for field, low in (("seed", None), ("passes", 0), ("next_segment", 1)):
        if not _is_int(body.get(field)) or (low is not None and body[field] < low):
            raise bad(field, "an int" if low is None else f"an int >= {low}")
    tables = body.get("tables")
    if not isinstance(tables, dict):
        raise bad("tables", "an object of tables")
    for name, meta in tables.items():
        if not valid_table_name(name):
            raise CorruptStoreError(f"{path}: table name {name!r} is not a valid table name.")
        if not isinstance(meta, dict):
            raise bad(f"tables.{name}", "an object")
        for field, low in (("dim", 1), ("width", 1), ("step", 0), ("rows", 0)):
            if not _is_int(meta.get(field)) or meta[field] < low:
                raise bad(f"tables.{name}.{field}", f"an int >= {low}")
        segments = meta.get("segments")
        if not isinstance(segments, dict) or not all(
            isinstance(s, str) and s.isdigit() and _is_int(n) and n >= 0 for s, n in segments.items()
        ):
            raise bad(f"tables.{name}.segments", "an object of segment id -> row count")
        try:
            OptimizerConfig.parse(meta.get("optimizer"))
            InitializerConfig.parse(meta.get("initializer"))
        except ConfigError as exc:
            raise CorruptStoreError(f"{path}: table {name!r}: {exc}") from exc


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CheckpointCatalog:
    """The checkpoints of one store directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _manifest_path(self, ckpt: int) -> Path:
        return self.root / f"{ckpt:08d}.json"

    def _index_path(self, ckpt: int) -> Path:
        return self.root / f"{ckpt:08d}"

    def ids(self) -> list[int]:
        """Ids of complete checkpoints, oldest first."""
        out = []
        for p in self.root.glob("*.json"):
            if p.stem.isdigit():
                out.append(int(p.stem))
        return sorted(out)

    def latest(self) -> int | None:
        ids = self.ids()
        return ids[-1] if ids else None

    def manifest(self, ckpt: int) -> dict[str, Any]:
        """The checked manifest of ``ckpt``: ``CorruptStoreError`` / ``StoreFormatError`` naming the file."""
        path = self._manifest_path(ckpt)
        body = read_json_checked(path)
        _check_manifest(path, ckpt, body)
        return body

    def exists(self, ckpt: int) -> bool:
        """Whether ``ckpt`` is still committed (not retired)."""
        return self._manifest_path(ckpt).exists()

    def find(self, ref: int | str) -> int | None:
        """A checkpoint by id (int) or by tag (str; the newest checkpoint carrying it)."""
        if isinstance(ref, int):
            return ref if ref in self.ids() else None
        for ckpt in reversed(self.ids()):
            try:
                tag = self.manifest(ckpt).get("tag")
            except CorruptStoreError:
                if self.exists(ckpt):
                    raise
                continue  # retired meanwhile by the process training the store
            if tag == ref:
                return ckpt
        return None

    def write(
        self,
        ckpt: int,
        indexes: dict[str, TableIndex],
        body: dict[str, Any],
        extra: dict[str, dict[str, np.ndarray]] | None = None,
    ) -> None:
        """Write the index arrays (and ``extra`` 1-D arrays per table), make them durable, then
        commit the manifest.

        On failure (e.g. :class:`StoreFullError`) what was written of ``ckpt`` is removed, so the
        previous checkpoint stays the latest and a later attempt starts clean.
        """
        path = self._index_path(ckpt)
        if path.exists():
            shutil.rmtree(path)
        chunk = 1 << 20
        arrays = {
            table: {**{name: getattr(idx, name) for name in _INDEX_DTYPES}, **(extra or {}).get(table, {})}
            for table, idx in indexes.items()
        }
        needed = sum(encoded_bytes(data, chunk) for named in arrays.values() for data in named.values())
        try:
            with disk_full_as_error(path, f"the key index of checkpoint {ckpt}", needed):
                zstore = LocalStore(str(path))
                for table, named in arrays.items():
                    for name, data in named.items():
                        create_array(zstore, f"{table}/{name}", data, min(len(data), chunk))
                    fault_point("checkpoint.index_table")
                fsync_tree(path)
            fault_point("checkpoint.before_manifest")
            write_json_atomic(self._manifest_path(ckpt), {**body, "id": ckpt, "created": time.time()})
        except BaseException:
            if not self._manifest_path(ckpt).exists():
                shutil.rmtree(path, ignore_errors=True)
            raise

    def read_index(self, ckpt: int, table: str, segments: dict[int, int]) -> TableIndex:
        """The key index of ``table`` in ``ckpt``, checked against the manifest's ``segments`` sizes."""
        path = self._index_path(ckpt)
        zstore = LocalStore(str(path), read_only=True)
        keys, seg, pos = (
            read_array(open_array(zstore, path, f"{table}/{name}", dtype, 1), path, f"{table}/{name}")
            for name, dtype in _INDEX_DTYPES.items()
        )
        where = f"{path / table}: the key index of checkpoint {ckpt}"
        if not (len(keys) == len(seg) == len(pos)) or (len(keys) > 1 and not np.all(keys[1:] > keys[:-1])):
            raise CorruptStoreError(f"{where} is inconsistent (lengths differ or keys are not sorted).")
        if len(seg):
            known = np.array(sorted(segments), dtype=np.int64)
            at = np.minimum(np.searchsorted(known, seg), max(len(known) - 1, 0))
            sizes = np.array([segments[int(s)] for s in known], dtype=np.int64)
            if len(known) == 0 or not np.all(known[at] == seg) or not np.all((pos >= 0) & (pos < sizes[at])):
                raise CorruptStoreError(f"{where} points outside the segments its manifest names.")
        return TableIndex(keys.astype(np.int64), seg.astype(np.int32), pos.astype(np.int32))

    def read_extra(self, ckpt: int, table: str, names: dict[str, str]) -> dict[str, np.ndarray] | None:
        """The ``extra`` arrays (``{name: dtype}``) written with a table's index; None when absent."""
        path = self._index_path(ckpt)
        first = next(iter(names))
        if not (path / table / first).exists():
            return None
        zstore = LocalStore(str(path), read_only=True)
        return {
            name: read_array(open_array(zstore, path, f"{table}/{name}", dtype, 1), path, f"{table}/{name}")
            for name, dtype in names.items()
        }

    def delete(self, ckpt: int) -> None:
        """Retire a checkpoint: the manifest first (so it stops counting), then its index."""
        self._manifest_path(ckpt).unlink(missing_ok=True)
        fault_point("checkpoint.retire_manifest_removed")
        shutil.rmtree(self._index_path(ckpt), ignore_errors=True)

    def remove_incomplete(self) -> int:
        """Remove index directories and temp files of checkpoints that never committed."""
        complete = set(self.ids())
        removed = 0
        for p in self.root.iterdir():
            if p.is_dir() and p.name.isdigit() and int(p.name) not in complete:
                shutil.rmtree(p, ignore_errors=True)
                removed += 1
            elif p.name.startswith(".") and ".tmp-" in p.name:
                p.unlink(missing_ok=True)
        return removed

    def referenced_segments(self) -> set[tuple[str, int]]:
        out: set[tuple[str, int]] = set()
        for ckpt in self.ids():
            for table, meta in self.manifest(ckpt)["tables"].items():
                out.update((table, int(s)) for s in meta["segments"])
        return out
