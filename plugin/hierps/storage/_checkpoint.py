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

import json
import shutil
import time
from dataclasses import dataclass
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

__all__ = [
    "FORMAT_VERSION",
    "MARKER",
    "MAX_DIM",
    "CheckpointCatalog",
    "StoreMarker",
    "check_marker",
    "require_format_version",
    "table_name_problem",
    "valid_table_name",
    "write_marker",
]

# 2: rows carry counters (count, decayed count, shows, clicks, last pass).
# 3: segments are sorted runs with their own fences and filter; checkpoints name segments, no key index.
# 4: each chunk's checksum is bound to what the chunk is (store, array, position); the marker holds the
#    store's id and whether a checkpoint was ever committed; manifests hold keep_checkpoints and
#    every table's count of keys pending admission; a checkpoint of several ranks counts once a
#    commit record names every rank's part; rows are laid out per table (weights_dtype,
#    state_dtype: fields of 4-byte words), recorded in every checkpoint's table entry.
FORMAT_VERSION = 4
MARKER = "hierps.json"
MAX_DIM = 65536  # floats per row: a row must fit a segment chunk of a few pages
_NAME_BYTES = 255  # the longest file name Linux file systems hold
# Names a table cannot take: files beside the tables' directories (an export's root, a store's).
_RESERVED = frozenset({"zarr.json", "manifest.json"})


def table_name_problem(name: object) -> str | None:
    """What keeps ``name`` from being a table name (it is a directory name in the store, its
    checkpoints and exports), or None: a non-empty str, at most 255 bytes in UTF-8, without '/' or
    NUL, not starting with '_' or '.', not a name a file beside the tables takes."""
    if not isinstance(name, str):
        return f"a str, not {type(name).__name__}"
    if not name or "/" in name or "\0" in name or name.startswith(("_", ".")):
        return "a non-empty name without '/' or NUL, not starting with '_' or '.'"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "a name that is valid UTF-8 (it holds a lone surrogate)"
    if size > _NAME_BYTES:
        return f"at most {_NAME_BYTES} bytes in UTF-8 (a file name); it has {size}"
    if name.casefold() in _RESERVED:
        return f"a name other than {sorted(_RESERVED)} (files of the store and of its exports)"
    return None


def valid_table_name(name: object) -> bool:
    """Whether ``name`` can be a table name: see :func:`table_name_problem`."""
    return table_name_problem(name) is None


@dataclass(frozen=True)
class StoreMarker:
    """What ``hierps.json`` says of a store: its id (checksums of its chunks are bound to it) and
    whether a checkpoint was ever committed (a store that had one never opens empty)."""

    uid: str
    checkpointed: bool = False


def write_marker(marker: Path, meta: StoreMarker) -> None:
    write_json_atomic(
        marker,
        {
            "format": "hierps-store",
            "format_version": FORMAT_VERSION,
            "uid": meta.uid,
            "checkpointed": meta.checkpointed,
        },
    )


def check_marker(marker: Path) -> StoreMarker:
    """Check the store marker file: a hierps store of this format version, else ``StoreFormatError``."""
    meta = read_json_checked(marker)
    if meta.get("format") != "hierps-store":
        raise StoreFormatError(f"{marker}: is not a hierps store marker (format={meta.get('format')!r}).")
    if meta.get("format_version") != FORMAT_VERSION:
        raise StoreFormatError(
            f"{marker.parent}: written by store format version {meta.get('format_version')!r}; this "
            f"hierps reads version {FORMAT_VERSION}. {_MIGRATE.get(meta.get('format_version'), _OTHER)}"
        )
    uid, done = meta.get("uid"), meta.get("checkpointed")
    if not isinstance(uid, str) or not uid or not isinstance(done, bool):
        raise CorruptStoreError(
            f"{marker}: fields uid / checkpointed: expected a non-empty str and a bool. Got {uid!r} and "
            f"{done!r} instead. The marker is damaged or was not written by hierps."
        )
    return StoreMarker(uid, done)


_OTHER = "Open it with a matching hierps release."
_MOVE_ROWS = (
    "To move its rows: with that release, read each table with CheckpointReader(path).iter_rows(table) "
    "and save keys and rows (e.g. with numpy); with this release, create a new store and call "
    "store.table(name, dim, optimizer=...) and store.write_rows(name, keys, rows) with them "
    "(optimizer state and counters included), then store.checkpoint()."
)
_MIGRATE: dict[object, str] = {
    2: "Version 2 (hierps 0.1) kept a whole key index in RAM and in every checkpoint. " + _MOVE_ROWS,
    3: (
        "Version 3 checksummed chunks without binding them to their place in the store, committed "
        "the checkpoint of each rank of a sharded store on its own, and did not record how rows are laid "
        "out (weights_dtype 'fp32', the default, keeps its rows exact). "
        + _MOVE_ROWS
        + " For a directory of rank-NNNNN stores, read every rank's rows (at the same checkpoint tag) "
        "into one new store at <new directory>/rank-00000: a ShardedStore of any number of ranks "
        "opened on <new directory> reshards it."
    ),
}


