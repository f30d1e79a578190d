"""The store's format version, and what to do with a store of another one.

Every file that describes a store (its marker, each checkpoint manifest, each commit record of a
sharded root) carries ``format_version``; this hierps reads exactly :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

from pathlib import Path

from hierps.errors import StoreFormatError

__all__ = ["FORMAT_VERSION", "MAX_DIM", "migration_hint", "require_format_version"]

# 2: rows carry counters (count, decayed count, shows, clicks, last pass).
# 3: segments are sorted runs with their own fences and filter; checkpoints name segments, no key index.
# 4: each chunk's checksum is bound to what the chunk is (store, array, position); the marker holds the
#    store's id and whether a checkpoint was ever committed; manifests hold keep_checkpoints and
#    every table's count of keys pending admission; a checkpoint of several ranks counts once a
#    commit record names every rank's part; rows are laid out per table (weights_dtype,
#    state_dtype: fields of 4-byte words), recorded in every checkpoint's table entry.
FORMAT_VERSION = 4
MAX_DIM = 65536  # floats per row: a row must fit a segment chunk of a few pages

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


def migration_hint(found: object) -> str:
    """What a user can do with a store written by format version ``found``."""
    return _MIGRATE.get(found, _OTHER)


def require_format_version(path: Path, what: str, found: object) -> None:
    """``StoreFormatError`` unless ``found`` (a file's ``format_version``) is this hierps' version."""
    if found != FORMAT_VERSION:
        raise StoreFormatError(
            f"{path}: {what} has format version {found!r}; this hierps reads {FORMAT_VERSION}. "
            "Open it with a matching hierps release."
        )
