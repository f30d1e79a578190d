"""Read-only access to one checkpoint of a store directory, without opening the store.

Used by serving, export, inspection and resharding: it takes no lock and writes nothing, so it
may run while another process trains in the same directory. It sees a committed checkpoint, never
a half-written one: checkpoints are immutable once their manifest exists, and the manifest is
written last. The training process retires old checkpoints (``keep_checkpoints``) and then
deletes segments no kept checkpoint names, possibly while a reader uses them; it always removes
the manifest first. So the reader checks, after every read, that its manifest still exists:

- while opening the latest checkpoint, a checkpoint retired under it is skipped for the newest;
- a read of a checkpoint retired meanwhile raises :class:`CheckpointRetiredError` (rows read
  while its files were being deleted are never returned).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hierps.errors import CheckpointRetiredError, ConfigError, CorruptStoreError, StoreFormatError
from hierps.rows._counters import NUM_COUNTERS
from hierps.rows._pending import PENDING_ARRAYS
from hierps.rows._table import TableInfo
from hierps.storage._checkpoint import CheckpointCatalog
from hierps.storage._manifest import Manifest, TableEntry
from hierps.storage._marker import MARKER, check_marker
from hierps.tiers._ssd import SsdTier

__all__ = ["CheckpointReader"]

# Opening the latest checkpoint retries this many times when the trainer retires it meanwhile.
_OPEN_ATTEMPTS = 20


class CheckpointReader:
    """Rows of every table as of one checkpoint (``ref``: id, tag, or None for the latest)."""

    def __init__(self, path: str | os.PathLike[str], ref: int | str | None = None) -> None:
        self.path = Path(path)
        marker = self.path / MARKER
        if not marker.exists():
            raise StoreFormatError(f"{self.path}: is not a hierps store (no {MARKER}).")
        self.marker = check_marker(marker)
        self.catalog = CheckpointCatalog(self.path / "checkpoints", self.marker.uid)
        self.catalog.check_present(self.marker.checkpointed)
        self._ssd: SsdTier | None = None
        for _ in range(_OPEN_ATTEMPTS):
            ckpt = self.catalog.latest() if ref is None else self.catalog.find(ref)
            if ckpt is None:
                raise ConfigError(f"{self.path}: no checkpoint {ref!r}; it has ids {self.catalog.ids()}.")
            try:
                self._load(ckpt)
                self._check_alive()
                return
            except (CorruptStoreError, CheckpointRetiredError):
                if self.catalog.exists(ckpt):
                    raise  # damaged, not retired
                if ref is not None:
                    self._check_alive()  # the very checkpoint asked for is gone: say so
                # retired while we opened it: a newer one is committed, take that
        raise CheckpointRetiredError(
            f"{self.path}: the latest checkpoint was retired {_OPEN_ATTEMPTS} times while this reader opened "
            "it; the trainer checkpoints faster than it can be read. Raise keep_checkpoints."
        )

    def _load(self, ckpt: int) -> None:
        self.checkpoint_id = ckpt
        self.meta: Manifest = self.catalog.manifest(ckpt)  # checked, its format version included
        self.close()
        self._ssd = SsdTier(self.path / "segments", store_id=self.marker.uid)
        self.infos: dict[str, TableInfo] = {}
        for name, entry in self.meta.tables.items():
            try:
                info = self.infos[name] = entry.table_info(name, self.meta.seed)
            except StoreFormatError as exc:
                raise StoreFormatError(f"{self.path}: checkpoint {ckpt}: {exc}") from None
            self._ssd.load_segments(name, info.words, dict(entry.segments))

    def close(self) -> None:
        """Close the segment files this reader keeps open (also done by ``with``)."""
        if self._ssd is not None:
            self._ssd.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def ssd(self) -> SsdTier:
        """The SSD tier over the checkpoint's segments, read-only (its ``read_many`` reads rows as
        the store's does, without decoding them)."""
        if self._ssd is None:
            raise ConfigError(f"{self.path}: the reader holds no checkpoint.")
        return self._ssd

    def _check_alive(self) -> None:
        if not self.catalog.exists(self.checkpoint_id):
            latest = self.catalog.latest()
            raise CheckpointRetiredError(
                f"{self.path}: checkpoint {self.checkpoint_id} was retired by the process training this store "
                f"while this reader used it (the newest is now {latest}). Open a new CheckpointReader, or "
                "raise the trainer's keep_checkpoints so that readers have time to finish."
            )

    @property
    def manifest(self) -> dict[str, Any]:
        """The checkpoint's manifest as its JSON file holds it (typed: :attr:`meta`)."""
        return self.meta.to_json()

    @property
    def tables(self) -> dict[str, dict[str, Any]]:
        """``{name: {"dim", "width", "weights_dtype", "state_dtype", "layout", "optimizer", "initializer",
        "step", "rows", "segments", ...}}``: the manifest's table entries as JSON (typed: :meth:`entry`)."""
        return {name: entry.to_json() for name, entry in self.meta.tables.items()}

    def entry(self, table: str) -> TableEntry:
        """The manifest's entry of ``table``: rows, keys pending, segments (its settings, typed:
        ``infos[table]``)."""
        return self.meta.tables[self._check(table)]

    def keys(self, table: str) -> np.ndarray:
        """(n,) int64 sorted keys stored for ``table``: all of them in RAM (see :meth:`iter_rows`)."""
        parts = [keys for keys, _ in self.iter_rows(table)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def num_rows(self, table: str) -> int:
        """Rows stored for ``table``."""
        return self.entry(table).rows

    def scan_counters(self, table: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys (b,) int64, counters (b, NUM_COUNTERS) float32)`` over every stored row."""
        width = self.infos[self._check(table)].width
        for keys, rows in self.iter_rows(table):
            yield keys, rows[:, width - NUM_COUNTERS :]

    def pending_keys(self, table: str) -> np.ndarray:
        """(p,) int64 keys of ``table`` that were pending admission (counted, without a row)."""
        return np.asarray(self.pending(table)["pending_keys"], np.int64)

    def pending(self, table: str) -> dict[str, np.ndarray]:
        """The keys of ``table`` pending admission with their counts: the arrays of
        :data:`~hierps.rows._pending.PENDING_ARRAYS`, (p,) each."""
        return self.catalog.read_arrays(self.checkpoint_id, table, PENDING_ARRAYS, self.entry(table).pending)

    def read(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys (n,) int64 sorted unique -> (found (n,) bool, decoded rows (found.sum(), width) float32).

        Raises :class:`CheckpointRetiredError` when the checkpoint was retired during the read.
        """
        try:
            found, rows = self.ssd.read(self._check(table), np.asarray(keys, dtype=np.int64))
        except CorruptStoreError:
            self._check_alive()  # a file that vanished because the checkpoint was retired
            raise
        self._check_alive()
        return found, self.infos[table].layout.decode_np(rows)

    def iter_rows(self, table: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys (b,) int64, decoded rows (b, width) float32)`` over every stored row, by key, in
        bounded memory (a buffer per segment). Raises :class:`CheckpointRetiredError` when the
        checkpoint was retired during the scan."""
        rows_iter = self.ssd.iter_rows(self._check(table))
        while True:
            try:
                part = next(rows_iter, None)
            except CorruptStoreError:
                self._check_alive()  # a file that vanished because the checkpoint was retired
                raise
            self._check_alive()
            if part is None:
                return
            yield part[0], self.infos[table].layout.decode_np(part[1])

    def _check(self, table: str) -> str:
        if table not in self.meta.tables:
            raise ConfigError(
                f"{self.path}: checkpoint {self.checkpoint_id} has no table {table!r}; "
                f"it has {sorted(self.meta.tables)}."
            )
        return table
