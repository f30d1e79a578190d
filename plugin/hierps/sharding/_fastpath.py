"""Sharded passes on the fast path: routed once per pass in the background; rows and gradients per mini-batch.

:class:`PassRouter` is the part of :class:`~hierps.sharding.ShardedStore` behind ``prefetch``,
``begin_pass``, ``gather_planned``, ``fused_bag`` and the fast half of ``step``:

- ``prefetch(batches)`` hands the routing of the announced pass to a worker thread, which plans
  this rank's requests and the owner's serving (:mod:`hierps.sharding._routes`) and exchanges
  keys and per-mini-batch entries over a second channel of the transport (its ``companion()``),
  so that training goes on meanwhile; once it is done, the owner's rows are read ahead by the
  local store's own pipeline;
- at a training forward of an announced mini-batch, the first table of each dim group fetches
  the rows of all of them in one all-to-all (no keys: the owner knows what each rank needs); the
  tables then pool together, as in one process (:func:`~hierps.training._batchplan.pool_bags`);
- at the step, gradients go back in the order the rows came, and the owner sums each row's
  gradients from every rank and updates the rows of all tables with the store's fused step.

Every choice that changes which collectives run is taken by all ranks together: one small
all-reduce per pass (is the pass the one announced everywhere?) and per table of a fetched
mini-batch (are these the announced ids everywhere?), before the table takes any row: the first
table's agreement comes before the fetch of the whole group, the others' before they take their
rows from it. Once some rank's ids differ, every rank goes on with the generic path of
``ShardedStore.gather``, key by key, with the same results; the tables that took their rows from
a fetch before that step with them, and only those.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hierps._store import Store, store_parts
from hierps.errors import HierpsError
from hierps.sharding._local import OwnerParts
from hierps.sharding._routes import (
    Asked,
    OwnedPass,
    PassRequests,
    RoutedTable,
    Serving,
    owner_of,
    pass_keys,
    plan_serving,
    requests,
)
from hierps.training._batchplan import (
    BatchPlan,
    FusedBags,
    PassBatches,
    index_add_rows,
    pool_bags,
    same_batches,
)
from hierps.training._trainer import summed_grads

__all__ = ["Fetched", "PassRouter"]


@dataclass
class _Routed:
    """A pass routed: this rank's requests, its serving as owner, and the bytes it sent."""

    raw: list[dict[str, np.ndarray]]
    tables: list[RoutedTable]
    requests: PassRequests
    owned: OwnedPass
    fast: bool  # every rank agreed on the mini-batches and every owner's working set fits
    fits: bool  # this owner's working set fits its device budget (it is loaded whole)
    bytes_sent: int


@dataclass
class _Announced:
    raw: list[dict[str, np.ndarray]]
    tables: list[RoutedTable]
    routed: Future[_Routed]
    handed: bool = False  # its owned keys were announced to the local store (read ahead)


@dataclass
class _Leaf:
    """A leaf handed to a forward: its rows are ``rows[take]`` (or ``rows[start : start + n]``)."""

    leaf: torch.Tensor
    take: torch.Tensor | None
    start: int
    tables: Collection[str]  # the tables whose forwards used it (a pooled leaf: those that took a piece)


@dataclass
class Fetched:
    """One mini-batch of one dim group: rows fetched from their owners, pending until the step."""

    fast: _FastPass
    dim: int
    asked: Asked
    serving: Serving
    rows: torch.Tensor  # (R,) rows received, by owner, table, key
    slots: torch.Tensor  # (u,) device-tier slots of serving.uniq when the rows were sent
    generation: int  # the device tier's generation then
    leaves: list[_Leaf] = field(default_factory=list)
    fused: FusedBags | None = None
    agreed: set[str] = field(default_factory=set)  # tables every rank agreed take their rows from here


@dataclass
class _FastPass:
    routed: _Routed
    batches: dict[int, PassBatches]  # per dim: the mini-batches, as announced
    dim_of: dict[str, int]
    fetched: dict[tuple[int, int], Fetched] = field(default_factory=dict)
    slot_map: torch.Tensor | None = None  # device-tier slot of each owned key (tables joined)
    generation: int = -1
    fuse: bool = True


