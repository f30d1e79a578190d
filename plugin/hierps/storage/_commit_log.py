"""The commit records of a sharded store directory, and the checkpoints they make: the on-disk side.

A directory of per-rank stores (``<root>/rank-NNNNN``, as :class:`hierps.ShardedStore` and
:mod:`hierps.deepspeed` write them) makes one checkpoint of all ranks (a :class:`Snapshot`) of one
checkpoint of each rank's store, its *part*. The snapshot is committed by a record, of which each
rank that took part keeps its own copy in its own directory::

    <root>/rank-00001/commits/00000012.json
        {"format": "hierps-sharded-checkpoint", "format_version": 4, "id": 12, "world_size": 2,
         "parts": [12, 9], "stores": ["<uid of rank-00000>", "<uid of rank-00001>"], "tag": "final",
         "created": ..., "resharded_from": null}

Rank 0 writes its copy first, once every part is durable: that rename is the commit point, and
rank 0's records are the directory's checkpoints (rank 0 takes part in every one). The other
ranks write theirs after it, so a rank recovers its part from its own directory (a disk only its
host sees), and a record anywhere proves every part durable. ``stores`` names each part's store
by the ``uid`` of its marker: a directory replaced by another store, or another host's directory
at the same path, is never taken for the part. ``resharded_from`` is the id of the checkpoint a
reshard copied (the rows are that checkpoint's; the user saved nothing): such snapshots do not
count against ``keep_checkpoints`` (:func:`retained`). The protocol that writes them is in
:mod:`hierps.sharding._commits`.

A rank directory holding ``commits/`` is a part of a sharded root: a plain ``hierps.Store`` on it
would take its checkpoints for the whole store's, so opening one is refused
(:func:`check_not_a_part`), except by the sharded machinery (:func:`opening_part`).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hierps.errors import ConfigError, CorruptStoreError, StoreFormatError
from hierps.storage._files import fsync_dir, read_json_checked, write_json_atomic
from hierps.storage._format import FORMAT_VERSION, require_format_version
from hierps.storage._marker import MARKER, check_marker

__all__ = [
    "Snapshot",
    "check_not_a_part",
    "collect_rank_dir",
    "delete_record",
    "find_in",
    "find_snapshot",
    "keep_record",
    "legacy_records",
    "opening_part",
    "rank_dir",
    "rank_dirs",
    "read_records",
    "records_dir",
    "retained",
    "snapshots",
    "store_uid",
    "write_record",
]

RECORD_FORMAT = "hierps-sharded-checkpoint"
_RANK_PREFIX = "rank-"
_DELETING = ".deleting-"


def rank_dir(path: str | os.PathLike[str], rank: int) -> Path:
    """The store directory of rank ``rank`` under a sharded root."""
    return Path(path) / f"{_RANK_PREFIX}{rank:05d}"


def rank_dirs(root: str | os.PathLike[str]) -> dict[int, Path]:
    """The rank directories this process sees under ``root``, by rank."""
    root = Path(root)
    found: dict[int, Path] = {}
    if root.is_dir():
        for p in root.iterdir():
            digits = p.name[len(_RANK_PREFIX) :]
            if p.name.startswith(_RANK_PREFIX) and len(digits) == 5 and digits.isdigit() and p.is_dir():
                found[int(digits)] = p
    return found


def store_uid(store: Path) -> str | None:
    """The ``uid`` of the store at ``store`` (from its marker), or None where no store is."""
    marker = Path(store) / MARKER
    return check_marker(marker).uid if marker.exists() else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Snapshot:
    """One checkpoint of a sharded root: which checkpoint of each rank's store holds its rows."""

    id: int  # rank 0's part (rank 0 takes part in every snapshot)
    world_size: int
    parts: tuple[int, ...]  # the checkpoint id of each rank's store, rank 0 first
    stores: tuple[str, ...]  # the uid of each rank's store (its marker's), rank 0 first
    tag: str | None
    created: float
    resharded_from: int | None = None  # the snapshot whose rows a reshard copied

    @property
    def source(self) -> int:
        """The snapshot the user saved that holds these rows: itself, or the one it was resharded from."""
        return self.resharded_from if self.resharded_from is not None else self.id

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tag": self.tag,
            "created": self.created,
            "world_size": self.world_size,
            "resharded_from": self.resharded_from,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "format_version": FORMAT_VERSION,
            "id": self.id,
            "world_size": self.world_size,
            "parts": list(self.parts),
            "stores": list(self.stores),
            "tag": self.tag,
            "created": self.created,
            "resharded_from": self.resharded_from,
        }

    @classmethod
    def from_json(cls, where: str | Path, body: Any) -> Snapshot:
        """A record's body, checked field by field: ``CorruptStoreError`` / ``StoreFormatError`` naming ``where``."""
        if not isinstance(body, dict) or body.get("format") != RECORD_FORMAT:
            got = body.get("format") if isinstance(body, dict) else body
            raise StoreFormatError(f"{where}: is not a commit record of hierps (format={got!r}).")
        require_format_version(Path(where), "commit record", body.get("format_version"))

        def bad(name: str, expected: str) -> CorruptStoreError:
            return CorruptStoreError(
                f"{where}: field {name}: expected {expected}. Got {body.get(name)!r} instead. "
                "The record is damaged or was not written by hierps."
            )

        world, parts, stores = body.get("world_size"), body.get("parts"), body.get("stores")
        tag, created, source = body.get("tag"), body.get("created"), body.get("resharded_from")
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise bad("world_size", "an int >= 1")
        if (
            not isinstance(parts, list)
            or len(parts) != world
            or not all(_is_int(p) and p >= 1 for p in parts)
        ):
            raise bad("parts", f"{world} checkpoint ids >= 1, one per rank")
        if (
            not isinstance(stores, list)
            or len(stores) != world
            or not all(isinstance(s, str) and s for s in stores)
        ):
            raise bad("stores", f"{world} store uids, one per rank")
        if body.get("id") != parts[0]:
            raise bad("id", f"rank 0's part {parts[0]}")
        if tag is not None and not isinstance(tag, str):
            raise bad("tag", "a string or null")
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise bad("created", "a time in seconds")
        if source is not None and (not _is_int(source) or not 1 <= source < parts[0]):
            raise bad("resharded_from", f"null or the id of an earlier checkpoint (< {parts[0]})")
        return cls(parts[0], world, tuple(parts), tuple(stores), tag, float(created), source)


