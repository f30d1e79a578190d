"""``hierps.json``: the marker that makes a directory a hierps store.

Written once when the store is created (its rename commits the creation) and again, once, when the
first checkpoint commits: from then on a store without any checkpoint manifest is a damaged store,
never an empty one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hierps.errors import CorruptStoreError, StoreFormatError
from hierps.storage._files import read_json_checked, write_json_atomic
from hierps.storage._format import FORMAT_VERSION, migration_hint

__all__ = ["MARKER", "StoreMarker", "check_marker", "write_marker"]

MARKER = "hierps.json"


@dataclass(frozen=True)
class StoreMarker:
    """What ``hierps.json`` says of a store: its id (checksums of its chunks are bound to it) and
    whether a checkpoint was ever committed (a store that had one never opens empty)."""

    uid: str
    checkpointed: bool = False


def write_marker(marker: Path, meta: StoreMarker) -> None:
    """Write (atomically) the marker file ``marker`` saying ``meta``."""
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
            f"hierps reads version {FORMAT_VERSION}. {migration_hint(meta.get('format_version'))}"
        )
    uid, done = meta.get("uid"), meta.get("checkpointed")
    if not isinstance(uid, str) or not uid or not isinstance(done, bool):
        raise CorruptStoreError(
            f"{marker}: fields uid / checkpointed: expected a non-empty str and a bool. Got {uid!r} and "
            f"{done!r} instead. The marker is damaged or was not written by hierps."
        )
    return StoreMarker(uid, done)
