"""Checkpoints of a sharded store that every rank agrees on, without a file the ranks share.

Each rank checkpoints its own store, ``<root>/rank-NNNNN``: that checkpoint is the rank's *part*.
A checkpoint of all ranks (a :class:`~hierps.storage._commit_log.Snapshot`) is committed in two
phases: every rank writes its part (retiring nothing), the ranks exchange their parts' ids (an
all-reduce: every part is durable), rank 0 writes its copy of the commit record (the commit
point), and once every rank knows it (a barrier) the other ranks write theirs. Old checkpoints are
retired after that: rank 0's records first, then the other ranks' copies and the parts no kept
record names. To train, checkpoint and recover, each rank reads and writes only its own directory,
so rank directories may lie on each host's own disk (the same path naming another disk on each
host) or on one shared file system: the files and the results are the same.

Opening (:meth:`ShardCheckpoints.open`, collective) agrees over the transport, before any store
is opened: rank 0's records are the root's checkpoints, and the newest record any rank holds is the
latest (a record anywhere proves every part durable; rank 0 holds every record another rank
holds). Each rank checks that it reaches the parts it needs (its directory's store is the one the
record names and holds its part); a part no rank reaches fails the open on every rank with a
:class:`~hierps.errors.MissingPartsError` naming the parts and their ranks, before anything is created or deleted. Then
each rank returns to its part of the latest checkpoint (removing parts that never committed and
writing the record copies it missed); at another world size the checkpoint's rows are resharded
into this one and committed as a checkpoint marked ``resharded_from``. Into a world size that
divides the old one, with the parts on this rank's file system, each rank adopts whole old parts
(its own gone back to, the others' segments hard-linked in: no row read or written); otherwise each
old part is read by one rank that sees it, on its host's disk, its rows streamed to their new owners
by all-to-all in key order, each new owner writing them straight to its SSD tier as one segment per
table, once. The reshard's checkpoint
never counts against ``keep_checkpoints`` (:func:`~hierps.storage._commit_log.retained`); a later
open at a world size that already has a checkpoint of those rows goes back to it without resharding.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hierps._faults import fault_point
from hierps._store import Store, store_parts
from hierps.errors import ConfigError, HierpsError, MissingPartsError
from hierps.rows._pending import PENDING_ARRAYS, PendingKeys
from hierps.rows._table import TableInfo
from hierps.sharding._local import OwnerParts
from hierps.sharding._routes import owner_of
from hierps.storage._checkpoint import CheckpointCatalog
from hierps.storage._commit_log import (
    Snapshot,
    collect_rank_dir,
    delete_record,
    find_in,
    keep_record,
    legacy_records,
    opening_part,
    rank_dir,
    rank_dirs,
    read_records,
    records_dir,
    remove_collected,
    retained,
    snapshots,
    store_uid,
    write_record,
)
from hierps.storage._files import all_closed, made_beside, read_json_checked
from hierps.storage._manifest import Manifest
from hierps.storage._marker import MARKER
from hierps.storage._merge import _Input, merged_sources
from hierps.tiers._reader import CheckpointReader

__all__ = [
    "ALONE",
    "Collectives",
    "ShardCheckpoints",
    "Snapshot",
    "rank_dir",
    "snapshots",
    "streamed_reshards",
]


class Collectives(Protocol):
    """What the checkpoints of a sharded store need of a transport (every transport has it)."""

    rank: int
    world_size: int

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_to_all(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]: ...

    def all_to_all_known(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor: ...

    def barrier(self) -> None: ...


class OneRank:
    """The collectives of a process that is the only rank, without a collective library (also the
    sharded store's transport at world size 1)."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def all_to_all(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        return send, list(send_counts)

    def all_to_all_known(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        return send

    def barrier(self) -> None:
        return None

    def companion(self) -> OneRank:
        return OneRank()


ALONE: Collectives = OneRank()


# -- agreeing over the transport --------------------------------------------------------------------
# Rows a rank reads ahead of each round of a reshard, at least (fewer rounds, each of more rows).
_ROUND_BYTES = 8 << 20


def _gathered(
    batches: Iterator[tuple[np.ndarray, np.ndarray]], rows: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Consecutive ``(keys, rows)`` batches joined into batches of at least ``rows`` rows (the last
    may hold fewer)."""
    keys: list[np.ndarray] = []
    values: list[np.ndarray] = []
    held = 0
    for k, v in batches:
        keys.append(k)
        values.append(v)
        held += len(k)
        if held >= rows:
            yield np.concatenate(keys), np.concatenate(values)
            keys, values, held = [], [], 0
    if held:
        yield np.concatenate(keys), np.concatenate(values)


def _gather_ints(coll: Collectives, values: Sequence[int]) -> list[list[int]]:
    """Every rank's ``values`` (the same count on every rank), rank 0's first (one all-reduce)."""
    mine = torch.zeros((coll.world_size, len(values)), dtype=torch.int64)
    mine[coll.rank] = torch.tensor(list(values), dtype=torch.int64)
    return [[int(v) for v in row] for row in coll.all_reduce_sum(mine).tolist()]


def _gather_bytes(coll: Collectives, data: bytes) -> list[bytes]:
    """Every rank's ``data``, rank 0's first (two all-reduces: the lengths, then the bytes)."""
    lengths = [row[0] for row in _gather_ints(coll, [len(data)])]
    if not any(lengths):
        return [b""] * coll.world_size
    mine = torch.zeros((coll.world_size, max(lengths, default=0)), dtype=torch.int64)
    mine[coll.rank, : len(data)] = torch.tensor(list(data), dtype=torch.int64)
    got = coll.all_reduce_sum(mine)
    return [bytes(got[r, : lengths[r]].to(torch.uint8).tolist()) for r in range(coll.world_size)]


def _reaches(root: Path, snap: Snapshot, q: int) -> bool:
    """Whether this process sees part ``q`` of ``snap``: rank q's directory holds the store the
    record names, and that store still holds the part."""
    store = rank_dir(root, q)
    try:
        if store_uid(store) != snap.stores[q]:
            return False
        return CheckpointCatalog(store / "checkpoints", snap.stores[q]).exists(snap.parts[q])
    except HierpsError:
        return False


def _missing(
    root: Path, snap: Snapshot, seen: list[list[int]], own_parts: bool, action: str = "opened"
) -> ConfigError | None:
    """The error for parts of ``snap`` out of reach (``seen[k][q]``: rank k reaches part q); None when
    each is reached. ``own_parts``: rank q must reach part q itself (it goes back to it); else any
    rank may (a reshard or an export reads each part on one rank that sees it). ``action``: what
    could not be done ("opened", "exported")."""
    world = len(seen)
    nowhere = [q for q in range(snap.world_size) if not any(row[q] for row in seen)]
    elsewhere = [q for q in range(snap.world_size) if own_parts and q not in nowhere and not seen[q][q]]
    what = f"{root}: checkpoint {snap.id} ({snap.tag!r}, written by {snap.world_size} ranks)"
    if nowhere:
        names = ", ".join(
            f"part {q} (rank {q}: {rank_dir(root, q).name}, store {snap.stores[q][:8]})" for q in nowhere
        )
        return MissingPartsError(
            f"{what} cannot be {action}: {len(nowhere)} of its parts are on no disk a rank of this job "
            f"reaches: {names}. Their host did not come back, its disk was replaced, or fewer hosts were "
            f"started than saved it. Start the job on every host that saved it, each with its disk at "
            f"{root}. Nothing was {action}, created or deleted.",
            parts=tuple(nowhere),
            checkpoint=snap.id,
        )
    if elsewhere:
        where = "; ".join(
            f"part {q} by ranks {[k for k in range(world) if seen[k][q]]}, not by rank {q}" for q in elsewhere
        )
        return ConfigError(
            f"{what}: each rank opens its own part, but {where}: the ranks run on other hosts than when "
            "they saved. Launch each host with the node rank (torchrun --node_rank) it had then. Nothing "
            "was opened, created or deleted."
        )
    return None


def _readers(snap: Snapshot, seen: list[list[int]]) -> list[int]:
    """The rank that reads each part of ``snap`` for a reshard: rank q for part q where it sees it,
    else one of the ranks that see it (spread by part)."""
    out = []
    for q in range(snap.world_size):
        ranks = [k for k, row in enumerate(seen) if row[q]]
        out.append(q if q in ranks else ranks[q % len(ranks)])
    return out


# Whether a reshard may adopt old parts by linking their files in (see ShardCheckpoints._can_adopt).
_links_allowed = True


@contextmanager
def streamed_reshards() -> Iterator[None]:
    """Within it, reshards in this process stream every row, even where the old parts could be
    linked in whole (to measure or compare the streamed path, as ``hierps bench --scale`` does)."""
    global _links_allowed
    allowed, _links_allowed = _links_allowed, False
    try:
        yield
    finally:
        _links_allowed = allowed


def _can_link(source: Path, into: Path) -> bool:
    """Whether files of the store ``source`` can be hard-linked into the store ``into`` (tried on
    ``source``'s marker: another file system or mount cannot, nor one that does not do links)."""
    probe = into / ".link-probe"  # one rank probes its own directory, one part at a time
    try:
        probe.unlink(missing_ok=True)  # left by a process killed here
        os.link(source / MARKER, probe)
    except OSError:
        return False
    probe.unlink()
    return True


@dataclass(frozen=True)
class _Plan:
    """What opening does, agreed by every rank: the root's checkpoints and where this world goes."""

    catalog: list[Snapshot]
    target: Snapshot | None  # a checkpoint of this world size holding the latest rows: go back to it
    source: Snapshot | None  # else the checkpoint to reshard from (None with target: no checkpoint)
    seen: list[list[int]] | None = None  # seen[k][q]: rank k reaches part q of target or source


def _plan(catalog: list[Snapshot], world: int) -> _Plan:
    if not catalog:
        return _Plan(catalog, None, None)
    return _choose(catalog, catalog[-1], world)


def _choose(catalog: list[Snapshot], snap: Snapshot, world: int) -> _Plan:
    """Where this world goes for the rows of ``snap``: ``snap`` itself at its world size, else the
    newest checkpoint of this world size with the same rows, else a reshard of the saved one."""
    if snap.world_size == world:
        return _Plan(catalog, snap, None)
    same = [s for s in catalog if s.world_size == world and s.source == snap.source]
    if same:
        return _Plan(catalog, same[-1], None)
    return _Plan(catalog, None, next((s for s in catalog if s.id == snap.source), snap))


def _newest_seen(root: Path) -> int:
    """The newest record in any rank directory this process sees (names only: ids are file names)."""
    ids = [
        int(p.stem)
        for d in rank_dirs(root).values()
        if records_dir(d).is_dir()
        for p in records_dir(d).glob("*.json")
        if p.stem.isdigit()
    ]
    return max(ids, default=0)


def _local_records(root: Path, rank: int) -> list[Snapshot]:
    """This rank's copies of the records (the records of an earlier hierps, which kept them in one
    directory of the root, copied in first)."""
    store = rank_dir(root, rank)
    if store_uid(store) is not None and not records_dir(store).is_dir():
        _adopt_legacy(root, rank)
    return read_records(store)


def _adopt_legacy(root: Path, rank: int) -> None:
    """A rank directory an earlier hierps wrote (no ``commits/`` of its own): its records, read
    from ``<root>/commits`` (and, for rank 0, its checkpoints of one process), kept as copies."""
    store = rank_dir(root, rank)
    legacy = legacy_records(root)
    found: list[Snapshot] = []
    for path in sorted(legacy.glob("*.json")) if legacy.is_dir() else []:
        body = read_json_checked(path)
        world = body.get("world_size")
        if isinstance(world, int) and rank < world and "stores" not in body:
            uids = [store_uid(rank_dir(root, q)) or "?" for q in range(world)]
            found.append(Snapshot.from_json(path, {**body, "stores": uids}))
    uid = store_uid(store)
    if rank == 0 and uid is not None and (store / "checkpoints").is_dir():
        catalog = CheckpointCatalog(store / "checkpoints", uid)
        for ckpt in catalog.ids():
            m = catalog.manifest(ckpt)
            if m.world_size == 1:
                found.append(Snapshot(ckpt, 1, (ckpt,), (uid,), m.tag, m.created))
    for snap in found:
        keep_record(store, snap)
    records_dir(store).mkdir(exist_ok=True)


class ShardCheckpoints:
    """The checkpoints of one rank of a sharded root: its store's part of each, and their commits.

    ``local`` is this rank's store (``<root>/rank-NNNNN``); ``collectives`` joins the ranks
    (:data:`ALONE` for a process that is the only rank). Built by :meth:`open`. Every method is
    collective: all ranks call it, in the same order.
    """

    def __init__(
        self,
        root: Path,
        local: Store,
        collectives: Collectives,
        owner_of: Callable[[np.ndarray, int], np.ndarray],
        catalog: list[Snapshot],
    ) -> None:
        self.root = root
        self.local = local
        self.parts: OwnerParts = store_parts(local)
        self.collectives = collectives
        self.rank, self.world_size = collectives.rank, collectives.world_size
        self._owner_of = owner_of
        self.catalog = catalog  # the root's checkpoints, oldest first: the same on every rank
        self.uid = self.parts.core.marker.uid
        self.stores = tuple(b.decode() for b in _gather_bytes(collectives, self.uid.encode()))

    @classmethod
    def open(
        cls,
        root: str | Path,
        collectives: Collectives,
        owner_of: Callable[[np.ndarray, int], np.ndarray],
        make_store: Callable[[], Store],
    ) -> ShardCheckpoints:
        """Agree on the root's checkpoints, open this rank's store (``make_store()``) and return it
        to the latest checkpoint, resharded if it has another world size (collective)."""
        root = Path(root)
        plan = cls._agree(root, collectives)
        with opening_part():
            local = make_store()
        try:
            records_dir(local.path).mkdir(exist_ok=True)  # a part from now on, never a store alone
            self = cls(root, local, collectives, owner_of, plan.catalog)
            self._recover(plan)
        except BaseException:
            local.close()
            raise
        return self

    @staticmethod
    def _agree(root: Path, coll: Collectives) -> _Plan:
        """The plan every rank follows, from rank 0's records and every rank's newest one; raises
        the same error on every rank when a part is out of reach (before anything is opened)."""
        failure: BaseException | None = None
        mine: list[Snapshot] = []
        try:
            mine = _local_records(root, coll.rank)
        except HierpsError as exc:  # raised below, once every rank knows
            failure = exc
        blob = json.dumps([s.to_json() for s in mine]).encode() if coll.rank == 0 else b""
        heads = _gather_ints(coll, [int(failure is not None), _newest_seen(root), len(blob)])
        failed = [r for r, row in enumerate(heads) if row[0]]
        if failure is not None:
            raise failure
        if failed:
            raise HierpsError(f"{root}: ranks {failed} could not read their directory; see their errors.")
        catalog = [
            Snapshot.from_json(f"rank 0's records of {root}", b)
            for b in json.loads(_gather_bytes(coll, blob)[0] or b"[]")
        ]
        newest = max(row[1] for row in heads)
        if newest and newest not in {s.id for s in catalog}:
            holders = [r for r, row in enumerate(heads) if row[1] == newest]
            raise ConfigError(
                f"{root}: ranks {holders} see the record of checkpoint {newest} on their disk, which rank 0's directory "
                f"{rank_dir(root, 0)} lacks: it is not the directory rank 0 saved with (its host did not "
                "come back, or the ranks run on other hosts than when they saved). Launch each host with "
                "the node rank it had then. Nothing was opened, created or deleted."
            )
        return ShardCheckpoints._require(root, coll, _plan(catalog, coll.world_size))

    @staticmethod
    def _require(root: Path, coll: Collectives, plan: _Plan) -> _Plan:
        """The plan with who reaches which part; raises on every rank when a part it reads is out of
        reach of the ranks that may read it."""
        snap = plan.target or plan.source
        if snap is None:
            return plan
        seen = _gather_ints(coll, [int(_reaches(root, snap, q)) for q in range(snap.world_size)])
        error = _missing(root, snap, seen, own_parts=plan.target is not None)
        if error is not None:
            raise error
        return replace(plan, seen=seen)

    # -- what is there -------------------------------------------------------------------------
    def list_checkpoints(self) -> list[dict[str, Any]]:
        """``[{"id", "tag", "created", "world_size", "resharded_from"}, ...]`` of the restorable
        checkpoints, oldest first."""
        return [s.describe() for s in self.catalog]

    def find(self, ref: int | str | None) -> Snapshot | None:
        """A checkpoint by id (or one resharded from it), by tag (the newest), or the latest (None)."""
        return find_in(self.catalog, ref)

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (as many on every rank), rank 0's first (collective)."""
        return _gather_ints(self.collectives, values)

    # -- opening ---------------------------------------------------------------------------------
    def _recover(self, plan: _Plan) -> None:
        """Return this rank to the plan's checkpoint (collective)."""
        if plan.target is not None:
            self._back_to(plan.target, opening=True)
        elif plan.source is None and self.local.list_checkpoints():
            self.local.rollback(None)  # parts of a checkpoint that never committed
        mine = {s.id for s in read_records(self.local.path)}
        for snap in self.catalog:  # the copies this rank missed (it died before writing them)
            if snap.id not in mine and self._took_part(snap):
                keep_record(self.local.path, snap)
        known = {s.id for s in self.catalog}
        for old in mine - known:  # retired by rank 0, not yet here
            delete_record(self.local.path, old)
        self.local.retire_checkpoints(self._parts(self.catalog))  # parts that never committed
        if plan.source is not None:
            self._reshard(plan.source, plan.seen or [])
        else:
            self._collect_rank_dirs(self.catalog)
        self.collectives.barrier()  # no rank checkpoints before every rank has recovered

    def _took_part(self, snap: Snapshot) -> bool:
        return self.rank < snap.world_size and snap.stores[self.rank] == self.uid

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(
        self,
        tag: str | None = None,
        extra: dict[str, Any] | None = None,
        *,
        retire: bool = True,
        resharded_from: int | None = None,
    ) -> int:
        """Checkpoint every rank's store and commit them as one checkpoint; returns its id (collective).

        Committed when rank 0's copy of the record is written, after every part is durable; every
        rank returns only once it holds its own copy. A crash before rank 0's record leaves the
        previous checkpoint as the latest on every rank. With ``retire`` False, older checkpoints
        stay until :meth:`retire` (or the next checkpoint).
        """
        body = {**(extra or {}), "world_size": self.world_size, "rank": self.rank}
        part = self.local.checkpoint(tag, extra=body, retire=False)
        if self.world_size > 1:
            fault_point("sharded.part_written")
        created = time.time_ns() // 1000 if self.rank == 0 else 0
        gathered = _gather_ints(self.collectives, [part, created])  # every part is durable
        snap = Snapshot(
            gathered[0][0],
            self.world_size,
            tuple(row[0] for row in gathered),
            self.stores,
            tag,
            gathered[0][1] / 1e6,
            resharded_from,
        )
        if self.rank == 0:
            if self.world_size > 1:
                fault_point("sharded.before_commit")
            keep_record(self.local.path, snap)  # the commit point
        self.collectives.barrier()  # committed: every rank knows
        if self.rank != 0:
            keep_record(self.local.path, snap)
        self.collectives.barrier()  # every rank holds its copy
        self.catalog = [*self.catalog, snap]
        if self.world_size > 1:
            fault_point("sharded.committed")
        if retire:
            self._retire()
        return snap.id

    def retire(self) -> None:
        """Retire the checkpoints beyond ``keep_checkpoints`` (collective)."""
        self._retire()

    def restore(self, ref: int | str | None = None) -> int:
        """Every rank back to checkpoint ``ref`` (an id, a tag, or the latest); returns the id of the
        checkpoint the ranks are now at: the one named, one of this world size with its rows, or a new
        one resharded from it. Collective."""
        snap = self.find(ref)
        if snap is None:
            raise ConfigError(
                f"{self.root}: no checkpoint {ref!r}; it has {[(s.id, s.tag) for s in self.catalog]}."
            )
        plan = self._require(self.root, self.collectives, _choose(self.catalog, snap, self.world_size))
        if plan.target is not None:
            self._back_to(plan.target)
            return plan.target.id
        assert plan.source is not None
        return self._reshard(plan.source, plan.seen or [])

    # -- parts -------------------------------------------------------------------------------------
    def _back_to(self, snap: Snapshot, *, opening: bool = False) -> None:
        """This rank's store at its part of ``snap`` (rows written since are dropped); ``opening``:
        the store was just opened, so already at its part when that is its latest checkpoint."""
        part = snap.parts[self.rank]
        if not opening or self.local.checkpoint_id != part:
            self.local.restore(part)

    def _reshard(self, snap: Snapshot, seen: list[list[int]]) -> int:
        """Fill this rank's store with the rows it owns in ``snap`` (written by another number of
        ranks), then commit that as a checkpoint of this world size resharded from it (collective).

        Each old part is read by one rank that sees it (:func:`_readers`): on rank directories on
        each host's own disk a rank reads only what its host holds. Its rows go to their new owners
        by all-to-all in rounds of ascending keys (:meth:`_owned_in_order`; bounded memory), with
        their optimizer state and counters, and each owner writes what it receives as one segment
        of its SSD tier (:meth:`hierps._rows.RowAccess.ingest_sorted`): no RAM tier, spill or
        compaction on the way. Like any write, nothing of it counts before the reshard's
        checkpoint commits: a crash before leaves the checkpoint read as the latest. The keys
        pending admission go to their owners too. Into a world size that divides the old one each
        rank adopts its old parts whole instead, where every rank can (:meth:`_can_adopt`)."""
        if self._can_adopt(snap, seen):
            return self._adopt(snap)
        readers = [
            CheckpointReader(rank_dir(self.root, q), snap.parts[q])
            for q, reader in enumerate(_readers(snap, seen))
            if reader == self.rank
        ]
        try:
            return self._reshard_from(snap, readers)
        finally:
            for reader in readers:
                reader.close()

    def _can_adopt(self, snap: Snapshot, seen: list[list[int]]) -> bool:
        """Whether every rank can take its rows of ``snap`` by adopting whole old parts (collective).

        With keys owned by ``splitmix64(key) mod world size``, a world size that divides the old one
        gives each old part q whole to rank ``q mod world size``: rank r's rows are exactly those of
        parts r, r + world size, ... So where rank r reaches those parts (its own among them), and
        can hard-link their files into its directory (one file system, one mount: tried on a marker),
        it adopts them, reading and writing no row (:meth:`_adopt`). Every rank must be able to, or
        all stream (the streaming reshard is collective)."""
        world = self.world_size
        able = _links_allowed and snap.world_size % world == 0 and self._owner_of is owner_of
        own = rank_dir(self.root, self.rank)
        for q in range(self.rank, snap.world_size, world) if able else ():
            able = bool(seen and seen[self.rank][q]) and (
                q == self.rank or _can_link(rank_dir(self.root, q), own)
            )
            if not able:
                break
        return all(row[0] for row in _gather_ints(self.collectives, [int(able)]))

    def _adopt(self, snap: Snapshot) -> int:
        """Take this rank's rows of ``snap`` as whole old parts (see :meth:`_can_adopt`), then commit
        them as a checkpoint of this world size resharded from it (collective).

        Its own old part it goes back to, in place; each other one's segments it links into its
        SSD tier under new ids (:meth:`hierps.tiers.SsdTier.adopt`): not a row read or written, the
        old part's files untouched (a retired link is unlinked, never cut: see
        ``hierps.storage._files``). Its keys pending admission join this rank's. Like the streaming
        reshard's, nothing of it counts before the reshard's checkpoint commits: a crash before
        leaves the links unnamed (collected at the next open) and the saved checkpoint the latest."""
        self._back_to(snap)
        readers = [
            CheckpointReader(rank_dir(self.root, q), snap.parts[q])
            for q in range(self.rank, snap.world_size, self.world_size)
        ]
        try:
            manifests = self._gathered_manifests(snap, readers)
            core = self.parts.core
            for name in self._tables_of(manifests):
                held = next(m for m in manifests if name in m.tables)
                info = held.tables[name].table_info(name, held.seed)
                mine = self.local.table(name, info.dim, info.spec)
                for r in readers[1:]:  # the first is this rank's own part, gone back to
                    if name in r.meta.tables:
                        core.ssd.adopt(name, r.path / "segments", r.marker.uid, r.entry(name).segments)
                mine.step = info.step
                self._take_pending(name, mine, [r.pending(name) for r in readers if name in r.meta.tables])
            fault_point("reshard.adopted")
            return self._commit_reshard(snap, manifests)
        finally:
            for reader in readers:
                reader.close()

    def _gathered_manifests(self, snap: Snapshot, readers: list[CheckpointReader]) -> list[Manifest]:
        """The manifests of the parts every rank's ``readers`` read, rank 0's first (collective)."""
        blobs = _gather_bytes(self.collectives, json.dumps([r.manifest for r in readers]).encode())
        return [
            Manifest.from_json(Path(f"checkpoint {snap.id}"), body["id"], body)
            for b in blobs
            for body in json.loads(b)
        ]

    def _tables_of(self, manifests: list[Manifest]) -> list[str]:
        """The tables ``manifests`` hold, sorted; this rank's other tables emptied (not in the checkpoint)."""
        names = sorted({name for m in manifests for name in m.tables})
        for name in set(self.local.tables) - set(names):
            self.parts.rows.reset(name)
        return names

    def _take_pending(self, name: str, table: TableInfo, pending: list[dict[str, np.ndarray]]) -> None:
        """``name``'s keys pending admission: those of ``pending`` (each part's arrays) this rank owns."""
        arrays = {
            k: np.concatenate([p[k] for p in pending] or [np.empty(0, d)]) for k, d in PENDING_ARRAYS.items()
        }
        keys, values = self._to_owners(
            arrays["pending_keys"].astype(np.int64), [arrays[k].astype(np.int64) for k in PENDING_ARRAYS]
        )
        order = np.argsort(keys, kind="stable")
        self.parts.core.pending_keys[name] = PendingKeys.from_arrays(
            table.admission.max_pending,
            {k: v[order].astype(d) for (k, d), v in zip(PENDING_ARRAYS.items(), values)},
        )

    def _reshard_from(self, snap: Snapshot, readers: list[CheckpointReader]) -> int:
        manifests = self._gathered_manifests(snap, readers)
        for name in self._tables_of(manifests):
            held = next(m for m in manifests if name in m.tables)
            info = held.tables[name].table_info(name, held.seed)
            mine = self.local.table(name, info.dim, info.spec)
            self.parts.rows.reset(name)
            # The parts read stay on disk while this rank rewrites its store: no part is retired
            # before every rank has checkpointed (and so has read them).
            # Each part scanned on a thread of its own, beside the others and the merge.
            sources = [made_beside(r.iter_rows(name)) for r in readers if name in r.meta.tables]
            # Each new owner's rows come in key order: written straight to its SSD tier as one
            # segment, once (about a world's share of the rows: for a full disk's message).
            rows = sum(m.tables[name].rows for m in manifests if name in m.tables)
            with all_closed(sources):
                self.parts.rows.ingest_sorted(
                    name, self._owned_in_order(sources, info.width), -(-rows // self.world_size)
                )
            mine.step = info.step
            self._take_pending(name, mine, [r.pending(name) for r in readers if name in r.meta.tables])
        return self._commit_reshard(snap, manifests)

    def _commit_reshard(self, snap: Snapshot, manifests: list[Manifest]) -> int:
        """Checkpoint the rows just resharded from ``snap`` (``manifests``: its parts', rank 0's first)."""
        self.local.passes = manifests[0].passes
        # No loader trained to these rows on this world size: the reshard's checkpoint holds no data
        # position (each old rank's position was of its own share of the data), and says so.
        data = self.parts.core.data
        source, data.source = data.source, None
        try:
            ckpt = self.checkpoint(
                snap.tag, extra={"resharded_from": snap.world_size}, resharded_from=snap.source
            )
        finally:
            data.source = source
        data.loaded(None, ckpt)
        return ckpt

    def _owned_in_order(
        self, sources: list[Iterator[tuple[np.ndarray, np.ndarray]]], width: int
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The rows this rank owns, from every rank's ``sources`` (the parts it reads: each yields
        ``(keys sorted, rows (b, width))`` by key, and no key lies in two parts), in ascending key
        order (collective, a round at a time until every rank's sources are read). Each round every
        rank sends its rows up to the lowest of the ranks' last buffered keys to their owners: the
        keys of a round lie above the previous round's at every owner, so that its rows, sorted, go
        on where the last round's ended. Memory: a buffer per source and a round's rows (at least
        :data:`_ROUND_BYTES` read ahead on each rank: fewer rounds)."""
        joined = sources[0] if len(sources) == 1 else ((k, r) for k, r, _ in merged_sources(sources, width))
        if self.world_size == 1:  # every row is this rank's: the merge's batches, in key order already
            yield from ((k, r) for k, r in joined if len(k))
            return
        held = _Input(_gathered(joined, _ROUND_BYTES // (4 * width + 8)), 0, width)
        while True:
            got = _gather_ints(self.collectives, [int(not held.done), 0 if held.done else held.last])
            bounds = [last for more, last in got if more]
            if not bounds:
                return
            keys, rows = held.take(min(bounds))
            keys, (rows,) = self._to_owners(keys, [rows])
            if len(keys):
                order = np.argsort(keys)
                yield keys[order], rows[order]

    def _to_owners(self, keys: np.ndarray, columns: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Send ``keys`` (n,) int64 and ``columns`` (n, ...) each to the keys' owners (collective) ->
        the keys this rank owns and their columns, grouped by source rank."""
        owners = self._owner_of(keys, self.world_size)
        order = np.argsort(owners, kind="stable")
        counts = np.bincount(owners, minlength=self.world_size).tolist()
        got, recv = self.collectives.all_to_all(torch.from_numpy(np.ascontiguousarray(keys[order])), counts)
        out = [
            self.collectives.all_to_all_known(torch.from_numpy(np.ascontiguousarray(c[order])), counts, recv)
            .cpu()
            .numpy()
            for c in columns
        ]
        return got.cpu().numpy(), out

    def _retire(self) -> None:
        """Keep the snapshots :func:`retained` names: rank 0 deletes the others' records first, then
        every rank its copies and the parts no kept snapshot names."""
        kept = retained(self.catalog, self.local.keep_checkpoints)
        dropped = [s.id for s in self.catalog if s not in kept]
        if self.rank == 0:
            for old in dropped:
                delete_record(self.local.path, old)
                fault_point("sharded.commit_retired")
        self.collectives.barrier()  # no part is retired while rank 0 holds a record naming it
        if self.rank != 0:
            for old in dropped:
                delete_record(self.local.path, old)
        self.catalog = kept
        self.local.retire_checkpoints(self._parts(kept))
        self._collect_rank_dirs(kept)
        self.collectives.barrier()  # every rank sees the same checkpoints from here on

    def _parts(self, snaps: list[Snapshot]) -> set[int]:
        """This rank's checkpoints that ``snaps`` name (those its store holds: keeping a part that is
        gone keeps nothing, and restoring that snapshot says it is missing)."""
        held = set(self.parts.core.catalog.ids())
        return {s.parts[self.rank] for s in snaps if self._took_part(s)} & held

    def _collect_rank_dirs(self, kept: list[Snapshot]) -> None:
        """Delete the rank directories this process sees that hold no rank's store of this world
        (a larger world's, or one a rank moved away from to another host) and that no kept snapshot
        names, once their checkpoints are retired."""
        remove_collected(self.root)
        for q, path in rank_dirs(self.root).items():
            try:
                uid = store_uid(path)
            except HierpsError:
                continue  # not a store hierps can read: left alone
            if q < self.world_size and uid == self.stores[q]:
                continue
            if not any(q < s.world_size and s.stores[q] == uid for s in kept):
                collect_rank_dir(path)


def update_each_rank(
    root: str | Path, work: Callable[[int, Store], None], tag: str, **store_kwargs: Any
) -> int:
    """Run ``work(rank, store)`` on each rank's store at the latest checkpoint of a sharded directory
    whose rank directories this process sees, one rank after another (e.g. ``hierps shrink``), and
    commit what they hold then as one checkpoint, as the ranks would; returns its id. The directory
    must not be open elsewhere. A crash before rank 0's record leaves the previous checkpoint the latest."""
    root = Path(root)
    catalog = snapshots(root)
    if not catalog:
        raise ConfigError(f"{root}: no checkpoint committed for all ranks; nothing to update.")
    latest = catalog[-1]
    seen = [[int(_reaches(root, latest, q)) for q in range(latest.world_size)]]  # this process reads all
    error = _missing(root, latest, seen, own_parts=False)
    if error is not None:
        raise error
    parts, keep = [], 1
    for rank in range(latest.world_size):
        with opening_part(), Store(rank_dir(root, rank), **store_kwargs) as store:
            if store.checkpoint_id != latest.parts[rank]:
                store.restore(latest.parts[rank])
            work(rank, store)
            extra = {"world_size": latest.world_size, "rank": rank}
            parts.append(store.checkpoint(tag, extra=extra, retire=False))
            keep = store.keep_checkpoints if rank == 0 else keep
    snap = write_record(root, parts, tag)  # rank 0's copy first: the commit point
    kept = retained([*catalog, snap], keep)
    for rank in range(latest.world_size):  # rank 0's records first, then every rank's parts
        with opening_part(), Store(rank_dir(root, rank), **store_kwargs) as store:
            for old in catalog:
                if old not in kept:
                    delete_record(store.path, old.id)
            core = store_parts(store).core
            named = {s.parts[rank] for s in kept if rank < s.world_size and s.stores[rank] == core.marker.uid}
            store.retire_checkpoints(named & set(core.catalog.ids()))
    return snap.id
