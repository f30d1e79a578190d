"""Durability: the part of a store that commits, retires, restores and recovers checkpoints.

A checkpoint makes every row written so far durable, atomically (``checkpoint``):

1. the pipeline drains; the device tier's dirty rows go down to the RAM tier, the RAM tier's
   dirty rows to new SSD segments, and the segments are synced;
2. the keys pending admission are written beside the checkpoint (Zarr arrays);
3. the :class:`~hierps.storage.Manifest`, naming every table's live segments, is renamed into
   place: its presence is the commit point. A crash before it leaves the previous checkpoint the
   latest; the next open removes what the interrupted one wrote (``recover``).

Going back (``restore``, ``rollback``) drops every row the device and RAM tiers hold, loads the
checkpoint's tables and segments, and collects the segments no kept checkpoint names. This part is
built on :class:`~hierps._core.StoreCore`, beside the pass runner and the trainer, whose
in-flight state it drops when the rows change under them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from typing import Any

import numpy as np

from hierps._core import StoreCore
from hierps._faults import fault_point
from hierps._position import EXTRA_KEY
from hierps.errors import ConfigError
from hierps.rows._pending import PENDING_ARRAYS, PendingKeys
from hierps.storage._commit_log import check_not_a_part
from hierps.storage._manifest import Manifest, TableEntry
from hierps.tiers._device import DrainedRows
from hierps.training._passes import PassRunner
from hierps.training._pipeline import PassPipeline
from hierps.training._trainer import SparseTrainer

__all__ = ["Checkpoints"]


class Checkpoints:
    """Checkpoint, retire, rollback, restore, reload and recover one store's checkpoints."""

    def __init__(
        self, core: StoreCore, pipe: PassPipeline, passes: PassRunner, trainer: SparseTrainer
    ) -> None:
        self.core = core
        self.pipe = pipe
        self.passes = passes
        self.trainer = trainer

    # -- committing ---------------------------------------------------------------------------
    def checkpoint(self, tag: str | None, extra: dict[str, Any] | None, retire: bool) -> int:
        """Commit a checkpoint of everything written so far; its id. See :meth:`hierps.Store.checkpoint`."""
        core = self.core
        core.check_open()
        if tag is not None and not isinstance(tag, str):
            raise ConfigError(
                f"checkpoint tag: expected a str or None. Got {tag!r} ({type(tag).__name__}); "
                f"pass str({tag!r}) to tag it, and restore it by that string."
            )
        extra = _parse_extra(extra)
        position = core.data.snapshot()
        if position is not None:
            if EXTRA_KEY in extra:
                raise ConfigError(
                    f"checkpoint extra: {EXTRA_KEY!r} is where the tracked loader's position is kept; use another key."
                )
            extra = {**extra, EXTRA_KEY: position}
        if not isinstance(retire, bool):
            raise ConfigError(f"retire: expected True or False. Got {retire!r} instead.")
        self.pipe.drain()
        core.put_dirty(
            {
                t: DrainedRows(k, r, np.ones(len(k), bool))
                for t, (k, r) in core.device_tier.take_dirty().items()
            }
        )
        fault_point("checkpoint.after_device_flush")
        core.memory.flush()
        fault_point("checkpoint.after_memory_flush")
        core.ssd.sync()
        fault_point("checkpoint.after_sync")
        manifest = Manifest(
            id=(core.catalog.latest() or 0) + 1,
            tag=tag,
            created=time.time(),
            seed=core.seed,
            passes=core.passes,
            next_segment=core.ssd.next_segment,
            keep_checkpoints=core.keep_checkpoints,
            tables={
                name: TableEntry.of(info, len(core.pending_keys[name].keys), core.ssd.live_set(name))
                for name, info in core.tables.items()
            },
            extra=extra,
        )
        core.catalog.write(manifest, {name: core.pending_keys[name].arrays() for name in core.tables})
        core.checkpoint_id = manifest.id
        fault_point("checkpoint.after_manifest")
        core.mark_checkpointed()
        if retire:
            self.retire()
        return manifest.id

    def retire(self, keep: Collection[int] | None = None) -> None:
        """Retire every checkpoint not in ``keep`` (default: the newest ``keep_checkpoints``) but the
        current one, and collect the segments no kept checkpoint names. ``keep``: a collection of
        checkpoint ids of this store; ``ConfigError`` for anything else, before anything is retired."""
        core = self.core
        core.check_open()
        ids = core.catalog.ids()
        kept = set(ids[-core.keep_checkpoints :]) if keep is None else _checkpoint_ids(keep, ids)
        self.pipe.drain()
        for old in ids:
            if old not in kept and old != core.checkpoint_id:
                core.catalog.delete(old)
                fault_point("checkpoint.after_retire")
        core.ssd.collect_garbage(core.catalog.referenced_segments())

    # -- going back ---------------------------------------------------------------------------
    def rollback(self, ckpt: int | None) -> None:
        """Retire every checkpoint newer than ``ckpt`` and return to it (None: to no checkpoint)."""
        core = self.core
        core.check_open()
        if ckpt is not None and not core.catalog.exists(ckpt):
            raise ConfigError(f"no checkpoint {ckpt!r} in {core.path}; it has {self.list()}.")
        if ckpt is None:  # first, so that a crash below leaves a store that opens (at a newer one)
            core.mark_checkpointed(False)
        for newer in core.catalog.ids():
            if ckpt is None or newer > ckpt:
                core.catalog.delete(newer)
        self.reload(ckpt)

    def restore(self, ref: int | str | None) -> int:
        """Return to a checkpoint by id, tag or None (the latest); its id."""
        core = self.core
        core.check_open()
        if ref is not None and (isinstance(ref, bool) or not isinstance(ref, (int, str))):
            raise ConfigError(
                f"restore: expected a checkpoint id (int), a tag (str) or None. Got {ref!r} instead."
            )
        ckpt = core.catalog.latest() if ref is None else core.catalog.find(ref)
        if ckpt is None:
            raise ConfigError(f"no checkpoint {ref!r} in {core.path}; it has {self.list()}.")
        self.reload(ckpt)
        return ckpt

    def reload(self, ckpt: int | None) -> None:
        """Drop every row held in the device and RAM tiers and load checkpoint ``ckpt`` (None: none)."""
        self.pipe.drain()
        self.passes.forget_announced()
        self.trainer.drop()
        self.core.device_tier.discard()
        self.core.memory.clear()
        self.load(ckpt)
        self.core.ssd.collect_garbage(self.core.catalog.referenced_segments())  # the newer rows' segments

    def recover(self) -> None:
        """At open: drop what an interrupted run left behind and load the latest checkpoint."""
        core = self.core
        check_not_a_part(core.path)  # one rank's part of a sharded store is not a store of its own
        core.catalog.check_present(core.marker.checkpointed)  # before anything is collected
        core.catalog.remove_incomplete()
        latest = core.catalog.latest()
        if latest is not None:
            manifest = self.load(latest)
            if manifest is not None and core.settings.keep_checkpoints is None:
                core.keep_checkpoints = manifest.keep_checkpoints
        core.ssd.collect_garbage(core.catalog.referenced_segments())
        core.ssd.next_segment = max(core.ssd.next_segment, core.ssd.max_segment_on_disk() + 1)

    def load(self, ckpt: int | None) -> Manifest | None:
        """Load checkpoint ``ckpt`` into the tiers' indexes (None: every table empty, as in a new
        store); its manifest."""
        core = self.core
        manifest = core.catalog.manifest(ckpt) if ckpt is not None else None  # checked
        tables = manifest.tables if manifest is not None else {}
        if manifest is not None:
            for name, entry in manifest.tables.items():
                info = entry.table_info(name, manifest.seed)
                arrays = core.catalog.read_arrays(manifest.id, name, PENDING_ARRAYS, entry.pending)
                core.register(info, PendingKeys.from_arrays(info.admission.max_pending, arrays))
                core.ssd.load_segments(name, info.words, entry.segments)
        for name in set(core.tables) - set(tables):  # created after that checkpoint
            info = core.tables[name]
            info.step = 0
            core.pending_keys[name] = PendingKeys(info.admission.max_pending)
            core.ssd.load_segments(name, info.words, {})
        if manifest is not None:
            core.seed = manifest.seed
            core.passes = manifest.passes
            core.ssd.next_segment = max(core.ssd.next_segment, manifest.next_segment)
        else:
            core.passes = 0
        core.memory.tick = core.passes
        core.checkpoint_id = ckpt
        core.data.loaded(manifest.extra if manifest is not None else None, ckpt)
        return manifest

    def list(self) -> list[dict[str, Any]]:
        """``[{"id", "tag", "created"}, ...]`` of the restorable checkpoints, oldest first."""
        out = []
        for ckpt in self.core.catalog.ids():
            m = self.core.catalog.manifest(ckpt)
            out.append({"id": ckpt, "tag": m.tag, "created": m.created})
        return out


def _checkpoint_ids(keep: Any, ids: list[int]) -> set[int]:
    """``retire(keep=)``: a collection of ints, each the id of one of the checkpoints ``ids`` -> a set."""
    hint = "pass a list of checkpoint ids to keep (list_checkpoints() gives them), or None"
    if isinstance(keep, (str, bytes)) or not isinstance(keep, Collection):
        raise ConfigError(f"retire_checkpoints: keep is a {type(keep).__name__} ({keep!r}); {hint}.")
    wrong = [k for k in keep if isinstance(k, bool) or not isinstance(k, (int, np.integer))]
    if wrong:
        raise ConfigError(f"retire_checkpoints: keep holds {wrong[0]!r}, not a checkpoint id; {hint}.")
    unknown = sorted(int(k) for k in keep if int(k) not in ids)
    if unknown:
        raise ConfigError(
            f"retire_checkpoints: no checkpoint {unknown[0]} to keep; the store has {ids}. Nothing was retired."
        )
    return {int(k) for k in keep}


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
