"""The state every part of a store shares, and reading rows down the hierarchy.

:class:`StoreCore` holds a store's directory (opened and locked), its settings, its tables and
its three tiers, and reads rows the way the paper's hierarchy does: from the device tier, else the
RAM tier, else the SSD tier, else the initializer (a key never stored gets its row from
``(seed, table, key)`` alone). The parts of a :class:`hierps.Store` are built on it, each given
typed references to what it uses::

    StoreCore ── directory, settings, tables, tiers, row reads, write-back to RAM
      ├─ PassPipeline      (hierps.training)   background read-ahead and write-back
      ├─ Features          (hierps.lifecycle)  admission, sightings, eviction of one table
      ├─ PassRunner        (hierps.training)   passes: plan, load, write back
      ├─ SparseTrainer     (hierps.training)   gathers of a forward, the fused optimizer step
      └─ FeatureLifeCycle  (hierps.lifecycle)  counters, observe, shrink, export

Tier access from the pipeline's worker and from the training thread is serialised by the
background's ``lock`` (see :mod:`hierps.training._pipeline`).
"""

from __future__ import annotations

import fcntl
import os
import uuid
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hierps._faults import fault_point
from hierps._position import DataPositions
from hierps.config import (
    DEFAULT_KEEP_CHECKPOINTS,
    AdmissionConfig,
    EvictionConfig,
    StoreSettings,
    TableSettings,
    TableSpec,
)
from hierps.errors import (
    ConfigError,
    CorruptStoreError,
    StoreClosedError,
    StoreFormatError,
    StoreFullError,
    StoreLockedError,
    TableMismatchError,
)
from hierps.rows import _ids
from hierps.rows._initializers import table_salt
from hierps.rows._pending import PendingKeys
from hierps.rows._table import TableInfo
from hierps.storage._checkpoint import CheckpointCatalog
from hierps.storage._format import MAX_DIM
from hierps.storage._marker import MARKER, StoreMarker, check_marker, write_marker
from hierps.storage._names import table_name_problem
from hierps.tiers import DeviceTier, MemoryTier, SsdTier
from hierps.tiers._device import DrainedRows
from hierps.tiers._stats import PassStats

__all__ = ["Background", "StoreCore"]

_NO_POSITIONS = np.empty(0, np.int64)  # no row of a request left for the SSD tier


class Background(Protocol):
    """What the core needs of the pass pipeline: the tier lock, and waiting for its work."""

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    def wait_writebacks(self) -> None:
        """Block until every row on its way down reached the RAM tier."""

    def drain(self) -> None:
        """Block until every background task finished; the tiers below are then quiet."""


