"""Checkpoints of a store: an atomically written manifest naming the segments of every table.

Layout under ``<store>/checkpoints``::

    00000007/            Zarr v3 group: per table, the keys pending admission (checksummed)
    00000007.json        the manifest; written last, by atomic rename, so its presence is the
                         commit point. For each table it names the segments of its live set, with
                         their rows and live rows. A checkpoint directory without a manifest is an
                         interrupted checkpoint and is removed on the next open.

Rows themselves are not copied, nor is any key index: rows live in immutable SSD segments, each
its own sorted index, and a checkpoint only names the segments it needs. A checkpoint therefore
costs the flush of the rows dirtied since the last one (new segments), and a manifest.
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
from hierps.storage._reads import read_array

__all__ = ["FORMAT_VERSION", "MARKER", "CheckpointCatalog", "check_marker", "valid_table_name"]

# 2: rows carry counters (count, decayed count, shows, clicks, last pass).
# 3: segments are sorted runs with their own fences and filter; checkpoints name segments, no key index.
FORMAT_VERSION = 3
MARKER = "hierps.json"


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
            f"hierps reads version {FORMAT_VERSION}. {_MIGRATE.get(meta.get('format_version'), _OTHER)}"
        )


_OTHER = "Open it with a matching hierps release."
_MIGRATE: dict[object, str] = {
    2: (
        "Version 2 (hierps 0.1) kept a whole key index in RAM and in every checkpoint. To move its "
        "rows: with hierps 0.1, read each table with CheckpointReader(path).iter_rows(table) and "
        "save keys and rows (e.g. with numpy); with this release, create a new store and call "
        "store.table(name, dim, optimizer=...) and store.write_rows(name, keys, rows) with them "
        "(optimizer state and counters included), then store.checkpoint()."
    )
}


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
        segments, live = meta.get("segments"), meta.get("live")
        if not isinstance(segments, dict) or not all(
            isinstance(s, str) and s.isdigit() and _is_int(n) and n >= 0 for s, n in segments.items()
        ):
            raise bad(f"tables.{name}.segments", "an object of segment id -> row count")
        if (
            not isinstance(live, dict)
            or set(live) != set(segments)
            or not all(_is_int(n) and 0 <= n <= segments[s] for s, n in live.items())
        ):
            raise bad(f"tables.{name}.live", "an object of segment id -> live rows, for the same segments")
        check = meta.get("check")
        if (
            not isinstance(check, dict)
            or set(check) != set(segments)
            or not all(_is_int(c) for c in check.values())
        ):
            raise bad(
                f"tables.{name}.check", "an object of segment id -> content check, for the same segments"
            )
        if sum(live.values()) != meta["rows"]:
            raise bad(f"tables.{name}.rows", f"the sum of its segments' live rows ({sum(live.values())})")
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

    def write(self, ckpt: int, body: dict[str, Any], extra: dict[str, dict[str, np.ndarray]]) -> None:
        """Write the ``extra`` 1-D arrays of each table (e.g. its keys pending admission), make them
        durable, then commit the manifest ``body``.

        On failure (e.g. :class:`StoreFullError`) what was written of ``ckpt`` is removed, so the
        previous checkpoint stays the latest and a later attempt starts clean.
        """
        path = self._index_path(ckpt)
        if path.exists():
            shutil.rmtree(path)
        chunk = 1 << 20
        needed = sum(encoded_bytes(data, chunk) for named in extra.values() for data in named.values())
        try:
            with disk_full_as_error(path, f"the arrays of checkpoint {ckpt}", needed):
                zstore = LocalStore(str(path))
                for table, named in extra.items():
                    for name, data in named.items():
                        create_array(zstore, f"{table}/{name}", data, min(len(data), chunk))
                    fault_point("checkpoint.table_arrays")
                fsync_tree(path)
            fault_point("checkpoint.before_manifest")
            write_json_atomic(self._manifest_path(ckpt), {**body, "id": ckpt, "created": time.time()})
        except BaseException:
            if not self._manifest_path(ckpt).exists():
                shutil.rmtree(path, ignore_errors=True)
            raise

    def segments(self, ckpt: int, table: str) -> dict[int, tuple[int, int, int]]:
        """The segments ``ckpt`` names for ``table``: ``{id: (rows, live rows, check)}`` from its manifest."""
        meta = self.manifest(ckpt)["tables"][table]
        return {
            int(s): (int(n), int(meta["live"][s]), int(meta["check"][s])) for s, n in meta["segments"].items()
        }

    def read_extra(self, ckpt: int, table: str, names: dict[str, str]) -> dict[str, np.ndarray] | None:
        """The ``extra`` arrays (``{name: dtype}``) written with a table; None when absent."""
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
