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

The life of a key (admission, counters, shrinking, export for serving) is in the base class,
:class:`hierps.lifecycle.LifeCycle`.
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
from hierps._tensors import joined
from hierps.admission import PENDING_ARRAYS, PendingKeys
from hierps.batchplan import Batch, BatchPlan, FusedBags, PassBatches, pool_bags
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
    NonFiniteGradientError,
    StoreClosedError,
    StoreFormatError,
    StoreLockedError,
    TableMismatchError,
)
from hierps.initializers import initial_rows, table_salt
from hierps.lifecycle import LifeCycle
from hierps.optim import apply_step, initial_state, state_width
from hierps.passes import Passes, _PassPlan
from hierps.pipeline import PassPipeline
from hierps.stats import PassStats
from hierps.tiers import DeviceTier, MemoryTier, SsdTier, TableIndex
from hierps.tiers.device import DrainedRows

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


@dataclass
class _Pending:
    """Rows one forward gathered for training: their keys, slots and the leaf holding their grad."""

    table: str
    keys: torch.Tensor  # (R,) int64, sorted unique: the keys that have rows
    slots: torch.Tensor  # (R,) int64, valid while generation matches
    generation: int
    leaf: torch.Tensor  # (U, dim) requires_grad
    rows: torch.Tensor | slice | None = None  # (R,) positions of keys in the leaf; None: all of it