class StoreCore:
    """A store's directory, settings, tables and tiers; the row reads all its parts share.

    ``background`` builds the pass pipeline from the core (it reads and writes through it).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        settings: StoreSettings,
        background: Callable[[StoreCore], Background],
    ) -> None:
        self.path = Path(path)
        self.settings = settings
        self.device = torch.device(settings.device) if settings.device is not None else _default_device()
        self.seed = settings.seed
        self._lock_fd: int | None = None
        self._owner: int | None = None  # the process that took the lock
        self.marker = StoreMarker("")
        self.pipe = background(self)
        self._open_dir()
        self.ssd = SsdTier(self.path / "segments", settings.max_segments, store_id=self.marker.uid)
        self.memory = MemoryTier(settings.memory_budget, self.ssd, settings.eviction)
        self.device_tier = DeviceTier(settings.device_budget, self.device)
        self.catalog = CheckpointCatalog(self.path / "checkpoints", self.marker.uid)
        self.tables: dict[str, TableInfo] = {}
        self.pending_keys: dict[str, PendingKeys] = {}  # per table: counts of keys waiting for admission
        self.passes = 0
        self.stats = PassStats()
        self.checkpoint_id: int | None = None
        self.data = DataPositions()  # the tracked loader, and the position of the checkpoint the store is at
        # Set explicitly, or kept from the store's latest checkpoint (3 for a new store): a tool
        # opening the store with defaults retires no more than the trainer did.
        self.keep_checkpoints = settings.keep_checkpoints or DEFAULT_KEEP_CHECKPOINTS

    # -- the directory ------------------------------------------------------------------------
    def _open_dir(self) -> None:
        try:
            self._open_or_create()
        except OSError as exc:
            if isinstance(exc, StoreFullError):
                raise
            raise ConfigError(
                f"store path {str(self.path)!r}: cannot be opened or created ({exc.strerror or exc}). "
                "Point the store at a directory on a writable local file system."
            ) from exc
        except ValueError as exc:  # a NUL byte in the path
            raise ConfigError(f"store path {str(self.path)!r}: not a valid path ({exc}).") from exc

    def _open_or_create(self) -> None:
        marker = self.path / MARKER
        if self.path.exists() and not self.path.is_dir():
            raise StoreFormatError(f"{self.path}: is a file, not a hierps store directory.")
        # What a creation interrupted before its marker was committed leaves: a lock, a temp marker,
        # the empty directories of segments and checkpoints.
        leftovers = (
            {"LOCK"}
            | {p.name for p in self.path.glob(f".{MARKER}.tmp-*")}
            | {p.name for p in (self.path / "segments", self.path / "checkpoints") if _empty_dir(p)}
            if self.path.exists()
            else set()
        )
        if (
            self.path.exists()
            and not marker.exists()
            and any(p.name not in leftovers for p in self.path.iterdir())
        ):
            raise StoreFormatError(
                f"{self.path}: is not a hierps store (no {MARKER}) and is not empty. "
                "Point the store at an empty or new directory, or at an existing hierps store."
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            if marker.exists():
                self.marker = check_marker(marker)
                for tmp in self.path.glob(f".{MARKER}.tmp-*"):  # a rewrite of the marker was killed
                    tmp.unlink(missing_ok=True)
                for sub in ("segments", "checkpoints"):
                    if not (self.path / sub).is_dir():
                        raise CorruptStoreError(
                            f"{self.path / sub}: missing from the store (a partial copy, or deleted files); "
                            "nothing was changed. Copy it back (or the whole store again) and reopen it."
                        )
            else:
                for name in leftovers - {"LOCK", "segments", "checkpoints"}:
                    (self.path / name).unlink(missing_ok=True)
                for sub in ("segments", "checkpoints"):
                    (self.path / sub).mkdir(exist_ok=True)
                # The marker's rename fsyncs the directory after both were made: created is complete.
                self.marker = StoreMarker(uuid.uuid4().hex)
                write_marker(marker, self.marker)
        except BaseException:
            self.unlock()
            raise

    def mark_checkpointed(self, done: bool = True) -> None:
        """Record in the marker that a checkpoint was committed (once): from then on a store without
        any checkpoint manifest is a damaged store, never an empty one. ``done=False`` (before every
        checkpoint is deliberately retired) makes it an empty store again."""
        if self.marker.checkpointed != done:
            self.marker = StoreMarker(self.marker.uid, checkpointed=done)
            write_marker(self.path / MARKER, self.marker)

    def _lock(self) -> None:
        fd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(
                f"{self.path}: another process has this store open for writing. Close it first, or "
                "open a read-only view with hierps.serving."
            ) from None
        self._lock_fd = fd
        self._owner = os.getpid()
        _LOCKED.add(self)

    @property
    def is_open(self) -> bool:
        return self._lock_fd is not None

    def unlock(self) -> None:
        """Release the directory's lock (the store is closed from then on)."""
        _LOCKED.discard(self)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _drop_in_child(self) -> None:
        """In a forked child: close the child's copy of the lock. A ``flock`` belongs to the open file
        description, which the child shares; with the copy closed, the lock goes when the parent
        closes the store or dies, whatever the child does. The child's store is closed."""
        _LOCKED.discard(self)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def check_open(self) -> None:
        if self._lock_fd is None:
            if self._owner is not None and self._owner != os.getpid():
                raise StoreClosedError(
                    f"{self.path}: this store was opened by process {self._owner}; a forked child cannot use "
                    "it (the parent holds the writer lock). Read rows in the child with "
                    "hierps.CheckpointReader or hierps.serving, or open the store after the parent closed it."
                )
            raise StoreClosedError(
                f"{self.path}: the store was closed; open it again with hierps.Store(path)."
            )

    # -- tables -------------------------------------------------------------------------------
    def info(self, table: str) -> TableInfo:
        try:
            return self.tables[table]
        except KeyError:
            raise ConfigError(f"unknown table {table!r}; the store has {sorted(self.tables)}.") from None

    @property
    def coalesced(self) -> set[str]:
        """The tables whose gradients are summed in torch's coalesce order (:attr:`TableInfo.coalesced`)."""
        return {name for name, info in self.tables.items() if info.coalesced}

    def register(self, info: TableInfo, pending: PendingKeys | None = None) -> None:
        """Give table ``info`` its place in every tier (and its keys pending admission)."""
        self.tables[info.name] = info
        self.ssd.add_table(info.name, info.words)
        self.memory.add_table(info.name, info.words)
        self.device_tier.add_table(info.name, info.words)
        self.pending_keys[info.name] = (
            pending if pending is not None else PendingKeys(info.admission.max_pending)
        )

    def open_table(self, name: str, dim: int, spec: TableSpec | None, settings: TableSettings) -> TableInfo:
        """Create table ``name`` of ``dim`` floats per row with ``spec`` and ``settings`` (keywords
        replacing the spec's; unset settings: the store's defaults), or reopen it:
        ``TableMismatchError`` when its dim, precisions, optimizer type or initializer differ from
        the stored ones; other settings given replace the stored ones. The initializer stays: a key's
        first row comes from ``(seed, table, key)`` and the initializer alone, whichever tier or pass
        first sees it, so rows already read or trained from the old one could not match rows drawn
        from a new one."""
        self.check_open()
        problem = table_name_problem(name)
        if problem is not None:
            raise ConfigError(
                f"table name: expected {problem} (it names directories on disk). Got {name!r} instead."
            )
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_DIM:
            raise ConfigError(
                f"dim of table {name!r}: expected an int from 1 to {MAX_DIM}. Got {dim!r} instead."
            )
        spec = TableSpec.of(spec, **settings)
        info = self.tables.get(name)
        if info is None:
            info = TableInfo(
                name,
                dim,
                spec.optimizer or self.settings.optimizer,
                spec.initializer or self.settings.initializer,
                table_salt(self.seed, name),
                admission=spec.admission or AdmissionConfig(),
                eviction=spec.eviction or EvictionConfig(),
                weights_dtype=spec.weights_dtype or "fp32",
                state_dtype=spec.state_dtype or "fp32",
            )
            self.tables[name] = info
            self.register(info)
            return info
        if info.dim != dim:
            raise TableMismatchError(
                f"table {name!r}: the store holds it with dim {info.dim}, asked for dim {dim}. "
                "Use another table name or another store directory."
            )
        for what, asked, held in (
            ("weights_dtype", spec.weights_dtype, info.weights_dtype),
            ("state_dtype", spec.state_dtype, info.state_dtype),
        ):
            if asked is not None and asked != held:
                raise TableMismatchError(
                    f"table {name!r}: the store holds its rows with {what} {held!r}, asked for "
                    f"{asked!r}. Rows keep the precision they were created with: pass {held!r} "
                    "(or nothing), or use another table name or another store directory."
                )
        if spec.initializer is not None and spec.initializer != info.initializer:
            raise TableMismatchError(
                f"table {name!r}: its rows start from the initializer {info.initializer.to_json()}, asked "
                f"for {spec.initializer.to_json()}. Rows already drawn (read, trained or checkpointed) "
                "cannot follow a new initializer: pass the stored one (or none), or use another table "
                "name or another store directory."
            )
        opt = spec.optimizer
        if opt is not None and info.optimizer != opt:
            if info.optimizer.type != opt.type:
                raise TableMismatchError(
                    f"table {name!r}: its rows carry {info.optimizer.type} state, asked for {opt.type}. "
                    "Use another table name or another store directory."
                )
            info.optimizer = opt  # same state layout; new hyper-parameters apply from now on
        if spec.admission is not None:
            info.admission = spec.admission
            self.pending_keys[name].capacity = spec.admission.max_pending
        if spec.eviction is not None:
            info.eviction = spec.eviction
        return info

    def num_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` per tier: ``{"device", "memory", "ssd"}``, once the pipeline is quiet."""
        self.info(table)  # an unknown table: ConfigError naming the tables
        self.pipe.drain()
        return {
            "device": self.device_tier.num_rows(table),
            "memory": self.memory.num_rows(table),
            "ssd": self.ssd.num_rows(table),
        }

    # -- reading rows through the tiers -------------------------------------------------------
    def fetch(self, table: str, keys: np.ndarray, *, touch: bool, ahead: bool = False) -> np.ndarray:
        """Rows of sorted unique ``keys`` from RAM, else SSD, else the initializer: (n, words) stored."""
        return self.fetch_many({table: keys}, touch=touch, ahead=ahead)[table]

    def fetch_many(
        self, requests: dict[str, np.ndarray], *, touch: bool, ahead: bool = False, tick: int | None = None
    ) -> dict[str, np.ndarray]:
        """:meth:`fetch` for many tables at once: the SSD reads of all of them go out together.
        ``tick``: the RAM tier's LRU clock its touches score (see :meth:`MemoryTier.get`).

        The core walks the hierarchy: each tier answers for itself and knows no other. Writes go
        the same way, from the core down (:meth:`put_dirty`); the RAM tier's evictions reach the
        SSD tier through the sink the core gave it (:class:`hierps.tiers._memory.RowSink`).
        """
        out, hits, rests = {}, {}, {}
        with self.pipe.lock:
            for table, keys in requests.items():
                hit, ram_rows = self.memory.get(table, keys, touch=touch, tick=tick)
                hits[table] = hit
                if len(ram_rows) == len(keys):  # all in RAM: its copy is the answer
                    out[table], rests[table] = ram_rows, _NO_POSITIONS
                    continue
                out[table] = np.empty((len(keys), self.tables[table].words), dtype=np.float32)
                out[table][hit] = ram_rows
                rests[table] = np.flatnonzero(~hit)
            lacking = {t: requests[t][rest] for t, rest in rests.items() if len(rest)}
            read = self.ssd.read_many(lacking) if lacking else {}
        for table, keys in requests.items():
            info, rest = self.tables[table], rests[table]
            if not len(rest):
                if touch:
                    self.stats.count_load(table, ram=len(keys), ssd=0, new=0, ahead=ahead)
                continue
            found, ssd_rows = read.get(table, (np.zeros(0, bool), None))
            rows = out[table]
            if len(found):
                rows[rest[found]] = ssd_rows
            new = rest[~found] if len(found) else rest
            if len(new):
                rows[new] = info.fresh_rows(keys[new], self.passes)
            if touch:
                self.stats.count_load(
                    table, ram=int(hits[table].sum()), ssd=int(found.sum()), new=len(new), ahead=ahead
                )
        return out

    def unique_rows(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """keys (n,) int64 -> (sorted unique keys (u,), inverse (n,), their decoded rows (u, width)
        float32), read from the device tier, else RAM, SSD or the initializer, without changing any tier."""
        self.check_open()
        self.info(table)
        self.pipe.wait_writebacks()
        uniq, inverse = np.unique(keys, return_inverse=True)
        found, slots = self.device_tier.resolve(table, torch.from_numpy(uniq).to(self.device))
        found_np = found.cpu().numpy()
        info = self.tables[table]
        out = np.empty((len(uniq), info.words), dtype=np.float32)
        if found_np.any():
            out[found_np] = self.device_tier.rows(table)[slots[found]].cpu().numpy()
        rest = np.flatnonzero(~found_np)
        if len(rest):
            out[rest] = self.fetch(table, uniq[rest], touch=False)
        return uniq, inverse.reshape(-1), info.layout.decode_np(out)

    def whole_rows(self, table: str, keys: Any) -> np.ndarray:
        """Decoded rows of int64 ``keys`` (n,) wherever they live: (n, width) float32 copy."""
        _, inverse, rows = self.unique_rows(table, _ids.as_int64_array(keys, what="keys"))
        return rows[inverse]

    def stored(self, table: str, keys: np.ndarray) -> np.ndarray:
        """keys (n,) int64 -> (n,) bool: True where the RAM or SSD tier holds a row."""
        self.pipe.wait_writebacks()  # a row on its way down is in no tier for a moment
        with self.pipe.lock:
            found = self.memory.contains(table, keys)
            return found | self.ssd.contains(table, keys)

    def has_row(self, table: str, keys: np.ndarray) -> np.ndarray:
        """keys (n,) int64 -> (n,) bool: True where any tier holds a row."""
        found, _ = self.device_tier.resolve(table, torch.from_numpy(keys).to(self.device))
        return found.cpu().numpy() | self.stored(table, keys)

    # -- writing rows back down ---------------------------------------------------------------
    def write_back(self) -> None:
        """Empty the device tier now, dirty rows to the RAM tier."""
        self.pipe.wait_writebacks()
        with self.pipe.lock:
            self.put_dirty(self.device_tier.drain())

    def put_dirty(self, drained: dict[str, DrainedRows], tick: int | None = None) -> None:
        """Hand dirty rows that left the device tier to the RAM tier, every table even if one fails
        (``tick``: their LRU clock, see :meth:`MemoryTier.put`).

        The RAM tier keeps the rows its sink (the SSD tier) refused, over budget, so nothing is
        lost; the first error (:class:`StoreFullError` for a full disk) is raised once every
        table's rows are in RAM (a table failing otherwise does not keep the others' out either).
        """
        fault_point("pass.write_back")
        failed: Exception | None = None
        try:
            # The rows the RAM tier evicts meanwhile reach the SSD tier as one segment per table.
            with self.memory.deferred_writes():
                for table, d in drained.items():
                    if not d.dirty.any():
                        continue
                    at = np.flatnonzero(d.dirty)
                    at = at[_ids.distinct_order(d.keys[at])]  # resident rows: one per key
                    try:  # each row copied once, into the RAM tier
                        self.memory.put(table, d.keys[at], d.rows, dirty=True, tick=tick, at=at)
                    except Exception as exc:
                        failed = failed or exc
        except OSError as exc:  # the SSD tier refused evicted rows: they are in RAM again
            failed = failed or exc
        if failed is not None:
            raise failed


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


# Stores this process holds the writer lock of: a forked child drops its copies of their locks.
_LOCKED: weakref.WeakSet[StoreCore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for core in list(_LOCKED):
        core._drop_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
