"""A pass routed once: which rows each mini-batch needs from which owner, planned ahead.

When a sharded pass is announced, every rank (as *requester*) sends each owner, once, the keys
of the pass it owns and, per mini-batch, which of them the mini-batch needs and how often
(:func:`plan_requests`); every owner merges what it was sent into its working set and plans, per
mini-batch, which of its rows go to whom (:func:`plan_serving`). Per mini-batch only rows then go
out and gradients come back, in an order both sides know: for each owner, table by table, in key
order. All of this is numpy on the routing worker; no key travels during the pass.

Example, 2 ranks, one table, a pass of one mini-batch whose ids on rank 0 are ``[5, 9, 5]``
(owner of 5: rank 1, of 9: rank 0): rank 0 sends rank 1 the pass key ``[5]`` and the entry
``(position 0, count 2)``, and keeps ``[9]`` with ``(0, 1)`` for itself. At the mini-batch rank
0 receives row 9 from itself then row 5 from rank 1, and its leaf is those rows in key order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hierps.rows._ids import distinct
from hierps.rows._initializers import splitmix64
from hierps.training._batchplan import Batch, translate, union_positions

__all__ = [
    "Asked",
    "OwnedPass",
    "PassRequests",
    "Serving",
    "RoutedTable",
    "pass_keys",
    "plan_serving",
    "requests",
]

_EMPTY = np.empty(0, np.int64)


@dataclass(frozen=True)
class RoutedTable:
    """What routing needs of a table: its dim, and whether its mini-batches take the fast path
    (tables filtering admission are routed for loading only; their mini-batches go key by key)."""

    name: str
    dim: int
    fast: bool


@dataclass
class Asked:
    """The requester's side of one mini-batch of one dim group (tables of one dim, in order)."""

    batch: Batch  # the tables' plans; ``slots`` are positions in the pass's keys (all tables)
    recv_counts: list[int]  # rows coming from each owner
    # leaf row i is received row take[i] (None: the same order, as at world size 1)
    take: torch.Tensor | None


@dataclass
class PassRequests:
    """A rank's pass as requester: what to send each owner, and its mini-batches' plans."""

    n_batches: int
    headers: list[np.ndarray]  # per owner: [n_batches, keys per table..., entries per (batch, table)...]
    keys: list[np.ndarray]  # per owner: its pass keys, table by table, each sorted
    entries: list[np.ndarray]  # per owner: (m, 2) int32 (position in keys of the table, count)
    asked: dict[int, list[Asked]]  # per dim: per mini-batch


@dataclass
class Serving:
    """The owner's side of one mini-batch of one dim group: its rows in sending order."""

    tables: list[str]
    send_counts: list[int]  # rows to each requester
    at: torch.Tensor  # (n,) position of each sent row in the owned keys (all tables joined)
    uniq: torch.Tensor  # (u,) its distinct positions, sorted (so table by table)
    inverse: torch.Tensor | None  # (n,) at = uniq[inverse]; None when at == uniq
    counts: torch.Tensor  # (u,) float32 sightings of each row over all requesters
    splits: list[int]  # entries of uniq per table


@dataclass
class OwnedPass:
    """An owner's pass: the keys it makes resident and what it serves per mini-batch."""

    tables: list[RoutedTable]
    keys: dict[str, np.ndarray]  # per table: sorted distinct keys any rank needs from it
    start: dict[str, int]  # first position of each table in the joined owned keys
    serving: dict[int, list[Serving]]  # per dim: per mini-batch
    agreed: bool  # every rank announced as many mini-batches (else no serving is planned)
    joined: np.ndarray  # the owned keys, tables joined


def owner_of(keys: np.ndarray, world_size: int) -> np.ndarray:
    """(n,) int64 keys -> (n,) int64 owner ranks: splitmix64(key) mod world size, fixed forever."""
    with np.errstate(over="ignore"):
        return (splitmix64(keys.astype(np.int64).view(np.uint64)) % np.uint64(world_size)).astype(np.int64)


def _groups(tables: list[RoutedTable]) -> dict[int, list[str]]:
    """Fast tables by dim, each group in table order."""
    out: dict[int, list[str]] = {}
    for t in tables:
        if t.fast:
            out.setdefault(t.dim, []).append(t.name)
    return dict(sorted(out.items()))


def pass_keys(
    batches: list[dict[str, np.ndarray]], tables: list[RoutedTable]
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]], dict[str, int], np.ndarray]:
    """The pass's sorted distinct keys per table, each id's position in them, each table's first
    position in the keys joined in ``tables`` order, and the joined keys."""
    names = [t.name for t in tables]
    raw = [{t: b[t] for t in names if t in b} for b in batches]
    keys, positions = union_positions(raw)
    for t in names:
        keys.setdefault(t, _EMPTY)
    start = dict(zip(names, np.cumsum([0, *[len(keys[t]) for t in names[:-1]]]).tolist()))
    joined = np.concatenate([keys[t] for t in names]) if names else _EMPTY
    return keys, positions, start, joined


