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
import zarr
import zarr.codecs
from zarr.storage import LocalStore

from hierps._faults import fault_point
from hierps._files import fsync_tree, read_json_checked, write_json_atomic
from hierps.errors import CorruptStoreError
from hierps.tiers.ssd import TableIndex

__all__ = ["CheckpointCatalog"]


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
        return read_json_checked(self._manifest_path(ckpt))

    def find(self, ref: int | str) -> int | None:
        """A checkpoint by id (int) or by tag (str; the newest checkpoint carrying it)."""
        if isinstance(ref, int):
            return ref if ref in self.ids() else None
        for ckpt in reversed(self.ids()):
            if self.manifest(ckpt).get("tag") == ref:
                return ckpt
        return None

    def write(self, ckpt: int, indexes: dict[str, TableIndex], body: dict[str, Any],
              extra: dict[str, dict[str, np.ndarray]] | None = None) -> None:
        """Write the index arrays (and ``extra`` 1-D arrays per table), make them durable, then commit the manifest."""
        path = self._index_path(ckpt)
        if path.exists():
            shutil.rmtree(path)
        zstore = LocalStore(str(path))
        zarr.open_group(zstore, mode="w")
        checksum = [zarr.codecs.Crc32cCodec()]
        for table, idx in indexes.items():
            arrays = {name: getattr(idx, name) for name in ("keys", "seg", "pos")}
            arrays.update((extra or {}).get(table, {}))
            for name, data in arrays.items():
                arr = zarr.create_array(zstore, name=f"{table}/{name}", shape=data.shape,
                                        chunks=(max(1, min(len(data), 1 << 20)),), dtype=data.dtype,
                                        compressors=checksum, fill_value=0)
                if len(data):
                    arr[:] = data
            fault_point("checkpoint.index_table")
        fsync_tree(path)
        fault_point("checkpoint.before_manifest")
        write_json_atomic(self._manifest_path(ckpt), {**body, "id": ckpt, "created": time.time()})

    def read_index(self, ckpt: int, table: str) -> TableIndex:
        path = self._index_path(ckpt)
        try:
            zstore = LocalStore(str(path), read_only=True)
            arrays = [zarr.open_array(zstore, path=f"{table}/{name}", mode="r")[:] for name in ("keys", "seg", "pos")]
        except Exception as exc:  # zarr raises many types for damaged files; all mean the same here
            raise CorruptStoreError(
                f"{path / table}: the key index of checkpoint {ckpt} cannot be read ({exc}). "
                "Open an earlier checkpoint or restore the store from a backup."
            ) from exc
        keys, seg, pos = arrays
        if not (len(keys) == len(seg) == len(pos)) or (len(keys) > 1 and not np.all(keys[1:] > keys[:-1])):
            raise CorruptStoreError(f"{path / table}: the key index of checkpoint {ckpt} is inconsistent.")
        return TableIndex(keys.astype(np.int64), seg.astype(np.int32), pos.astype(np.int32))

    def read_extra(self, ckpt: int, table: str, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
        """The ``extra`` arrays written with a table's index, or None when the checkpoint has none."""
        path = self._index_path(ckpt)
        if not (path / table / names[0]).exists():
            return None
        try:
            zstore = LocalStore(str(path), read_only=True)
            return {name: zarr.open_array(zstore, path=f"{table}/{name}", mode="r")[:] for name in names}
        except Exception as exc:  # zarr raises many types for damaged files; all mean the same here
            raise CorruptStoreError(
                f"{path / table}: arrays {list(names)} of checkpoint {ckpt} cannot be read ({exc}). "
                "Open an earlier checkpoint or restore the store from a backup."
            ) from exc

    def delete(self, ckpt: int) -> None:
        """Retire a checkpoint: the manifest first (so it stops counting), then its index."""
        self._manifest_path(ckpt).unlink(missing_ok=True)
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
