"""The commit records of a sharded store directory, and the checkpoints they make: the on-disk side.

A directory of per-rank stores (``<root>/rank-NNNNN``, as :class:`hierps.ShardedStore` and
:mod:`hierps.deepspeed` write them) holds in ``<root>/commits/`` one record per checkpoint of
several ranks, naming each rank's part (a checkpoint of its store)::

    <root>/commits/00000012.json   {"format": "hierps-sharded-checkpoint", "format_version": 4, "id": 12,
                                    "world_size": 2, "parts": [12, 9], "tag": "final", "created": ...}

written atomically by rank 0 once every part is durable: its rename commits the checkpoint. A
checkpoint of one process is rank 0's own checkpoint (world size 1 in its manifest's ``extra``).
The checkpoints of the directory (:class:`Snapshot`) are the records and rank 0's checkpoints of
one process, ordered by rank 0's part, which is their id. A part no record names, newer than the
latest snapshot, never committed. The protocol that writes them is in :mod:`hierps.sharding._commits`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hierps.errors import CorruptStoreError, StoreFormatError
from hierps.storage._checkpoint import CheckpointCatalog
from hierps.storage._files import read_json_checked, write_json_atomic
from hierps.storage._format import FORMAT_VERSION, require_format_version
from hierps.storage._marker import MARKER, check_marker

__all__ = [
    "Snapshot",
    "find_snapshot",
    "rank_dir",
    "record_path",
    "records_dir",
    "remove_stale_records",
    "snapshots",
    "write_record",
]

RECORD_FORMAT = "hierps-sharded-checkpoint"


def rank_dir(path: Path, rank: int) -> Path:
    """The store directory of rank ``rank`` under a sharded root."""
    return Path(path) / f"rank-{rank:05d}"


@dataclass(frozen=True)
class Snapshot:
    """One checkpoint of a sharded root: which checkpoint of each rank's store holds its rows."""

    id: int  # rank 0's checkpoint id (rank 0 takes part in every snapshot)
    world_size: int
    parts: tuple[int, ...]  # the checkpoint id of each rank's store, rank 0 first
    tag: str | None
    created: float

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "tag": self.tag, "created": self.created, "world_size": self.world_size}


def records_dir(root: Path) -> Path:
    return Path(root) / "commits"


def record_path(root: Path, snapshot_id: int) -> Path:
    return records_dir(root) / f"{snapshot_id:08d}.json"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_record(path: Path) -> Snapshot:
    """A commit record, checked field by field: ``CorruptStoreError`` / ``StoreFormatError`` naming it."""
    body = read_json_checked(path)
    if body.get("format") != RECORD_FORMAT:
        raise StoreFormatError(f"{path}: is not a commit record of hierps (format={body.get('format')!r}).")
    require_format_version(path, "commit record", body.get("format_version"))

    def bad(field: str, expected: str) -> CorruptStoreError:
        return CorruptStoreError(
            f"{path}: field {field}: expected {expected}. Got {body.get(field)!r} instead. "
            "The record is damaged or was not written by hierps."
        )

    world, parts, tag, created = (
        body.get("world_size"),
        body.get("parts"),
        body.get("tag"),
        body.get("created"),
    )
    if not isinstance(world, int) or isinstance(world, bool) or world < 2:
        raise bad("world_size", "an int >= 2")
    if not isinstance(parts, list) or len(parts) != world or not all(_is_int(p) and p >= 1 for p in parts):
        raise bad("parts", f"{world} checkpoint ids >= 1, one per rank")
    if body.get("id") != parts[0] or path.stem != f"{parts[0]:08d}":
        raise bad("id", f"rank 0's part {parts[0]}, as in the file name")
    if tag is not None and not isinstance(tag, str):
        raise bad("tag", "a string or null")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise bad("created", "a time in seconds")
    return Snapshot(parts[0], world, tuple(parts), tag, float(created))


def snapshots(root: str | Path) -> list[Snapshot]:
    """The checkpoints of a sharded root, oldest first: its commit records, and rank 0's
    checkpoints written by one process alone."""
    root = Path(root)
    found: dict[int, Snapshot] = {}
    records = records_dir(root)
    if records.is_dir():
        for path in records.glob("*.json"):
            try:
                snap = _read_record(path)
            except CorruptStoreError:
                if path.exists():
                    raise
                continue  # retired meanwhile by rank 0
            found[snap.id] = snap
    ckpts, marker = rank_dir(root, 0) / "checkpoints", rank_dir(root, 0) / MARKER
    if ckpts.is_dir() and marker.exists():  # without its marker, rank 0's store is being created
        catalog = CheckpointCatalog(ckpts, check_marker(marker).uid)
        for ckpt in catalog.ids():
            if ckpt in found:
                continue
            try:
                manifest = catalog.manifest(ckpt)
            except CorruptStoreError:
                if catalog.exists(ckpt):
                    raise
                continue
            if manifest.world_size == 1:
                found[ckpt] = Snapshot(ckpt, 1, (ckpt,), manifest.tag, manifest.created)
    return [found[i] for i in sorted(found)]


def find_snapshot(root: str | Path, ref: int | str | None) -> Snapshot | None:
    """A snapshot by id (int), by tag (str: the newest carrying it), or the latest (None)."""
    known = snapshots(root)
    if ref is None:
        return known[-1] if known else None
    if isinstance(ref, str):
        return next((s for s in reversed(known) if s.tag == ref), None)
    return next((s for s in known if s.id == ref), None)


def write_record(root: Path, parts: list[int], tag: str | None) -> None:
    """Commit the checkpoint whose part on rank r is ``parts[r]`` (rank 0 writes it, once every part is durable)."""
    records = records_dir(root)
    records.mkdir(parents=True, exist_ok=True)
    body = {
        "format": RECORD_FORMAT,
        "format_version": FORMAT_VERSION,
        "id": parts[0],
        "world_size": len(parts),
        "parts": parts,
        "tag": tag,
        "created": time.time(),
    }
    write_json_atomic(record_path(root, parts[0]), body)


def remove_stale_records(root: Path) -> None:
    """Remove the temp files of commit records a crash left unrenamed (never committed)."""
    records = records_dir(root)
    if records.is_dir():
        for p in records.iterdir():
            if p.name.startswith(".") and ".tmp-" in p.name:
                p.unlink(missing_ok=True)