def require_format_version(path: Path, what: str, found: object) -> None:
    """``StoreFormatError`` unless ``found`` (a file's ``format_version``) is this hierps' version."""
    if found != FORMAT_VERSION:
        raise StoreFormatError(
            f"{path}: {what} has format version {found!r}; this hierps reads {FORMAT_VERSION}. "
            "Open it with a matching hierps release."
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

    require_format_version(path, f"checkpoint {ckpt}", body.get("format_version"))
    if not _is_int(body.get("id")) or body["id"] != ckpt:
        raise bad("id", f"the checkpoint id {ckpt} of the file name")
    if body.get("tag") is not None and not isinstance(body.get("tag"), str):
        raise bad("tag", "a string or null")
    if not isinstance(body.get("extra", {}), dict):
        raise bad("extra", "an object")
    if not isinstance(body.get("created", 0.0), (int, float)):
        raise bad("created", "a time in seconds")
    for field, low in (("seed", None), ("passes", 0), ("next_segment", 1)):
        if not _is_int(body.get(field)) or (low is not None and body[field] < low):
            raise bad(field, "an int" if low is None else f"an int >= {low}")
    tables = body.get("tables")
    if not isinstance(tables, dict):
        raise bad("tables", "an object of tables")
    if not _is_int(body.get("keep_checkpoints")) or body["keep_checkpoints"] < 1:
        raise bad("keep_checkpoints", "an int >= 1")
    for name, meta in tables.items():
        problem = table_name_problem(name)
        if problem is not None:
            raise CorruptStoreError(
                f"{path}: table name {name!r} is not a valid table name: expected {problem}."
            )
        if not isinstance(meta, dict):
            raise bad(f"tables.{name}", "an object")
        for field, low in (("dim", 1), ("width", 1), ("step", 0), ("rows", 0), ("pending", 0)):
            if not _is_int(meta.get(field)) or meta[field] < low:
                raise bad(f"tables.{name}.{field}", f"an int >= {low}")
        if meta["dim"] > MAX_DIM:
            raise bad(f"tables.{name}.dim", f"an int <= {MAX_DIM}")
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

    def __init__(self, root: Path, store_id: str) -> None:
        self.root = Path(root)
        self.store_id = store_id  # the store's id: the chunks of checkpoint arrays are bound to it
        if not self.root.is_dir():
            raise CorruptStoreError(
                f"{self.root}: the store's checkpoints directory is missing (a partial copy, or deleted "
                "files); nothing was changed. Copy it back (or the whole store again) and reopen it."
            )

    def _manifest_path(self, ckpt: int) -> Path:
        return self.root / f"{ckpt:08d}.json"

    def _index_path(self, ckpt: int) -> Path:
        return self.root / f"{ckpt:08d}"

    def _identity(self, ckpt: int, name: str) -> str:
        """What array ``name`` of checkpoint ``ckpt`` is: the arrays of an older checkpoint copied over
        a newer one's fail their chunks' binding tags."""
        return f"{self.store_id}:checkpoints/{ckpt:08d}/{name}"

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

    def check_present(self, checkpointed: bool) -> None:
        """``CorruptStoreError`` when a store that committed a checkpoint (``checkpointed``, from
        its marker) holds none: a partial copy, or deleted manifests. Checked before anything is
        collected, so nothing of what is left is deleted."""
        if checkpointed and self.latest() is None:
            raise CorruptStoreError(
                f"{self.root}: this store committed checkpoints but no checkpoint manifest is there (a "
                "partial copy, or deleted files); nothing was deleted. Copy its checkpoints directory "
                "back (or the whole store again) and reopen it."
            )

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

        The manifest is checked as a reader will check it before anything is written: a body that
        would not verify (a bad tag, values JSON cannot hold) raises ``ConfigError`` and commits
        nothing. On failure (e.g. :class:`StoreFullError`) what was written of ``ckpt`` is removed,
        so the previous checkpoint stays the latest and a later attempt starts clean.
        """
        path = self._index_path(ckpt)
        full = {**body, "id": ckpt, "created": time.time()}
        try:
            _check_manifest(self._manifest_path(ckpt), ckpt, json.loads(json.dumps(full, sort_keys=True)))
        except (CorruptStoreError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"checkpoint {ckpt} would not be readable, so it was not written: {exc}"
            ) from exc
        if path.exists():
            shutil.rmtree(path)
        chunk = 1 << 20
        needed = sum(encoded_bytes(data, chunk) for named in extra.values() for data in named.values())
        try:
            with disk_full_as_error(path, f"the arrays of checkpoint {ckpt}", needed):
                zstore = LocalStore(str(path))
                for table, named in extra.items():
                    for name, data in named.items():
                        create_array(
                            zstore,
                            f"{table}/{name}",
                            data,
                            min(len(data), chunk),
                            identity=self._identity(ckpt, f"{table}/{name}"),
                        )
                    fault_point("checkpoint.table_arrays")
                fsync_tree(path)
            fault_point("checkpoint.before_manifest")
            write_json_atomic(self._manifest_path(ckpt), full)
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

    def read_extra(self, ckpt: int, table: str, names: dict[str, str], rows: int) -> dict[str, np.ndarray]:
        """The ``extra`` arrays (``{name: dtype}``) written with a table, each of ``rows`` rows (as its
        manifest says); ``CorruptStoreError`` naming the array when one is missing or of another length."""
        path = self._index_path(ckpt)
        zstore = LocalStore(str(path), read_only=True)
        out = {}
        for name, dtype in names.items():
            arr = open_array(
                zstore, path, f"{table}/{name}", dtype, 1, identity=self._identity(ckpt, f"{table}/{name}")
            )
            if arr.shape != (rows,):
                raise CorruptStoreError(
                    f"{path / table / name}: {arr.shape[0]} rows where the manifest of checkpoint {ckpt} "
                    f"names {rows}; the checkpoint is damaged. Restore it from a backup or open an earlier one."
                )
            out[name] = read_array(arr, path, f"{table}/{name}")
        return out

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