def records_dir(store: str | os.PathLike[str]) -> Path:
    """Where the store of one rank keeps its copies of the commit records."""
    return Path(store) / "commits"


def _record_path(store: Path, snapshot_id: int) -> Path:
    return records_dir(store) / f"{snapshot_id:08d}.json"


def read_records(store: str | os.PathLike[str]) -> list[Snapshot]:
    """The commit records a rank's store directory holds, oldest first (temp files of a record a
    crash left unrenamed are removed: they never committed)."""
    records = records_dir(store)
    found: list[Snapshot] = []
    if not records.is_dir():
        return found
    for path in records.iterdir():
        if path.name.startswith(".") and ".tmp-" in path.name:
            path.unlink(missing_ok=True)
            continue
        if path.suffix != ".json" or not path.stem.isdigit():
            continue
        try:
            snap = Snapshot.from_json(path, read_json_checked(path))
        except CorruptStoreError:
            if path.exists():
                raise
            continue  # retired meanwhile
        if path.stem != f"{snap.id:08d}":
            raise CorruptStoreError(f"{path}: holds the record of checkpoint {snap.id}, not of {path.stem}.")
        found.append(snap)
    return sorted(found, key=lambda s: s.id)


def keep_record(store: str | os.PathLike[str], snap: Snapshot) -> None:
    """Write (atomically, durably) this rank's copy of the record of ``snap``."""
    records = records_dir(store)
    records.mkdir(parents=True, exist_ok=True)
    write_json_atomic(_record_path(Path(store), snap.id), snap.to_json())


def delete_record(store: str | os.PathLike[str], snapshot_id: int) -> None:
    """Delete this rank's copy of a record (the snapshot stops counting here)."""
    _record_path(Path(store), snapshot_id).unlink(missing_ok=True)