class PassRouter:
    """Announced passes of a sharded store: routing, fetching rows, returning gradients."""

    def __init__(self, local: Store, transport: Any, pend: Callable[[Fetched], None]) -> None:
        self.local = local
        self.parts: OwnerParts = store_parts(local)
        self.transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self.device = local.device
        self._pend = pend
        self._channel: Any = None  # the transport's companion, for routing on the worker
        self._worker: ThreadPoolExecutor | None = None
        self._next: _Announced | None = None
        self.fast: _FastPass | None = None
        self.in_pass = False
        self.bytes_sent = 0

    # -- routing -----------------------------------------------------------------------------------
    def _specs(self) -> list[RoutedTable]:
        tables = self.local.tables
        return [RoutedTable(n, tables[n].dim, not tables[n].admission.filters) for n in sorted(tables)]

    def _route(self, raw: list[dict[str, np.ndarray]], tables: list[RoutedTable], channel: Any) -> _Routed:
        """Plan and exchange a pass's routing over ``channel`` (collective on it)."""
        w = self.world_size
        keys, positions, start, joined = pass_keys(raw, tables)
        req = requests(raw, tables, owner_of(joined, w), w, self.device, keys, positions, start)
        sent = 0

        def exchange(parts: list[np.ndarray], counts: list[int] | None) -> list[np.ndarray]:
            nonlocal sent
            send_counts = [len(p) for p in parts]
            send = torch.from_numpy(np.concatenate(parts))
            sent += sum(p.nbytes for o, p in enumerate(parts) if o != self.rank)
            if counts is None:
                got, counts = channel.all_to_all(send, send_counts)
            else:
                got = channel.all_to_all_known(send, send_counts, counts)
            return np.split(got.cpu().numpy(), np.cumsum(counts)[:-1])

        headers = exchange(req.headers, None)
        n_t = len(tables)
        got_keys = exchange(req.keys, [int(h[1 : 1 + n_t].sum()) for h in headers])
        got_entries = exchange(req.entries, [int(h[1 + n_t :].sum()) for h in headers])
        owned = plan_serving(tables, req.n_batches, headers, got_keys, got_entries, self.device)
        tier = self.parts.core.device_tier
        fits = tier.bytes_for({t: len(k) for t, k in owned.keys.items()}) <= tier.budget
        bad = channel.all_reduce_sum(torch.tensor([float(not (fits and owned.agreed))], dtype=torch.float64))
        return _Routed(raw, tables, req, owned, bool(bad[0] == 0), fits, sent)

    def _submit(self, raw: list[dict[str, np.ndarray]], tables: list[RoutedTable]) -> Future[_Routed]:
        """Route on the worker over the companion channel; without one, here and now."""
        if self._channel is None and hasattr(self.transport, "companion"):
            self._channel = self.transport.companion()  # collective, like every prefetch
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hierps-route")
        if self._worker is not None:
            return self._worker.submit(self._route, raw, tables, self._channel)
        done: Future[_Routed] = Future()
        done.set_result(self._route(raw, tables, self.transport))
        return done

    def prefetch(self, raw: list[dict[str, np.ndarray]]) -> None:
        """Announce the next pass: routed in the background, then read ahead by its owners."""
        self._drop_next()
        tables = self._specs()
        self._next = _Announced(raw, tables, self._submit(raw, tables))
        self.poll()

    def _drop_next(self) -> None:
        nxt, self._next = self._next, None
        if nxt is not None:
            nxt.routed.result()  # its collectives ran on every rank; let it finish

    def poll(self) -> None:
        """During a pass: once the next pass is routed, let the local store read its rows ahead."""
        nxt = self._next
        if nxt is None or nxt.handed or not self.in_pass or not nxt.routed.done():
            return
        nxt.handed = True
        routed = nxt.routed.result()
        if routed.fits:
            self.local.prefetch(routed.owned.keys)

    # -- passes --------------------------------------------------------------------------------
    def begin_pass(self, raw: list[dict[str, np.ndarray]]) -> None:
        """Begin a pass (collective): its routing, as announced if every rank announced it."""
        tables = self._specs()
        nxt, self._next = self._next, None
        mine = nxt is not None and nxt.tables == tables and same_batches(nxt.raw, raw)
        others = self.transport.all_reduce_sum(torch.tensor([float(not mine)], dtype=torch.float64))
        if others[0] == 0 and nxt is not None:
            routed = nxt.routed.result()
        else:
            if nxt is not None:
                nxt.routed.result()
            routed = self._submit(raw, tables).result()
        self.bytes_sent += routed.bytes_sent
        owned = routed.owned.keys
        self.local.begin_pass(owned if routed.fits else [])  # too large: rows come on demand
        self.in_pass = True
        self.fast = None
        if routed.fast and routed.requests.asked:
            self.fast = _FastPass(
                routed,
                {
                    dim: PassBatches(list(a.batch for a in asked), 0)
                    for dim, asked in routed.requests.asked.items()
                },
                {t.name: t.dim for t in routed.tables if t.fast},
            )

    def end_pass(self) -> None:
        self.fast = None
        self.in_pass = False

    def close(self) -> None:
        try:
            self._drop_next()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            # Let the companion's process group go now, while the caller's groups still exist, not in
            # the interpreter's teardown, where destroying it can abort the process.
            self._channel = None

    # -- forwards ------------------------------------------------------------------------------
    def _agree(self, ok: bool) -> bool:
        bad = self.transport.all_reduce_sum(torch.tensor([float(not ok)], dtype=torch.float64))
        return bool(bad[0] == 0)

    def _fetched_for(self, table: str, ids: torch.Tensor) -> tuple[Fetched, int, BatchPlan] | None:
        """The fetched rows of ``table``'s next announced mini-batch, fetching them (collective) at
        the group's first forward; None (on every rank) when some rank's ids are not the announced."""
        fp = self.fast
        if fp is None or table not in fp.dim_of:
            return None
        dim = fp.dim_of[table]
        batches = fp.batches[dim]
        k = batches.cursor.get(table, 0)
        found = batches.next_plan(table, ids, 0)
        fetched = fp.fetched.get((dim, k))
        if fetched is None or table not in fetched.agreed:
            # Once per table and mini-batch (a forward may ask twice: pooled, then alone), on every
            # rank, before this table takes a row: all ranks go on fast, or all key by key.
            if not self._agree(found is not None):
                self.fast = None  # these are not the announced mini-batches: key by key from here on
                return None
            if fetched is None:
                fetched = fp.fetched[dim, k] = self._exchange(fp, dim, k)
                self._pend(fetched)
            fetched.agreed.add(table)
        if found is None:  # agreed for these ids, asked again with others in the same forward
            raise HierpsError(
                f"table {table!r}: mini-batch {k} of the pass was asked for with other ids within one forward."
            )
        return fetched, k, found[1]

    def _ran(self, fp: _FastPass, table: str, dim: int, k: int) -> None:
        batches = fp.batches[dim]
        batches.ran(table, k)
        if batches.batches[k] is None:  # every table of the group ran it
            fp.fetched.pop((dim, k), None)

    def gather_planned(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, BatchPlan] | None:
        """``table``'s rows of an announced mini-batch as a leaf (U, dim), and its plan, or None."""
        got = self._fetched_for(table, ids)
        if got is None:
            return None
        fetched, k, plan = got
        start = 0
        for t, p in fetched.asked.batch.plans.items():
            if t == table:
                break
            start += p.keys.numel()
        n = plan.keys.numel()
        take = fetched.asked.take
        if take is not None:
            take = take[start : start + n]
            leaf = fetched.rows.index_select(0, take)
        else:
            leaf = fetched.rows.narrow(0, start, n).detach()
        leaf.requires_grad_(True)
        fetched.leaves.append(_Leaf(leaf, take, start, [table]))
        self._ran(fetched.fast, table, fetched.dim, k)
        return leaf, plan

    def fused_bag(
        self, table: str, ids: torch.Tensor, offsets: torch.Tensor, mode: str
    ) -> torch.Tensor | None:
        """``table``'s (B, dim) pooled output of an announced mini-batch, pooled with the other tables
        of its dim, or None (see :meth:`hierps.training._trainer.SparseTrainer.fused_bag`)."""
        fp = self.fast
        if fp is None or not fp.fuse:
            return None
        got = self._fetched_for(table, ids)
        if got is None:
            return None
        fetched, k, plan = got
        fused = fetched.fused
        if fused is None:
            plans = list(fetched.asked.batch.plans.values())
            if any(p.ids.numel() != plan.ids.numel() for p in plans):
                fp.fuse = False  # bags of other sizes: table by table
                return None
            take = fetched.asked.take
            leaf = fetched.rows.index_select(0, take) if take is not None else fetched.rows.detach()
            leaf.requires_grad_(True)
            ends = np.cumsum([p.ids.numel() for p in plans]).tolist()
            bags = torch.cat([offsets] + [offsets + e for e in ends[:-1]])
            parts = [(p.ids.numel(), p.keys.numel(), p.coalesced) for p in plans]
            pooled = pool_bags(leaf, fetched.asked.batch.local, bags, mode, offsets.numel(), parts)
            fused = fetched.fused = FusedBags(
                leaf, {}, dict(zip(fetched.asked.batch.plans, pooled)), offsets, mode
            )
            fetched.leaves.append(_Leaf(leaf, take, 0, fused.used))  # the tables that take their piece
        if (
            table in fused.used
            or mode != fused.mode
            or not (offsets is fused.offsets or torch.equal(offsets, fused.offsets))
        ):
            fp.fuse = False  # this model's tables pool differently: one by one
            return None
        fused.used.add(table)
        self._ran(fp, table, fetched.dim, k)
        return fused.pieces[table]

    # -- the owner's side ------------------------------------------------------------------------
    def _slots(self, fp: _FastPass, at: torch.Tensor) -> torch.Tensor:
        """Device-tier slots of owned keys at positions ``at`` (the working set made resident again
        when something replaced it since the pass began)."""
        tier = self.parts.core.device_tier
        if fp.slot_map is None or fp.generation != tier.generation:
            owned = fp.routed.owned
            parts = []
            for spec in fp.routed.tables:
                keys = torch.from_numpy(owned.keys[spec.name]).to(self.device)
                if spec.fast and keys.numel():
                    parts.append(self.parts.passes.resident_slots(spec.name, keys))
                else:
                    parts.append(torch.zeros(keys.numel(), dtype=torch.int64, device=self.device))
            fp.slot_map = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=self.device)
            fp.generation = tier.generation
        return fp.slot_map[at]

    def _exchange(self, fp: _FastPass, dim: int, k: int) -> Fetched:
        """Send the rows of mini-batch ``k`` of group ``dim`` to the ranks that need them, count their
        sightings, and receive this rank's (collective)."""
        asked = fp.routed.requests.asked[dim][k]
        serving = fp.routed.owned.serving[dim][k]
        slots = self._slots(fp, serving.uniq)
        at = 0
        for t, n in zip(serving.tables, serving.splits):
            if n:
                self.parts.trainer.count_sightings(t, slots[at : at + n], serving.counts[at : at + n])
            at += n
        sent = slots if serving.inverse is None else slots[serving.inverse]
        rows = self._rows(fp, serving, sent, dim)
        self._count(rows, serving.send_counts)
        got = self.transport.all_to_all_known(rows, serving.send_counts, asked.recv_counts).to(self.device)
        return Fetched(fp, dim, asked, serving, got, slots, self.parts.core.device_tier.generation)

    def _rows(self, fp: _FastPass, serving: Serving, slots: torch.Tensor, dim: int) -> torch.Tensor:
        """(n, dim) weights of the rows at ``slots``, the tables of ``serving`` in sending order."""
        tier = self.parts.core.device_tier
        layouts = {t: self.local.info(t).layout for t in serving.tables}
        if len({(id(tier.arena(t)), layouts[t].weights) for t in serving.tables}) == 1:
            t = serving.tables[0]
            return layouts[t].gather_weights(tier.arena(t).rows, slots)
        out = torch.empty((slots.numel(), dim), dtype=torch.float32, device=self.device)
        owned = fp.routed.owned
        for t in serving.tables:
            first = owned.start[t]
            mine = (serving.at >= first) & (serving.at < first + len(owned.keys[t]))
            out[mine] = layouts[t].gather_weights(tier.arena(t).rows, slots[mine])
        return out

    def _count(self, t: torch.Tensor, counts: list[int]) -> None:
        per_row = t[0].numel() * t.element_size() if t.numel() else 0
        self.bytes_sent += per_row * (sum(counts) - counts[self.rank])

    # -- the step --------------------------------------------------------------------------------
    def gradients(self, fetched: list[Fetched]) -> tuple[list[torch.Tensor], set[str], bool]:
        """The requester's gradients of fetched rows, in the order they came: one (R, dim) per
        mini-batch; the tables that got a gradient; whether all of it is finite."""
        stepped: set[str] = set()
        out = []
        with_grad = [leaf for f in fetched for leaf in f.leaves if leaf.leaf.grad is not None]
        dense = dict(zip(map(id, with_grad), summed_grads([x.leaf for x in with_grad])))
        finite = True
        for f in fetched:
            mine = [(x, dense[id(x)]) for x in f.leaves if id(x) in dense]
            for x, _ in mine:
                stepped.update(x.tables)
            if len(mine) == 1 and mine[0][0].take is None and mine[0][1].shape[0] == f.rows.shape[0]:
                grad = mine[0][1]  # one leaf of every row, in the order they came (pooled, one rank)
            else:
                grad = torch.zeros_like(f.rows)
                for x, g in mine:
                    if x.take is None:
                        grad.narrow(0, x.start, g.shape[0]).add_(g)
                    else:
                        index_add_rows(grad, x.take, g)
            # NaN and inf survive a sum; check exactly only when the sum is not finite (overflow).
            ok = bool(torch.isfinite(grad.sum())) or bool(torch.isfinite(grad).all())
            finite = finite and ok
            out.append(grad)
        return out, stepped, finite

    def send_back(
        self, fetched: list[Fetched], grads: list[torch.Tensor], stepped: set[str]
    ) -> dict[str, list[tuple[Fetched, int, torch.Tensor]]]:
        """Gradients back to the owners (collective): per table stepped anywhere, what this rank
        owns: (the mini-batch, the table's first row in its ``serving.uniq``, summed gradients)."""
        out: dict[str, list[tuple[Fetched, int, torch.Tensor]]] = {}
        scale = 1.0 / self.world_size
        for f, grad in zip(fetched, grads):
            s = f.serving
            if not stepped & set(s.tables):
                continue  # no table of the group stepped anywhere: every rank skips it
            self._count(grad, f.asked.recv_counts)
            got = self.transport.all_to_all_known(grad, f.asked.recv_counts, s.send_counts).to(self.device)
            if s.inverse is not None:
                got = index_add_rows(
                    torch.zeros((s.uniq.numel(), got.shape[1]), device=self.device), s.inverse, got
                )
            if self.world_size > 1:
                got = got * scale
            at = 0
            for t, n in zip(s.tables, s.splits):
                if t in stepped and t in f.agreed:  # not a table that went key by key at this mini-batch
                    out.setdefault(t, []).append((f, at, got[at : at + n]))
                at += n
        return out

    def apply(
        self, updates: dict[str, list[tuple[Fetched, int, torch.Tensor]]], by_keys: set[str]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Apply by slots what can go so (the fused step): tables not in ``by_keys`` with one
        mini-batch of the current pass; -> the rest as ``{table: (keys, grads)}``, for
        :meth:`hierps.Store.apply_gradients`."""
        slotted, keyed = [], {}
        generation = self.parts.core.device_tier.generation
        for table, items in updates.items():
            f, at, grad = items[0]
            if len(items) == 1 and f.generation == generation and table not in by_keys:
                slotted.append((table, f.slots[at : at + grad.shape[0]], grad))  # views: joined, not copied
                continue
            keys = [
                torch.from_numpy(i[0].fast.routed.owned.joined).to(self.device)[
                    i[0].serving.uniq[i[1] : i[1] + i[2].shape[0]]
                ]
                for i in items
            ]
            keyed[table] = (torch.cat(keys), torch.cat([i[2] for i in items]))
        self.parts.trainer.apply_slot_gradients(slotted)
        return keyed
