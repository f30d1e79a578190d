"""Read-only embedding tables for serving, built from exports (:mod:`hierps.lifecycle._export`).

::

    tables = hierps.serving.open("/models/ads/base", deltas=["/models/ads/d1", "/models/ads/d2"])
    tables.lookup("user", ids)        # ids (...) int64 -> (..., dim) float32 (numpy, or torch for torch ids)

    tables = hierps.serving.open("/models/ads")     # a directory of exports: base + chain of deltas

A *serving directory* holds exports as subdirectories, under any names. :func:`open` takes its
newest full export as the base and then applies deltas in chain: the delta taken since the
base's checkpoint, then the one taken since that delta's checkpoint, and so on (when several
deltas start at the same checkpoint, the one reaching furthest is taken). Exports off the chain
are ignored, so old deltas can be left in place and a new base starts a new chain.

Keys that no export holds read as the manifest's ``unknown`` (what they read as in training:
the initializer's row for (seed, table, key), or zeros), unless ``open(..., unknown="zeros")``.
Rows are held in RAM: keys (8 bytes) and weights (4 * dim bytes) per row.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.storage import LocalStore

from hierps.config import UNADMITTED_VALUES, InitializerConfig
from hierps.errors import ConfigError, CorruptStoreError, StoreFormatError
from hierps.lifecycle._export import EXPORT_FORMAT, EXPORT_VERSION
from hierps.rows import _ids
from hierps.rows._initializers import initial_rows, table_salt

__all__ = ["ServingTables", "open"]


@dataclass
class _Table:
    dim: int
    keys: np.ndarray  # (n,) int64 sorted unique
    values: np.ndarray  # (n, dim) float32
    initializer: InitializerConfig
    unknown: str
    salt: np.uint64


class ServingTables:
    """Embedding tables as of one checkpoint, read-only: see :func:`open`."""

    def __init__(self, tables: dict[str, _Table], checkpoint: int, applied: list[Path]) -> None:
        self._tables = tables
        self.checkpoint = checkpoint
        """The checkpoint the rows are as of."""
        self.applied = applied
        """The exports applied, base first."""

    @property
    def tables(self) -> dict[str, int]:
        """Table name -> dim."""
        return {name: t.dim for name, t in self._tables.items()}

    def num_rows(self, table: str) -> int:
        return int(len(self._table(table).keys))

    def keys(self, table: str) -> np.ndarray:
        """(n,) int64 sorted keys that have a row."""
        return self._table(table).keys

    def lookup(self, table: str, ids: Any) -> np.ndarray | torch.Tensor:
        """ids: (...) int64 (tensor, array or list) -> (..., dim) float32 rows.

        A torch tensor of ids gives a torch tensor on the same device; anything else a numpy array.
        """
        t = self._table(table)
        flat = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
        shape = tuple(ids.shape) if hasattr(ids, "shape") else (len(flat),)
        out = np.empty((len(flat), t.dim), np.float32)
        at = np.searchsorted(t.keys, flat)
        at_c = np.minimum(at, max(len(t.keys) - 1, 0))
        found = (at < len(t.keys)) & (t.keys[at_c] == flat) if len(t.keys) else np.zeros(len(flat), bool)
        out[found] = t.values[at_c[found]]
        missing = np.flatnonzero(~found)
        if len(missing):
            if t.unknown == "zeros":
                out[missing] = 0.0
            else:
                out[missing] = initial_rows(flat[missing], t.dim, t.salt, t.initializer)
        out = out.reshape(*shape, t.dim)
        if isinstance(ids, torch.Tensor):
            return torch.from_numpy(out).to(ids.device)
        return out

    def _table(self, table: str) -> _Table:
        try:
            return self._tables[table]
        except KeyError:
            raise ConfigError(f"unknown table {table!r}; the exports hold {sorted(self._tables)}.") from None


def open(
    path: str | os.PathLike[str],
    deltas: list[str | os.PathLike[str]] | None = None,
    *,
    unknown: str | None = None,
) -> ServingTables:
    """Tables from an export plus deltas applied in order, or from a serving directory.

    ``path``: a full export (then ``deltas``: exports each taken since the previous one's
    checkpoint, in that order), or a directory of exports (base and delta chain found by their
    manifests; ``deltas`` must then be None). ``unknown``: ``"initializer"`` or ``"zeros"`` for
    keys without a row (default: what each table's manifest says).
    """
    if unknown is not None and unknown not in UNADMITTED_VALUES:
        raise ConfigError(f"unknown: expected one of {UNADMITTED_VALUES}. Got {unknown!r} instead.")
    root = Path(path)
    if (root / "manifest.json").exists():
        chain = [root, *(Path(d) for d in deltas or [])]
    elif deltas:
        raise ConfigError(
            f"{root}: has no manifest.json, so it is a serving directory, which finds its own "
            "deltas; pass deltas=None, or pass an export as the base."
        )
    else:
        chain = _find_chain(root)
    manifests = [_manifest(p) for p in chain]
    if manifests[0]["since"] is not None:
        raise ConfigError(
            f"{chain[0]}: is a delta (since checkpoint {manifests[0]['since']}), not a full export; "
            "start from a full export (hierps export STORE OUT)."
        )
    tables: dict[str, _Table] = {}
    checkpoint: int | None = None
    for p, m in zip(chain, manifests):
        if checkpoint is not None and m["since"] != checkpoint:
            raise ConfigError(
                f"{p}: is a delta since checkpoint {m['since']}, but the rows so far are as of "
                f"checkpoint {checkpoint}. Pass deltas in order, each taken since the previous "
                "one's checkpoint."
            )
        _apply(tables, p, m, unknown)
        checkpoint = int(m["checkpoint"])
    if checkpoint is None:  # unreachable: the chain always starts with the base export
        raise ConfigError(f"{root}: no export to open.")
    return ServingTables(tables, checkpoint, chain)


def _manifest(path: Path) -> dict[str, Any]:
    try:
        m = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StoreFormatError(
            f"{path}: no readable manifest.json ({exc}); it is not a hierps export."
        ) from None
    if m.get("format") != EXPORT_FORMAT or m.get("format_version") != EXPORT_VERSION:
        raise StoreFormatError(
            f"{path}: manifest.json is not a hierps export of format version {EXPORT_VERSION} "
            f"(format={m.get('format')!r}, version={m.get('format_version')!r})."
        )
    return m


def _find_chain(root: Path) -> list[Path]:
    """The newest full export under ``root`` and the longest-reaching chain of deltas from it."""
    found = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        # Dot-names are exports being written (hierps.lifecycle._export writes .<name>.tmp-<pid>, then renames).
        if not p.name.startswith(".") and (p / "manifest.json").exists():
            found.append((p, _manifest(p)))
    bases = [(p, m) for p, m in found if m["since"] is None]
    if not bases:
        raise ConfigError(
            f"{root}: holds no full export (a subdirectory whose manifest.json has since null); "
            "write one with hierps export STORE OUT."
        )
    path, m = max(bases, key=lambda pm: pm[1]["checkpoint"])
    chain, at = [path], m["checkpoint"]
    while True:
        nxt = [(p, d) for p, d in found if d["since"] == at and d["checkpoint"] > at]
        if not nxt:
            return chain
        path, m = max(nxt, key=lambda pm: pm[1]["checkpoint"])
        chain.append(path)
        at = m["checkpoint"]


def _apply(tables: dict[str, _Table], path: Path, manifest: dict[str, Any], unknown: str | None) -> None:
    """Apply one export to ``tables``: delete its deleted keys, then insert or replace its rows."""
    for name, meta in manifest["tables"].items():
        dim = int(meta["dim"])
        keys, values, deleted = _read_table(path, name, dim)
        t = tables.get(name)
        if t is None:
            t = _Table(
                dim,
                np.empty(0, np.int64),
                np.empty((0, dim), np.float32),
                InitializerConfig.parse(meta["initializer"]),
                unknown or meta["unknown"],
                table_salt(int(manifest["seed"]), name),
            )
            tables[name] = t
        elif t.dim != dim:
            raise StoreFormatError(
                f"{path}: table {name!r} has dim {dim} here and {t.dim} in the exports before "
                "it; they are not exports of one store."
            )
        keep = ~np.isin(t.keys, np.concatenate([deleted, keys]))
        merged = np.concatenate([t.keys[keep], keys])
        order = np.argsort(merged, kind="stable")
        t.keys = merged[order]
        t.values = np.concatenate([t.values[keep], values])[order]


def _read_table(path: Path, name: str, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys (n,) int64, values (n, dim) float32, deleted (m,) int64) of one table of an export."""
    try:
        sub = zarr.open_group(LocalStore(str(path), read_only=True), mode="r")[name]
        if not isinstance(sub, zarr.Group):
            raise ValueError(f"{name!r} is an array, not a group")
        keys = np.asarray(_array(sub, "keys")[:], np.int64)
        values = np.asarray(_array(sub, "values")[:], np.float32)
        deleted = (
            np.asarray(_array(sub, "deleted")[:], np.int64) if "deleted" in sub else np.empty(0, np.int64)
        )
    except (KeyError, ValueError, OSError) as exc:
        raise CorruptStoreError(
            f"{path}: table {name!r} of the export cannot be read ({exc!r}); the export is "
            "incomplete or damaged. Export it again."
        ) from exc
    if values.shape != (len(keys), dim):
        raise CorruptStoreError(
            f"{path}: table {name!r} has values of shape {values.shape} for {len(keys)} keys "
            f"of dim {dim}; the export is damaged. Export it again."
        )
    return keys, values, deleted


def _array(group: zarr.Group, key: str) -> zarr.Array:
    """The array ``key`` of ``group``; KeyError when absent, ValueError when it is a group."""
    node = group[key]
    if not isinstance(node, zarr.Array):
        raise ValueError(f"{key!r} is a group, not an array")
    return node
