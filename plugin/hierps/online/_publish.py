"""The freshness loop: the rows of each new checkpoint published for serving, as deltas, on a schedule.

A :class:`Publisher` keeps a *serving directory* (:mod:`hierps.serving._chain`: a full export, the
base, and a chain of deltas, each the rows changed since the one before) up to date with a training
store: after the trainer made a checkpoint, :meth:`Publisher.publish` exports what changed since
the checkpoint the chain ends at, deletions and evictions included, into a new subdirectory,
written under a temporary name and renamed into place when whole. Serving
(``hierps.serving.open(directory, follow=seconds)``) picks it up at its next poll and switches to
it in one step, never to half of it.

Every ``compact_every`` deltas, a new base (a full export of the latest checkpoint) replaces the
chain, so serving's chain stays short; serving follows it as it follows a delta. The chain before
it is kept one generation longer (a follower still reading it can finish), and removed when the
next base is written.

Restart safety: the publisher holds no state of its own. It reads what the directory holds (the
chain's last export: its store and checkpoint) each time, so a trainer killed at any point and
started again continues the chain from there. A half-written export left by a kill is removed
(serving does so too). When the checkpoint the chain ends at is no longer in the store (retired
past ``keep_checkpoints``, or the store is another one, or it was rolled back and checkpointed
again), no delta can be taken since it: a new base is written instead, never a wrong delta. Only
the store's latest checkpoint is published, so serving never goes back to older rows.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hierps._store import Store, store_parts
from hierps.errors import ConfigError
from hierps.lifecycle._export import export_store
from hierps.serving._chain import find_chain, is_export
from hierps.sharding._commits import ShardCheckpoints
from hierps.sharding._sharded import ShardedStore
from hierps.storage._commit_log import check_not_a_part
from hierps.storage._export_format import ExportManifest, read_manifest
from hierps.storage._files import remove_stale_temp_dirs, temp_dir_for

__all__ = ["Published", "Publisher"]

_NONE, _BASE, _DELTA = 0, 1, 2


@dataclass(frozen=True)
class Published:
    """One export :meth:`Publisher.publish` wrote."""

    path: Path  # the export's directory in the serving directory
    kind: str  # "base" or "delta"
    checkpoint: int  # the checkpoint whose rows serving now has
    since: int | None  # the checkpoint a delta was taken since (None: a base)
    bytes: int  # of its files
    seconds: float  # to write it

    def __str__(self) -> str:
        what = f"delta since {self.since}" if self.since is not None else "base"
        return f"{what} -> checkpoint {self.checkpoint}: {self.bytes / 2**20:.2f} MiB in {self.seconds:.2f}s"


class Publisher:
    """Publishes a store's latest checkpoint into a serving directory, as a delta of what changed.

    Args:
        store: the :class:`hierps.Store` the trainer checkpoints, a :class:`hierps.ShardedStore`
            (then :meth:`publish` is collective, and the directory is on rank ``rank``'s host), or an
            engine of ``hierps.deepspeed.initialize`` (its store, as ``engine.save_checkpoint`` commits it).
        directory: the serving directory (created if need be).
        every_passes / every_seconds: the schedule :meth:`due` says (at most one; neither: always due).
        compact_every: deltas after which the next publish writes a new base instead (>= 1).
        dtype: the precision of the exported weights, ``"fp32"`` or ``"fp16"``.
        rank: the rank that writes, for a sharded store.
    """

    def __init__(
        self,
        store: Any,
        directory: str | os.PathLike[str],
        *,
        every_passes: int | None = None,
        every_seconds: float | None = None,
        compact_every: int = 8,
        dtype: str = "fp32",
        rank: int = 0,
    ) -> None:
        # An engine of hierps.deepspeed.initialize: its store is a part of a root of rank stores (one
        # rank: a Store in <root>/rank-00000), whose checkpoints are the root's commits.
        self._root: ShardCheckpoints | None = getattr(store, "hierps_checkpoints", None)
        store = getattr(store, "hierps_store", store)
        if not isinstance(store, (Store, ShardedStore)):
            raise ConfigError(
                "Publisher: expected a hierps.Store, a ShardedStore or an engine of "
                f"hierps.deepspeed.initialize. Got {type(store).__name__}."
            )
        if isinstance(store, ShardedStore):
            self._root = None  # its own export and checkpoints are the root's
        elif self._root is None:
            try:
                check_not_a_part(store.path)
            except ConfigError as exc:
                raise ConfigError(
                    f"Publisher: {exc} Under hierps.deepspeed, give the Publisher the engine."
                ) from None
        if every_passes is not None and every_seconds is not None:
            raise ConfigError("Publisher: give every_passes or every_seconds, not both.")
        for name, value in (("every_passes", every_passes), ("compact_every", compact_every)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}: expected an int >= 1. Got {value!r} instead.")
        if every_seconds is not None and (
            isinstance(every_seconds, bool)
            or not isinstance(every_seconds, (int, float))
            or not every_seconds > 0
        ):
            raise ConfigError(f"every_seconds: expected a number > 0. Got {every_seconds!r} instead.")
        if dtype not in ("fp32", "fp16"):
            raise ConfigError(f"dtype: expected 'fp32' or 'fp16'. Got {dtype!r} instead.")
        self.store = store
        self.directory = Path(directory)
        self.every_passes, self.every_seconds = every_passes, every_seconds
        self.compact_every = compact_every
        self.dtype = dtype
        self.rank = rank
        self._writes = not isinstance(store, ShardedStore) or store.rank == rank
        if self._writes:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._chain()  # a directory of something else than exports is refused now
        self._passes = self._store_passes()
        self._time = time.monotonic()

    def _store_passes(self) -> int:
        local = self.store.local if isinstance(self.store, ShardedStore) else self.store
        return local.passes

    def due(self) -> bool:
        """Whether the schedule says to publish: ``every_passes`` passes or ``every_seconds`` seconds
        since the last publish of this publisher (or its creation)."""
        if self.every_passes is not None:
            return self._store_passes() - self._passes >= self.every_passes
        if self.every_seconds is not None:
            return time.monotonic() - self._time >= self.every_seconds
        return True

    def publish(self) -> Published | None:
        """Export the store's latest checkpoint into the directory: a delta since the chain's last
        checkpoint, or a base (the first time, every ``compact_every`` deltas, or when no delta can
        be taken since it). None when serving already has it (or the store has no checkpoint)."""
        kind, since, ckpt = self._decide()
        self._passes, self._time = self._store_passes(), time.monotonic()
        if kind == _NONE:
            return None
        name = f"{'base' if kind == _BASE else 'delta'}-{ckpt:010d}"
        path = self.directory / name
        started = time.perf_counter()
        if self._writes and path.exists():  # an export of this checkpoint off the chain: replaced
            _remove(path)
        start = since if kind == _DELTA else None
        if isinstance(self.store, ShardedStore):
            self.store.export(path, start, self.dtype, checkpoint=ckpt, rank=self.rank)
        elif self._root is not None:  # one rank's root, read from this process
            export_store(self._root.root, path, since=start, checkpoint=ckpt, dtype=self.dtype)
        else:  # the latest checkpoint: ``ckpt``
            self.store.export(path, start, self.dtype)
        seconds = time.perf_counter() - started
        if self._writes and kind == _BASE:
            self._collect(path)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if self._writes else 0
        return Published(
            path, "base" if kind == _BASE else "delta", ckpt, since if kind == _DELTA else None, size, seconds
        )

    # -- what to write -------------------------------------------------------------------------------
    def _decide(self) -> tuple[int, int, int]:
        """(kind, since, checkpoint), the same on every rank (rank ``rank`` decides)."""
        row = [_NONE, 0, 0]
        if self._writes:
            row = self._plan()
        if isinstance(self.store, ShardedStore):
            row = self.store.checkpoints.gather(row)[self.rank]
        return row[0], row[1], row[2]

    def _plan(self) -> list[int]:
        held = (self._root or self.store).list_checkpoints()
        if not held:
            return [_NONE, 0, 0]
        latest = held[-1]["id"]
        chain = self._chain()
        if chain is None:
            return [_BASE, 0, latest]
        end = chain[-1]
        if end.state.store == self._uid() and end.checkpoint == latest:
            return [_NONE, 0, 0]
        if len(chain) - 1 >= self.compact_every or not self._holds(end, held):
            return [_BASE, 0, latest]
        return [_DELTA, end.checkpoint, latest]

    def _chain(self) -> list[ExportManifest] | None:
        """The directory's chain, base first; None when it holds no export yet."""
        remove_stale_temp_dirs(self.directory)
        entries = [p for p in self.directory.iterdir() if not p.name.startswith(".")]
        if not entries:
            return None
        try:
            return find_chain(self.directory)
        except ConfigError as exc:
            raise ConfigError(
                f"Publisher: {self.directory} is not a serving directory of this store's exports ({exc}). "
                "Give the publisher a directory of its own."
            ) from exc

    def _uid(self) -> str:
        """The store exports name (of a root of rank stores: rank 0's store)."""
        if isinstance(self.store, ShardedStore):
            return str(self.store.checkpoints.stores[0])
        if self._root is not None:
            return str(self._root.stores[0])
        return store_parts(self.store).core.marker.uid

    def _holds(self, end: ExportManifest, held: list[dict[str, Any]]) -> bool:
        """Whether the store still has the checkpoint the chain ends at, as it was when exported."""
        if end.state.store != self._uid():
            return False
        mine = [c for c in held if c["id"] == end.checkpoint]
        if not mine:
            return False
        # A plain store's checkpoint is exported with its own time; a root's commit has a time of its
        # own and its parts theirs: there the store's uid and the id say it.
        if isinstance(self.store, ShardedStore) or self._root is not None:
            return True
        return bool(mine[0]["created"] == end.state.created)

    def _collect(self, base: Path) -> None:
        """After a new base: remove the exports older than the chain before it (kept one generation)."""
        exports = [m for m in _manifests(self.directory) if m.path != base]
        taken = sorted((m.state.created, m.checkpoint) for m in exports if m.since is None)
        for m in exports if taken else []:
            if (m.state.created, m.checkpoint) < taken[-1]:
                _remove(m.path)


def _remove(export: Path) -> None:
    """Remove an export: renamed out of view first (a temporary name serving ignores, whose leftovers
    a kill leaves are removed by the next publish or open), so no half export is ever in view."""
    gone = temp_dir_for(export)
    os.replace(export, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _manifests(directory: Path) -> list[ExportManifest]:
    return [
        read_manifest(p) for p in sorted(directory.iterdir()) if not p.name.startswith(".") and is_export(p)
    ]
