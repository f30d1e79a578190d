"""The hierarchical store: named tables of rows keyed by raw int64 ids, over three tiers.

::

    device tier   working set of the current pass (torch, cuda when present)   DeviceTier
        ▲ load pass / on demand            │ write back at end of pass
    RAM tier      bounded LRU/LFU cache, mmap-backed slabs                      MemoryTier
        ▲ read misses in sorted batches    │ evict dirty rows in batches
    SSD tier      append-only Zarr v3 segments + key index, durable checkpoints SsdTier

A row is ``[weights | optimizer state | counters]`` and moves whole between tiers; a key never
stored gets its row from ``(seed, table, key)`` alone. Training goes through :meth:`Store.gather`
and :meth:`Store.step`; :meth:`Store.checkpoint` makes everything so far durable, atomically.

:class:`Store` is a façade: each method checks nothing the part behind it does not, and forwards to
one part, each an object in its own module built on the shared :class:`~hierps._core.StoreCore`
(directory, settings, tables, tiers, row reads)::

    PassRunner        hierps.training._passes    passes: plan, load, write back (PassPipeline beside)
    SparseTrainer     hierps.training._trainer   gathers of a forward, the fused optimizer step
    Features          hierps.lifecycle           admission, sightings, eviction of one table
    FeatureLifeCycle  hierps.lifecycle           counters, observe, shrink, export
    RowAccess         hierps._rows               lookups and writes of rows by key
    Checkpoints       hierps._checkpoints        checkpoint, retire, restore, rollback, recover

The parts themselves, for :mod:`hierps.sharding`, which drives them directly: :func:`store_parts`.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack, cast

import numpy as np
import torch

from hierps._checkpoints import Checkpoints
from hierps._core import StoreCore
from hierps._rows import RowAccess
from hierps.config import StoreSettings, TableSettings, TableSpec
from hierps.interface import Batches, Lookup, run_pass
from hierps.lifecycle._features import Features
from hierps.lifecycle._lifecycle import FeatureLifeCycle
from hierps.rows._table import TableInfo
from hierps.storage._format import FORMAT_VERSION
from hierps.tiers._stats import PassRecord, PassStats
from hierps.tiers._usage import StoreUsage, usage_of
from hierps.training._batchplan import BatchPlan
from hierps.training._passes import PassRunner
from hierps.training._pipeline import PassPipeline
from hierps.training._trainer import SparseTrainer

__all__ = ["FORMAT_VERSION", "Store", "StoreParts", "TableInfo", "store_parts"]


@dataclass(frozen=True)
class StoreParts:
    """The parts a :class:`Store` is made of: what :mod:`hierps.sharding` drives directly (the tiers
    through ``core``, the owner's side of a sharded pass through ``passes`` and ``trainer``). Not for
    users: the store's methods keep the parts consistent with each other."""

    core: StoreCore
    pipe: PassPipeline
    passes: PassRunner
    trainer: SparseTrainer
    life: FeatureLifeCycle
    rows: RowAccess
    checkpoints: Checkpoints


def store_parts(store: Store) -> StoreParts:
    """The parts of ``store`` (see :class:`StoreParts`)."""
    return store._parts


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
        features = Features(core)
        self._passes = passes = PassRunner(core, pipe, features)
        self._trainer = trainer = SparseTrainer(core, passes, features)
        self._life = life = FeatureLifeCycle(core, features, passes)
        self._rows = rows = RowAccess(core, pipe, trainer)
        self._checkpoints = ckpts = Checkpoints(core, pipe, passes, trainer)
        self._parts = StoreParts(core, pipe, passes, trainer, life, rows, ckpts)
        try:
            ckpts.recover()
        except BaseException:
            self.close()  # a store that failed to open must not keep its lock
            raise

    # -- what the store is --------------------------------------------------------------------
    @property
    def path(self) -> Path:
        """The store's directory."""
        return self._core.path

    @property
    def device(self) -> torch.device:
        """The training device: every gathered row lives there."""
        return self._core.device

    @property
    def seed(self) -> int:
        """The seed of the initializer: a key never stored gets its row from (seed, table, key)."""
        return self._core.seed

    @property
    def settings(self) -> StoreSettings:
        """The settings the store was opened with, checked (:class:`~hierps.config.StoreSettings`)."""
        return self._core.settings

    @property
    def pipeline(self) -> bool:
        """Whether the next pass is read ahead and the last written back in the background."""
        return self._core.settings.pipeline

    @property
    def keep_checkpoints(self) -> int:
        """How many checkpoints stay restorable (set, or kept from the latest checkpoint)."""
        return self._core.keep_checkpoints

    @property
    def max_segments(self) -> int:
        """SSD segments per table before compaction merges them."""
        return self._core.settings.max_segments

    @property
    def tables(self) -> dict[str, TableInfo]:
        """The tables by name (dim, optimizer, initializer, precisions, life-cycle settings)."""
        return self._core.tables

    @property
    def stats(self) -> PassStats:
        """Per-pass figures: ``stats.history`` holds one :class:`hierps.PassRecord` per finished pass
        (rows loaded from each tier, hit rates, SSD bytes read and written, rows and bytes per tier;
        each field documented on the record and in docs/planning.md), ``stats.last`` the newest."""
        return self._core.stats

    @property
    def passes(self) -> int:
        """Passes finished so far (the clock of the rows' counters)."""
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
        """The checkpoint the store is at (the last committed, restored or rolled back to); None: none."""
        return self._core.checkpoint_id

    def info(self, table: str) -> TableInfo:
        """The settings of ``table``; ``ConfigError`` naming the tables when there is none."""
        return self._core.info(table)

    # -- passes -------------------------------------------------------------------------------
    def begin_pass(self, batches: Batches) -> None:
        """Load a pass's working set into the device tier before its mini-batches run.

        ``batches``: ``{table: ids}`` for the whole pass, or one such mapping per mini-batch, in
        order (ids: integer tensors, arrays or lists). Given per mini-batch, each one's gathers are
        translated ahead (the fast path of the modules). A pass larger than the device budget is
        split into groups that load one after the other (:attr:`pass_groups`). With the pipeline on,
        rows announced by :meth:`prefetch` are already read, and the last pass's write-back runs on.
        """
        self._passes.begin_pass(batches)

    def prefetch(self, batches: Batches) -> None:
        """Announce the next pass (as :meth:`begin_pass` takes it): its rows are read in the
        background while this one trains, and its :meth:`begin_pass` takes them from there."""
        self._passes.prefetch(batches)

    def read_ahead(self, batches: Batches) -> None:
        """Announce mini-batches that will be evaluated, not trained (as :meth:`begin_pass` takes
        them): the rows of their ids that the device tier lacks are read in the background (from
        RAM, SSD, or the initializer's values), for their forwards under ``torch.no_grad()`` or
        ``model.eval()``. No row enters a tier and nothing is counted; a row that changes in the
        meantime is read again by its forward. ``PassLoader(..., evaluate=True)`` calls it a
        group of batches ahead."""
        self._core.check_open()
        self._trainer.read_ahead.announce(self._passes.parse_batches(batches))

    @property
    def pass_groups(self) -> int:
        """Groups the current pass was split into to fit the device budget (1: it loaded whole; 0: none)."""
        return len(self._passes.plan.groups)

    def end_pass(self) -> None:
        """Close the pass: its rows are written back to the RAM tier (in the background with the
        pipeline on), eviction runs when its schedule says so, and the pass counter advances."""
        self._passes.end_pass()

    def record_stats(self) -> PassRecord | None:
        """For a loop that announces no passes (rows loaded on demand): close a record of the steps
        since the last one, as ``end_pass`` closes a pass's (``on_demand`` True; it goes to
        :attr:`stats` and its listeners, such as DeepSpeed's monitor). None while a pass is open
        (its record comes at ``end_pass``) or when nothing happened since the last record.
        ``hierps.deepspeed`` calls it every ``steps_per_print`` steps taken outside passes (100 when unset)."""
        self._core.check_open()
        if self._passes.in_pass:
            return None
        core = self._core
        return core.stats.record_on_demand(core.ssd, core.memory, list(core.tables), core.passes)

    def run_pass(self, batches: Batches) -> AbstractContextManager[None]:
        """``with store.run_pass(batches): ...`` = begin_pass(batches) ... end_pass()."""
        return run_pass(self, batches)

    # -- training -----------------------------------------------------------------------------
    def gather(
        self, table: str, keys: torch.Tensor, *, requires_grad: bool, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of a mini-batch: keys (U,) sorted unique int64 on the device -> (U, dim) float32.

        With ``requires_grad`` the result is a leaf whose gradient :meth:`step` applies; ``counts``
        (U,) are the sightings of each key in the mini-batch (for admission and the counters).
        Rows not resident are loaded on demand.
        """
        return self._trainer.gather(table, keys, requires_grad=requires_grad, counts=counts)

    def gather_planned(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, BatchPlan] | None:
        """The gather of the next announced mini-batch of ``table`` if ``ids`` are its ids
        (translated to slots ahead, by :meth:`begin_pass`): (rows (U, dim), its plan), else None."""
        return self._trainer.gather_planned(table, ids)

    def planned_lookup(self, table: str, ids: torch.Tensor, lookup: Lookup) -> torch.Tensor | None:
        """The training forward of ``table``'s next announced mini-batch, as ``lookup`` says (an
        embedding lookup or a pooling, with the table's own offsets): its rows gathered at once with
        the other tables of the mini-batch, its ids translated ahead; None when not announced."""
        return self._trainer.planned_lookup(table, ids, lookup)

    def step(self) -> None:
        """One optimizer step per row gathered since the last step, its gradients summed first."""
        self._trainer.step()

    def apply_gradients(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step of rows ``keys`` (n,) int64 with ``grads`` (n, dim) float32, repeated
        keys summed first: for gradients computed outside a gather."""
        self._trainer.apply_gradients(table, keys, grads)

    def zero_grad(self) -> None:
        """Forget gradients gathered since the last step."""
        self._trainer.zero_grad()

    # -- the feature life cycle ---------------------------------------------------------------
    def counters(self, table: str, keys: Any) -> dict[str, np.ndarray]:
        """Counters of int64 ``keys`` (n,): ``{"count", "decayed_count", "shows", "clicks",
        "last_pass"}``, (n,) float32 each (zeros for keys never seen)."""
        return self._life.counters(table, keys)

    def has_rows(self, table: str, ids: Any) -> np.ndarray:
        """ids: (n,) int64 -> (n,) bool, True for keys that have a row in some tier."""
        return self._life.has_rows(table, ids)

    def observe(self, table: str, ids: Any, clicks: Any = None) -> None:
        """Count impressions of ``ids`` (N,) (and ``clicks`` (N,) 0/1) into their rows' show and
        click counters; keys waiting for admission are counted there."""
        self._life.observe(table, ids, clicks)

    def shrink(
        self,
        table: str | None = None,
        *,
        ttl_passes: int | None = None,
        min_decayed_count: float | None = None,
    ) -> dict[str, int]:
        """Delete the rows eviction condemns (unseen for ``ttl_passes``, or a decayed count below
        ``min_decayed_count``; default: each table's eviction settings), in ``table`` or every
        table; ``{table: rows deleted}``. A checkpoint makes the deletion durable."""
        self._core.check_open()
        self._pipe.drain()
        self._trainer.check_no_pending("shrink")
        return self._life.shrink(table, ttl_passes, min_decayed_count)

    def num_pending(self, table: str) -> int:
        """Keys of ``table`` counted while waiting for admission (they have no row)."""
        return self._life.num_pending(table)

    def export(
        self, path: str | os.PathLike[str], since: int | str | None = None, dtype: str = "fp32"
    ) -> dict[str, Any]:
        """Write the latest checkpoint's weights for serving (:mod:`hierps.serving`) to ``path``, in
        ``dtype`` ("fp32" or "fp16"); with ``since`` (a checkpoint id or tag) only the rows changed
        or deleted after it (a delta). Returns the export's manifest."""
        return self._life.export(path, since, dtype)

    # -- tables and rows ----------------------------------------------------------------------
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
        :class:`~hierps.errors.TableMismatchError` (the rows carry its state), and so does another
        initializer (a key's first row comes from it, whichever tier first sees the key).

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
        return self._core.open_table(name, dim, spec, settings)

    def lookup(self, table: str, ids: Any) -> torch.Tensor:
        """Current weights of ``ids`` wherever they live, without gradient or side effects.

        ids: (...) integer tensor, array or list -> (..., dim) float32 on the store's device. Keys
        without a row read as the initializer gives them (zeros for an admission that says so).
        """
        return self._rows.lookup(table, ids)

    def read_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Weights and optimizer state of int64 ``keys`` (n,), decoded: (n, dim + state) float32
        (counters: :meth:`counters`)."""
        return self._rows.read_rows(table, keys)

    def write(self, table: str, keys: Any, weights: Any) -> None:
        """Set the weights of ``keys`` (optimizer state starts afresh), e.g. from a trained model.

        keys: (n,) unique int64; weights: (n, dim) float32 tensor or array.
        """
        self._rows.write(table, keys, weights)

    def write_rows(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """Set whole rows (weights, optimizer state, counters), e.g. when resharding a checkpoint.

        keys: (n,) int64 unique; rows: (n, width) float32 decoded rows (as
        :meth:`CheckpointReader.iter_rows` gives them), stored in the table's precisions (rounded to
        nearest: a decoded row of this table is stored back unchanged).
        """
        self._rows.write_rows(table, keys, rows)

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
        return self._checkpoints.checkpoint(tag, extra, retire)

    def track_data(self, loader: Any) -> None:
        """Save ``loader``'s position with every checkpoint from now on (None: stop saving one).

        ``loader``: an object with ``state_dict()`` / ``load_state_dict(state)`` whose state is JSON
        values, tensors and arrays (torchdata's ``StatefulDataLoader``, :class:`hierps.PassLoader`,
        which tracks itself, :class:`hierps.online.ParquetStream`). The position goes into the
        checkpoint's manifest, atomic with its rows. Opening the store at a checkpoint, or
        :meth:`restore`, gives the saved position back to the tracked loader (one tracked later gets
        it when tracked), so that iterating it again resumes at the batch after the last one trained.
        """
        self._core.data.track(loader)

    def retire_checkpoints(self, keep: Collection[int] | None = None) -> None:
        """Retire every checkpoint whose id is not in ``keep`` (default: the newest
        ``keep_checkpoints``) and collect their segments. The current checkpoint is always kept."""
        self._checkpoints.retire(keep)

    def rollback(self, ckpt: int | None) -> None:
        """Retire every checkpoint newer than ``ckpt`` and return to ``ckpt`` (None: to an empty store,
        whose tables keep their settings and have no rows). Used when a newer checkpoint must not
        count, e.g. one rank's part of a sharded checkpoint that was never committed for all ranks."""
        self._checkpoints.rollback(ckpt)

    def restore(self, ref: int | str | None = None) -> int:
        """Return every table to a checkpoint (id, tag, or the latest), discarding newer changes;
        returns its id. ``ConfigError`` listing the checkpoints when there is no such one."""
        return self._checkpoints.restore(ref)

    def list_checkpoints(self) -> list[dict[str, Any]]:
        """``[{"id", "tag", "created"}, ...]`` of the restorable checkpoints, oldest first."""
        return self._checkpoints.list()

    def _settle_for_fork(self) -> None:
        """Let the background work of this store finish (write-back, read-ahead, removals), so that a
        process forked next (DataLoader workers) is made while its threads are idle."""
        if self._core.is_open:
            self._pipe.settle()
            self._trainer.read_ahead.settle()
            self._core.ssd.wait_removals()

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
            self._trainer.read_ahead.close()
            self._pipe.close()
        finally:
            self._core.ssd.close()  # segment files kept open for reads
            self._core.unlock()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def usage(self) -> StoreUsage:
        """Bytes and rows each tier holds now; SSD traffic and pipeline stage times since the store
        opened (:class:`~hierps.tiers.StoreUsage`). It waits for nothing: the background may be
        merging segments meanwhile (``disk_bytes`` counts the files there at the moment)."""
        core, pipe = self._core, self._pipe
        stages = (pipe.prepare_seconds, pipe.writeback_seconds, pipe.wait_seconds)
        return usage_of(core.device_tier, core.memory, core.ssd, list(core.tables), stages)

    def num_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` per tier: ``{"device", "memory", "ssd"}`` (a row may be in several)."""
        return self._core.num_rows(table)
