"""Mini-batches translated ahead: each table's ids of each mini-batch of a pass, as working-set slots.

When a pass is announced (:meth:`hierps.Store.prefetch`, or at :meth:`hierps.Store.begin_pass`),
every mini-batch's ids of every table are deduplicated and translated into the slots the device
tier will give their rows (:meth:`hierps.tiers.DeviceTier.layout`), on the pipeline's worker. A
training forward then only checks that its ids are the announced ones (one comparison) and
gathers its rows: no sort, no search, no host round trip on the training thread.

Example: a pass of two mini-batches of table ``"user"`` with ids ``[7, 3, 7]`` then ``[3]``,
resident as keys ``[3, 7]`` from slot 10 on, translates into ``keys [3, 7]``, ``local [1, 0, 1]``,
``counts [1, 2]``, ``slots [10, 11]``, then ``keys [3]``, ``local [0]``, ``counts [1]``, ``slots [10]``.

The tables of a mini-batch that share a row arena, dim and weights dtype go further
(:class:`RowGroup`): the first table's forward gathers the rows of all of them in one call; each
table's forward then pools (or looks up) its own slice with its own offsets
(:func:`table_rows`), and its backward leaves that table's gradient, summed per row, for the step,
which updates them all with one optimizer call. A sum-pooled table's gradient is itself one
``embedding_bag``: of the output gradients, over each key's ids (``BatchPlan.order`` /
``.starts``, sorted ahead), in the order torch's own sparse optimizer would sum them
(:func:`sum_order`).
(The sharded store pools the tables of one offsets tensor with one ``embedding_bag``:
:class:`FusedBags`, :func:`pool_bags`.)
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from hierps.storage import _native

__all__ = [
    "BagIds",
    "Batch",
    "BatchPlan",
    "FusedBags",
    "JoinedBags",
    "PassBatches",
    "RowGroup",
    "look_up",
    "pool_bags",
    "add_in_sum_order",
    "add_joined_in_sum_order",
    "add_parts_in_sum_order",
    "same_batches",
    "sum_order",
    "table_rows",
    "translate",
    "union_positions",
]


class BagIds(np.ndarray):
    """An announced mini-batch's ids of one table (n,) int64 that came with their bags' ``offsets``
    (B,) int64 (:class:`hierps.Bags`). Only the array made from the announcement carries them: a
    view or a piece of it (routing ids to their owners) has ``offsets`` None."""

    offsets: np.ndarray | None

    def __array_finalize__(self, obj: object) -> None:
        self.offsets = None


def bag_ids(ids: np.ndarray, offsets: np.ndarray) -> BagIds:
    """``ids`` (n,) int64 carrying ``offsets`` (B,) int64 (checked by the caller)."""
    out = ids.view(BagIds)
    out.offsets = offsets
    return out


def sum_order(ids: torch.Tensor) -> torch.Tensor:
    """Positions of ``ids`` (n,) int64 grouped by id, each id's in the order ``Tensor.coalesce``
    sums a sparse gradient's duplicates -> (n,) int64: the permutation of its non-stable
    ``torch.sort`` (what ``torch.optim.Adagrad`` and ``SparseAdam`` step with). A table that does
    not coalesce sums in the order the ids come (``index_add_``'s, as ``torch.optim.SGD`` adds them).
    A sort decides by comparing ids only, so any order-preserving renumbering of the ids (a table's
    local ids) gives the same positions.
    """
    return torch.sort(ids).indices


# Below this many ids torch's CPU sort is std::sort, row by row of a 2-D input as of a 1-D one;
# from it on a 1-D sort of integers may take another (stable) algorithm.
_ROWWISE_BELOW = 32_768


def add_in_sum_order(
    grad: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, coalesced: bool
) -> torch.Tensor:
    """``grad`` (U, dim) plus each of ``values`` (n, dim) at its row ``rows`` (n,), each row's
    summed in :func:`sum_order` if ``coalesced``, else in the order of ``rows`` -> ``grad``,
    changed in place."""
    return add_parts_in_sum_order(grad, [rows], [values], [coalesced], [grad.shape[0]])


def add_parts_in_sum_order(
    grad: torch.Tensor,
    rows: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    coalesced: Sequence[bool],
    row_counts: Sequence[int],
) -> torch.Tensor:
    """``grad`` (sum U_i, dim), parts after one another (part i: ``row_counts[i]`` rows U_i), plus
    each part's ``values[i]`` (n_i, dim) at its rows ``rows[i]`` (n_i,) within its own U_i -> ``grad``,
    changed in place. On the CPU each part is added into its own slice of ``grad`` (a slice stays in
    the cache, where the rows of all parts at once would not); on an accelerator all parts by one
    ``index_add_`` (one kernel). Each row's values are summed in :func:`sum_order` where
    ``coalesced[i]``, else in their order; the coalesced parts of one length are sorted by one
    row-wise sort, which orders each row as a sort of it alone does."""
    if grad.device.type != "cpu" and len(rows) > 1:
        firsts = np.cumsum([0, *row_counts[:-1]]).tolist()
        joined_rows = torch.cat([r + first if first else r for r, first in zip(rows, firsts)])
        return add_joined_in_sum_order(grad, joined_rows, torch.cat(list(values)), rows, coalesced)
    pieces = grad.split(list(row_counts)) if len(rows) > 1 else [grad]
    for piece, r, v, order in zip(pieces, rows, values, _sum_orders(rows, coalesced)):
        if order is not None:
            r, v = r.index_select(0, order), v.index_select(0, order)
        index_add_rows(piece, r, v)
    return grad


def add_joined_in_sum_order(
    grad: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    keys: Sequence[torch.Tensor],
    coalesced: Sequence[bool],
) -> torch.Tensor:
    """``grad`` plus ``values`` (n, dim) at ``rows`` (n,) of ``grad`` by one ``index_add_`` ->
    ``grad``, changed in place. The entries come in parts, part i the next ``keys[i].numel()``
    ones, its ``keys[i]`` the ids (or any numbers ordered as they are) its rows stand for; no row
    takes entries of two parts. Each row's entries are summed in :func:`sum_order` of its part's
    keys where ``coalesced[i]``, else in their order."""
    if any(coalesced):
        order = _joined_sum_order(keys, coalesced)
        rows, values = rows.index_select(0, order), values.index_select(0, order)
    return index_add_rows(grad, rows, values)


def index_add_rows(grad: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``grad.index_add_(0, rows, values)`` -> ``grad``: by the compiled core for float32 rows on the
    CPU (the same floats, one add an element with the entries in order, without torch's dispatch per
    entry: about 5x faster at a mini-batch's rows of dim 16), else by torch."""
    if (
        grad.device.type == "cpu"
        and grad.dtype == values.dtype == torch.float32
        and rows.dtype == torch.int64
        and grad.dim() == values.dim() == 2
        and values.shape == (rows.numel(), grad.shape[1])
        and grad.is_contiguous()
        and not (grad.requires_grad or values.requires_grad)
        and _native.enabled()
    ):
        _native.index_add_rows(grad.numpy(), rows.contiguous().numpy(), values.contiguous().numpy())
        return grad
    return grad.index_add_(0, rows, values)


def _sum_orders(rows: Sequence[torch.Tensor], coalesced: Sequence[bool]) -> list[torch.Tensor | None]:
    """Each part's positions in its :func:`sum_order` where coalesced, else None (their order)."""
    orders: list[torch.Tensor | None] = [None] * len(rows)
    n = rows[0].numel() if len(rows) else 0
    if all(coalesced) and 0 < n < _ROWWISE_BELOW and all(r.numel() == n for r in rows):  # one sort
        return list(torch.sort(torch.stack(list(rows)), dim=1).indices.unbind(0))
    alike: dict[int, list[int]] = {}
    for k, (r, c) in enumerate(zip(rows, coalesced)):
        if not c:
            continue
        if r.numel() < _ROWWISE_BELOW:
            alike.setdefault(r.numel(), []).append(k)
        else:
            orders[k] = sum_order(r)
    for ks in alike.values():
        perm = torch.sort(torch.stack([rows[k] for k in ks]), dim=1).indices
        for j, k in enumerate(ks):
            orders[k] = perm[j]
    return orders


def _joined_sum_order(rows: Sequence[torch.Tensor], coalesced: Sequence[bool]) -> torch.Tensor:
    """The positions of the joined ``rows`` parts: each coalesced part's in its :func:`sum_order`,
    the others' in their order."""
    starts = np.cumsum([0, *[r.numel() for r in rows[:-1]]]).tolist()
    return torch.cat(
        [
            torch.arange(start, start + r.numel(), device=r.device) if order is None else order + start
            for r, order, start in zip(rows, _sum_orders(rows, coalesced), starts)
        ]
    )


@dataclass(frozen=True)
class _Piece:
    """A table's part of an array joined over its mini-batch's tables: ``size`` entries from
    ``start``, each less ``shift`` (the joined array holds them shifted past the tables before)."""

    array: torch.Tensor  # int32 where a mini-batch's ids allow (half the bytes held), else int64
    start: int
    size: int
    shift: int

    def get(self) -> torch.Tensor:
        part = self.array.narrow(0, self.start, self.size)
        return (part - self.shift if self.shift else part).to(torch.int64)


@dataclass
class BatchPlan:
    """One table's ids of one mini-batch, translated (all tensors on the training device).

    ``local``, ``order``, ``starts`` and ``bags`` are held once, joined over the mini-batch's tables
    (:class:`Batch`): a table's own are made from them when first asked for (the paths that run
    the tables one by one), so the plans of a pass keep only the joined arrays alive.
    """

    ids: torch.Tensor  # (n,) int64 the ids as announced (a private copy)
    keys: torch.Tensor  # (U,) int64 sorted distinct ids
    counts: torch.Tensor  # (U,) float32 occurrences of each key
    slots: torch.Tensor  # (U,) int64 device-tier slots of the keys' rows
    # Announced bags (hierps.Bags), else None: their offsets (B,).
    offsets: torch.Tensor | None = None
    coalesced: bool = False  # the table sums a key's gradients in torch's coalesce order (sum_order)
    # where local / order / starts (and bags, if announced) come from
    pieces: dict[str, _Piece] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def local(self) -> torch.Tensor:
        """(n,) int64 position of each id in keys."""
        return self.pieces["local"].get()

    @functools.cached_property
    def order(self) -> torch.Tensor:
        """(n,) int64 positions of the ids sorted by key, in sum_order."""
        return self.pieces["order"].get()

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        """(U,) int64 each key's first entry in order."""
        return self.pieces["starts"].get()

    @functools.cached_property
    def bags(self) -> torch.Tensor | None:
        """(n,) int64 the bag of each id in ``order``, where bags were announced, else None."""
        piece = self.pieces.get("bags")
        return None if piece is None else piece.get()


@dataclass
class Batch:
    """The plans of one mini-batch's tables, and the same joined over its tables in order.

    ``slots``, ``counts`` and ``local`` (each table's local ids shifted past the keys of the
    tables before it) let all tables of the mini-batch be gathered and pooled in one call
    (:class:`FusedBags`); ``plans[t].slots`` / ``.counts`` are views into them.
    """

    plans: dict[str, BatchPlan]
    slots: torch.Tensor  # (sum U,) int64
    counts: torch.Tensor  # (sum U,) float32
    # Positions within the mini-batch (``local``, ``order``, ``starts`` and the bags' arrays) are
    # int32 where its ids fit, else int64: the plans of about two passes are held at once.
    local: torch.Tensor  # (sum n,)
    # Joined over the tables too, for one backward of all of them: each table's ``order`` shifted
    # past the ids of the tables before it (sum n,), and its ``starts`` likewise (sum U,).
    order: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    # When every table's bags were announced: the same joined, for one pooling of all of them
    # (:func:`pool_bags`), and None otherwise.
    bags: JoinedBags | None = None


@dataclass
class JoinedBags:
    """The announced bags of a mini-batch's tables joined in their order: ``offsets`` (sum B,) into
    :attr:`Batch.local`, ``counts`` each table's B, and for the summed gradient ``ids_bags``
    (sum n,), each id's bag with the ids sorted by row (each row's first entry there:
    :attr:`Batch.starts`)."""

    offsets: torch.Tensor
    counts: list[int]
    ids_bags: torch.Tensor


@dataclass
class FusedBags:
    """One ``embedding_bag`` over the rows of several tables of a mini-batch, split per table.

    ``leaf`` holds the weights of every member table's keys (table after table); ``pieces[t]``
    is table t's pooled output, a piece of one ``torch.split``, so autograd runs one backward
    for all of them and leaves one gradient in ``leaf``.
    """

    leaf: torch.Tensor  # (sum U, dim), requires grad
    rows: dict[str, slice]  # each member's rows of leaf
    pieces: dict[str, torch.Tensor]  # each member's (B, dim) output
    offsets: torch.Tensor  # (B,) the bags, as the first member's forward gave them
    mode: str
    used: set[str] = field(default_factory=set)


_MODES = {"sum": 0, "mean": 1, "max": 2}  # torch's embedding_bag mode codes


@dataclass
class RowGroup:
    """The rows of the tables of one mini-batch that share an arena, dim and weights dtype,
    gathered by one call at the first member's forward.

    ``weights`` requires grad only so that the members' outputs do: its own ``.grad`` stays None.
    Each member's backward leaves its (U_t, dim) gradient in ``grads`` instead. ``stored`` are the
    whole rows as gathered, for the step to update without gathering them again, as long as the
    arena's rows have not changed since (``source`` and its version counter say so).
    """

    weights: torch.Tensor  # (sum U_t, dim) float32, the members' rows table after table
    start: dict[str, int]  # each member's first row in weights
    left: int  # members whose forward has not taken its rows yet
    slots: torch.Tensor  # (sum U_t,) int64 the rows' arena slots
    stored: torch.Tensor | None  # (sum U_t, words) float32 the rows as gathered; None once used
    source: torch.Tensor  # the arena's rows they were gathered from
    version: int  # source._version at the gather
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    # Bags of one offsets tensor for every member, pooled at once (pool_bags): each member's piece,
    # taken by its forward when it brings the same offsets; their gradient lands in weights.grad.
    pieces: dict[str, torch.Tensor] | None = None
    offsets: torch.Tensor | None = None
    mode: str | None = None
    # ...or of each member's own offsets as announced (hierps.Bags), pooled concatenated.
    bag_offsets: dict[str, torch.Tensor] | None = None
    pooled: set[str] = field(default_factory=set)  # members that took their piece
    backed: set[int] = field(default_factory=set)  # members (by index) whose piece a backward reached

    def gradient(self, table: str, rows: int) -> torch.Tensor | None:
        """``table``'s (rows, dim) gradient, summed per row, or None when no backward reached it."""
        grad = self.grads.get(table)
        if grad is None and table in self.pooled and self.weights.grad is not None:
            if list(self.start).index(table) in self.backed:
                grad = self.weights.grad.narrow(0, self.start[table], rows)
        return grad

    def rows_of(self, source: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """The rows at ``slots`` of ``source`` as gathered at the forward, if they still are those
        (the same arena tensor, not written since, the same slots), else None. Given once."""
        if (
            self.stored is None
            or source is not self.source
            or source._version != self.version
            or slots.numel() != self.slots.numel()
            or not torch.equal(slots, self.slots)
        ):
            return None
        stored, self.stored = self.stored, None
        return stored


class _TableRows(torch.autograd.Function):
    """One table's forward on its slice of a :class:`RowGroup`: torch's own kernels, so the floats
    are those of ``F.embedding`` / ``F.embedding_bag`` on the table's gathered rows. The backward
    sums the gradient per row as ``summed_grads`` sums torch's sparse gradient (in
    :func:`sum_order`) and leaves it in the group."""

    @staticmethod
    def forward(ctx, weights, group, table, plan, shape, mode, offsets, psw, include_last, pad):
        rows = weights.narrow(0, group.start[table], plan.keys.numel())
        local = plan.local
        ctx.kept = (group, table, plan, mode, offsets, psw, include_last, pad, None)
        if mode is None:  # nn.Embedding
            return rows.index_select(0, local).view(*shape, rows.shape[1])
        if offsets is None:  # (B, L): bags of L ids each, as F.embedding_bag makes them
            offsets = torch.arange(0, local.numel(), shape[1], dtype=torch.int64, device=local.device)
        if _summed(mode, psw, include_last, pad):  # the backward needs none of the kernel's by-products
            ctx.kept = (group, table, plan, mode, offsets, psw, include_last, pad, None)  # the 2-D offsets
            return F.embedding_bag(local, rows, offsets, mode="sum")
        out, *by_products = torch.ops.aten._embedding_bag(
            rows, local, offsets, False, _MODES[mode], mode != "max", psw, include_last, _pad(pad)
        )
        ctx.kept = (group, table, plan, mode, offsets, psw, include_last, pad, by_products)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        group, table, plan, mode, offsets, psw, include_last, pad, by_products = ctx.kept
        n_rows, dim = plan.keys.numel(), grad_out.shape[-1]
        if mode is None:  # nn.Embedding: each id's gradient is its output row's
            grad_ids = grad_out.reshape(-1, dim)
            if pad is None:
                grad = F.embedding_bag(plan.order, grad_ids, plan.starts, mode="sum")
            else:
                keep = plan.local != pad  # torch's sparse gradient leaves the padding row's ids out
                grad = add_in_sum_order(
                    grad_out.new_zeros((n_rows, dim)), plan.local[keep], grad_ids[keep], plan.coalesced
                )
        elif by_products is None:
            # Each key's gradient: the sum of its ids' bags' gradients, an embedding_bag of them.
            bags = _bags_of(offsets, plan.local.numel(), plan.order)
            grad = F.embedding_bag(bags, grad_out.contiguous(), plan.starts, mode="sum")
        else:
            offset2bag, bag_size, max_indices = by_products
            spread = torch.ops.aten._embedding_bag_backward(
                grad_out,
                plan.local,
                offsets,
                offset2bag,
                bag_size,
                max_indices,
                n_rows,
                False,
                _MODES[mode],
                mode != "max",
                psw,
                _pad(pad),
            )
            if spread.is_sparse:
                grad = add_in_sum_order(
                    grad_out.new_zeros((n_rows, dim)), spread._indices()[0], spread._values(), plan.coalesced
                )
            else:
                grad = spread
        before = group.grads.get(table)
        group.grads[table] = grad if before is None else before + grad
        return None, None, None, None, None, None, None, None, None, None


def _summed(mode: str, psw: torch.Tensor | None, include_last: bool, pad: int | None) -> bool:
    """Plain sums of bags that cover the ids: their gradient is an ``embedding_bag`` of the bags'."""
    return mode == "sum" and psw is None and not include_last and pad is None


def _pad(pad: int | None) -> int:
    return -1 if pad is None else pad


def _bags_of(offsets: torch.Tensor, n: int, order: torch.Tensor) -> torch.Tensor:
    """The bag of each id at ``order`` (n,), for bags starting at ``offsets`` (B,) and covering n ids."""
    if offsets.device.type == "cpu":  # numpy's repeat is several times faster here
        starts = offsets.numpy()
        bag_of = np.repeat(np.arange(len(starts), dtype=order.numpy().dtype), np.diff(starts, append=n))
        return torch.from_numpy(bag_of[order.numpy()])
    sizes = torch.diff(offsets, append=offsets.new_tensor([n]))
    bag_numbers = torch.arange(offsets.numel(), dtype=order.dtype, device=offsets.device)
    return torch.repeat_interleave(bag_numbers, sizes)[order]


def table_rows(
    group: RowGroup,
    table: str,
    plan: BatchPlan,
    shape: tuple[int, ...],
    mode: str | None,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None,
    include_last_offset: bool,
    pad: int | None,
) -> torch.Tensor:
    """``table``'s forward of an announced mini-batch on its rows of ``group``.

    shape: the ids' shape; mode None: an embedding lookup -> (*shape, dim); else a pooling of
    bags (``offsets`` as checked by the module, None for (B, L) ids) -> (B, dim);
    per_sample_weights (n,) float32 or None; pad: the padding key's row in the table's keys, or
    None. After backward, the table's (U, dim) gradient is ``group.grads[table]``.
    """
    return _TableRows.apply(
        group.weights, group, table, plan, shape, mode, offsets, per_sample_weights, include_last_offset, pad
    )


class _PooledBags(torch.autograd.Function):
    """``embedding_bag`` over many tables' bags at once, its output split per table.

    torch's own kernels pool and spread the gradient back to the ids (so the floats are those
    of pooling table by table); the leaf's gradient is then summed per row table by table, into
    that table's slice of one dense gradient: small, cache-friendly sums, in the order of the
    ids. Nothing is kept as a saved tensor, so each table's output may be backpropagated on its
    own, in separate ``backward`` calls, as with separate modules.
    """

    @staticmethod
    def forward(ctx, leaf, local, bags, mode, bag_count, members, backed, by_key, by_order):
        ctx.set_materialize_grads(False)  # an output no loss uses comes back as None, not zeros
        ctx.backed, ctx.by_key, ctx.by_order = backed, by_key, by_order
        out, offset2bag, bag_size, max_indices = torch.ops.aten._embedding_bag(
            leaf, local, bags, False, _MODES[mode], True, None, False, -1
        )
        # Summed bags of one id each (one-hot features): each id's gradient is its bag's.
        one_hot = (
            mode == "sum"
            and local.numel() == bags.numel()
            and torch.equal(bags, torch.arange(bags.numel(), dtype=bags.dtype, device=bags.device))
        )
        ctx.kept = (
            local,
            bags,
            offset2bag,
            bag_size,
            max_indices,
            leaf.shape,
            _MODES[mode],
            members,
            one_hot,
        )
        return tuple(out.split(bag_count))

    @staticmethod
    def backward(ctx, *grads):
        local, bags, offset2bag, bag_size, max_indices, shape, mode, members, one_hot = ctx.kept
        if ctx.backed is not None:
            ctx.backed.update(i for i, g in enumerate(grads) if g is not None)
        some = next(g for g in grads if g is not None)
        # contiguous: index_add_ reads strided rows slowly
        grad_out = torch.cat([g if g is not None else torch.zeros_like(some) for g in grads])
        if ctx.by_key is not None or ctx.by_order is not None:
            # summed bags: each key's gradient, the sum of its ids' bags'
            if ctx.by_key is not None:
                ids_bags, starts = ctx.by_key
            else:  # the bags the forward pooled (torch checked them): each id's, in the order given
                order, starts = ctx.by_order
                ids_bags = order if one_hot else _bags_of(bags, local.numel(), order)
            return F.embedding_bag(ids_bags, grad_out, starts, mode="sum"), *[None] * 8
        sizes = [n for n, _, _ in members]
        if one_hot:
            values = grad_out.split(sizes)  # each id's bag is itself
        else:
            spread = torch.ops.aten._embedding_bag_backward(
                grad_out,
                local,
                bags,
                offset2bag,
                bag_size,
                max_indices,
                shape[0],
                False,
                mode,
                True,
                None,
                -1,
            )
            values = spread._values().split(sizes)  # one row per id, in order
        firsts = np.cumsum([0, *[n_rows for _, n_rows, _ in members[:-1]]]).tolist()
        rows_of = local.to(torch.int64).split(sizes)  # (the sums take int64 rows: one cast for all)
        grad = add_parts_in_sum_order(
            torch.zeros(shape, dtype=some.dtype, device=some.device),
            [rows - first if first else rows for rows, first in zip(rows_of, firsts)],
            values,
            [c for _, _, c in members],
            [n_rows for _, n_rows, _ in members],
        )
        return grad, *[None] * 8


def pool_bags(
    leaf: torch.Tensor,
    local: torch.Tensor,
    bags: torch.Tensor,
    mode: str,
    bag_count: int | list[int],
    members: list[tuple[int, int, bool]],
    backed: set[int] | None = None,
    by_key: tuple[torch.Tensor, torch.Tensor] | None = None,
    by_order: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Pool the rows of T tables at once -> T outputs of (B_t, dim).

    leaf: (U, dim) the tables' rows one table after the other; local: (N,) each id's row of
    leaf; bags: (sum B_t,) bag starts in local, table after table; bag_count: B (every table's)
    or each B_t; mode ``"sum"`` or ``"mean"``; members: per table, its id count n_t (its ids are
    the next n_t of ``local``), its row count U_t (the next U_t rows of ``leaf``) and whether it
    sums in torch's coalesce order
    (:func:`sum_order`; ``by_key`` was sorted so already). The leaf's gradient is dense. ``backed``: if given, gets
    the index of each output a backward reached. ``by_key`` (sum only): the bag of each id with
    the ids sorted by row (N,), and each row's first entry there (U,): the backward is then one
    ``embedding_bag`` of the output gradients, summing each row's in that order. ``by_order`` (sum
    only; in place of ``by_key`` where the bags are not known ahead): the ids sorted by row (N,) and
    each row's first entry there (U,); the backward finds each id's bag among ``bags`` and sums the
    same way.
    """
    bags = bags.to(local.dtype)  # a plan's joined ids may be int32: torch pools ids and bags of one type
    return _PooledBags.apply(leaf, local, bags, mode, bag_count, members, backed, by_key, by_order)


class _LookedUp(torch.autograd.Function):
    """``nn.Embedding`` lookups of many tables at once: one ``index_select`` of their ids' rows,
    split per table (each piece a table's (n_t, dim) rows, in the order of its ids). The backward
    sums each row's gradient over its ids, in their order, by one ``embedding_bag`` over all tables
    (``order`` / ``starts``: the ids sorted by row, joined), as each table's own backward does."""

    @staticmethod
    def forward(ctx, leaf, local, sizes, order, starts, backed):
        ctx.set_materialize_grads(False)  # an output no loss uses comes back as None, not zeros
        ctx.kept, ctx.sizes = (order, starts, backed), sizes
        return tuple(leaf.index_select(0, local).split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        order, starts, backed = ctx.kept
        backed.update(i for i, g in enumerate(grads) if g is not None)
        some = next(g for g in grads if g is not None)
        # the pieces were handed out as views of the ids' shape: flatten each back to (n_t, dim)
        flat = [
            g.reshape(-1, some.shape[-1]) if g is not None else some.new_zeros(n, some.shape[-1])
            for g, n in zip(grads, ctx.sizes)
        ]
        grad_ids = torch.cat(flat)
        return F.embedding_bag(order, grad_ids, starts, mode="sum"), None, None, None, None, None


def look_up(
    leaf: torch.Tensor,
    local: torch.Tensor,
    sizes: list[int],
    order: torch.Tensor,
    starts: torch.Tensor,
    backed: set[int],
) -> tuple[torch.Tensor, ...]:
    """The rows of every id of T tables at once -> T pieces (n_t, dim) (see :class:`_LookedUp`);
    ``backed`` gets the index of each piece a backward reached."""
    return _LookedUp.apply(leaf, local, sizes, order, starts, backed)


@dataclass
class PassBatches:
    """The translated mini-batches of the current pass and, per table, the next one expected.

    A mini-batch's plans are let go once each of its tables has run it.
    """

    batches: list[Batch | None]
    generation: int  # the device tier's generation the slots belong to
    cursor: dict[str, int] = field(default_factory=dict)
    # by (mini-batch index, arena, dim, weights dtype): the tables of a mini-batch gathered together
    groups: dict[tuple[int, int, int, str], RowGroup] = field(default_factory=dict)
    left: list[int] = field(init=False)  # tables of each mini-batch that have not run it yet

    def __post_init__(self) -> None:
        self.left = [len(b.plans) if b is not None else 0 for b in self.batches]

    def next_plan(self, table: str, ids: torch.Tensor, generation: int) -> tuple[int, BatchPlan] | None:
        """(index, plan) of ``table``'s next announced mini-batch if ``ids`` are its ids, else None."""
        if generation != self.generation:
            return None
        k = self.cursor.get(table, 0)
        batch = self.batches[k] if k < len(self.batches) else None
        plan = batch.plans.get(table) if batch is not None else None
        if plan is None or plan.ids.numel() != ids.numel():
            return None
        if not torch.equal(plan.ids, ids if ids.dim() == 1 else ids.reshape(-1)):  # (a view costs µs)
            return None
        return k, plan

    def ran(self, table: str, k: int) -> None:
        """``table`` ran mini-batch ``k``: expect the next one."""
        self.cursor[table] = k + 1
        self.left[k] -= 1
        if self.left[k] == 0:
            self.batches[k] = None

    def match(self, table: str, ids: torch.Tensor, generation: int) -> BatchPlan | None:
        """:meth:`next_plan`'s plan, the mini-batch then counting as run for ``table``."""
        found = self.next_plan(table, ids, generation)
        if found is None:
            return None
        self.ran(table, found[0])
        return found[1]


def same_batches(a: Sequence[Mapping[str, np.ndarray]], b: Sequence[Mapping[str, np.ndarray]]) -> bool:
    """Whether two passes have the same mini-batches: the same tables and ids, in the same order."""
    return len(a) == len(b) and all(
        x is y or x.keys() == y.keys() and all(x[t] is y[t] or np.array_equal(x[t], y[t]) for t in x)
        for x, y in zip(a, b)
    )


def union_positions(
    batches: Sequence[Mapping[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """The sorted distinct ids of each table over all ``batches`` (the working set of a pass), and
    the position of each id of each batch in them."""
    tables = dict.fromkeys(t for batch in batches for t in batch)
    keys: dict[str, np.ndarray] = {}
    positions: list[dict[str, np.ndarray]] = [{} for _ in batches]
    for t in tables:
        ids = [b[t] for b in batches if t in b]
        keys[t], at = _unique_inverse(np.concatenate(ids))
        ends = np.cumsum([len(i) for i in ids])
        parts = iter(np.split(at.reshape(-1), ends[:-1]))
        for b, pos in zip(batches, positions):
            if t in b:
                pos[t] = next(parts)
    return keys, positions


def _unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)``: by the compiled core's hashing (only the distinct ids
    are sorted), else by one stable argsort."""
    if len(ids) == 0:
        return ids.copy(), np.empty(0, np.int64)
    if _native.enabled():
        keys, inverse, _ = _native.unique_ids(np.ascontiguousarray(ids, np.int64))
        return keys.copy(), inverse  # the keys stay with the pass: not a view of the whole buffer
    order = np.argsort(ids, kind="stable")
    ranked = ids[order]
    first = np.empty(len(ids), bool)
    first[0] = True
    np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
    inverse = np.empty(len(ids), np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ranked[first], inverse


def _grouped(
    ids: np.ndarray, keep: np.ndarray, at: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """ids (n,) int64, all among ``keep`` (sorted distinct), ``at`` their positions in it if known ->
    the distinct ids' positions in ``keep`` (u,), their counts (u,), each id's number among them (n,)
    and, from the compiled core, the ids' order by it (``np.argsort(local, kind="stable")``; None
    from numpy: the caller sorts if it needs it). By counting, not sorting."""
    if _native.enabled():
        return _native.group_ids(ids, np.ascontiguousarray(keep, np.int64), at)
    at = at if at is not None else np.searchsorted(keep, ids)
    seen = np.bincount(at, minlength=len(keep))
    where = np.flatnonzero(seen)
    return where, seen[where], (np.cumsum(seen > 0) - 1)[at], None


_NO_IDS = np.empty(0, np.int64)


def _joined(parts: Sequence[np.ndarray], dtype: type, device: torch.device) -> torch.Tensor:
    """``parts`` joined into one array of ``dtype``, as a tensor on ``device``."""
    return torch.from_numpy(np.concatenate(parts or [np.empty(0, dtype)]).astype(dtype, copy=False)).to(
        device
    )


def translate(
    batches: Sequence[Mapping[str, np.ndarray]],
    keep: Mapping[str, np.ndarray],
    base: Mapping[str, int],
    device: torch.device,
    positions: Sequence[Mapping[str, np.ndarray]] | None = None,
    coalesced: Collection[str] = (),
) -> list[Batch]:
    """Plans of each mini-batch's tables in ``keep``.

    batches: per mini-batch ``{table: (n,) int64 ids}``; keep: per table the sorted distinct
    keys the pass makes resident (every id of ``batches`` among them); base: the table's first
    slot (:meth:`~hierps.tiers.DeviceTier.layout` of ``keep``); positions: each id's position
    in ``keep`` if known (:func:`union_positions`), else searched; coalesced: the tables whose
    gradients are summed in torch's coalesce order (:func:`sum_order`), the others' in the order
    of their ids.

    A mini-batch's ids are grouped in one call for all its tables, joined, against the keys of its
    tables placed one table after the other (:class:`_JoinedKeys`): the distinct ids come out table
    after table, so the numbers, counts, order and starts it gives are each table's own shifted
    past the tables before it, the arrays the plans keep joined.
    """
    pass_keys = _JoinedKeys(keep)
    out: list[Batch] = []
    for k, batch in enumerate(batches):
        tables = [t for t in batch if t in keep]
        # The pass's keys joined serve every mini-batch whose tables come in their order.
        joined = pass_keys if pass_keys.in_order(tables) else _JoinedKeys({t: keep[t] for t in tables})
        known = positions[k] if positions is not None else {}
        out.append(_translate_batch(batch, tables, joined, base, device, known, coalesced))
    return out


class _JoinedKeys:
    """The sorted keys of tables placed one table after the other: :attr:`keys` (sum K,) int64, each
    table's first position there (``start``) and its own keys (``of``)."""

    def __init__(self, keep: Mapping[str, np.ndarray]) -> None:
        self.of = keep
        self._keys: np.ndarray | None = None  # joined when first needed
        sizes = [len(k) for k in keep.values()]
        self.start = dict(zip(keep, np.cumsum([0, *sizes[:-1]]).tolist()))
        self._rank = {t: i for i, t in enumerate(keep)}

    @property
    def keys(self) -> np.ndarray:
        if self._keys is None:
            parts = [np.asarray(k, np.int64) for k in self.of.values()]
            self._keys = np.concatenate(parts) if parts else _NO_IDS
        return self._keys

    def in_order(self, tables: Sequence[str]) -> bool:
        """Whether ``tables`` are among these, in their order."""
        ranks = [self._rank.get(t, -1) for t in tables]
        return all(r >= 0 for r in ranks) and all(a < b for a, b in zip(ranks, ranks[1:]))


def _translate_batch(
    batch: Mapping[str, np.ndarray],
    tables: list[str],
    joined: _JoinedKeys,
    base: Mapping[str, int],
    device: torch.device,
    known: Mapping[str, np.ndarray],
    coalesced: Collection[str],
) -> Batch:
    """:func:`translate` of one mini-batch, whose ``tables`` come in ``joined``'s order."""
    lengths = [len(batch[t]) for t in tables]
    n_before = np.cumsum([0, *lengths[:-1]]).astype(np.int64).tolist()  # each table's first id
    # One private copy of the ids: later changes to the caller's ids don't leak into the plans.
    ids = np.concatenate([batch[t] for t in tables], dtype=np.int64, casting="unsafe") if tables else _NO_IDS
    at = np.empty(len(ids), np.int64)  # each id's position among the joined keys
    for t, n0, n in zip(tables, n_before, lengths):
        pos = known.get(t)
        if pos is None:  # searched; an id past its table's keys gets -1: refused as not among them
            pos = np.searchsorted(joined.of[t], ids[n0 : n0 + n])
            pos[pos == len(joined.of[t])] = -1 - joined.start[t]
        np.add(pos, joined.start[t], out=at[n0 : n0 + n])
    # Dedup through the positions in the joined keys: counting, no sort.
    where, counts, local, order = _grouped(ids, joined.keys, at)
    if order is None:
        order = np.argsort(local, kind="stable")
    ends = np.searchsorted(where, [joined.start[t] + len(joined.of[t]) for t in tables]).tolist()
    sizes = np.diff([0, *ends]).tolist()
    firsts = [0, *ends[:-1]]  # each table's first key
    keys = joined.keys[where]
    # the keys' slots (a new array: where is a view of the grouping's scratch, which it would keep)
    slots = where + np.repeat(np.array([base[t] - joined.start[t] for t in tables], np.int64), sizes)
    for t, n0, n in zip(tables, n_before, lengths):
        if t in coalesced:  # torch sorts the ids themselves: sort them as it does
            order[n0 : n0 + n] = sum_order(torch.from_numpy(ids[n0 : n0 + n])).numpy() + n0
    # the tables whose bags were announced: their offsets (B,)
    offsets = {
        i: o for i, o in enumerate(getattr(batch[t], "offsets", None) for t in tables) if o is not None
    }
    b_counts = [len(o) for o in offsets.values()]
    # Positions within the mini-batch (ids' and bags' numbers): int32 where they fit (the plans
    # of two passes are held).
    index = np.int32 if max(len(ids), sum(b_counts)) < 2**31 else np.int64
    # Each id's bag, in the order of the keys (what the backward sums per key), past the bags of the
    # tables before its own, joined over the tables whose bags were announced.
    b_before = np.cumsum([0, *b_counts[:-1]]).tolist()  # each one's first bag
    if len(offsets) == len(tables):
        j_offsets = np.concatenate([o + n0 for o, n0 in zip(offsets.values(), n_before)] or [_NO_IDS])
        if all(len(o) and o[0] == 0 for o in offsets.values()):  # (hierps.Bags are checked so)
            lens = np.diff(j_offsets, append=len(ids))  # each bag's length, tables joined
        else:
            lens = np.concatenate(
                [np.diff(o, append=n) for o, n in zip(offsets.values(), lengths)] or [_NO_IDS]
            )
        bag_of = np.repeat(np.arange(len(lens), dtype=np.int64), lens)[order]
        at_bags = [n_before[i] for i in offsets]
    else:
        bag_of = np.concatenate(
            [
                np.repeat(np.arange(len(o), dtype=np.int64), np.diff(o, append=lengths[i]))[
                    order[n_before[i] : n_before[i] + lengths[i]] - n_before[i]
                ]
                + b0
                for (i, o), b0 in zip(offsets.items(), b_before)
            ]
            or [_NO_IDS]
        )
        at_bags = np.cumsum([0, *[lengths[i] for i in offsets][:-1]]).tolist()  # each one's first id
    ids_bags = _joined([bag_of], index, device)
    bags = None
    if tables and len(offsets) == len(tables):
        bags = JoinedBags(
            offsets=_joined([j_offsets], index, device),
            counts=b_counts,
            ids_bags=ids_bags,
        )
    return _batch(
        tables,
        [ids[n0 : n0 + n] for n0, n in zip(n_before, lengths)],
        [keys[f : f + u] for f, u in zip(firsts, sizes)],
        firsts,
        n_before,
        torch.from_numpy(slots).to(device),
        torch.from_numpy(counts.astype(np.float32)).to(device),
        _joined([local], index, device),
        _joined([order], index, device),
        _joined([np.cumsum(counts) - counts], index, device),
        coalesced,
        device,
        {i: (o.copy(), at, b0) for (i, o), at, b0 in zip(offsets.items(), at_bags, b_before)},
        ids_bags,
        bags,
    )


def _batch(
    tables: list[str],
    ids: list[np.ndarray],
    keys: list[np.ndarray],
    firsts: list[int],
    n_before: list[int],
    j_slots: torch.Tensor,
    j_counts: torch.Tensor,
    j_local: torch.Tensor,
    j_order: torch.Tensor,
    j_starts: torch.Tensor,
    coalesced: Collection[str],
    device: torch.device,
    bags: Mapping[int, tuple[np.ndarray, int, int]],
    ids_bags: torch.Tensor,
    joined: JoinedBags | None,
) -> Batch:
    """The :class:`Batch` of a mini-batch's ``tables`` from its joined arrays. ``bags``: per table
    whose bags were announced (by its number in ``tables``), a copy of its offsets, its first id in
    ``ids_bags`` (each id's bag, joined over those tables) and its first bag; ``joined``: the bags
    joined when every table's were announced."""
    sizes, plans = [len(k) for k in keys], {}
    for i, (table, p_slots, p_counts) in enumerate(zip(tables, j_slots.split(sizes), j_counts.split(sizes))):
        n, u, n0, k0 = len(ids[i]), sizes[i], n_before[i], firsts[i]
        pieces = {
            "local": _Piece(j_local, n0, n, k0),
            "order": _Piece(j_order, n0, n, n0),
            "starts": _Piece(j_starts, k0, u, n0),
        }
        offsets = None
        if i in bags:
            t_offsets, at, b0 = bags[i]
            pieces["bags"] = _Piece(ids_bags, at, n, b0)
            offsets = torch.from_numpy(t_offsets).to(device)
        plans[table] = BatchPlan(
            ids=torch.from_numpy(ids[i]).to(device),
            keys=torch.from_numpy(keys[i]).to(device),
            counts=p_counts,
            slots=p_slots,
            offsets=offsets,
            coalesced=table in coalesced,
            pieces=pieces,
        )
    return Batch(plans, j_slots, j_counts, j_local, j_order, j_starts, joined)