class Store(Passes, LifeCycle):
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
        self._last_plan: tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]] | None = None
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
        info = self.tables[table]
        out = np.empty((len(keys), info.width), dtype=np.float32)
        with self._pipe.lock:
            hit, ram_rows = self.memory.get(table, keys, touch=touch)
            out[hit] = ram_rows
            rest = np.flatnonzero(~hit)
            found, ssd_rows = self.ssd.read(table, keys[rest])
        out[rest[found]] = ssd_rows
        new = rest[~found]
        if len(new):
            out[new, : info.dim] = initial_rows(keys[new], info.dim, info.salt, info.initializer)
            out[new, info.dim : info.state_end] = initial_state(info.optimizer, len(new), info.dim)
            out[new, info.state_end :] = initial_counters(len(new), self.passes)
        if touch:
            self.stats.count_load(table, ram=int(hit.sum()), ssd=int(found.sum()), new=len(new), ahead=ahead)
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

    # -- training -----------------------------------------------------------------------------
    def gather_planned(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, BatchPlan] | None:
        """The training gather of an announced mini-batch, or None when ``ids`` are not the next one.

        ids: (...) int64 on the store's device. When they equal ``table``'s next mini-batch of the
        current pass (see :mod:`hierps.batchplan`), returns the leaf of its distinct rows' weights
        (U, dim) float32, as :meth:`gather` with ``requires_grad``, and the plan (``local`` ids,
        ``keys``): their translation was done ahead, so no sort or search runs here.
        """
        batches = self._batches
        if batches is None:
            return None
        plan = batches.match(table, ids, self.device_tier.generation)
        if plan is None:
            return None
        info = self.tables[table]
        tier = self.device_tier
        tier.defer_seen(table, plan.slots, plan.counts, info.state_end, self.passes, info.eviction.decay)
        weights = tier.weights(table, plan.slots, info.dim).requires_grad_(True)
        self._pending.append(_Pending(table, plan.keys, plan.slots, tier.generation, weights))
        return weights, plan

    def fused_bag(
        self, table: str, ids: torch.Tensor, offsets: torch.Tensor, mode: str
    ) -> torch.Tensor | None:
        """``table``'s pooled output of an announced mini-batch, pooled with its other tables, or None.

        ids: (n,) int64, offsets: (B,) int64 (``include_last_offset`` False), mode ``"sum"`` or
        ``"mean"``, no per-sample weights or padding. At the first such forward of a mini-batch,
        the rows of all its tables of this table's width and dim are gathered into one leaf and
        pooled by one ``embedding_bag`` with these offsets (see :class:`hierps.batchplan.FusedBags`);
        each table's forward then returns its piece: the same floats as pooling table by table.
        None when ``ids`` are not the announced ones or the tables do not pool alike.
        """
        batches = self._batches
        if batches is None or not batches.fuse:
            return None
        found = batches.next_plan(table, ids, self.device_tier.generation)
        if found is None:
            return None
        k, plan = found
        info = self.tables[table]
        tier = self.device_tier
        group = (k, id(tier.arena(table)), info.dim)
        fused = batches.fused.get(group)
        if fused is None:
            fused = batches.fused[group] = self._fuse(batches.batches[k], table, offsets, mode)
        if (
            table not in fused.rows
            or table in fused.used
            or mode != fused.mode
            or not (offsets is fused.offsets or torch.equal(offsets, fused.offsets))
        ):
            batches.fuse = False  # this model's tables pool differently: gather them one by one
            return None
        fused.used.add(table)
        batches.cursor[table] = k + 1
        tier.defer_seen(table, plan.slots, plan.counts, info.state_end, self.passes, info.eviction.decay)
        self._pending.append(
            _Pending(table, plan.keys, plan.slots, tier.generation, fused.leaf, fused.rows[table])
        )
        return fused.pieces[table]

    def _fuse(self, batch: Batch, table: str, offsets: torch.Tensor, mode: str) -> FusedBags:
        """Gather and pool in one go the tables of ``batch`` that share ``table``'s arena and dim."""
        tier, dim = self.device_tier, self.tables[table].dim
        arena = tier.arena(table)
        members = [t for t in batch.plans if tier.arena(t) is arena and self.tables[t].dim == dim]
        plans = [batch.plans[t] for t in members]
        if len(members) == len(batch.plans):
            slots, local = batch.slots, batch.local
        else:
            starts = np.cumsum([0, *[p.keys.numel() for p in plans[:-1]]]).tolist()
            slots = torch.cat([p.slots for p in plans])
            local = torch.cat([p.local + s for p, s in zip(plans, starts)])
        ends = np.cumsum([p.ids.numel() for p in plans]).tolist()
        bags = torch.cat([offsets] + [offsets + e for e in ends[:-1]])
        leaf = arena.rows[:, :dim].index_select(0, slots).requires_grad_(True)
        rows, at = {}, 0
        for t, p in zip(members, plans):
            rows[t] = slice(at, at + p.keys.numel())
            at += p.keys.numel()
        parts = [(p.local, p.keys.numel()) for p in plans]
        pieces = dict(zip(members, pool_bags(leaf, local, bags, mode, offsets.numel(), parts)))
        return FusedBags(leaf, rows, pieces, offsets, mode)

    def gather(
        self, table: str, keys: torch.Tensor, *, requires_grad: bool, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Weights of a mini-batch's rows for a forward pass.

        keys: (U,) sorted unique int64 on the store's device -> (U, dim) float32. With
        ``requires_grad`` (training) the result is a leaf whose gradient :meth:`step` applies to
        the rows, and the keys count as seen: ``counts`` (U,) integer, how often each key occurs
        in the mini-batch (default once each), goes into the rows' counters and drives admission.
        Keys not admitted yet read as the initializer's row (or zeros) and their gradient is dropped.
        """
        self._check_open()
        info = self._info(table)
        if info.admission.filters:
            return self._gather_filtered(info, keys, requires_grad, counts)
        slots = self._resident_slots(table, keys)
        if requires_grad:
            self._count_seen(info, slots, counts)
        weights = self.device_tier.weights(table, slots, info.dim)
        if requires_grad:
            weights.requires_grad_(True)
            self._pending.append(_Pending(table, keys, slots, self.device_tier.generation, weights))
        return weights

    def _gather_filtered(
        self, info: TableInfo, keys: torch.Tensor, requires_grad: bool, counts: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`gather` for a table with admission: rows only for keys that have or earn one."""
        table = info.name
        keys_np = keys.cpu().numpy()
        n_seen = (
            counts.cpu().numpy().astype(np.int64) if counts is not None else np.ones(len(keys_np), np.int64)
        )
        has = self._has_row(table, keys_np)
        prior = np.zeros(len(keys_np), np.int64)
        if requires_grad:
            new, prior = self._admit(info, keys_np, n_seen, ~has)
            has |= new
        weights = torch.empty((len(keys_np), info.dim), dtype=torch.float32, device=self.device)
        if not has.all():
            out = np.flatnonzero(~has)
            weights[torch.from_numpy(out).to(self.device)] = torch.from_numpy(
                self._unadmitted_weights(info, keys_np[out])
            ).to(self.device)
        at = torch.from_numpy(np.flatnonzero(has)).to(self.device)
        sub, slots = keys[at], at
        if len(at):
            slots = self._resident_slots(table, sub)
            if requires_grad:
                seen = torch.from_numpy((n_seen + prior)[has].astype(np.float32)).to(self.device)
                self._count_seen(info, slots, seen)
            weights[at] = self.device_tier.rows(table)[slots, : info.dim]
        if requires_grad:
            weights.requires_grad_(True)
            # Recorded even without rows: the table's step count (Adam's bias correction) then
            # advances as in an unfiltered run, so admitted rows train as unfiltered rows do.
            self._pending.append(_Pending(table, sub, slots, self.device_tier.generation, weights, rows=at))
        return weights

    def step(self) -> None:
        """One optimizer step for every row touched since the last step (gradients summed per row).

        Tables of one row width, optimizer and step count are updated together: one gather, one
        optimizer call and one scatter for all of them. Raises :class:`NonFiniteGradientError`
        before changing any row when a gradient is NaN/inf.
        """
        self._check_open()
        pending = [p for p in self._pending if p.leaf.grad is not None]
        self._pending = []
        if not pending:
            return
        leaves = list({id(p.leaf): p.leaf for p in pending}.values())  # fused tables share a leaf
        summed = dict(zip(map(id, leaves), _summed_grads(leaves)))
        grads = [summed[id(p.leaf)] for p in pending]
        if not _all_finite(_distinct_buffers(list(summed.values()))):
            own = [g[p.rows] if isinstance(p.rows, slice) else g for p, g in zip(pending, grads)]
            bad = sorted({p.table for p, g in zip(pending, own) if not bool(torch.isfinite(g).all())})
            raise NonFiniteGradientError(
                f"NaN or inf gradient for table(s) {bad}; the step was skipped and no row changed. "
                "Lower the learning rate, clip gradients, or check the inputs of this mini-batch."
            )
        grads = [g if p.rows is None else g[p.rows] for p, g in zip(pending, grads)]
        by_table: dict[str, list[tuple[_Pending, torch.Tensor]]] = {}
        for p, g in zip(pending, grads):
            by_table.setdefault(p.table, []).append((p, g))
        fused: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for table, items in by_table.items():
            first = items[0][0]
            if len(items) == 1 and first.generation == self.device_tier.generation:
                self.tables[table].step += 1
                if first.keys.numel():
                    fused.append((table, first.slots, items[0][1]))  # the common case: slots still valid
            else:
                self.apply_gradients(
                    table, torch.cat([p.keys for p, _ in items]), torch.cat([g for _, g in items])
                )
        self._apply_steps(fused)
        self.device_tier.flush_seen()
        fault_point("store.step")

    def apply_gradients(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step for each distinct key, its gradients summed first.

        keys: (n,) int64 on the store's device, repeats allowed; grads: (n, dim) float32. The
        table's step count advances even when no key has a row yet (admission pending).
        """
        info = self._info(table)
        info.step += 1
        if keys.numel() == 0:
            return
        uniq, inverse = torch.unique(keys, return_inverse=True)
        summed = torch.zeros((uniq.numel(), info.dim), dtype=torch.float32, device=self.device)
        summed.index_add_(0, inverse, grads)
        self._apply_step(table, self._resident_slots(table, uniq), summed)

    def _apply_step(self, table: str, slots: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply the table's optimizer (its step count already advanced) to resident ``slots``."""
        self._apply_steps([(table, slots, grad)])

    def _apply_steps(self, updates: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Apply each table's optimizer (step counts already advanced) to ``(table, slots, grads)``.

        Tables sharing a device-tier arena, optimizer, dim and step count go through one gather,
        one :func:`~hierps.optim.apply_step` and one scatter: the same arithmetic row by row.
        """
        groups: list[tuple[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for table, slots, grad in updates:
            info = self.tables[table]
            key = (self.device_tier.arena(table), info.optimizer, info.dim, info.step)
            for k, items in groups:
                if k[0] is key[0] and k[1:] == key[1:]:
                    items.append((slots, grad))
                    break
            else:
                groups.append((key, [(slots, grad)]))
        for (arena, opt, _, step), items in groups:
            slots = joined([s for s, _ in items])
            grad = joined([g for _, g in items])
            rows = arena.rows.index_select(0, slots)
            apply_step(opt, rows, grad, step)
            arena.rows.index_copy_(0, slots, rows)
            arena.dirty.index_fill_(0, slots, True)

    def zero_grad(self) -> None:
        """Forget gradients gathered since the last step."""
        self._pending = []

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
        try:
            self._pipe.close()
        finally:
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


def _summed_grads(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of gathered leaves as dense (U_i, dim_i) tensors, duplicates summed.

    Sparse gradients of one dim are summed by one ``index_add_`` into one buffer, of which the
    results are views (see :func:`_distinct_buffers`).
    """
    out: list[torch.Tensor | None] = [None] * len(leaves)
    by_dim: dict[int, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf.grad.is_sparse:
            by_dim.setdefault(leaf.shape[1], []).append(i)
        else:
            out[i] = leaf.grad.detach()
    for dim, idx in by_dim.items():
        sizes = [leaves[i].shape[0] for i in idx]
        grads = [leaves[i].grad for i in idx]
        total = torch.zeros((sum(sizes), dim), dtype=grads[0].dtype, device=grads[0].device)
        for i, g, part in zip(idx, grads, total.split(sizes)):
            out[i] = part.index_add_(0, g._indices()[0], g._values())
    return out  # type: ignore[return-value]


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN or inf in ``tensors``: one sum each (NaN and inf survive a sum), checked exactly
    only when a sum is not finite (it may have overflowed)."""
    if bool(torch.stack([t.sum() for t in tensors]).isfinite().all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _distinct_buffers(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors holding ``grads``: each view's base once, the others as they are."""
    seen: dict[int, torch.Tensor] = {}
    for g in grads:
        base = g._base if g._base is not None else g
        seen.setdefault(id(base), base)
    return list(seen.values())


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
