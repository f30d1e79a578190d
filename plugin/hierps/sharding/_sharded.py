"""The store sharded over ranks: every key has one owner rank; rows and gradients travel by all-to-all.

Each rank keeps a :class:`~hierps._store.Store` of the rows it owns under ``<path>/rank-NNNNN``.
Per pass, ranks send their pass's distinct keys to the owners, which load them into their device
tier. Per mini-batch, rows travel from owners to the ranks that need them; at the step, gradients
travel back, each owner sums a row's gradients from all ranks and takes one optimizer step. Sparse
gradients are divided by the world size, as dense gradients are averaged, so W ranks on W slices
of a global batch give the parameters of 1 rank on the whole batch.

All methods that move data are collective: every rank calls them in the same order (the model's
forward does that naturally).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Unpack

import numpy as np
import torch

from hierps._store import Store, store_parts
from hierps.config import TableSettings, TableSpec
from hierps.errors import ConfigError, NonFiniteGradientError
from hierps.interface import Batches, Lookup, run_pass
from hierps.lifecycle._lifecycle import observation
from hierps.rows import _ids
from hierps.rows._counters import COUNTERS
from hierps.rows._table import TableInfo
from hierps.sharding._commits import OneRank, ShardCheckpoints, rank_dir
from hierps.sharding._export import export_sharded
from hierps.sharding._fastpath import Fetched, PassRouter
from hierps.sharding._local import OwnerParts
from hierps.sharding._routes import owner_of
from hierps.training._batchplan import index_add_rows
from hierps.training._trainer import summed_grads

__all__ = ["ShardedStore", "Transport", "owner_of", "rank_dir"]


class Transport(Protocol):
    """The collectives hierps needs; implemented over torch.distributed and over Horovod.

    A transport may also offer ``companion() -> Transport``: a second channel over the same ranks
    (collective to create), on which passes are routed by a worker thread while training goes on.
    Without one, a pass is routed when it is announced, on the calling thread.
    """

    rank: int
    world_size: int

    def all_to_all(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Rows of ``send`` grouped by destination rank -> rows received, grouped by source rank."""
        ...

    def all_to_all_known(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Like :meth:`all_to_all` when the receive counts are already known (no count exchange)."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def barrier(self) -> None: ...


@dataclass
class _Route:
    """Where a rank's keys went: the permutation that grouped them by owner, and the counts."""

    order: torch.Tensor  # (U,) positions of keys, grouped by owner
    send_counts: list[int]
    recv_counts: list[int]


@dataclass
class _ShardPending:
    table: str
    keys: torch.Tensor  # (U,) sorted unique int64, on the store device
    leaf: torch.Tensor  # (U, dim)


class ShardedStore:
    """A :class:`Store` per rank, keys sharded by :func:`owner_of`, over a :class:`Transport`.

    Offers what the modules use (``table``, ``gather``, ``step``, ``lookup``, ``write``, passes,
    checkpoints) so ``hierps.EmbeddingBag(..., store=sharded)`` works unchanged.

    Opening is collective: every rank opens at the latest checkpoint committed for all ranks; one
    written by another number of ranks is resharded into this world size as it opens.
    """

    def __init__(self, path: str | os.PathLike[str], transport: Transport, **store_kwargs: Any) -> None:
        self.root = Path(path)
        # A world of one rank needs no collective: what is sent comes back as it is.
        self.transport: Transport = transport if transport.world_size > 1 else OneRank()
        self.rank, self.world_size = transport.rank, transport.world_size
        # Every rank at the latest checkpoint, resharded if need be (agreed before the store opens).
        self.checkpoints = ShardCheckpoints.open(
            self.root, self.transport, owner_of, lambda: Store(rank_dir(self.root, self.rank), **store_kwargs)
        )
        self.local = self.checkpoints.local
        self._parts: OwnerParts = store_parts(self.local)
        self.device = self.local.device
        self._pending: list[_ShardPending | Fetched] = []
        self._passes = PassRouter(self.local, self.transport, self._pending_append)
        self._bytes_sent = 0
        self.rows_fetched = 0  # distinct rows this rank fetched key by key for its mini-batches

    def _pending_append(self, fetched: Fetched) -> None:
        self._pending.append(fetched)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent to other ranks by all-to-all: keys, rows, gradients, routing."""
        return self._bytes_sent + self._passes.bytes_sent

    def _sent(self, t: torch.Tensor, counts: list[int]) -> None:
        per_row = t[0].numel() * t.element_size() if t.numel() else 0
        self._bytes_sent += per_row * (sum(counts) - counts[self.rank])

    # -- what modules need from a store --------------------------------------------------------
    @property
    def tables(self) -> dict[str, TableInfo]:
        """The tables by name (the same on every rank): dim, optimizer, precisions, life-cycle settings."""
        return self.local.tables

    @property
    def path(self) -> Path:
        """The root directory: each rank's store is its ``rank-NNNNN`` below it."""
        return self.root

    @property
    def keep_checkpoints(self) -> int:
        """How many checkpoints (of all ranks together) stay restorable."""
        return self.local.keep_checkpoints

    def table(
        self, name: str, dim: int, spec: TableSpec | None = None, **settings: Unpack[TableSettings]
    ) -> TableInfo:
        """Create or reopen table ``name`` on every rank, with the settings of ``spec`` and / or the
        keywords (see :meth:`hierps.Store.table`)."""
        return self.local.table(name, dim, TableSpec.of(spec, **settings))

    def write(self, table: str, keys: Any, weights: Any) -> None:
        """Set weights of ``keys``; every rank passes the same keys and keeps those it owns."""
        keys = _ids.as_int64_array(keys, what="keys")
        w = weights.detach().cpu().numpy() if isinstance(weights, torch.Tensor) else np.asarray(weights)
        dim = self.local.info(table).dim
        if w.shape != (len(keys), dim):
            raise ConfigError(
                f"write to {table!r}: weights of shape {w.shape} for {len(keys)} keys of "
                f"dim {dim}; expected {(len(keys), dim)}."
            )
        mine = owner_of(keys, self.world_size) == self.rank
        self.local.write(table, keys[mine], w[mine])

    # -- routing -------------------------------------------------------------------------------
    def _route(self, keys: torch.Tensor) -> tuple[_Route, torch.Tensor]:
        """Send sorted unique keys to their owners -> (route, keys this rank owns, grouped by source)."""
        owners = torch.from_numpy(owner_of(keys.cpu().numpy(), self.world_size))
        order = torch.argsort(owners, stable=True).to(keys.device)
        send_counts = torch.bincount(owners, minlength=self.world_size).tolist()
        self._sent(keys[order], send_counts)
        received, recv_counts = self.transport.all_to_all(keys[order], send_counts)
        return _Route(order, send_counts, recv_counts), received.to(self.device)

    def _return_rows(self, rows: torch.Tensor, route: _Route) -> torch.Tensor:
        """Rows an owner looked up for the keys it was sent -> the asking rank's rows, in its key order."""
        got = self.transport.all_to_all_known(rows, route.recv_counts, route.send_counts).to(self.device)
        weights = torch.empty_like(got)
        weights[route.order] = got
        return weights

    def gather_planned(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
        """An announced mini-batch's rows as a leaf, fetched without keys, or None (collective at
        the first table of a mini-batch; see :mod:`hierps.sharding._fastpath`)."""
        return self._passes.gather_planned(table, ids)

    def planned_lookup(self, table: str, ids: torch.Tensor, lookup: Lookup) -> torch.Tensor | None:
        """Bags of one offsets tensor shared by the tables of an announced mini-batch (sum or mean,
        no weights or padding), pooled with its other tables, or None: the module then gathers
        (collective at the first table of a mini-batch; see :mod:`hierps.sharding._fastpath`)."""
        if (
            lookup.mode not in ("sum", "mean")
            or lookup.offsets is None
            or lookup.per_sample_weights is not None
            or lookup.padding_idx is not None
            or lookup.include_last_offset
        ):
            return None
        return self._passes.fused_bag(table, ids, lookup.offsets, lookup.mode)

    def gather(
        self, table: str, keys: torch.Tensor, *, requires_grad: bool, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """keys: (U,) sorted unique int64 -> (U, dim) weights fetched from their owners (collective).

        counts: (U,) sightings of each key in the mini-batch (default 1), counted when training.
        """
        route, asked = self._route(keys)
        seen = None
        if requires_grad:
            mine = counts if counts is not None else torch.ones(keys.numel(), device=keys.device)
            seen = self.transport.all_to_all_known(
                mine.to(torch.float32)[route.order], route.send_counts, route.recv_counts
            ).to(self.device)
        rows = self._parts.trainer.serve(table, asked, seen)
        self._sent(rows, route.recv_counts)
        self.rows_fetched += keys.numel()
        weights = self._return_rows(rows, route)
        if requires_grad:
            weights.requires_grad_(True)
            self._pending.append(_ShardPending(table, keys, weights))
        return weights

    def lookup(self, table: str, ids: Any) -> torch.Tensor:
        """Current weights of ``ids`` from their owners (collective): (..., dim) float32."""
        flat = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
        shape = tuple(ids.shape) if hasattr(ids, "shape") else (len(flat),)
        keys, inverse = np.unique(flat, return_inverse=True)
        key_t = torch.from_numpy(keys).to(self.device)
        route, asked = self._route(key_t)
        asked_np = asked.cpu().numpy()
        rows = (
            self.local.lookup(table, asked_np)
            if len(asked_np)
            else torch.empty((0, self.local.tables[table].dim), device=self.device)
        )
        weights = self._return_rows(rows, route)
        return weights[torch.from_numpy(inverse.reshape(-1)).to(self.device)].reshape(*shape, -1)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> None:
        """One optimizer step per touched row, gradients of all ranks summed at its owner (collective)."""
        self._passes.poll()
        pending, self._pending = self._pending, []
        keyed = [p for p in pending if isinstance(p, _ShardPending) and p.leaf.grad is not None]
        fetched = [p for p in pending if isinstance(p, Fetched)]
        names = sorted(self.local.tables)
        grads: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in names}
        for p, g in zip(keyed, summed_grads([p.leaf for p in keyed])):
            grads[p.table].append((p.keys, g))
        fast_grads, fast_tables, finite = self._passes.gradients(fetched)
        # One small all-reduce: non-finite gradients anywhere, and which tables stepped anywhere
        # (key by key; on the fast path).
        n = len(names)
        flags = torch.zeros(1 + 2 * n, dtype=torch.float64)
        flags[0] = float(not finite)
        for i, name in enumerate(names):
            for _, g in grads[name]:
                flags[0] += float(not bool(torch.isfinite(g).all()))
                flags[1 + i] = 1.0
            flags[1 + n + i] = float(name in fast_tables)
        flags = self.transport.all_reduce_sum(flags)
        if flags[0] > 0:
            raise NonFiniteGradientError(
                "NaN or inf gradient on some rank; the step was skipped on every rank and no row changed. "
                "Lower the learning rate, clip gradients, or check the inputs of this mini-batch."
            )
        fast = self._passes.send_back(
            fetched, fast_grads, {name for i, name in enumerate(names) if flags[1 + n + i] > 0}
        )
        routed = {
            name: self._routed_grads(name, grads[name]) for i, name in enumerate(names) if flags[1 + i] > 0
        }
        rest = self._passes.apply(fast, by_keys=set(routed))
        for i, name in enumerate(names):
            if (name in fast and name not in rest) or (flags[1 + i] == 0 and flags[1 + n + i] == 0):
                continue  # stepped by slots above, or not at all
            parts = [p for p in (routed.get(name), rest.get(name)) if p is not None]
            dim = self.local.tables[name].dim
            keys = torch.cat([k for k, _ in parts]) if parts else torch.empty(0, dtype=torch.int64)
            grad = torch.cat([g for _, g in parts]) if parts else torch.empty((0, dim))
            self.local.apply_gradients(name, keys.to(self.device), grad.to(self.device))

    def _routed_grads(
        self, name: str, grads: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A table's key-by-key gradients, summed per key, to their owners (collective) -> what this
        rank owns: (keys, gradients divided by the world size)."""
        dim = self.local.tables[name].dim
        if grads:
            keys = torch.cat([k for k, _ in grads])
            grad = torch.cat([g for _, g in grads])
            keys, inverse = torch.unique(keys, return_inverse=True)
            grad = index_add_rows(torch.zeros((keys.numel(), dim), device=self.device), inverse, grad)
        else:
            keys = torch.empty(0, dtype=torch.int64, device=self.device)
            grad = torch.empty((0, dim), device=self.device)
        route, owned = self._route(keys)
        self._sent(grad, route.send_counts)
        owned_grads = self.transport.all_to_all_known(
            grad[route.order] * (1.0 / self.world_size), route.send_counts, route.recv_counts
        ).to(self.device)
        if self.local.tables[name].admission.filters and owned.numel():
            # Keys still pending admission have no row: their gradient is dropped, as in one process.
            has = torch.from_numpy(self.local.has_rows(name, owned.cpu().numpy())).to(self.device)
            owned, owned_grads = owned[has], owned_grads[has]
        return owned, owned_grads

    def zero_grad(self) -> None:
        """Forget what was gathered since the last step (on this rank)."""
        self._pending = []

    # -- passes --------------------------------------------------------------------------------
    def begin_pass(self, batches: Any) -> None:
        """Owners load the union of every rank's pass keys (collective); with one dict per mini-batch,
        in order, those mini-batches take the fast path (see :mod:`hierps.sharding._fastpath`)."""
        self._passes.begin_pass(self._parts.passes.parse_batches(batches))

    def _settle_for_fork(self) -> None:
        """The local store's :meth:`hierps.Store._settle_for_fork` (routing is idle between passes)."""
        self.local._settle_for_fork()

    def prefetch(self, batches: Any) -> None:
        """Announce the next pass (collective): routed in the background, read ahead by its owners."""
        self._passes.prefetch(self._parts.passes.parse_batches(batches))

    def end_pass(self) -> None:
        """Close the pass on every rank: each owner writes its rows back (collective). ``ConfigError``
        when no pass is open (see :meth:`hierps.Store.end_pass`), before anything changes."""
        try:
            self.local.end_pass()
        finally:
            if not self._parts.passes.in_pass:  # closed, even by an end_pass that raised
                self._passes.end_pass()

    def run_pass(self, batches: Batches) -> AbstractContextManager[None]:
        """``with sharded.run_pass(batches): ...`` = begin_pass(batches) ... end_pass() (collective)."""
        return run_pass(self, batches)

    # -- the feature life cycle: each key's counters, admission and eviction live at its owner ----
    def _answered(
        self, table: str, keys: np.ndarray, answer: Callable[[np.ndarray], np.ndarray]
    ) -> np.ndarray:
        """Ask the owners of int64 ``keys`` (n,) for ``answer(their keys)`` ((m, c) float32 each)
        -> (n, c) float32 in the order of ``keys`` (collective)."""
        uniq, inverse = np.unique(keys, return_inverse=True)
        route, asked = self._route(torch.from_numpy(uniq).to(self.device))
        rows = torch.from_numpy(np.ascontiguousarray(answer(asked.cpu().numpy()), dtype=np.float32))
        got = self._return_rows(rows.to(self.device), route).cpu().numpy()
        return got[inverse.reshape(-1)]

    def observe(self, table: str, ids: Any, clicks: Any = None) -> None:
        """Count impressions (and clicks) of ``ids`` (N,) into their rows' counters at the owners
        (collective; see :meth:`hierps.Store.observe`): every rank passes its own examples."""
        self.local.info(table)
        keys, shows, labels = observation(table, ids, clicks)
        uniq, inverse = np.unique(keys, return_inverse=True)
        counted = np.stack(
            [
                np.bincount(inverse, weights=shows, minlength=len(uniq)),
                np.bincount(inverse, weights=labels, minlength=len(uniq)),
            ],
            axis=1,
        ).astype(np.float32)
        route, asked = self._route(torch.from_numpy(uniq).to(self.device))
        got = self.transport.all_to_all_known(
            torch.from_numpy(counted)[route.order.cpu()], route.send_counts, route.recv_counts
        ).cpu()
        self._sent(got, route.send_counts)
        self._parts.life.observe_counts(table, asked.cpu().numpy(), got[:, 0].numpy(), got[:, 1].numpy())

    def counters(self, table: str, keys: Any) -> dict[str, np.ndarray]:
        """The counters of int64 ``keys`` (n,) from their owners (collective; see :meth:`hierps.Store.counters`)."""
        self.local.info(table)
        flat = _ids.as_int64_array(keys, what="keys")

        def answer(owned: np.ndarray) -> np.ndarray:
            got = self.local.counters(table, owned)
            return np.stack([got[name] for name in COUNTERS], axis=1)

        block = self._answered(table, flat, answer)
        return {name: block[:, i] for i, name in enumerate(COUNTERS)}

    def has_rows(self, table: str, ids: Any) -> np.ndarray:
        """ids: (n,) int64 -> (n,) bool, True for keys whose owner holds a row (collective)."""
        self.local.info(table)
        flat = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
        found = self._answered(table, flat, lambda owned: self.local.has_rows(table, owned)[:, None])
        return found[:, 0] > 0

    def num_pending(self, table: str) -> int:
        """Keys of ``table`` waiting for admission, over all ranks (collective)."""
        mine = torch.tensor([float(self.local.num_pending(table))], dtype=torch.float64)
        return int(self.transport.all_reduce_sum(mine)[0])

    def shrink(
        self,
        table: str | None = None,
        *,
        ttl_passes: int | None = None,
        min_decayed_count: float | None = None,
    ) -> dict[str, int]:
        """Every rank deletes the rows of its shard that eviction condemns; ``{table: rows deleted}``
        over all ranks (collective; see :meth:`hierps.Store.shrink`)."""
        self._check_no_pending("shrink")
        deleted = self.local.shrink(table, ttl_passes=ttl_passes, min_decayed_count=min_decayed_count)
        names = sorted(deleted)
        total = self.transport.all_reduce_sum(
            torch.tensor([float(deleted[n]) for n in names], dtype=torch.float64)
        )
        return {name: int(n) for name, n in zip(names, total.tolist())}

    def export(
        self,
        path: str | os.PathLike[str],
        since: int | str | None = None,
        dtype: str = "fp32",
        *,
        checkpoint: int | str | None = None,
        rank: int = 0,
    ) -> dict[str, Any]:
        """One export of checkpoint ``checkpoint`` (an id or tag; default the latest) of all ranks, or
        a delta ``since`` an earlier one, merged, weights in ``dtype`` ("fp32" or "fp16"), for
        :mod:`hierps.serving`; returns its manifest on every rank (collective; see
        :meth:`hierps.Store.export`).

        It is written at ``path`` on the host of rank ``rank``, whose disk needs room for it; the other
        ranks stream the rows of the parts their hosts hold to it, in bounded pieces, so no shared
        file system is needed (see :mod:`hierps.sharding._export`). A part no rank reaches raises
        :class:`~hierps.errors.MissingPartsError` on every rank; nothing is written.
        """
        return export_sharded(
            self.root,
            self.transport,
            self.checkpoints.catalog,
            path,
            since=since,
            checkpoint=checkpoint,
            dtype=dtype,
            writer=rank,
        )

    def _check_no_pending(self, what: str) -> None:
        if self._pending:
            raise ConfigError(
                f"{what}: rows were gathered for an optimizer step that has not run; call "
                f"store.step() or store.zero_grad() first, then {what}."
            )

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, tag: str | None = None, *, retire: bool = True) -> int:
        """Checkpoint every rank's shard as one checkpoint (collective); returns its id, the same on
        every rank. Committed once for all ranks, after every shard is durable (see
        :mod:`hierps.sharding._commits`); every rank returns once it is committed. ``retire``: as
        :meth:`hierps.Store.checkpoint`."""
        return self.checkpoints.checkpoint(tag, retire=retire)

    def track_data(self, loader: Any) -> None:
        """Save ``loader``'s position with this rank's part of every checkpoint (as
        :meth:`hierps.Store.track_data`): each rank tracks its own loader. A checkpoint resharded
        from another number of ranks holds no position (a warning says so when one is restored)."""
        self.local.track_data(loader)

    def retire_checkpoints(self) -> None:
        """Retire the checkpoints beyond ``keep_checkpoints`` (collective)."""
        self.checkpoints.retire()

    def restore(self, ref: int | str | None = None) -> int:
        """Every rank returns to checkpoint ``ref`` (an id or tag, the same on all ranks; or the latest).

        A checkpoint written by another number of ranks is resharded: each rank reads the rows it
        now owns from every old shard, with their optimizer state, and the ranks commit that as a
        new checkpoint with the same tag (whose id is returned).
        """
        ckpt = self.checkpoints.restore(ref)
        self._pending = []
        return ckpt

    def list_checkpoints(self) -> list[dict[str, Any]]:
        """``[{"id", "tag", "created", "world_size", "resharded_from"}, ...]`` of the restorable
        checkpoints, oldest first (``resharded_from``: the id of the checkpoint whose rows a reshard
        copied into this world size, which counts against no ``keep_checkpoints``; else None)."""
        return self.checkpoints.list_checkpoints()

    def close(self) -> None:
        """Release this rank's store and the routing; rows not covered by a checkpoint are not durable."""
        try:
            self._passes.close()
        finally:
            self.local.close()

    def num_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` per tier in this rank's store: ``{"device", "memory", "ssd"}``."""
        return self.local.num_rows(table)
