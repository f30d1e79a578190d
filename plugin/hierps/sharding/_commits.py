"""Checkpoints of a sharded store that every rank agrees on: the protocol.

Each rank checkpoints its own store, ``<root>/rank-NNNNN``: that checkpoint is the rank's *part*.
A checkpoint of W > 1 ranks is committed once for all of them: every rank writes its part (not
retiring anything), the ranks exchange their parts' ids (an all-reduce: every part is durable),
rank 0 writes the commit record (:mod:`hierps.storage._commit_log`, whose rename is the commit
point), and a barrier lets every rank return only once it is committed. Old checkpoints are
retired after that: commit records first, then the parts no kept record names.

Opening a root with any number of ranks returns every rank to the latest checkpoint
(:meth:`ShardCheckpoints.recover`): at the world size that wrote it, each rank rolls its store
back to its part (removing a part that was never committed); at another world size the
checkpoint is resharded (each rank reads the rows it now owns from every old part, with their
optimizer state and pending admission counts) and committed as a checkpoint of the new ranks. No
rank ever reads another checkpoint's rows, nor a part of a checkpoint that did not commit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hierps._faults import fault_point
from hierps._store import Store, store_parts
from hierps.errors import CheckpointRetiredError, ConfigError
from hierps.rows._pending import PENDING_ARRAYS, PendingKeys
from hierps.sharding._local import OwnerParts
from hierps.storage._commit_log import (
    Snapshot,
    find_snapshot,
    rank_dir,
    record_path,
    records_dir,
    remove_stale_records,
    snapshots,
    write_record,
)
from hierps.tiers._reader import CheckpointReader

__all__ = ["ALONE", "Collectives", "ShardCheckpoints", "Snapshot", "rank_dir", "snapshots"]


class Collectives(Protocol):
    """What the checkpoints of a sharded store need of a transport (every transport has it)."""

    rank: int
    world_size: int

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def barrier(self) -> None: ...


class _Alone:
    """The collectives of a process that is the only rank."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def barrier(self) -> None:
        return None


ALONE: Collectives = _Alone()


