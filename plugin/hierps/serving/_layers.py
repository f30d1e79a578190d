"""One served table as of one generation: its layers (the base's table, then each delta's) and how
a batch of ids is read through them.

A lookup asks every layer at once: each layer's filter and fences name the chunks that may hold an
id (of its keys, values and deleted keys), and all those chunks are read in one batch of reads
(:func:`hierps.storage._reads.read_arrays`). Then, newest layer first, an id takes the row of the
first layer that holds it; an id a newer layer deletes, or that no layer holds, reads as the
table's unknown row (the initializer's row for the key, or zeros).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hierps.config import InitializerConfig
from hierps.errors import StoreFormatError
from hierps.rows._initializers import initial_rows, table_salt
from hierps.rows._layout import as_stored
from hierps.storage._export_format import ExportManifest
from hierps.storage._export_tables import ExportTable
from hierps.storage._files import OpenFiles
from hierps.storage._reads import read_arrays

__all__ = ["ServedTable", "served_tables"]


@dataclass(frozen=True, eq=False)
class ServedTable:
    """A table over its layers, oldest (the base) first."""

    name: str
    dim: int
    initializer: InitializerConfig
    unknown: str  # "initializer" or "zeros"
    salt: np.uint64
    layers: tuple[ExportTable, ...]

    @property
    def rows(self) -> int:
        """Rows held as of the newest layer."""
        return self.layers[-1].entry.total_rows

    @property
    def ram_bytes(self) -> int:
        return sum(layer.ram_bytes for layer in self.layers)

    def read(self, ids: np.ndarray, files: OpenFiles) -> np.ndarray:
        """ids (k,) int64 sorted unique -> (k, dim) float32 rows as served."""
        probes = [layer.plan(ids) for layer in self.layers]
        requests = [req for layer, probe in zip(self.layers, probes) for req in layer.requests(probe)]
        blocks = list(read_arrays(requests, files))
        out = np.empty((len(ids), self.dim), np.float32)
        found = np.zeros(len(ids), bool)  # a row, or a deletion, in a newer layer
        has_row = np.zeros(len(ids), bool)
        for i in reversed(range(len(self.layers))):
            keys, values, deleted = blocks[3 * i : 3 * i + 3]
            held, rows, gone = self.layers[i].resolve(probes[i], keys, values, deleted)
            take = held & ~found
            out[take] = rows[take[held]]
            has_row |= take
            found |= held | gone
        unknown = np.flatnonzero(~has_row)
        if len(unknown):
            out[unknown] = self.unknown_rows(ids[unknown])
        return out

    def unknown_rows(self, ids: np.ndarray) -> np.ndarray:
        """(k,) int64 -> (k, dim) float32: what keys without a row read as (the initializer's rows at
        the precision of the store's weights, then of the export's values)."""
        if self.unknown == "zeros":
            return np.zeros((len(ids), self.dim), np.float32)
        entry = self.layers[-1].entry
        rows = as_stored(initial_rows(ids, self.dim, self.salt, self.initializer), entry.weights_dtype)
        return as_stored(rows, entry.dtype)

    def keys(self) -> np.ndarray:
        """(n,) int64 sorted: every key with a row. Reads every layer's keys: O(n) memory."""
        keys = np.empty(0, np.int64)
        for layer in self.layers:
            deleted = _concat(layer.sorted_keys("deleted"))
            keys = np.union1d(
                np.setdiff1d(keys, deleted, assume_unique=True), _concat(layer.sorted_keys("keys"))
            )
        return keys


def _concat(blocks: Iterable[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.empty(0, np.int64), *blocks])


def served_tables(
    chain: list[ExportManifest], opened: dict[Path, dict[str, ExportTable]], unknown: str | None
) -> dict[str, ServedTable]:
    """The tables of ``chain`` (base first) over the opened tables of each export (``opened[path]``)."""
    tables: dict[str, ServedTable] = {}
    for m in chain:
        for name, entry in m.tables.items():
            t = tables.get(name)
            layer = opened[m.path][name]
            if t is None:
                salt = table_salt(m.seed, name)
                t = ServedTable(name, entry.dim, entry.initializer, unknown or entry.unknown, salt, ())
            elif t.dim != entry.dim:
                raise StoreFormatError(
                    f"{m.path}: table {name!r} has dim {entry.dim} here and {t.dim} in the exports before "
                    "it; they are not exports of one store."
                )
            tables[name] = ServedTable(t.name, t.dim, t.initializer, t.unknown, t.salt, (*t.layers, layer))
    return tables
