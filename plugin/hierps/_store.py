"""The hierarchical store: named tables of rows keyed by raw int64 ids, over three tiers.

::

    device tier   working set of the current pass (torch, cuda when present)   DeviceTier
        ▲ load pass / on demand            │ write back at end of pass
    RAM tier      bounded LRU/LFU cache, mmap-backed slabs                      MemoryTier
        ▲ read misses in sorted batches    │ evict dirty rows in batches
    SSD tier      append-only Zarr v3 segments + key index, durable checkpoints SsdTier

A row is ``[weights | optimizer state | counters]`` and moves whole between tiers (the counters:
how often and when its key was seen, see :mod:`hierps.rows._counters`). Keys never stored get their row
from ``(seed, table, key)`` alone. Training goes through :meth:`Store.gather` (rows of a
mini-batch, tracked for gradients) and :meth:`Store.step` (one optimizer step per touched row);
:meth:`Store.checkpoint` makes everything so far durable, atomically.

The store is composed of parts, each an object in its own module built on the shared
:class:`~hierps._core.StoreCore` (directory, settings, tables, tiers, row reads): passes in
:class:`~hierps.training._passes.PassRunner` with the :class:`~hierps.training._pipeline.PassPipeline`;
the training gathers and the fused optimizer step in :class:`~hierps.training._trainer.SparseTrainer`;
the life of a key (admission, counters, shrinking, export for serving) in
:class:`~hierps.lifecycle._features.Features` and :class:`~hierps.lifecycle._lifecycle.FeatureLifeCycle`.
The store itself holds what spans tables and parts: tables, reads and writes of rows, checkpoints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Unpack, cast

import numpy as np
import torch

from hierps._core import StoreCore
from hierps._faults import fault_point
from hierps.config import AdmissionConfig, EvictionConfig, StoreSettings, TableSettings, TableSpec
from hierps.errors import ConfigError, TableMismatchError
from hierps.interface import Batches, run_pass
from hierps.lifecycle._features import Features
from hierps.lifecycle._lifecycle import FeatureLifeCycle
from hierps.rows import _ids
from hierps.rows._initializers import table_salt
from hierps.rows._pending import PENDING_ARRAYS, PendingKeys
from hierps.rows._table import TableInfo
from hierps.storage._checkpoint import FORMAT_VERSION, MAX_DIM, CheckpointCatalog, table_name_problem
from hierps.tiers import DeviceTier, MemoryTier, SsdTier
from hierps.tiers._device import DrainedRows
from hierps.tiers._stats import PassStats
from hierps.training._batchplan import BatchPlan
from hierps.training._passes import PassRunner
from hierps.training._pipeline import PassPipeline
from hierps.training._trainer import SparseTrainer

__all__ = ["FORMAT_VERSION", "Store", "TableInfo"]


class Store:
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
        keep_checkpoints: how many checkpoints stay restorable (older ones are retired); None:
            as many as the store kept at its latest checkpoint (3 for a new store). It is kept with
            every checkpoint, so tools that open the store with defaults retire nothing more.
        max_segments: SSD segments per table before compaction merges them.
        pipeline: read the next pass ahead and write the last one back in the background
            (same parameters as without; see :mod:`hierps.training._pipeline`).
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
        keep_checkpoints: int | None = None,
        max_segments: int = 16,
        pipeline: bool = True,
    ) -> None:
        settings = StoreSettings.parse(
            memory_budget=memory_budget,
            device_budget=device_budget,
            device=device,
            eviction=eviction,
            seed=seed,
            optimizer=optimizer,
            initializer=initializer,
            keep_checkpoints=keep_checkpoints,
            max_segments=max_segments,
            pipeline=pipeline,
        )
        self._core = core = StoreCore(path, settings, PassPipeline)
        self._pipe = pipe = cast(PassPipeline, core.pipe)
        self._features = features = Features(core)
        self._passes = passes = PassRunner(core, pipe, features)
        self._trainer = SparseTrainer(core, passes, features)
        self._life = FeatureLifeCycle(core, features, passes)
        try:
            self._recover()
        except BaseException:
            self.close()  # a store that failed to open must not keep its lock
            raise

    # -- what the parts hold ------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self._core.path

    @property
    def device(self) -> torch.device:
        return self._core.device

    @property
    def seed(self) -> int:
        return self._core.seed

    @property
    def settings(self) -> StoreSettings:
        return self._core.settings

    @property
    def pipeline(self) -> bool:
        return self._core.pipeline

    @property
    def keep_checkpoints(self) -> int:
        return self._core.keep_checkpoints

    @property
    def max_segments(self) -> int:
        return self._core.max_segments

    @property
    def tables(self) -> dict[str, TableInfo]:
        return self._core.tables

    @property
    def pending_keys(self) -> dict[str, PendingKeys]:
        return self._core.pending_keys

    @property
    def device_tier(self) -> DeviceTier:
        return self._core.device_tier

    @property
    def memory(self) -> MemoryTier:
        return self._core.memory

    @property
    def ssd(self) -> SsdTier:
        return self._core.ssd

    @property
    def catalog(self) -> CheckpointCatalog:
        return self._core.catalog

    @property
    def stats(self) -> PassStats:
        return self._core.stats

    @property
    def passes(self) -> int:
        """Passes finished so far."""
        return self._core.passes

    @passes.setter
    def passes(self, value: int) -> None:
        """Set when the rows of another store come in with their counters (the passes their keys
        were last seen in count from that store's), e.g. a checkpoint resharded into this one."""
        self._core.check_open()
        self._core.passes = int(value)
        self._core.memory.tick = self._core.passes

    @property
    def checkpoint_id(self) -> int | None:
        return self._core.checkpoint_id

    # -- passes (hierps.training._passes) -----------------------------------------------------
    def begin_pass(self, batches: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Load a pass's working set into the device tier: see :meth:`PassRunner.begin_pass`."""
        self._passes.begin_pass(batches)

    def prefetch(self, batches: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Announce the next pass, read ahead in the background: see :meth:`PassRunner.prefetch`."""
        self._passes.prefetch(batches)

    def parse_batches(self, batches: Batches) -> list[dict[str, np.ndarray]]:
        """A pass as :meth:`begin_pass` takes it -> one ``{table: (n,) int64 ids}`` per mini-batch, checked."""
        return self._passes.parse_batches(batches)

    @property
    def pass_groups(self) -> int:
        """Groups the current pass was split into to fit the device budget (1: it loaded whole; 0: none)."""
        return len(self._passes.plan.groups)

    def end_pass(self) -> None:
        """Close the pass: see :meth:`PassRunner.end_pass`."""
        self._passes.end_pass()

    def run_pass(self, batches: Batches) -> AbstractContextManager[None]:
        """``with store.run_pass(batches): ...`` = begin_pass(batches) ... end_pass()."""
        return run_pass(self, batches)

    # -- training (hierps.training._trainer) --------------------------------------------------
    def gather(
        self, table: str, keys: torch.Tensor, *, requires_grad: bool, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """keys: (U,) sorted unique int64 on the device -> (U, dim) float32: see :meth:`SparseTrainer.gather`."""
        return self._trainer.gather(table, keys, requires_grad=requires_grad, counts=counts)

    def gather_planned(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, BatchPlan] | None:
        """The gather of an announced mini-batch, or None: see :meth:`SparseTrainer.gather_planned`."""
        return self._trainer.gather_planned(table, ids)

    def fused_bag(
        self, table: str, ids: torch.Tensor, offsets: torch.Tensor, mode: str
    ) -> torch.Tensor | None:
        """Pooled bags of an announced mini-batch, or None: see :meth:`SparseTrainer.fused_bag`."""
        return self._trainer.fused_bag(table, ids, offsets, mode)

    def step(self) -> None:
        """One optimizer step per row touched since the last step: see :meth:`SparseTrainer.step`."""
        self._trainer.step()

    def apply_gradients(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        """keys (n,) int64, grads (n, dim) float32: see :meth:`SparseTrainer.apply_gradients`."""
        self._trainer.apply_gradients(table, keys, grads)

    def zero_grad(self) -> None:
        """Forget gradients gathered since the last step."""
        self._trainer.zero_grad()

    def info(self, table: str) -> TableInfo:
        """The settings of ``table``; ``ConfigError`` naming the tables when there is none."""
        return self._core.info(table)

    def resident_slots(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """keys: (U,) sorted unique int64 on the device -> their device-tier slots, loading what is
        missing (the owner's side of a sharded pass: see :meth:`PassRunner.resident_slots`)."""
        self._core.check_open()
        return self._passes.resident_slots(table, keys)

    def count_sightings(self, table: str, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """Count ``counts`` (U,) sightings into the resident rows at ``slots`` (U,): see :meth:`SparseTrainer.count_sightings`."""
        self._trainer.count_sightings(table, slots, counts)

    def apply_slot_gradients(self, updates: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """One step of each table of ``(table, slots, grads)``: see :meth:`SparseTrainer.apply_slot_gradients`."""
        self._trainer.apply_slot_gradients(updates)

    def serve_rows(self, table: str, keys: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """keys (n,) int64, repeats allowed -> (n, dim) float32: see :meth:`SparseTrainer.serve`."""
        return self._trainer.serve(table, keys, counts)

    # -- the feature life cycle (hierps.lifecycle._lifecycle) ---------------------------------
    def counters(self, table: str, keys: Any) -> dict[str, np.ndarray]:
        """Counters of int64 ``keys`` (n,) -> (n,) float32 each: see :meth:`FeatureLifeCycle.counters`."""
        return self._life.counters(table, keys)

    def has_rows(self, table: str, ids: Any) -> np.ndarray:
        """ids: (n,) int64 -> (n,) bool, True for keys that have a row in some tier."""
        return self._life.has_rows(table, ids)

    def observe(self, table: str, ids: Any, clicks: Any = None) -> None:
        """Count impressions (and clicks) of ids: see :meth:`FeatureLifeCycle.observe`."""
        self._life.observe(table, ids, clicks)

    def observe_counts(self, table: str, keys: np.ndarray, shows: np.ndarray, clicks: np.ndarray) -> None:
        """Add shows and clicks (n,) to the counters of ``keys`` (n,): see :meth:`FeatureLifeCycle.observe_counts`."""
        self._life.observe_counts(table, keys, shows, clicks)

    def shrink(
        self,
        table: str | None = None,
        *,
        ttl_passes: int | None = None,
        min_decayed_count: float | None = None,
    ) -> dict[str, int]:
        """Delete the rows eviction condemns; ``{table: rows deleted}``: see :meth:`FeatureLifeCycle.shrink`."""
        self._core.check_open()
        self._pipe.drain()
        self._trainer.check_no_pending("shrink")
        return self._life.shrink(table, ttl_passes=ttl_passes, min_decayed_count=min_decayed_count)

    def num_pending(self, table: str) -> int:
        """Keys of ``table`` counted while waiting for admission (they have no row)."""
        return self._life.num_pending(table)

    def export(
        self, path: str | os.PathLike[str], since: int | str | None = None, dtype: str = "fp32"
    ) -> dict[str, Any]:
        """Write the latest checkpoint's weights (or a delta) for serving, in ``dtype`` ("fp32" or
        "fp16"): see :meth:`FeatureLifeCycle.export`."""
        return self._life.export(path, since, dtype)

    def _recover(self) -> None:
        """Drop what an interrupted run left behind and load the latest checkpoint."""
        self._core.catalog.check_present(self._core.marker.checkpointed)  # before anything is collected
        self._core.catalog.remove_incomplete()
        latest = self._core.catalog.latest()
        if latest is not None:
            self._load_checkpoint(latest)
            if self._core.settings.keep_checkpoints is None:
                self._core.keep_checkpoints = int(self._core.catalog.manifest(latest)["keep_checkpoints"])
        self._core.ssd.collect_garbage(self._core.catalog.referenced_segments())
        self._core.ssd.next_segment = max(
            self._core.ssd.next_segment, self._core.ssd.max_segment_on_disk() + 1
        )

    # -- tables -------------------------------------------------------------------------------
    def table(
        self, name: str, dim: int, spec: TableSpec | None = None, **settings: Unpack[TableSettings]
    ) -> TableInfo:
        """Create table ``name`` with rows of ``dim`` floats, or reopen it (checking dim, optimizer
        and precisions).

        The table's settings come as a :class:`~hierps.config.TableSpec`, by keyword
        (``optimizer=``, ``initializer=``, ``admission=``, ``eviction=``, ``weights_dtype=``,
        ``state_dtype=``), or both (a keyword replaces the spec's setting); one not given (None)
        takes the store's default on creation and keeps the stored setting on reopening.

        ``optimizer`` (``"adagrad"``, or a dict / :class:`~hierps.config.OptimizerConfig`) and
        ``initializer`` default to the store's. On reopening, an optimizer of the same type replaces
        the stored hyper-parameters from now on; another type raises
        :class:`~hierps.errors.TableMismatchError` (the rows carry its state).

        ``weights_dtype`` (``"fp32"``, the default, ``"bf16"`` or ``"fp16"``) and ``state_dtype``
        (``"fp32"`` or ``"bf16"``: the per-coordinate optimizer state) are the precisions rows are
        stored in, in every tier; training computes in float32 and rounds stochastically on write
        (:mod:`hierps.rows._layout`). They are fixed when the table is created: reopening it with
        others raises :class:`~hierps.errors.TableMismatchError`.

        ``admission`` (:class:`~hierps.config.AdmissionConfig` or a mapping like ``{"min_count": 3}``)
        says when a new key gets a row; ``eviction`` (:class:`~hierps.config.EvictionConfig` or a
        mapping like ``{"ttl_passes": 30, "every_passes": 10}``) when a row is deleted. Both default
        to keeping every key; given on reopening, they replace the stored settings.

        ``ConfigError`` for a bad name, dim or setting (or an unknown keyword).
        """
        self._core.check_open()
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
        info = self._core.tables.get(name)
        if info is None:
            info = TableInfo(
                name,
                dim,
                spec.optimizer or self._core.settings.optimizer,
                spec.initializer or self._core.settings.initializer,
                table_salt(self._core.seed, name),
                admission=spec.admission or AdmissionConfig(),
                eviction=spec.eviction or EvictionConfig(),
                weights_dtype=spec.weights_dtype or "fp32",
                state_dtype=spec.state_dtype or "fp32",
            )
            self._core.tables[name] = info
            self._core.register(info)
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
            self._core.pending_keys[name].capacity = spec.admission.max_pending
        if spec.eviction is not None:
            info.eviction = spec.eviction
        return info

    def lookup(self, table: str, ids: Any) -> torch.Tensor:
        """Current weights of ``ids`` wherever they live, without gradient or side effects.

        ids: (...) integer tensor, array or list -> (..., dim) float32 on the store's device.
        """
        info = self._core.info(table)
        flat = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
        shape = tuple(ids.shape) if hasattr(ids, "shape") else (len(flat),)
        keys, inverse, rows = self._core.unique_rows(table, flat)
        weights = np.ascontiguousarray(rows[:, : info.dim])
        if info.admission.unknown_rows == "zeros" and len(keys):
            weights[~self._core.has_row(table, keys)] = 0.0
        return torch.from_numpy(weights[inverse]).reshape(*shape, info.dim).to(self._core.device)

    def read_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Weights and optimizer state of int64 ``keys``, decoded: (n, dim + state) float32 (counters:
        :meth:`counters`)."""
        return self._core.whole_rows(table, keys)[:, : self._core.info(table).state_end]

    def write(self, table: str, keys: Any, weights: Any) -> None:
        """Set the weights of ``keys`` (optimizer state starts afresh), e.g. from a trained model.

        keys: (n,) unique int64; weights: (n, dim) float32 tensor or array.
        """
        self._core.check_open()
        info = self._core.info(table)
        keys = _ids.as_int64_array(keys, what="keys")
        w = _real_array(weights, f"write to {table!r}: weights")
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
        rows = info.fresh_rows(keys, self._core.passes, w[order].astype(np.float32))
        self._core.pending_keys[table].remove(keys)
        key_t = torch.from_numpy(keys).to(self._core.device)
        found, slots = self._core.device_tier.resolve(table, key_t)
        if found.any():
            f_np = found.cpu().numpy()
            self._core.device_tier.rows(table)[slots[found]] = torch.from_numpy(rows[f_np]).to(
                self._core.device
            )
            self._core.device_tier.mark_dirty(table, slots[found])
            keys, rows = keys[~f_np], rows[~f_np]
        for start in range(0, len(keys), 1 << 16):
            self._core.memory.put(
                table, keys[start : start + (1 << 16)], rows[start : start + (1 << 16)], dirty=True
            )

    def write_rows(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """Set whole rows (weights, optimizer state, counters), e.g. when resharding a checkpoint.

        keys: (n,) int64 unique; rows: (n, width) float32 decoded rows (as
        :meth:`CheckpointReader.iter_rows` gives them), stored in the table's precisions (rounded to
        nearest: a decoded row of this table is stored back unchanged).
        """
        self._core.check_open()
        info = self._core.info(table)
        keys = _ids.as_int64_array(keys, what="keys")
        rows = _real_array(rows, f"write_rows to {table!r}: rows")
        if rows.shape != (len(keys), info.width):
            raise ConfigError(
                f"write_rows to {table!r}: rows of shape {rows.shape}; expected {(len(keys), info.width)}."
            )
        self._pipe.drain()
        self._core.device_tier.discard(table)
        order = None if _ids.strictly_increasing(keys) else np.argsort(keys, kind="stable")
        step = 1 << 18  # rows gathered (sorted) per step: the caller's array is never copied whole
        for start in range(0, len(keys), step):
            part = slice(start, start + step) if order is None else order[start : start + step]
            self._core.memory.put(
                table,
                keys[part],
                info.layout.encode_np(np.ascontiguousarray(rows[part], dtype=np.float32)),
                dirty=True,
            )

    def reset_table(self, table: str) -> None:
        """Forget every row of ``table`` in every tier (checkpoints keep theirs) and its step count."""
        self._core.check_open()
        info = self._core.info(table)
        self._pipe.drain()
        self._trainer.drop(table)
        self._core.device_tier.discard(table)
        self._core.memory.discard(table)
        self._core.ssd.reset(table)
        info.step = 0

    # -- durability ---------------------------------------------------------------------------
    def checkpoint(
        self, tag: str | None = None, extra: dict[str, Any] | None = None, *, retire: bool = True
    ) -> int:
        """Make every row and optimizer state written so far durable; returns the checkpoint id.

        Atomic: a crash before it returns leaves the previous checkpoint as the latest. The
        working set stays resident. ``tag``: a str (or None) to find the checkpoint by. ``extra``
        (a JSON object) is kept in the manifest, e.g. the world size of a sharded run. Checkpoints
        beyond ``keep_checkpoints`` are retired, unless ``retire`` is False: then they stay until
        :meth:`retire_checkpoints` (or the next checkpoint), e.g. until a caller has written what
        belongs with this checkpoint elsewhere.
        """
        self._core.check_open()
        if tag is not None and not isinstance(tag, str):
            raise ConfigError(
                f"checkpoint tag: expected a str or None. Got {tag!r} ({type(tag).__name__}); "
                f"pass str({tag!r}) to tag it, and restore it by that string."
            )
        extra = _parse_extra(extra)
        if not isinstance(retire, bool):
            raise ConfigError(f"retire: expected True or False. Got {retire!r} instead.")
        self._pipe.drain()
        self._core.put_dirty(
            {
                t: DrainedRows(k, r, np.ones(len(k), bool))
                for t, (k, r) in self._core.device_tier.take_dirty().items()
            }
        )
        fault_point("checkpoint.after_device_flush")
        self._core.memory.flush()
        fault_point("checkpoint.after_memory_flush")
        self._core.ssd.sync()
        fault_point("checkpoint.after_sync")
        ckpt = (self._core.catalog.latest() or 0) + 1
        body = {
            "tag": tag,
            "extra": extra,
            "format_version": FORMAT_VERSION,
            "seed": self._core.seed,
            "passes": self._core.passes,
            "next_segment": self._core.ssd.next_segment,
            "keep_checkpoints": self._core.keep_checkpoints,
            "tables": {
                name: {
                    **info.to_json(),
                    "rows": self._core.ssd.num_rows(name),
                    "pending": len(self._core.pending_keys[name].keys),
                    **self._core.ssd.describe(name),
                }
                for name, info in self._core.tables.items()
            },
        }
        self._core.catalog.write(
            ckpt, body, extra={name: self._core.pending_keys[name].arrays() for name in self._core.tables}
        )
        self._core.checkpoint_id = ckpt
        fault_point("checkpoint.after_manifest")
        self._core.mark_checkpointed()
        if retire:
            self.retire_checkpoints()
        return ckpt

    def retire_checkpoints(self, keep: Collection[int] | None = None) -> None:
        """Retire every checkpoint whose id is not in ``keep`` (default: the newest
        ``keep_checkpoints``) and collect their segments. The current checkpoint is always kept."""
        self._core.check_open()
        self._pipe.drain()
        ids = self._core.catalog.ids()
        kept = set(ids[-self._core.keep_checkpoints :] if keep is None else keep)
        for old in ids:
            if old not in kept and old != self._core.checkpoint_id:
                self._core.catalog.delete(old)
                fault_point("checkpoint.after_retire")
        self._core.ssd.collect_garbage(self._core.catalog.referenced_segments())

    def rollback(self, ckpt: int | None) -> None:
        """Retire every checkpoint newer than ``ckpt`` and return to ``ckpt`` (None: to an empty store,
        whose tables keep their settings and have no rows). Used when a newer checkpoint must not
        count, e.g. one rank's part of a sharded checkpoint that was never committed for all ranks."""
        self._core.check_open()
        if ckpt is not None and not self._core.catalog.exists(ckpt):
            raise ConfigError(f"no checkpoint {ckpt!r} in {self.path}; it has {self.list_checkpoints()}.")
        if ckpt is None:  # first, so that a crash below leaves a store that opens (at a newer one)
            self._core.mark_checkpointed(False)
        for newer in self._core.catalog.ids():
            if ckpt is None or newer > ckpt:
                self._core.catalog.delete(newer)
        self._reload(ckpt)

    def restore(self, ref: int | str | None = None) -> int:
        """Return every table to a checkpoint (id, tag, or the latest), discarding newer changes."""
        self._core.check_open()
        if ref is not None and (isinstance(ref, bool) or not isinstance(ref, (int, str))):
            raise ConfigError(
                f"restore: expected a checkpoint id (int), a tag (str) or None. Got {ref!r} instead."
            )
        ckpt = self._core.catalog.latest() if ref is None else self._core.catalog.find(ref)
        if ckpt is None:
            raise ConfigError(f"no checkpoint {ref!r} in {self.path}; it has {self.list_checkpoints()}.")
        self._reload(ckpt)
        return ckpt

    def _reload(self, ckpt: int | None) -> None:
        """Drop every row held in the device and RAM tiers and load checkpoint ``ckpt`` (None: none)."""
        self._pipe.drain()
        self._passes.forget_announced()
        self._trainer.drop()
        self._core.device_tier.discard()
        self._core.memory.clear()
        self._load_checkpoint(ckpt)
        self._core.ssd.collect_garbage(self._core.catalog.referenced_segments())  # the newer rows' segments

    def _load_checkpoint(self, ckpt: int | None) -> None:
        """Load checkpoint ``ckpt``; None: no checkpoint, every table empty as in a new store."""
        manifest: dict[str, Any] = {"tables": {}, "seed": self._core.seed, "next_segment": 1}
        if ckpt is not None:
            manifest = self._core.catalog.manifest(ckpt)  # checked, its format version included
            self._load_tables(ckpt, manifest)
        for name in set(self._core.tables) - set(manifest["tables"]):  # created after that checkpoint
            self._core.tables[name].step = 0
            self._core.pending_keys[name] = PendingKeys(self._core.tables[name].admission.max_pending)
            self._core.ssd.load_segments(name, self._core.tables[name].words, {})
        self._core.seed = int(manifest["seed"])
        self._core.passes = int(manifest.get("passes", 0))
        self._core.memory.tick = self._core.passes
        self._core.ssd.next_segment = max(self._core.ssd.next_segment, int(manifest["next_segment"]))
        self._core.checkpoint_id = ckpt

    def _load_tables(self, ckpt: int, manifest: dict[str, Any]) -> None:
        for name, meta in manifest["tables"].items():
            info = TableInfo.from_json(name, meta, int(manifest["seed"]))
            self._core.tables[name] = info
            pending = PendingKeys.from_arrays(
                info.admission.max_pending,
                self._core.catalog.read_extra(ckpt, name, PENDING_ARRAYS, int(meta["pending"])),
            )
            self._core.register(info, pending)
            self._core.ssd.load_segments(name, info.words, self._core.catalog.segments(ckpt, name))

    def list_checkpoints(self) -> list[dict[str, Any]]:
        """``[{"id", "tag", "created"}, ...]`` of the restorable checkpoints, oldest first."""
        out = []
        for ckpt in self._core.catalog.ids():
            m = self._core.catalog.manifest(ckpt)
            out.append({"id": ckpt, "tag": m.get("tag"), "created": m.get("created")})
        return out

    def flush(self) -> None:
        """Write the working set back (end of pass) without a checkpoint."""
        self._core.write_back()

    def close(self) -> None:
        """Release the store. Rows not covered by a checkpoint are not made durable."""
        if not self._core.is_open:
            return
        self._trainer.drop()
        self._passes.forget_batches()  # forwards take the generic path, which refuses a closed store
        try:
            self._pipe.close()
        finally:
            self._core.ssd.close()  # segment files kept open for reads
            self._core.unlock()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection ------------------------------------------------------------------------
    def num_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` per tier: ``{"device", "memory", "ssd"}`` (a row may be in several)."""
        self._pipe.drain()
        return {
            "device": self._core.device_tier.num_rows(table),
            "memory": self._core.memory.num_rows(table),
            "ssd": self._core.ssd.num_rows(table),
        }


def _parse_extra(extra: Any) -> dict[str, Any]:
    """``checkpoint(extra=)``: None or a JSON object (str keys, JSON values) -> a dict."""
    if extra is None:
        return {}
    try:
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise TypeError("not an object with str keys")
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"checkpoint extra: expected a JSON object (a dict of str keys and JSON values: str, int, "
            f"finite float, bool, None, lists and dicts of them). Got {extra!r} ({exc})."
        ) from exc
    return extra


def _real_array(data: Any, what: str) -> np.ndarray:
    """A tensor, array or nested list of real numbers -> a numpy array; ``ConfigError`` otherwise."""
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu()
        if data.is_sparse:
            data = data.to_dense()
        if data.dtype == torch.bfloat16:
            data = data.float()
    try:
        arr = np.asarray(data.numpy() if isinstance(data, torch.Tensor) else data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{what}: expected an array of real numbers. Got {type(data).__name__} ({exc})."
        ) from exc
    if arr.dtype.kind not in "iuf":
        raise ConfigError(
            f"{what}: expected an array of real numbers (float32). Got dtype {arr.dtype}; convert it first."
        )
    return arr