class ShardCheckpoints:
    """The checkpoints of one rank of a sharded root: its store's part of each, and their commits.

    ``local`` is this rank's store (``<root>/rank-NNNNN``); ``collectives`` joins the ranks
    (:data:`ALONE` for a process that is the only rank). ``reshard(local, readers)`` fills the
    local store with the rows it owns from the old parts when the world size changed.
    Every method is collective: all ranks call it, in the same order.
    """

    def __init__(
        self,
        root: str | Path,
        local: Store,
        collectives: Collectives,
        owner_of: Callable[[np.ndarray, int], np.ndarray],
    ) -> None:
        self.root = Path(root)
        self.local = local
        self.parts: OwnerParts = store_parts(local)
        self.collectives = collectives
        self.rank, self.world_size = collectives.rank, collectives.world_size
        self._owner_of = owner_of

    # -- what is there -------------------------------------------------------------------------
    def list_checkpoints(self) -> list[dict[str, Any]]:
        """``[{"id", "tag", "created", "world_size"}, ...]`` of the restorable checkpoints, oldest first."""
        return [s.describe() for s in snapshots(self.root)]

    def find(self, ref: int | str | None) -> Snapshot | None:
        return find_snapshot(self.root, ref)

    # -- opening ---------------------------------------------------------------------------------
    def recover(self) -> None:
        """Return this rank to the latest snapshot, resharding it if it has another world size (collective)."""
        if self.rank == 0:
            remove_stale_records(self.root)
        latest = self.find(None)
        self._agree(latest.id if latest is not None else 0, "the latest checkpoint")
        if latest is None:
            if self.local.list_checkpoints():  # parts of a checkpoint that never committed
                self.local.rollback(None)
        elif latest.world_size == self.world_size:
            self._back_to_part(latest, rollback=True)
            # Parts no commit record names any more (a retirement cut short) are retired now.
            self.local.retire_checkpoints(self._parts(snapshots(self.root)))
        else:
            self._reshard(latest)
        self.collectives.barrier()  # no rank checkpoints before every rank has recovered

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(
        self, tag: str | None = None, extra: dict[str, Any] | None = None, *, retire: bool = True
    ) -> int:
        """Checkpoint every rank's store and commit them as one checkpoint; returns its id (collective).

        Committed when rank 0's commit record is written, after every part is durable; every rank
        returns only then. A crash before leaves the previous checkpoint as the latest on every rank.
        With ``retire`` False, older checkpoints stay until :meth:`retire` (or the next checkpoint).
        """
        body = {**(extra or {}), "world_size": self.world_size, "rank": self.rank}
        part = self.local.checkpoint(tag, extra=body, retire=False)
        if self.world_size > 1:
            fault_point("sharded.part_written")
            parts = self._agree_parts(part)
            if self.rank == 0:
                fault_point("sharded.before_commit")
                write_record(self.root, parts, tag)
            self.collectives.barrier()  # every rank returns once the checkpoint is committed
            seen = self._agree_parts(int(record_path(self.root, parts[0]).exists()))
            unseen = [r for r, flag in enumerate(seen) if not flag]
            if unseen:
                raise ConfigError(
                    f"{self.root}: ranks {unseen} do not see the commit record rank 0 wrote "
                    f"({record_path(self.root, parts[0]).name}): every rank must open the same directory "
                    "(one machine, or a file system all ranks share). The checkpoint is committed only "
                    "where rank 0 wrote it."
                )
            fault_point("sharded.committed")
            part = parts[0]
        if retire:
            self._retire()
        return part

    def retire(self) -> None:
        """Retire the checkpoints beyond ``keep_checkpoints`` (collective)."""
        self._retire()

    def restore(self, ref: int | str | None = None) -> int:
        """Every rank back to checkpoint ``ref`` (an id, a tag, or the latest); returns the id of the
        checkpoint the ranks are now at (a new one when it was resharded). Collective."""
        snap = self.find(ref)
        self._agree(snap.id if snap is not None else 0, f"checkpoint {ref!r}")
        if snap is None:
            raise ConfigError(
                f"{self.root}: no checkpoint {ref!r}; it has {[(s['id'], s['tag']) for s in self.list_checkpoints()]}."
            )
        if snap.world_size == self.world_size:
            self._back_to_part(snap, rollback=False)
            return snap.id
        return self._reshard(snap)

    # -- parts -------------------------------------------------------------------------------------
    def _back_to_part(self, snap: Snapshot, rollback: bool) -> None:
        part = snap.parts[self.rank]
        if not self.parts.core.catalog.exists(part):
            raise CheckpointRetiredError(
                f"{rank_dir(self.root, self.rank)}: checkpoint {part}, this rank's part of checkpoint "
                f"{snap.id} ({snap.tag!r}, {snap.world_size} ranks), is missing: retired, or the rank "
                "directory was replaced. Restore another checkpoint, or restore the directory from a backup."
            )
        if rollback:  # parts newer than the latest commit never committed: they go
            if self.local.checkpoint_id != part or self.parts.core.catalog.latest() != part:
                self.local.rollback(part)
        else:
            self.local.restore(part)

    def _reshard(self, snap: Snapshot) -> int:
        """Fill this rank's store with the rows it owns in ``snap`` (written by another number of
        ranks), then commit that as a checkpoint of this world size, with the snapshot's tag."""
        readers = [CheckpointReader(rank_dir(self.root, q), snap.parts[q]) for q in range(snap.world_size)]
        names = sorted({name for r in readers for name in r.meta.tables})
        for name in set(self.local.tables) - set(names):  # a table the snapshot does not have
            self.parts.rows.reset(name)
        for name in names:
            held = next(r.infos[name] for r in readers if name in r.infos)
            info = self.local.table(name, held.dim, held.spec)
            self.parts.rows.reset(name)
            # The parts read stay on disk while this rank rewrites its store: no part is retired
            # before every rank has checkpointed (and so has read them).
            for reader in readers:
                if name in reader.meta.tables:
                    for keys, rows in reader.iter_rows(name):
                        mine = self._owner_of(keys, self.world_size) == self.rank
                        self.local.write_rows(name, keys[mine], rows[mine])
            info.step = held.step
            self.parts.core.pending_keys[name] = self._pending_keys(name, info.admission.max_pending, readers)
        self.local.passes = readers[0].meta.passes
        return self.checkpoint(snap.tag, extra={"resharded_from": snap.world_size})

    def _pending_keys(self, name: str, capacity: int, readers: list[CheckpointReader]) -> PendingKeys:
        """The keys of table ``name`` pending admission in every old part that this rank now owns."""
        parts = [r.pending(name) for r in readers if name in r.meta.tables]
        merged = {k: np.concatenate([p[k] for p in parts]) for k in PENDING_ARRAYS}
        keys = merged["pending_keys"].astype(np.int64)
        mine = np.flatnonzero(self._owner_of(keys, self.world_size) == self.rank)
        mine = mine[np.argsort(keys[mine], kind="stable")]
        return PendingKeys.from_arrays(capacity, {k: v[mine] for k, v in merged.items()})

    def _retire(self) -> None:
        """Keep the ``keep_checkpoints`` latest snapshots: rank 0 retires older commit records first,
        then every rank the parts no kept snapshot names."""
        kept = snapshots(self.root)[-self.local.keep_checkpoints :]
        if self.rank == 0 and records_dir(self.root).is_dir():
            kept_ids = {s.id for s in kept}
            for path in sorted(records_dir(self.root).glob("*.json")):
                if path.stem.isdigit() and int(path.stem) not in kept_ids:
                    path.unlink(missing_ok=True)
                    fault_point("sharded.commit_retired")
        self.collectives.barrier()  # no part is retired while a record naming it remains
        self.local.retire_checkpoints(self._parts(kept))
        self.collectives.barrier()  # every rank sees the same checkpoints from here on

    def _parts(self, snaps: list[Snapshot]) -> set[int]:
        """This rank's checkpoints that ``snaps`` name (those its store holds: keeping a part that is
        gone keeps nothing, and restoring that snapshot says it is missing)."""
        held = set(self.parts.core.catalog.ids())
        return {s.parts[self.rank] for s in snaps if self.rank < s.world_size} & held

    # -- agreement -----------------------------------------------------------------------------
    def _agree_parts(self, value: int) -> list[int]:
        """Every rank's ``value``, rank 0's first (an all-reduce: also a barrier)."""
        mine = torch.zeros(self.world_size, dtype=torch.int64)
        mine[self.rank] = value
        return [int(v) for v in self.collectives.all_reduce_sum(mine).tolist()]

    def _agree(self, value: int, what: str) -> None:
        """Check that every rank found the same ``value`` (``ConfigError`` naming them otherwise)."""
        if self.world_size == 1:
            return
        values = self._agree_parts(value)
        if len(set(values)) > 1:
            raise ConfigError(
                f"{self.root}: the ranks found different checkpoints for {what} (ids {values}, by rank). "
                "Every rank must see the same store directory (a shared file system) and the same files."
            )


def update_each_rank(
    root: str | Path, work: Callable[[int, Store], None], tag: str, **store_kwargs: Any
) -> int:
    """Run ``work(rank, store)`` on each rank's store at the latest checkpoint of a sharded directory,
    one rank after another in this process (e.g. ``hierps shrink``), and commit what they hold
    then as one checkpoint, as the ranks would; returns its id. The directory must not be open
    elsewhere. A crash before the commit leaves the previous checkpoint as the latest."""
    root = Path(root)
    latest = find_snapshot(root, None)
    if latest is None:
        raise ConfigError(f"{root}: no checkpoint committed for all ranks; nothing to update.")
    parts = []
    for rank in range(latest.world_size):
        with Store(rank_dir(root, rank), **store_kwargs) as store:
            part = latest.parts[rank]
            if store.checkpoint_id != part or store_parts(store).core.catalog.latest() != part:
                store.rollback(part)  # a part newer than the commit never committed
            work(rank, store)
            extra = {"world_size": latest.world_size, "rank": rank}
            parts.append(store.checkpoint(tag, extra=extra, retire=latest.world_size == 1))
    if latest.world_size > 1:
        write_record(root, parts, tag)
    return parts[0]
