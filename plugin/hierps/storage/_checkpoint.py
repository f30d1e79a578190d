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
from pathlib import Path

import numpy as np
from zarr.storage import LocalStore

from hierps._faults import fault_point
from hierps.errors import CorruptStoreError
from hierps.storage._arrays import create_array, encoded_bytes, open_array
from hierps.storage._files import disk_full_as_error, fsync_tree, read_json_checked, write_json_atomic
from hierps.storage._manifest import Manifest
from hierps.storage._reads import read_array

__all__ = ["CheckpointCatalog"]


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

    def manifest(self, ckpt: int) -> Manifest:
        """The checked manifest of ``ckpt``: ``CorruptStoreError`` / ``StoreFormatError`` naming the file."""
        path = self._manifest_path(ckpt)
        return Manifest.from_json(path, ckpt, read_json_checked(path))

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
                tag = self.manifest(ckpt).tag
            except CorruptStoreError:
                if self.exists(ckpt):
                    raise
                continue  # retired meanwhile by the process training the store
            if tag == ref:
                return ckpt
        return None

    def write(self, manifest: Manifest, arrays: dict[str, dict[str, np.ndarray]]) -> None:
        """Write the 1-D ``arrays`` of each table (``{table: {name: array}}``, e.g. its keys pending
        admission), make them durable, then commit ``manifest``.

        The manifest is checked as a reader will check it before anything is written: one that
        would not verify (a bad tag, values JSON cannot hold) raises ``ConfigError`` and commits
        nothing. On failure (e.g. :class:`StoreFullError`) what was written of the checkpoint is
        removed, so the previous checkpoint stays the latest and a later attempt starts clean.
        """
        ckpt = manifest.id
        manifest.check(self._manifest_path(ckpt))
        path = self._index_path(ckpt)
        if path.exists():
            shutil.rmtree(path)
        chunk = 1 << 20
        needed = sum(encoded_bytes(data, chunk) for named in arrays.values() for data in named.values())
        try:
            with disk_full_as_error(path, f"the arrays of checkpoint {ckpt}", needed):
                zstore = LocalStore(str(path))
                for table, named in arrays.items():
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
            write_json_atomic(self._manifest_path(ckpt), manifest.to_json())
        except BaseException:
            if not self._manifest_path(ckpt).exists():
                shutil.rmtree(path, ignore_errors=True)
            raise

    def read_arrays(self, ckpt: int, table: str, names: dict[str, str], rows: int) -> dict[str, np.ndarray]:
        """The arrays (``{name: dtype}``) written with a table, each of ``rows`` rows (as its
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
            for table, entry in self.manifest(ckpt).tables.items():
                out.update((table, s) for s in entry.segments)
        return out