def snapshots(root: str | os.PathLike[str]) -> list[Snapshot]:
    """The checkpoints of a sharded root, oldest first: rank 0's records (read from outside, e.g. by
    an export, where rank 0's directory is visible)."""
    return read_records(rank_dir(root, 0))


def find_in(known: Sequence[Snapshot], ref: int | str | None) -> Snapshot | None:
    """A snapshot by id (int; or the newest resharded from it), by tag (str: the newest carrying
    it), or the latest (None)."""
    if ref is None:
        return known[-1] if known else None
    if isinstance(ref, str):
        return next((s for s in reversed(known) if s.tag == ref), None)
    exact = next((s for s in known if s.id == ref), None)
    return exact or next((s for s in reversed(known) if s.resharded_from == ref), None)


def find_snapshot(root: str | os.PathLike[str], ref: int | str | None) -> Snapshot | None:
    """:func:`find_in` over the snapshots of ``root`` (rank 0's records)."""
    return find_in(snapshots(root), ref)


def retained(known: Sequence[Snapshot], keep: int) -> list[Snapshot]:
    """The snapshots to keep: the newest ``keep`` the user saved, and the latest (a reshard's copy
    of one counts against nothing: opening at another world size never costs a tag)."""
    saved = [s.id for s in known if s.resharded_from is None][-keep:]
    kept = set(saved) | ({known[-1].id} if known else set())
    return [s for s in known if s.id in kept]


def write_record(
    root: str | os.PathLike[str], parts: Sequence[int], tag: str | None, **fields: Any
) -> Snapshot:
    """Commit the snapshot whose part on rank r is ``parts[r]``, from one process that sees every
    rank directory (a tool, e.g. ``hierps shrink``): rank 0's copy first, then the others'."""
    stores = tuple(store_uid(rank_dir(root, r)) or "" for r in range(len(parts)))
    snap = Snapshot(parts[0], len(parts), tuple(parts), stores, tag, time.time(), **fields)
    for r in range(len(parts)):
        keep_record(rank_dir(root, r), snap)
    return snap


def legacy_records(root: str | os.PathLike[str]) -> Path:
    """Where an earlier hierps kept the commit records of a root (one directory all ranks shared)."""
    return Path(root) / "commits"


def collect_rank_dir(path: Path) -> None:
    """Delete a rank directory no kept snapshot names: renamed away first (so that one process
    claims it, and a crash leaves a name :func:`remove_collected` finishes), then removed."""
    claimed = path.with_name(f".{path.name}{_DELETING}{os.getpid()}-{time.monotonic_ns()}")
    try:
        path.rename(claimed)
    except FileNotFoundError:
        return  # claimed by another rank that sees the same directory
    fsync_dir(path.parent)
    shutil.rmtree(claimed, ignore_errors=True)


def remove_collected(root: str | os.PathLike[str]) -> None:
    """Finish deleting the rank directories a crash left renamed away by :func:`collect_rank_dir`."""
    root = Path(root)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(f".{_RANK_PREFIX}") and _DELETING in p.name:
                shutil.rmtree(p, ignore_errors=True)


# -- a rank directory is a part, not a store of its own --------------------------------------------
_OPENING_PART: ContextVar[bool] = ContextVar("hierps_opening_part", default=False)


@contextmanager
def opening_part() -> Iterator[None]:
    """Within it, a ``hierps.Store`` may open a rank directory of a sharded root (the sharded
    machinery opening its own part, or a tool that commits for every rank)."""
    token = _OPENING_PART.set(True)
    try:
        yield
    finally:
        _OPENING_PART.reset(token)


def check_not_a_part(store: Path) -> None:
    """``ConfigError`` when ``store`` is one rank's directory of a sharded root and is opened alone."""
    if _OPENING_PART.get() or not records_dir(store).is_dir():
        return
    root = Path(store).parent
    raise ConfigError(
        f"{store}: this is one rank's part of the sharded store {root} (its commit records are in "
        f"{records_dir(store)}). Opened alone, its checkpoints would pass for the whole store's and "
        "hide the rows the other ranks own, so it is not opened. Open the root with "
        "hierps.ShardedStore (any number of ranks, one included) or hierps.deepspeed.initialize; read "
        f"it with `hierps export {root}` or `hierps inspect {root}`."
    )
