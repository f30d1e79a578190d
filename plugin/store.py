"""The hierarchical store: named tables of rows keyed by raw int64 ids, over three tiers.

::

    device tier   working set of the current pass (torch, cuda when present)   DeviceTier
        ▲ load pass / on demand            │ write back at end of pass
    RAM tier      bounded LRU/LFU cache, mmap-backed slabs                      MemoryTier
        ▲ read misses in sorted batches    │ evict dirty rows in batches
    SSD tier      append-only Zarr v3 segments + key index, durable checkpoints SsdTier

A row is ``[weights | optimizer state | counters]`` and moves whole between tiers (the counters:
how often and when its key was seen, see :mod:`hierps.counters`). Keys never stored get their row
from ``(seed, table, key)`` alone. Training goes through :meth:`Store.gather` (rows of a
mini-batch, tracked for gradients) and :meth:`Store.step` (one optimizer step per touched row);
:meth:`Store.checkpoint` makes everything so far durable, atomically.

The store's methods come in parts, each a base class in its own module: planning, loading and
writing back passes in :class:`hierps.passes.Passes`; the training gathers and the fused
optimizer step in :class:`hierps.training.Training`; the life of a key (admission, counters,
shrinking, export for serving) in :class:`hierps.lifecycle.LifeCycle`.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hierps import ids as _ids
from hierps._faults import fault_point
from hierps._files import write_json_atomic
from hierps.admission import PENDING_ARRAYS, PendingKeys
from hierps.batchplan import PassBatches
from hierps.checkpoint import FORMAT_VERSION, MARKER, CheckpointCatalog, check_marker, valid_table_name
from hierps.config import (
    EVICTION_POLICIES,
    AdmissionConfig,
    EvictionConfig,
    InitializerConfig,
    OptimizerConfig,
    parse_size,
)
from hierps.counters import NUM_COUNTERS, initial_counters
from hierps.errors import (
    ConfigError,
    StoreClosedError,
    StoreFormatError,
    StoreLockedError,
    TableMismatchError,
)
from hierps.initializers import initial_rows, table_salt
from hierps.lifecycle import LifeCycle
from hierps.optim import initial_state, state_width
from hierps.passes import Passes, _LastPlan, _PassPlan
from hierps.pipeline import PassPipeline
from hierps.stats import PassStats
from hierps.tiers import DeviceTier, MemoryTier, SsdTier, TableIndex
from hierps.tiers.device import DrainedRows
from hierps.training import Training, _Pending

__all__ = ["FORMAT_VERSION", "Store", "TableInfo"]


@dataclass
class TableInfo:
    """One table: its dim, optimizer, initializer, life-cycle settings and optimizer step count."""

    name: str
    dim: int
    optimizer: OptimizerConfig
    initializer: InitializerConfig
    salt: np.uint64
    step: int = 0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)

    @property
    def state_end(self) -> int:
        """Columns of weights and optimizer state; the counters follow."""
        return self.dim + state_width(self.optimizer, self.dim)

    @property
    def width(self) -> int:
        """Floats per row: weights, optimizer state, counters."""
        return self.state_end + NUM_COUNTERS

    def to_json(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "width": self.width,
            "optimizer": self.optimizer.to_json(),
            "initializer": self.initializer.to_json(),
            "step": self.step,
            "admission": self.admission.to_json(),
            "eviction": self.eviction.to_json(),
        }


class Store(Passes, Training, LifeCycle):
    """Named tables of rows keyed by raw int64 ids, kept over device, RAM and SSD tiers.

    Args:
        path: directory of the store (created if missing; reopened at its latest checkpoint).
        memory_budget: bytes (or ``"512MiB"``) of rows the RAM tier may cache.
        device_budget: bytes of rows the device tier may hold (the working set of a pass).
        device: training device; default ``cuda`` when available, else ``cpu``.
        eviction: ``"lru"`` or ``"lfu"`` for the RAM tier.
        seed: seed of the initializer of new rows.
        optimizer: default sparse optimizer of new tables (``"adagrad"``, or a dict / config).
        initializer: default initializer of new tables (``"normal"`` like ``nn.Embedding``).
        keep_checkpoints: how many checkpoints stay restorable (older ones are retired).
        max_segments: SSD segments per table before compaction merges them.
        pipeline: read the next pass ahead and write the last one back in the background
            (same parameters as without; see :mod:`hierps.pipeline`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        memory_budget: int | str = "1GiB",
        device_budget: int | str = "1GiB",
        device: str | torch.device | None = None,
        eviction: str = "lru",
        seed: int = 0,
        optimizer: Any = "adagrad",
        initializer: Any = "normal",
        keep_checkpoints: int = 3,
        max_segments: int = 16,
        pipeline: bool = True,
    ) -> None:
        self.path = Path(path)
        if eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction: expected one of {EVICTION_POLICIES}. Got {eviction!r} instead.")
        if not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints: expected an int >= 1. Got {keep_checkpoints!r} instead.")
        if not isinstance(max_segments, int) or max_segments < 2:
            raise ConfigError(f"max_segments: expected an int >= 2. Got {max_segments!r} instead.")
        self.device = torch.device(device) if device is not None else _default_device()
        self.seed = int(seed)
        self.default_optimizer = OptimizerConfig.parse(optimizer)
        self.default_initializer = InitializerConfig.parse(initializer)
        self.keep_checkpoints = keep_checkpoints
        self.max_segments = max_segments
        memory_bytes = parse_size(memory_budget, "memory_budget")
        device_bytes = parse_size(device_budget, "device_budget")
        self._lock_fd: int | None = None
        self._pipe = PassPipeline(self)
        self._open_dir()
        self.ssd = SsdTier(self.path / "segments")
        self.memory = MemoryTier(memory_bytes, self.ssd, eviction)
        self.device_tier = DeviceTier(device_bytes, self.device)
        self.catalog = CheckpointCatalog(self.path / "checkpoints")
        self.tables: dict[str, TableInfo] = {}
        self.pending_keys: dict[str, PendingKeys] = {}  # per table: counts of keys waiting for admission
        self._pending: list[_Pending] = []
        self._plan = _PassPlan()
        self._batches: PassBatches | None = None
        self._in_pass = False
        self.pipeline = bool(pipeline)
        self._announced: list[dict[str, np.ndarray]] | None = None
        self._last_plan: _LastPlan | None = None
        self.passes = 0
        self.stats = PassStats()
        self.checkpoint_id: int | None = None
        try:
            self._recover()
        except BaseException:
            self.close()  # a store that failed to open must not keep its lock
            raise

    # -- opening ------------------------------------------------------------------------------
    def _open_dir(self) -> None:
        marker = self.path / MARKER
        if self.path.exists() and not self.path.is_dir():
            raise StoreFormatError(f"{self.path}: is a file, not a hierps store directory.")
        # What a creation interrupted before its marker was committed leaves: a lock, a temp marker.
        leftovers = (
            {"LOCK"} | {p.name for p in self.path.glob(f".{MARKER}.tmp-*")} if self.path.exists() else set()
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
                check_marker(marker)
            else:
                for name in leftovers - {"LOCK"}:
                    (self.path / name).unlink(missing_ok=True)
                write_json_atomic(marker, {"format": "hierps-store", "format_version": FORMAT_VERSION})
        except BaseException:
            self.close()
            raise

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

    def _recover(self) -> None:
        """Drop what an interrupted run left behind and load the latest checkpoint."""
        self.catalog.remove_incomplete()
        latest = self.catalog.latest()
        if latest is not None:
            self._load_checkpoint(latest)
        self.ssd.collect_garbage(self.catalog.referenced_segments())
        self.ssd.next_segment = max(self.ssd.next_segment, self.ssd.max_segment_on_disk() + 1)

    # -- tables -------------------------------------------------------------------------------
    def table(
        self,
        name: str,
        dim: int,
        *,
        optimizer: Any = None,
        initializer: Any = None,
        admission: Any = None,
        eviction: Any = None,
    ) -> TableInfo:
        """Create table ``name`` with rows of ``dim`` floats, or reopen it (checking dim and optimizer).

        ``admission`` (:class:`~hierps.config.AdmissionConfig` or a mapping like ``{"min_count": 3}``)
        says when a new key gets a row; ``eviction`` (:class:`~hierps.config.EvictionConfig` or a
        mapping like ``{"ttl_passes": 30, "every_passes": 10}``) when a row is deleted. Both default
        to keeping every key; given on reopening, they replace the stored settings.
        """
        self._check_open()
        if not valid_table_name(name):
            raise ConfigError(
                f"table name: expected a non-empty name without '/' not starting with '_' "
                f"or '.'. Got {name!r} instead."
            )
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ConfigError(f"dim of table {name!r}: expected an int >= 1. Got {dim!r} instead.")
        opt = OptimizerConfig.parse(optimizer) if optimizer is not None else self.default_optimizer
        init = InitializerConfig.parse(initializer) if initializer is not None else self.default_initializer
        adm = AdmissionConfig.parse(admission) if admission is not None else None
        evict = EvictionConfig.parse(eviction) if eviction is not None else None
        info = self.tables.get(name)
        if info is not None:
            if info.dim != dim:
                raise TableMismatchError(
                    f"table {name!r}: the store holds it with dim {info.dim}, asked for dim {dim}. "
                    "Use another table name or another store directory."
                )
            if optimizer is not None and info.optimizer != opt:
                if info.optimizer.type != opt.type:
                    raise TableMismatchError(
                        f"table {name!r}: its rows carry {info.optimizer.type} state, asked for {opt.type}. "
                        "Use another table name or another store directory."
                    )
                info.optimizer = opt  # same state layout; new hyper-parameters apply from now on
            if adm is not None:
                info.admission = adm
                self.pending_keys[name].capacity = adm.max_pending
            if evict is not None:
                info.eviction = evict
            return info
        info = TableInfo(
            name,
            dim,
            opt,
            init,
            table_salt(self.seed, name),
            admission=adm or AdmissionConfig(),
            eviction=evict or EvictionConfig(),
        )
        self.tables[name] = info
        self._register(info)
        return info

    def _register(self, info: TableInfo, pending: PendingKeys | None = None) -> None:
        self.ssd.add_table(info.name, info.width)
        self.memory.add_table(info.name, info.width)
        self.device_tier.add_table(info.name, info.width)
        self.pending_keys[info.name] = (
            pending if pending is not None else PendingKeys(info.admission.max_pending)
        )

    def _info(self, table: str) -> TableInfo:
        try:
            return self.tables[table]
        except KeyError:
            raise ConfigError(f"unknown table {table!r}; the store has {sorted(self.tables)}.") from None

    # -- reading rows through the tiers -------------------------------------------------------
    def _fetch(self, table: str, keys: np.ndarray, *, touch: bool, ahead: bool = False) -> np.ndarray:
        """Rows of sorted unique ``keys`` from RAM, else SSD, else the initializer: (n, width) float32."""
        return self._fetch_many({table: keys}, touch=touch, ahead=ahead)[table]

    def _fetch_many(
        self, requests: dict[str, np.ndarray], *, touch: bool, ahead: bool = False
    ) -> dict[str, np.ndarray]:
        """:meth:`_fetch` for many tables at once: the SSD reads of all of them go out together."""
        out, hits, rests = {}, {}, {}
        with self._pipe.lock:
            for table, keys in requests.items():
                out[table] = np.empty((len(keys), self.tables[table].width), dtype=np.float32)
                hit, ram_rows = self.memory.get(table, keys, touch=touch)
                out[table][hit] = ram_rows
                hits[table], rests[table] = hit, np.flatnonzero(~hit)
            read = self.ssd.read_many({t: requests[t][rest] for t, rest in rests.items() if len(rest)})
        for table, keys in requests.items():
            info, rest = self.tables[table], rests[table]
            found, ssd_rows = read.get(table, (np.zeros(0, bool), None))
            rows = out[table]
            if len(found):
                rows[rest[found]] = ssd_rows
            new = rest[~found] if len(found) else rest
            if len(new):
                rows[new, : info.dim] = initial_rows(keys[new], info.dim, info.salt, info.initializer)
                rows[new, info.dim : info.state_end] = initial_state(info.optimizer, len(new), info.dim)
                rows[new, info.state_end :] = initial_counters(len(new), self.passes)
            if touch:
                self.stats.count_load(
                    table, ram=int(hits[table].sum()), ssd=int(found.sum()), new=len(new), ahead=ahead
                )
        return out

    def lookup(self, table: str, ids: Any) -> torch.Tensor:
        """Current weights of ``ids`` wherever they live, without gradient or side effects.

        ids: (...) integer tensor, array or list -> (..., dim) float32 on the store's device.
        """
        info = self._info(table)
        flat = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
        shape = tuple(ids.shape) if hasattr(ids, "shape") else (len(flat),)
        keys, inverse, rows = self._unique_rows(table, flat)
        weights = np.ascontiguousarray(rows[:, : info.dim])
        if info.admission.unknown_rows == "zeros" and len(keys):
            weights[~self._has_row(table, keys)] = 0.0
        return torch.from_numpy(weights[inverse]).reshape(*shape, info.dim).to(self.device)

    def read_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Weights and optimizer state of int64 ``keys``: (n, dim + state) float32 (counters: :meth:`counters`)."""
        return self._whole_rows(table, keys)[:, : self._info(table).state_end]

    def _whole_rows(self, table: str, keys: Any) -> np.ndarray:
        """Rows of int64 ``keys`` wherever they live: (n, width) float32 copy."""
        _, inverse, rows = self._unique_rows(table, _ids.as_int64_array(keys, what="keys"))
        return rows[inverse]

    def _unique_rows(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """keys (n,) int64 -> (sorted unique keys (u,), inverse (n,), their rows (u, width) float32),
        read from the device tier, else RAM, SSD or the initializer, without changing any tier."""
        self._check_open()
        self._info(table)
        self._pipe.wait_writebacks()
        uniq, inverse = np.unique(keys, return_inverse=True)
        found, slots = self.device_tier.resolve(table, torch.from_numpy(uniq).to(self.device))
        found_np = found.cpu().numpy()
        out = np.empty((len(uniq), self.tables[table].width), dtype=np.float32)
        if found_np.any():
            out[found_np] = self.device_tier.rows(table)[slots[found]].cpu().numpy()
        rest = np.flatnonzero(~found_np)
        if len(rest):
            out[rest] = self._fetch(table, uniq[rest], touch=False)
        return uniq, inverse.reshape(-1), out

    def write(self, table: str, keys: Any, weights: Any) -> None:
        """Set the weights of ``keys`` (optimizer state starts afresh), e.g. from a trained model.

        keys: (n,) unique int64; weights: (n, dim) float32 tensor or array.
        """
        self._check_open()
        info = self._info(table)
        keys = _ids.as_int64_array(keys, what="keys")
        w = weights.detach().cpu().numpy() if isinstance(weights, torch.Tensor) else np.asarray(weights)
        if w.shape != (len(keys), info.dim):
            raise ConfigError(
                f"write to {table!r}: weights of shape {w.shape} for {len(keys)} keys of "
                f"dim {info.dim}; expected {(len(keys), info.dim)}."
            )
        if len(np.unique(keys)) != len(keys):
            raise ConfigError(f"write to {table!r}: keys must be unique.")
        self._pipe.drain()
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        rows = np.concatenate(
            [
                w[order].astype(np.float32),
                initial_state(info.optimizer, len(keys), info.dim),
                initial_counters(len(keys), self.passes),
            ],
            axis=1,
        )
        self.pending_keys[table].remove(keys)
        key_t = torch.from_numpy(keys).to(self.device)
        found, slots = self.device_tier.resolve(table, key_t)
        if found.any():
            f_np = found.cpu().numpy()
            self.device_tier.rows(table)[slots[found]] = torch.from_numpy(rows[f_np]).to(self.device)
            self.device_tier.mark_dirty(table, slots[found])
            keys, rows = keys[~f_np], rows[~f_np]
        for start in range(0, len(keys), 1 << 18):
            self.memory.put(
                table, keys[start : start + (1 << 18)], rows[start : start + (1 << 18)], dirty=True
            )

    def write_rows(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """Set whole rows (weights and optimizer state), e.g. when resharding a checkpoint.

        keys: (n,) int64 unique; rows: (n, width) float32.
        """
        self._check_open()
        info = self._info(table)
        keys = _ids.as_int64_array(keys, what="keys")
        if rows.shape != (len(keys), info.width):
            raise ConfigError(
                f"write_rows to {table!r}: rows of shape {rows.shape}; expected {(len(keys), info.width)}."
            )
        self._pipe.drain()
        self.device_tier.discard(table)
        order = np.argsort(keys, kind="stable")
        keys, rows = keys[order], np.ascontiguousarray(rows[order], dtype=np.float32)
        for start in range(0, len(keys), 1 << 18):
            self.memory.put(
                table, keys[start : start + (1 << 18)], rows[start : start + (1 << 18)], dirty=True
            )

    def reset_table(self, table: str) -> None:
        """Forget every row of ``table`` in every tier (checkpoints keep theirs) and its step count."""
        self._check_open()
        info = self._info(table)
        self._pipe.drain()
        self._pending = [p for p in self._pending if p.table != table]
        self.device_tier.discard(table)
        self.memory.discard(table)
        self.ssd.load_index(table, info.width, TableIndex(), {})
        info.step = 0

    # -- durability ---------------------------------------------------------------------------
    def checkpoint(self, tag: str | None = None, extra: dict[str, Any] | None = None) -> int:
        """Make every row and optimizer state written so far durable; returns the checkpoint id.

        Atomic: a crash before it returns leaves the previous checkpoint as the latest. The
        working set stays resident. Checkpoints beyond ``keep_checkpoints`` are retired.
        ``extra`` (JSON-serialisable) is kept in the manifest, e.g. the world size of a sharded run.
        """
        self._check_open()
        self._pipe.drain()
        self._put_dirty(
            {
                t: DrainedRows(k, r, np.ones(len(k), bool))
                for t, (k, r) in self.device_tier.take_dirty().items()
            }
        )
        fault_point("checkpoint.after_device_flush")
        self.memory.flush()
        fault_point("checkpoint.after_memory_flush")
        self.ssd.sync()
        fault_point("checkpoint.after_sync")
        ckpt = (self.catalog.latest() or 0) + 1
        body = {
            "tag": tag,
            "extra": extra or {},
            "format_version": FORMAT_VERSION,
            "seed": self.seed,
            "passes": self.passes,
            "next_segment": self.ssd.next_segment,
            "tables": {
                name: {
                    **info.to_json(),
                    "rows": self.ssd.num_rows(name),
                    "segments": {str(s): self.ssd.segment_size(name, s) for _, s in self.ssd.segments(name)},
                }
                for name, info in self.tables.items()
            },
        }
        self.catalog.write(
            ckpt,
            {name: self.ssd.index[name] for name in self.tables},
            body,
            extra={name: self.pending_keys[name].arrays() for name in self.tables},
        )
        self.checkpoint_id = ckpt
        fault_point("checkpoint.after_manifest")
        for old in self.catalog.ids()[: -self.keep_checkpoints]:
            self.catalog.delete(old)
            fault_point("checkpoint.after_retire")
        self.ssd.collect_garbage(self.catalog.referenced_segments())
        return ckpt

    def restore(self, ref: int | str | None = None) -> int:
        """Return every table to a checkpoint (id, tag, or the latest), discarding newer changes."""
        self._check_open()
        ckpt = self.catalog.latest() if ref is None else self.catalog.find(ref)
        if ckpt is None:
            raise ConfigError(f"no checkpoint {ref!r} in {self.path}; it has {self.list_checkpoints()}.")
        self._pipe.drain()
        self._announced = None
        self._pending = []
        self.device_tier.discard()
        self.memory.clear()
        self._load_checkpoint(ckpt)
        return ckpt

    def _load_checkpoint(self, ckpt: int) -> None:
        manifest = self.catalog.manifest(ckpt)
        if manifest.get("format_version") != FORMAT_VERSION:
            raise StoreFormatError(
                f"{self.path}: checkpoint {ckpt} has format version {manifest.get('format_version')!r}; "
                f"this hierps reads {FORMAT_VERSION}."
            )
        for name, meta in manifest["tables"].items():
            info = TableInfo(
                name,
                int(meta["dim"]),
                OptimizerConfig.parse(meta["optimizer"]),
                InitializerConfig.parse(meta["initializer"]),
                table_salt(int(manifest["seed"]), name),
                int(meta["step"]),
                AdmissionConfig.parse(meta["admission"]),
                EvictionConfig.parse(meta["eviction"]),
            )
            if info.width != int(meta["width"]):
                raise StoreFormatError(
                    f"{self.path}: checkpoint {ckpt} table {name!r} has an inconsistent width."
                )
            self.tables[name] = info
            pending = PendingKeys.from_arrays(
                info.admission.max_pending, self.catalog.read_extra(ckpt, name, PENDING_ARRAYS)
            )
            self._register(info, pending)
            sizes = {int(s): int(n) for s, n in meta["segments"].items()}
            self.ssd.load_index(name, info.width, self.catalog.read_index(ckpt, name, sizes), sizes)
        for name in set(self.tables) - set(manifest["tables"]):  # created after that checkpoint
            self.tables[name].step = 0
            self.pending_keys[name] = PendingKeys(self.tables[name].admission.max_pending)
            self.ssd.load_index(name, self.tables[name].width, TableIndex(), {})
        self.seed = int(manifest["seed"])
        self.passes = int(manifest.get("passes", 0))
        self.memory.tick = self.passes
        self.ssd.next_segment = max(self.ssd.next_segment, int(manifest["next_segment"]))
        self.checkpoint_id = ckpt

    def list_checkpoints(self) -> list[dict[str, Any]]:
        """``[{"id", "tag", "created"}, ...]`` of the restorable checkpoints, oldest first."""
        out = []
        for ckpt in self.catalog.ids():
            m = self.catalog.manifest(ckpt)
            out.append({"id": ckpt, "tag": m.get("tag"), "created": m.get("created")})
        return out

    def flush(self) -> None:
        """Write the working set back (end of pass) without a checkpoint."""
        self._write_back()

    def close(self) -> None:
        """Release the store. Rows not covered by a checkpoint are not made durable."""
        if self._lock_fd is None:
            return
        self._pending = []
        self._batches = None  # forwards take the generic path, which refuses a closed store
        try:
            self._pipe.close()
        finally:
            if hasattr(self, "ssd"):  # (a store that failed to open may not have one yet)
                self.ssd.close()  # segment files kept open for reads
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise StoreClosedError(
                f"{self.path}: the store was closed; open it again with hierps.Store(path)."
            )

    # -- introspection ------------------------------------------------------------------------
    def num_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` per tier: ``{"device", "memory", "ssd"}`` (a row may be in several)."""
        self._pipe.drain()
        return {
            "device": self.device_tier.num_rows(table),
            "memory": self.memory.num_rows(table),
            "ssd": self.ssd.num_rows(table),
        }


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
