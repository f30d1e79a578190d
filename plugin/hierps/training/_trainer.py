"""Training: the gathers of a mini-batch's rows for a forward, and the optimizer step after backward.

:class:`SparseTrainer` is the part of :class:`hierps.Store` that serves training. A forward reads the weights of its rows from the device tier as a
leaf tensor that requires grad, and records it as pending; :meth:`SparseTrainer.step` then applies one
optimizer step per touched row:

- :meth:`SparseTrainer.gather`: keys (U,) sorted unique int64 -> (U, dim) float32 leaf, the rows
  brought into the device tier on demand (admission decides which keys get a row);
- :meth:`SparseTrainer.gather_planned`: the same for the next mini-batch announced by
  :meth:`~hierps.training._passes.PassRunner.begin_pass`, whose ids were translated to slots ahead of time
  (:mod:`hierps.training._batchplan`), so no sort or search runs in the forward;
- :meth:`SparseTrainer.planned_lookup`: a module's whole training forward of an announced
  mini-batch: the rows of all its tables of one arena, dim and weights dtype are gathered by one
  call (:class:`hierps.training._batchplan.RowGroup`), and each table pools (or looks up) its
  slice with its own offsets, mode and weights; its backward leaves its gradient summed per row;
- :meth:`SparseTrainer.step`: the fused step. The leaves' gradients, dense or sparse, are summed per
  row (:func:`summed_grads`), checked for NaN/inf once over their buffers before any row changes,
  and the tables of one arena, optimizer, dim and step count are updated by one gather, one
  :func:`~hierps.rows._optim.apply_step` and one scatter (:meth:`SparseTrainer._apply_steps`): the same
  arithmetic as row by row.

A loop that never calls ``step()`` trains nothing, and its pending leaves hold memory: when one
table has been gathered for training more than :attr:`SparseTrainer.gathers_before_warning` times
since the last step (or ``zero_grad()``), a :class:`MissingStepWarning` says so, once per store.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hierps._core import StoreCore
from hierps._faults import fault_point
from hierps._tensors import joined
from hierps.errors import ConfigError, NonFiniteGradientError
from hierps.interface import Lookup
from hierps.lifecycle._features import Features
from hierps.rows._counters import record_seen_rows
from hierps.rows._layout import rounding_bits
from hierps.rows._optim import apply_step
from hierps.rows._table import TableInfo
from hierps.tiers._device import DeviceTier, Sightings
from hierps.tiers._slot_index import NATIVE_UNIQUE_MAX, distinct_ids
from hierps.training._batchplan import (
    Batch,
    BatchPlan,
    RowGroup,
    add_joined_in_sum_order,
    add_parts_in_sum_order,
    index_add_rows,
    look_up,
    pool_bags,
    table_rows,
)
from hierps.training._passes import PassRunner
from hierps.training._readahead import ReadAhead

__all__ = ["MissingStepWarning", "SparseTrainer"]


class MissingStepWarning(UserWarning):
    """Forwards gathered rows for training many times over without a ``store.step()``."""


@dataclass
class _Pending:
    """Rows one forward gathered for training: their keys, slots and the leaf holding their grad."""

    table: str
    keys: (
        torch.Tensor
    )  # (R,) int64 unique (sorted, but for summed lookups of each id): the keys that have rows
    slots: torch.Tensor  # (R,) int64, valid while generation matches (DeviceTier.valid)
    generation: int  # the device tier's: its step_generation for touched rows, else its generation
    leaf: torch.Tensor | None = None  # (U, dim) requires_grad; None: the rows of a group
    rows: torch.Tensor | None = None  # (R,) positions of keys in the leaf; None: all of it
    group: RowGroup | None = None  # where the gradient is, for a table pooled from a group
    # keys, slots and the leaf's rows are one per id of the lookup, repeats included (a plain
    # nn.Embedding lookup outside announced mini-batches): the step makes them distinct
    each: bool = False
    touched: bool = False  # the rows were marked gathered (DeviceTier.touch): evictions leave them

    def valid(self, tier: DeviceTier) -> bool:
        """Whether :attr:`slots` still hold the rows of :attr:`keys`."""
        return tier.valid(self.generation, self.touched)

    def gradient(self, summed: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """The gradient of the gathered rows (``summed``: leaves' by id), or None without a backward."""
        if self.group is not None:
            return self.group.gradient(self.table, self.keys.numel())
        assert self.leaf is not None
        return summed.get(id(self.leaf))


@dataclass
class _Merged:
    """Lookups of each id of several tables summed as one (:meth:`SparseTrainer._merged_each`)."""

    members: list[_Pending]
    slots: torch.Tensor  # (U,) int64 unique slots of the members' rows, in one arena
    grad: torch.Tensor  # (U, dim) float32 each row's gradient, summed


def _runs_of_ids(members: list[_Pending]) -> list[list[_Pending]]:
    """``members`` in consecutive runs of at most :data:`~hierps.tiers._slot_index.NATIVE_UNIQUE_MAX`
    ids (a member with more alone): runs that one compiled deduplication serves (past it, a sort
    of all of them would cost more than one per run)."""
    runs: list[list[_Pending]] = []
    total = 0
    for p in members:
        if runs and total + p.keys.numel() <= NATIVE_UNIQUE_MAX:
            runs[-1].append(p)
            total += p.keys.numel()
        else:
            runs.append([p])
            total = p.keys.numel()
    return runs


def _pools_alike(lookup: Lookup) -> bool:
    """Whether ``lookup`` is a plain sum or mean of bags by offsets, as several tables may share."""
    return (
        lookup.mode in ("sum", "mean")
        and lookup.offsets is not None
        and lookup.per_sample_weights is None
        and lookup.padding_idx is None
        and not lookup.include_last_offset
    )


_LOOKUP = "lookup"  # RowGroup.mode of pieces looked up, not pooled


def _looks_up(lookup: Lookup) -> bool:
    """Whether ``lookup`` is a plain ``nn.Embedding`` lookup (no padding row)."""
    return lookup.mode is None and lookup.padding_idx is None


def _same_bags(group: RowGroup, table: str, lookup: Lookup) -> bool:
    """Whether ``lookup`` pools the bags ``table`` was pooled with, with the rest of ``group``."""
    mine = lookup.offsets
    theirs = group.bag_offsets.get(table) if group.bag_offsets is not None else group.offsets
    if not _pools_alike(lookup) or lookup.mode != group.mode or mine is None or theirs is None:
        return False
    return mine is theirs or (mine.numel() == theirs.numel() and torch.equal(mine, theirs))


class SparseTrainer:
    """Training gathers and the optimizer step: the part of :class:`hierps.Store` behind ``gather``,
    ``step``, ``apply_gradients`` and ``zero_grad``."""

    # Gradient accumulation over k micro-batches gathers each table k times per step (more for a
    # module a model calls twice): far fewer than this. hierps.deepspeed raises it for its
    # gradient_accumulation_steps.
    gathers_before_warning: int = 64

    def __init__(self, core: StoreCore, passes: PassRunner, features: Features) -> None:
        self._core = core
        self._passes = passes
        self._features = features
        self.pending: list[_Pending] = []  # what forwards gathered since the last step
        self._gathers: dict[str, int] = {}  # table -> its entries in pending
        self._warned = False
        # Pool the tables of a mini-batch at once while they bring one offsets tensor (until one does not).
        self._pool_alike = True
        # Look up the tables of a mini-batch at once while they are plain nn.Embedding lookups.
        self._look_alike = True
        self.read_ahead = ReadAhead(core)  # rows of announced evaluation mini-batches

    def _record(self, pending: _Pending) -> None:
        """Keep what a forward gathered for the next step; warn once when steps seem forgotten."""
        self.pending.append(pending)
        n = self._gathers[pending.table] = self._gathers.get(pending.table, 0) + 1
        if n > self.gathers_before_warning and not self._warned:
            self._warned = True
            warnings.warn(
                f"hierps: table {pending.table!r} was gathered for training {n} times without a "
                "store.step(): its rows are not trained, and the gathered rows and their gradients "
                "are held in memory until a step. Call store.step() after each backward (after "
                "the last micro-batch when accumulating gradients), or store.zero_grad() to discard "
                "them; forwards that only evaluate run under torch.no_grad() or model.eval().",
                MissingStepWarning,
                stacklevel=4,
            )

    def check_no_pending(self, what: str) -> None:
        """Raise ``ConfigError`` when rows were gathered for a step that has not run yet."""
        if self.pending:
            raise ConfigError(
                f"{what}: rows were gathered for an optimizer step that has not run; call "
                f"store.step() or store.zero_grad() first, then {what}."
            )

    def drop(self, table: str | None = None) -> None:
        """Forget what forwards gathered (of ``table`` only, when given) without a step."""
        self.pending = [p for p in self.pending if table is not None and p.table != table]
        self._gathers = {t: n for t, n in self._gathers.items() if table is not None and t != table}

    def gather_planned(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, BatchPlan] | None:
        """The training gather of an announced mini-batch, or None when ``ids`` are not the next one.

        ids: (...) int64 on the store's device. When they equal ``table``'s next mini-batch of the
        current pass (see :mod:`hierps.training._batchplan`), returns the leaf of its distinct rows' weights
        (U, dim) float32, as :meth:`gather` with ``requires_grad``, and the plan (``local`` ids,
        ``keys``): their translation was done ahead, so no sort or search runs here.
        """
        batches = self._passes.batches
        if batches is None:
            return None
        plan = batches.match(table, ids, self._core.device_tier.generation)
        if plan is None:
            return None
        info = self._core.tables[table]
        tier = self._core.device_tier
        tier.defer_seen(
            table, plan.slots, plan.counts, info.counter_word, self._core.passes, info.eviction.decay
        )
        weights = tier.weights(table, plan.slots, info.layout).requires_grad_(True)
        self._record(_Pending(table, plan.keys, plan.slots, tier.generation, weights))
        return weights, plan

    def planned_lookup(self, table: str, ids: torch.Tensor, lookup: Lookup) -> torch.Tensor | None:
        """``table``'s training forward of an announced mini-batch, or None when ``ids`` are not it.

        At the first forward of a mini-batch among the tables that share ``table``'s arena, dim and
        weights dtype, the rows of all of them are gathered by one call (:class:`RowGroup`); each
        table's forward then pools or looks up its own slice, with its own offsets and mode
        (:func:`~hierps.training._batchplan.table_rows`): the floats of torch's module on the
        table's rows. Its backward leaves the table's gradient, summed per row, for :meth:`step`.
        """
        batches = self._passes.batches
        if batches is None:
            return self._look_up_each(table, ids, lookup)
        tier = self._core.device_tier
        found = batches.next_plan(table, ids, tier.generation)
        if found is None:
            return None
        k, plan = found
        info = self._core.tables[table]
        pad = None
        if lookup.padding_idx is not None:
            at = int(torch.searchsorted(plan.keys, lookup.padding_idx).item())
            if at < plan.keys.numel() and int(plan.keys[at].item()) == lookup.padding_idx:
                pad = at
        key = (k, id(tier.arena(table)), info.dim, info.weights_dtype)
        group = batches.groups.get(key)
        if group is None:
            for done in [g for g in batches.groups if g[0] < k]:  # earlier mini-batches: let them go
                del batches.groups[done]
            batch = batches.batches[k]
            assert batch is not None  # next_plan found table's plan in it
            group = batches.groups[key] = self._gather_group(batch, table)
            if self._pool_alike and _pools_alike(lookup):
                self._pool_members(group, batch, lookup)
            elif self._look_alike and _looks_up(lookup) and len(group.start) == len(batch.plans) > 1:
                self._look_up_members(group, batch)
        piece = None
        if group.pieces is not None and table in group.pieces and group.mode == _LOOKUP:
            if _looks_up(lookup):
                piece = group.pieces.pop(table).view(*ids.shape, info.dim)
                group.pooled.add(table)
            else:  # this model's tables are not all plain lookups: each looks up its own from now on
                self._look_alike = False
        elif group.pieces is not None and table in group.pieces:
            if _same_bags(group, table, lookup):
                piece = group.pieces.pop(table)
                group.pooled.add(table)
            elif group.bag_offsets is None:  # this model's tables pool differently: each its own from now on
                self._pool_alike = False
            # (bags announced for this mini-batch that are not the forward's: only this one pools apart)
        group.left -= 1
        if group.left == 0:
            del batches.groups[key]  # every member has taken its rows; their outputs keep the group
        batches.ran(table, k)
        tier.defer_seen(
            table, plan.slots, plan.counts, info.counter_word, self._core.passes, info.eviction.decay
        )
        self._record(_Pending(table, plan.keys, plan.slots, tier.generation, group=group))
        if piece is not None:
            return piece
        psw = lookup.per_sample_weights
        return table_rows(
            group,
            table,
            plan,
            tuple(ids.shape),
            lookup.mode,
            lookup.offsets,
            psw.reshape(-1) if psw is not None else None,
            lookup.include_last_offset,
            pad,
        )

    def _look_up_each(self, table: str, ids: torch.Tensor, lookup: Lookup) -> torch.Tensor | None:
        """A plain ``nn.Embedding`` training lookup outside announced mini-batches, or None for any
        other (a padding row, pooling, admission: the module's generic gather serves).

        The leaf holds the row of each id, repeats included, gathered by one probe of the device
        tier's index (rows not resident are loaded first, as :meth:`gather` loads them): the
        forward neither deduplicates nor builds a sparse gradient. Its output is a copy of the leaf,
        shaped as the ids, the floats of ``F.embedding``; the step sums each key's gradients in the
        order the module's sparse gradient has them (:meth:`_sum_each`).
        """
        if not _looks_up(lookup):
            return None
        self._core.check_open()
        info = self._core.info(table)
        if info.admission.filters:
            return None
        tier = self._core.device_tier
        flat = ids.reshape(-1).clone()  # a private copy: the step reads the ids again
        slots, found = tier.locate(table, flat)
        if found is not None:
            slots = self._passes.resident_each(table, flat, slots, found)
        tier.touch(table, slots)
        tier.defer_seen(table, slots, None, info.counter_word, self._core.passes, info.eviction.decay)
        leaf = tier.weights(table, slots, info.layout).view(*ids.shape, info.dim).requires_grad_(True)
        self._record(_Pending(table, flat, slots, tier.step_generation, leaf, each=True, touched=True))
        return leaf.clone()

    def _merged_each(
        self, pending: list[_Pending]
    ) -> tuple[list[_Merged], dict[int, torch.Tensor], list[_Pending]]:
        """Sum the gradients of the lookups of each id (:meth:`_look_up_each`) per key -> (one
        :class:`_Merged` per set of them the step updates as one, ``{id(leaf): (U, dim) summed
        gradient}`` of the others, the rest of ``pending``).

        A set: lookups with a gradient and valid slots, of tables looked up once since the last
        step, whose rows share an arena, optimizer, full-precision layout, step count and counter
        decay. Any other lookup of each id with a gradient is summed alone and stays in the rest,
        its keys and slots then one per key, as a gathered leaf's are (:meth:`_sum_each`).
        """
        tier = self._core.device_tier
        lookups: dict[str, int] = {}
        for p in pending:
            lookups[p.table] = lookups.get(p.table, 0) + 1
        sets: list[tuple[tuple[Any, ...], list[_Pending]]] = []
        rest = []
        alone: dict[int, torch.Tensor] = {}
        for p in pending:
            info = self._core.tables[p.table]
            if not (p.each and p.leaf is not None and p.leaf.grad is not None):
                rest.append(p)
            elif lookups[p.table] > 1 or not p.valid(tier) or info.layout.compact:
                p.keys, p.slots, alone[id(p.leaf)] = self._sum_each([p])
                p.each = False
                rest.append(p)
            else:
                key = (
                    tier.arena(p.table),
                    info.optimizer,
                    info.layout,
                    info.step,
                    info.eviction.decay,
                    info.dim,
                )
                for k, members in sets:
                    if k[0] is key[0] and k[1:] == key[1:]:
                        members.append(p)
                        break
                else:
                    sets.append((key, [p]))
        merged = []
        for _, members in sets:
            for run in _runs_of_ids(members):
                _, slots, grad = self._sum_each(run)
                merged.append(_Merged(run, slots, grad))
        return merged, alone, rest

    def _sum_each(self, members: list[_Pending]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lookups of each id with a gradient, of tables whose rows share an arena -> (keys (U,),
        slots (U,), gradients (U, dim) summed per key).

        One deduplication of all their slots (a slot is one key of one table: one of a lookup whose
        slots have moved since still stands for one key), one ``index_add_``: each key's gradients
        in the order its table's sparse gradient over the distinct rows would sum them. Their
        sightings, if still deferred, are deferred again as one count per row, where the step's
        update counts them.
        """
        tier = self._core.device_tier
        slots, inverse, counts = distinct_ids(joined([p.slots for p in members]))
        grads = joined(
            [
                p.leaf.grad.reshape(-1, p.leaf.shape[-1])
                for p in members
                if p.leaf is not None and p.leaf.grad is not None
            ]
        )
        grad = torch.zeros((slots.numel(), grads.shape[1]), dtype=grads.dtype, device=grads.device)
        ids = [p.keys for p in members]
        add_joined_in_sum_order(
            grad, inverse, grads, ids, [self._core.tables[p.table].coalesced for p in members]
        )
        keys = torch.empty_like(slots)
        if keys.device.type == "cpu":  # numpy's scatter: a few µs where torch's takes tens
            keys.numpy()[inverse.numpy()] = joined(ids).numpy()
        else:
            keys[inverse] = joined(ids)
        seen = tier.take_seen(tier.arena(members[0].table), [p.slots for p in members])
        first = seen[0]
        if first is not None and all(s is not None for s in seen):
            tier.defer_seen(
                members[0].table, slots, counts.to(torch.float32), first.start, first.now, first.decay
            )
        else:  # some were counted already: the others as they were deferred
            for p, s in zip(members, seen):
                if s is not None:
                    tier.defer_seen(p.table, s.slots, s.counts, s.start, s.now, s.decay)
        return keys, slots, grad

    def _pool_members(self, group: RowGroup, batch: Batch, lookup: Lookup) -> None:
        """Pool every member of ``group`` at once (one ``embedding_bag``,
        :func:`~hierps.training._batchplan.pool_bags`), each with the offsets announced for it
        (:class:`hierps.Bags`), or else all with ``lookup``'s, if they have as many ids each (the
        tables of a model that hands one offsets tensor to all of them). Each member's forward then
        takes its piece if its offsets are the ones pooled."""
        members = list(group.start)
        plans = [batch.plans[t] for t in members]
        assert lookup.offsets is not None and lookup.mode is not None
        if len(members) == len(batch.plans):
            local = batch.local
        else:
            local = torch.cat([p.local + group.start[t] for t, p in zip(members, plans)])
        parts = [(p.ids.numel(), p.keys.numel(), p.coalesced) for p in plans]
        announced = [p.offsets for p in plans]
        joined = batch.bags
        if joined is not None and len(members) == len(batch.plans):  # joined ahead, on the worker
            assert batch.starts is not None
            by_key = (joined.ids_bags, batch.starts) if lookup.mode == "sum" else None
            pieces = pool_bags(
                group.weights, local, joined.offsets, lookup.mode, joined.counts, parts, group.backed, by_key
            )
            offsets = [o for o in announced if o is not None]
            group.pieces, group.bag_offsets, group.mode = (
                dict(zip(members, pieces)),
                dict(zip(members, offsets)),
                lookup.mode,
            )
            return
        if all(o is not None for o in announced):
            offsets = [o for o in announced if o is not None]
            firsts = np.cumsum([0, *[p.ids.numel() for p in plans[:-1]]]).tolist()
            bags = torch.cat([o + n0 if n0 else o for o, n0 in zip(offsets, firsts)])
            counts = [o.numel() for o in offsets]
            by_key = None
            if lookup.mode == "sum":
                bag0 = np.cumsum([0, *counts[:-1]]).tolist()
                ids_bags = torch.cat(
                    [p.bags + b0 if b0 else p.bags for p, b0 in zip(plans, bag0) if p.bags is not None]
                )
                starts = torch.cat([p.starts + n0 if n0 else p.starts for p, n0 in zip(plans, firsts)])
                by_key = (ids_bags, starts)
            pieces = pool_bags(group.weights, local, bags, lookup.mode, counts, parts, group.backed, by_key)
            group.pieces, group.bag_offsets, group.mode = (
                dict(zip(members, pieces)),
                dict(zip(members, offsets)),
                lookup.mode,
            )
            return
        offsets_t = lookup.offsets
        n = plans[0].ids.numel()
        if any(p.ids.numel() != n for p in plans):
            return
        bags = torch.cat([offsets_t + i * n for i in range(len(plans))])
        # Summed bags of every table of the batch: the backward sums each key's bags in the order
        # sorted ahead on the worker (one embedding_bag), not by a sort of its own.
        by_order = None
        if lookup.mode == "sum" and batch.order is not None and len(members) == len(batch.plans):
            assert batch.starts is not None
            by_order = (batch.order, batch.starts)
        pieces = pool_bags(
            group.weights, local, bags, lookup.mode, offsets_t.numel(), parts, group.backed, None, by_order
        )
        group.pieces, group.offsets, group.mode = dict(zip(members, pieces)), offsets_t, lookup.mode

    def _look_up_members(self, group: RowGroup, batch: Batch) -> None:
        """Look up the rows of every id of every table of ``batch`` at once (one ``index_select``,
        :func:`~hierps.training._batchplan.look_up`), their gradient summed per row by one
        ``embedding_bag``: each member's forward then takes its piece if it is a plain lookup."""
        assert batch.order is not None and batch.starts is not None
        members = list(group.start)
        sizes = [batch.plans[t].ids.numel() for t in members]
        pieces = look_up(group.weights, batch.local, sizes, batch.order, batch.starts, group.backed)
        group.pieces, group.mode = dict(zip(members, pieces)), _LOOKUP

    def _gather_group(self, batch: Batch, table: str) -> RowGroup:
        """The rows of the tables of ``batch`` that share ``table``'s arena, dim and weights dtype,
        gathered by one call."""
        tier, info = self._core.device_tier, self._core.tables[table]
        arena = tier.arena(table)
        members = [
            t
            for t in batch.plans
            if tier.arena(t) is arena
            and (self._core.tables[t].dim, self._core.tables[t].weights_dtype)
            == (info.dim, info.weights_dtype)
        ]
        plans = [batch.plans[t] for t in members]
        slots = batch.slots if len(members) == len(batch.plans) else torch.cat([p.slots for p in plans])
        stored = arena.rows.index_select(0, slots)  # whole rows: the step updates them from here
        weights = info.layout.weights_of(stored).requires_grad_(True)
        starts = np.cumsum([0, *[p.keys.numel() for p in plans[:-1]]]).tolist()
        return RowGroup(
            weights, dict(zip(members, starts)), len(members), slots, stored, arena.rows, arena.rows._version
        )

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
        self._core.check_open()
        info = self._core.info(table)
        if info.admission.filters:
            return self._gather_filtered(info, keys, requires_grad, counts)
        if not requires_grad:
            return self.read_weights(table, keys)
        tier = self._core.device_tier
        slots = self._passes.resident_slots(table, keys)
        # Sightings are counted later, fused: by the step into the rows it updates anyway, or
        # before any row leaves the tier (as for announced mini-batches).
        seen = counts.to(torch.float32) if counts is not None else torch.ones(len(slots), device=slots.device)
        tier.defer_seen(table, slots, seen, info.counter_word, self._core.passes, info.eviction.decay)
        tier.touch(table, slots)
        weights = tier.weights(table, slots, info.layout).requires_grad_(True)
        self._record(_Pending(table, keys, slots, tier.step_generation, weights, touched=True))
        return weights

    def read_weights(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """keys: (U,) sorted unique int64 on the device -> (U, dim) float32 current weights, no gradient.

        The read of a forward that does not train (under ``torch.no_grad()`` or ``model.eval()``):
        rows resident in the device tier are copied from it; the others are read from RAM, SSD or
        the initializer in pieces of at most the device budget's rows, and enter no tier. So an
        evaluation batch may need more rows than the device tier holds, with the outputs of a
        forward whose rows were all resident, and it leaves the training working set as it was.
        """
        info = self._core.info(table)
        tier = self._core.device_tier
        found, slots = tier.resolve(table, keys)
        weights = torch.empty((keys.numel(), info.dim), dtype=torch.float32, device=self._core.device)
        found_np = found.cpu().numpy()
        if found_np.any():
            weights[found] = tier.weights(table, slots[found], info.layout)
        rest = np.flatnonzero(~found_np)
        keys_np = keys.cpu().numpy()
        ahead = self.read_ahead.rows(table, keys_np[rest]) if len(rest) else None
        if ahead is not None:  # read in the background, announced by store.read_ahead
            hit, rows_ahead = ahead
            at_ahead = torch.from_numpy(rest[hit]).to(self._core.device)
            weights[at_ahead] = info.layout.weights_of(torch.from_numpy(rows_ahead)).to(self._core.device)
            rest = rest[~hit]
        if len(rest):
            self._pipe_wait()
            piece = max(1, tier.budget // tier.row_bytes(table))
            for start in range(0, len(rest), piece):
                at = rest[start : start + piece]
                rows = torch.from_numpy(self._core.fetch(table, keys_np[at], touch=False))
                weights[torch.from_numpy(at).to(self._core.device)] = info.layout.gather_weights(
                    rows, torch.arange(len(at))
                ).to(self._core.device)
        return weights

    def _pipe_wait(self) -> None:
        """Rows on their way down to RAM are in no tier for a moment: wait for them."""
        self._core.pipe.wait_writebacks()

    def _gather_filtered(
        self, info: TableInfo, keys: torch.Tensor, requires_grad: bool, counts: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`gather` for a table with admission: rows only for keys that have or earn one."""
        weights, at, slots = self._filtered_rows(info, keys, requires_grad, counts)
        if requires_grad:
            weights.requires_grad_(True)
            # Recorded even without rows: the table's step count (Adam's bias correction) then
            # advances as in an unfiltered run, so admitted rows train as unfiltered rows do.
            tier = self._core.device_tier
            self._record(
                _Pending(info.name, keys[at], slots, tier.step_generation, weights, rows=at, touched=True)
            )
        return weights

    def _filtered_rows(
        self, info: TableInfo, keys: torch.Tensor, training: bool, counts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weights of sorted unique ``keys`` (U,) of a table with admission -> ((U, dim) weights, positions
        of the keys that have a row (R,), their slots (R,)). ``training``: sightings count, keys may earn rows."""
        table = info.name
        keys_np = keys.cpu().numpy()
        n_seen = (
            counts.cpu().numpy().astype(np.int64) if counts is not None else np.ones(len(keys_np), np.int64)
        )
        has = self._core.has_row(table, keys_np)
        prior = np.zeros(len(keys_np), np.int64)
        if training:
            new, prior = self._features.admit(info, keys_np, n_seen, ~has)
            has |= new
        weights = torch.empty((len(keys_np), info.dim), dtype=torch.float32, device=self._core.device)
        if not has.all():
            out = np.flatnonzero(~has)
            weights[torch.from_numpy(out).to(self._core.device)] = torch.from_numpy(
                self._features.unadmitted_weights(info, keys_np[out])
            ).to(self._core.device)
        at = torch.from_numpy(np.flatnonzero(has)).to(self._core.device)
        slots = at
        if len(at) and not training:
            weights[at] = self.read_weights(table, keys[at])
        elif len(at):
            slots = self._passes.resident_slots(table, keys[at])
            self._core.device_tier.touch(table, slots)
            if training:
                seen = torch.from_numpy((n_seen + prior)[has].astype(np.float32)).to(self._core.device)
                self._features.count_seen(info, slots, seen)
            weights[at] = info.layout.gather_weights(self._core.device_tier.rows(table), slots)
        return weights, at, slots

    def serve(self, table: str, keys: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """Weights of keys other ranks asked for (the owner's side of a sharded gather).

        keys: (n,) int64 on the device, repeats allowed (one per asking rank) -> (n, dim) float32,
        no gradient. With ``counts`` (n,) (training), each key's sightings are summed over the
        asking ranks and counted once, as one gather of the whole batch counts them: into the
        rows' counters and, for a table with admission, towards its admission.
        """
        self._core.check_open()
        info = self._core.info(table)
        if keys.numel() == 0:
            return torch.empty((0, info.dim), dtype=torch.float32, device=self._core.device)
        uniq, inverse = torch.unique(keys, return_inverse=True)
        seen = None
        if counts is not None:
            seen = torch.zeros(uniq.numel(), dtype=torch.float32, device=self._core.device)
            seen.index_add_(0, inverse, counts.to(torch.float32))
        if info.admission.filters:
            return self._filtered_rows(info, uniq, seen is not None, seen)[0][inverse]
        if seen is None:  # not training: read in pieces, whatever the device tier holds
            return self.read_weights(table, uniq)[inverse]
        slots = self._passes.resident_slots(table, uniq)
        self._features.count_seen(info, slots, seen)
        return info.layout.gather_weights(self._core.device_tier.rows(table), slots)[inverse]

    def step(self) -> None:
        """One optimizer step for every row touched since the last step (gradients summed per row).

        Tables of one row width, optimizer and step count are updated together: one gather, one
        optimizer call and one scatter for all of them. Raises :class:`NonFiniteGradientError`
        before changing any row when a gradient is NaN/inf.
        """
        self._core.check_open()
        self._core.device_tier.tick()
        self._core.stats.count_step()
        pending, self.pending, self._gathers = self.pending, [], {}
        merged, summed, pending = self._merged_each(pending)
        leaves = list(
            {
                id(p.leaf): p.leaf
                for p in pending
                if p.leaf is not None and p.leaf.grad is not None and id(p.leaf) not in summed
            }.values()
        )
        coalesced = {
            id(p.leaf) for p in pending if p.leaf is not None and self._core.tables[p.table].coalesced
        }
        summed.update(zip(map(id, leaves), summed_grads(leaves, coalesced)))
        found = [(p, p.gradient(summed)) for p in pending]
        with_grad = [(p, g) for p, g in found if g is not None]
        if not with_grad and not merged:
            return
        if not _all_finite(_distinct_buffers([g for _, g in with_grad] + [m.grad for m in merged])):
            each_grad = [(p, p.leaf.grad) for m in merged for p in m.members if p.leaf is not None]
            bad = sorted(
                {
                    p.table
                    for p, g in with_grad + each_grad
                    if g is not None and not bool(torch.isfinite(g).all())
                }
            )
            raise NonFiniteGradientError(
                f"NaN or inf gradient for table(s) {bad}; the step was skipped and no row changed. "
                "Lower the learning rate, clip gradients, or check the inputs of this mini-batch."
            )
        fused: list[tuple[str, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
        for m in merged:
            for p in m.members:
                self._core.tables[p.table].step += 1
            fused.append((m.members[0].table, None, m.slots, m.grad))
        pending = [p for p, _ in with_grad]
        grads = [g if p.rows is None else g[p.rows] for p, g in with_grad]
        by_table: dict[str, list[tuple[_Pending, torch.Tensor]]] = {}
        for p, g in zip(pending, grads):
            by_table.setdefault(p.table, []).append((p, g))
        by_keys = []
        for table, items in by_table.items():
            first = items[0][0]
            if len(items) == 1 and first.valid(self._core.device_tier):
                self._core.tables[table].step += 1
                if first.keys.numel():
                    fused.append((table, first.keys, first.slots, items[0][1]))  # slots still valid
            else:
                by_keys.append(
                    (table, torch.cat([p.keys for p, _ in items]), torch.cat([g for _, g in items]))
                )
        gathered = list({id(p.group): p.group for p in pending if p.group is not None}.values())
        self._apply_steps(fused, gathered)
        # Then the rows whose slots changed, by key: loading them may move the others' rows.
        for table, keys, grad in by_keys:
            self.apply_gradients(table, keys, grad)
        self._core.device_tier.flush_seen()
        fault_point("store.step")

    def apply_gradients(self, table: str, keys: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step for each distinct key, its gradients summed first.

        keys: (n,) int64 on the store's device, repeats allowed; grads: (n, dim) float32. The
        table's step count advances even when no key has a row yet (admission pending).
        """
        info = self._core.info(table)
        info.step += 1
        if keys.numel() == 0:
            return
        uniq, inverse = torch.unique(keys, return_inverse=True)
        summed = torch.zeros((uniq.numel(), info.dim), dtype=torch.float32, device=self._core.device)
        index_add_rows(summed, inverse, grads)
        self._apply_steps([(table, uniq, self._passes.resident_slots(table, uniq), summed)])

    def count_sightings(self, table: str, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """Count ``counts`` (U,) float32 sightings into the counters of the resident rows at unique
        ``slots`` (U,), later and fused with the others (the owner's side of a sharded mini-batch)."""
        info = self._core.tables[table]
        self._core.device_tier.defer_seen(
            table, slots, counts, info.counter_word, self._core.passes, info.eviction.decay
        )

    def apply_slot_gradients(self, updates: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """One optimizer step for each table of ``(table, slots (U,) unique resident, grads (U, dim))``,
        its gradients summed per row already: the fused step of :meth:`step` (the owner's side of a
        sharded step). Each table's step count advances, rows or not."""
        self._core.check_open()
        self._core.device_tier.tick()
        for table, _, _ in updates:
            self._core.tables[table].step += 1
        self._apply_steps([(t, None, slots, grads) for t, slots, grads in updates if slots.numel()])
        self._core.device_tier.flush_seen()

    def _apply_steps(
        self,
        updates: list[tuple[str, torch.Tensor | None, torch.Tensor, torch.Tensor]],
        gathered: Sequence[RowGroup] = (),
    ) -> None:
        """Apply each table's optimizer (step counts already advanced) to ``(table, keys, slots, grads)``
        (keys None: the keys resident at ``slots``, looked up only for compact rows, which need them).

        Tables sharing a device-tier arena, optimizer, row layout and step count go through one
        gather, one decode, one :func:`~hierps.rows._optim.apply_step`, one encode and one scatter:
        the same arithmetic row by row. Compact rows are rounded stochastically with bits drawn
        from (table salt ^ key, step, column) (:mod:`hierps.rows._layout`). Rows a forward gathered
        whole (``gathered``) and that are unchanged since are not gathered again.
        """
        groups: list[
            tuple[tuple[Any, ...], list[tuple[TableInfo, torch.Tensor | None, torch.Tensor, torch.Tensor]]]
        ] = []
        for table, keys, slots, grad in updates:
            info = self._core.tables[table]
            key = (self._core.device_tier.arena(table), info.optimizer, info.layout, info.step)
            for k, items in groups:
                if k[0] is key[0] and k[1:] == key[1:]:
                    items.append((info, keys, slots, grad))
                    break
            else:
                groups.append((key, [(info, keys, slots, grad)]))
        for (arena, opt, layout, step), items in groups:
            slots = joined([s for _, _, s, _ in items])
            grad = joined([g for _, _, _, g in items])
            stored = next((r for g in gathered if (r := g.rows_of(arena.rows, slots)) is not None), None)
            rows = layout.decode(stored if stored is not None else arena.rows.index_select(0, slots))
            apply_step(opt, rows, grad, step)
            if not layout.compact:  # stored rows are these: count their sightings here, in the same pass
                self._count_seen_in(arena, rows, [s for _, _, s, _ in items])
            bits = None
            if layout.compact:
                tier = self._core.device_tier
                seeds = joined(
                    [
                        (k if k is not None else tier.keys_at(i.name, s))
                        ^ int(np.uint64(i.salt).view(np.int64))
                        for i, k, s, _ in items
                    ]
                )
                bits = rounding_bits(seeds, step, layout.rounded_columns)
            arena.rows.index_copy_(0, slots, layout.encode(rows, bits))
            arena.dirty.index_fill_(0, slots, True)

    def _count_seen_in(self, arena: Any, rows: torch.Tensor, slots: list[torch.Tensor]) -> None:
        """Count the deferred sightings recorded with each of ``slots`` into ``rows`` (the rows at
        those slots one after the other, about to be written back) instead of into the arena."""
        tier = self._core.device_tier
        seen = tier.take_seen(arena, slots)
        counts = [_counts_of(s) for s in seen]
        first = seen[0]
        if first is not None and all(
            s is not None and (s.start, s.now, s.decay) == (first.start, first.now, first.decay) for s in seen
        ):
            record_seen_rows(
                rows, first.start, joined([c for c in counts if c is not None]), first.now, first.decay
            )
            return
        at = 0
        for s, c, n in zip(seen, counts, [x.numel() for x in slots]):
            if s is not None and c is not None:
                record_seen_rows(rows.narrow(0, at, n), s.start, c, s.now, s.decay)
            at += n

    def zero_grad(self) -> None:
        """Forget gradients gathered since the last step."""
        self.pending, self._gathers = [], {}


def summed_grads(leaves: list[torch.Tensor], coalesced: Collection[int] = ()) -> list[torch.Tensor]:
    """The gradients of gathered leaves as dense (U_i, dim_i) tensors, duplicates summed.

    Sparse gradients of one dim are summed into one buffer, of which the results are views (see
    :func:`_distinct_buffers`): each row's in torch's coalesce order for the leaves whose ``id``
    is in ``coalesced``, else in the order of the gradient's entries
    (:func:`~hierps.training._batchplan.sum_order`).
    """
    grads = [_grad_of(leaf) for leaf in leaves]
    out = list(grads)
    by_dim: dict[int, list[int]] = {}
    for i, (leaf, grad) in enumerate(zip(leaves, grads)):
        if grad.is_sparse:
            by_dim.setdefault(leaf.shape[1], []).append(i)
        else:
            out[i] = grad.detach()
    for dim, idx in by_dim.items():
        sizes = [leaves[i].shape[0] for i in idx]
        sparse = [grads[i] for i in idx]
        total = torch.zeros((sum(sizes), dim), dtype=sparse[0].dtype, device=sparse[0].device)
        add_parts_in_sum_order(
            total,
            [g._indices()[0] for g in sparse],
            [g._values() for g in sparse],
            [id(leaves[i]) in coalesced for i in idx],
            sizes,
        )
        for i, part in zip(idx, total.split(sizes)):
            out[i] = part
    return out


def _counts_of(seen: Sightings | None) -> torch.Tensor | None:
    """The counts of sightings the step counts into the rows it updates: per slot, as every entry
    of its rows has (the sightings of lookups of each id are made per slot before, by
    :meth:`SparseTrainer._sum_each`)."""
    if seen is None:
        return None
    if seen.counts is None:
        raise AssertionError("sightings of each id reached the step's rows")
    return seen.counts


def _grad_of(leaf: torch.Tensor) -> torch.Tensor:
    if leaf.grad is None:
        raise ValueError("a gathered leaf without a gradient reached the step (it is filtered before)")
    return leaf.grad


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