def requests(
    batches: list[dict[str, np.ndarray]],
    tables: list[RoutedTable],
    owner_of_keys: np.ndarray,
    world_size: int,
    device: torch.device,
    keys: dict[str, np.ndarray],
    positions: list[dict[str, np.ndarray]],
    start: dict[str, int],
) -> PassRequests:
    """Plan a rank's requests for a pass of ``batches`` (per mini-batch ``{table: ids}``) whose
    distinct keys are ``keys`` (:func:`pass_keys`), owned by ``owner_of_keys`` (tables joined)."""
    names = [t.name for t in tables]
    n_b, n_t = len(batches), len(names)
    # Each key's place among the keys of its table that its owner gets, and what each owner gets.
    chunk = np.empty(len(owner_of_keys), np.int64)
    to_owner: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    per_table = np.zeros((world_size, n_t), np.int64)
    for j, t in enumerate(names):
        seg = slice(start[t], start[t] + len(keys[t]))
        own = owner_of_keys[seg]
        for o in range(world_size):
            mine = np.flatnonzero(own == o)
            chunk[seg.start + mine] = np.arange(len(mine))
            to_owner[o].append(keys[t][mine])
            per_table[o, j] = len(mine)
    asked: dict[int, list[Asked]] = {}
    n_entries = np.zeros((world_size, n_b, n_t), np.int64)
    parts: list[dict[tuple[int, int], np.ndarray]] = [{} for _ in range(world_size)]
    column = {t: j for j, t in enumerate(names)}
    for dim, group in _groups(tables).items():
        plans = translate(
            [{t: b[t] for t in group if t in b} for b in batches],
            {t: keys[t] for t in group},
            start,
            device,
            positions,
        )
        asked[dim] = []
        for k, batch in enumerate(plans):
            where = batch.slots.cpu().numpy()  # positions in the pass's keys, table by table
            own = owner_of_keys[where]
            order = np.argsort(own, kind="stable")  # by owner, then table, then key
            counts = batch.counts.cpu().numpy().astype(np.int64)
            at = 0
            for t, plan in batch.plans.items():
                n = plan.keys.numel()
                for o in range(world_size):
                    sel = at + np.flatnonzero(own[at : at + n] == o)
                    n_entries[o, k, column[t]] = len(sel)
                    parts[o][k, column[t]] = np.stack([chunk[where[sel]], counts[sel]], axis=1)
                at += n
            take = None
            if world_size > 1:
                inv = np.empty(len(order), np.int64)
                inv[order] = np.arange(len(order))
                take = torch.from_numpy(inv).to(device)
            asked[dim].append(Asked(batch, np.bincount(own, minlength=world_size).tolist(), take))
    # Entries go mini-batch by mini-batch, table by table (the order of the header's counts).
    entries = [[p[kj] for kj in sorted(p)] for p in parts]
    headers = [
        np.concatenate([[n_b], per_table[o], n_entries[o].reshape(-1)]).astype(np.int64)
        for o in range(world_size)
    ]
    return PassRequests(
        n_b,
        headers,
        [np.concatenate(chunks) if chunks else _EMPTY for chunks in to_owner],
        [np.concatenate(e).astype(np.int32) if e else np.empty((0, 2), np.int32) for e in entries],
        asked,
    )


def plan_serving(
    tables: list[RoutedTable],
    n_batches: int,
    headers: list[np.ndarray],
    keys: list[np.ndarray],
    entries: list[np.ndarray],
    device: torch.device,
) -> OwnedPass:
    """An owner's pass from what each requester sent it (per source rank: its header, keys and
    entries, as :func:`requests` made them for this owner)."""
    names = [t.name for t in tables]
    n_t = len(names)
    per_table = [h[1 : 1 + n_t] for h in headers]
    # Keys from each source, per table, and the owner's working set: their union.
    src_keys: list[dict[str, np.ndarray]] = []
    for r, h in enumerate(per_table):
        cuts = np.cumsum(h)[:-1]
        src_keys.append(dict(zip(names, np.split(keys[r], cuts))))
    owned = {t: distinct(np.concatenate([s[t] for s in src_keys])) for t in names}
    start = dict(zip(names, np.cumsum([0, *[len(owned[t]) for t in names[:-1]]]).tolist()))
    # Where each source's keys are in the joined owned keys.
    src_at = [{t: start[t] + np.searchsorted(owned[t], s[t]) for t in names} for s in src_keys]
    joined = np.concatenate([owned[t] for t in names]) if names else _EMPTY
    if not all(int(h[0]) == n_batches for h in headers):  # no common mini-batches to plan
        return OwnedPass(tables, owned, start, {}, False, joined)
    # Each source's entries, per (mini-batch, table).
    src_entries = []
    for r, h in enumerate(headers):
        cuts = np.cumsum(h[1 + n_t :])[:-1]
        src_entries.append(np.split(entries[r], cuts))
    column = {t: j for j, t in enumerate(names)}
    serving: dict[int, list[Serving]] = {}
    for dim, group in _groups(tables).items():
        serving[dim] = []
        for k in range(n_batches):
            at_parts, count_parts, send_counts = [], [], []
            for r in range(len(headers)):
                sent = 0
                for t in group:
                    e = src_entries[r][k * n_t + column[t]]
                    at_parts.append(src_at[r][t][e[:, 0]])
                    count_parts.append(e[:, 1])
                    sent += len(e)
                send_counts.append(sent)
            at = np.concatenate(at_parts) if at_parts else _EMPTY
            seen = np.concatenate(count_parts).astype(np.float64) if count_parts else np.empty(0)
            uniq, inverse = np.unique(at, return_inverse=True)
            counts = np.bincount(inverse.reshape(-1), weights=seen, minlength=len(uniq)).astype(np.float32)
            same = len(uniq) == len(at) and bool(np.array_equal(uniq, at))
            bounds = np.searchsorted(uniq, [start[t] + len(owned[t]) for t in group])
            splits = np.diff(np.concatenate([[0], bounds])).tolist()
            serving[dim].append(
                Serving(
                    group,
                    send_counts,
                    torch.from_numpy(at).to(device),
                    torch.from_numpy(uniq).to(device),
                    None if same else torch.from_numpy(inverse.reshape(-1)).to(device),
                    torch.from_numpy(counts).to(device),
                    splits,
                )
            )
    return OwnedPass(tables, owned, start, serving, True, joined)
