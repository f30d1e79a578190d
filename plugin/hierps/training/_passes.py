"""Passes: the working set of a group of mini-batches, loaded into the device tier before they run.

:class:`Passes` is the part of :class:`hierps.Store` that plans passes (split into groups that fit
the device budget), loads their rows (carried over from the last pass, read ahead by the
pipeline, or fetched on demand), and writes them back. See :mod:`hierps.training._pipeline` for the
background half.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from hierps._core import StoreCore
from hierps._faults import fault_point
from hierps.errors import ConfigError, DeviceBudgetError, InvalidIdsError, OffsetsError
from hierps.interface import Bags
from hierps.lifecycle._features import Features
from hierps.rows import _ids
from hierps.tiers._slot_index import distinct_ids
from hierps.training._batchplan import (
    Batch,
    PassBatches,
    bag_ids,
    same_batches,
    translate,
    union_positions,
)
from hierps.training._pipeline import PassPipeline

__all__ = ["PassRunner", "plan_groups"]

_EMPTY = np.empty(0, np.int64)
# A device tier used as a cache (no mini-batches announced) that overflows lets its least recently
# used rows go until this fraction of its budget is taken, the rows asked for included: evictions
# come at most once per (1 - _EVICT_TO) of the budget in new rows, and most of the tier stays hot.
_EVICT_TO = 0.75


@dataclass
class _PassPlan:
    """Groups of a pass's mini-batches whose rows fit the device budget together."""

    groups: list[dict[str, np.ndarray]] = field(default_factory=list)
    cursor: int = 0


# The batches of the last plan, its groups, and each id's position in the group (one group only).
_LastPlan = tuple[
    list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], list[dict[str, np.ndarray]] | None
]


def _id_counts(batches: list[dict[str, np.ndarray]]) -> dict[str, int]:
    """Ids per table over all ``batches``, repeats included."""
    out: dict[str, int] = {}
    for batch in batches:
        for table, keys in batch.items():
            out[table] = out.get(table, 0) + len(keys)
    return out


def plan_groups(
    batches: Sequence[Mapping[str, np.ndarray]], nbytes: Callable[[dict[str, int]], float], budget: float
) -> list[tuple[int, dict[str, np.ndarray]]]:
    """Consecutive mini-batches (sorted unique keys per table) merged while their rows fit ``budget``
    (``nbytes``: bytes of ``{table: rows}``): ``(first mini-batch, keys per table)`` per group, in order.
    A mini-batch over the budget alone is a group of its own (the store refuses it before)."""
    groups: list[tuple[int, dict[str, np.ndarray]]] = []
    start, current = 0, None
    for i, keys in enumerate(batches):
        merged = dict(keys)
        if current is not None:
            merged = {
                t: _ids.union(current.get(t, _EMPTY), keys.get(t, _EMPTY))
                for t in current.keys() | keys.keys()
            }
            if nbytes({t: len(k) for t, k in merged.items()}) > budget:
                groups.append((start, current))
                start, merged = i, dict(keys)
        current = merged
    if current:
        groups.append((start, current))
    return groups


class PassRunner:
    """Planning, loading and writing back the passes of a store (the part of :class:`hierps.Store`
    behind ``begin_pass``, ``prefetch``, ``end_pass``, ``run_pass``)."""

    def __init__(self, core: StoreCore, pipe: PassPipeline, features: Features) -> None:
        self._core = core
        self._pipe = pipe
        self._features = features
        self.plan = _PassPlan()
        self.batches: PassBatches | None = None  # the current pass's translated mini-batches
        self.in_pass = False
        self._announced: list[dict[str, np.ndarray]] | None = None
        self._last_plan: _LastPlan | None = None
        # The groups of the pass announced during a pass loaded group by group, planned on the worker.
        self._plan_ahead: tuple[list[dict[str, np.ndarray]], Future[_LastPlan | None]] | None = None
        # The batches prefetch parsed, by identity (the mappings and their id objects), and the result.
        self._parsed: (
            tuple[list[tuple[Mapping[str, Any], tuple[Any, ...]]], list[dict[str, np.ndarray]]] | None
        ) = None

    def forget_announced(self) -> None:
        """Drop the pass announced between passes (e.g. when the store returns to a checkpoint)."""
        self._announced = None

    def forget_batches(self) -> None:
        """Drop the current pass's translated mini-batches: forwards take the generic path."""
        self.batches = None

    def begin_pass(self, batches: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Load the working set of a pass into the device tier before its mini-batches run.

        ``batches`` is ``{table: ids}`` (the pass's ids) or a list of such, one per mini-batch in
        the order they will run. When the working set exceeds the device budget, a list is split
        into consecutive groups that fit, loaded one after the other as training reaches them.
        With the pipeline on, rows shared with the previous pass stay resident, the others were
        read ahead (see :meth:`prefetch`), and the rows leaving are written back in the background.
        """
        self._core.check_open()
        raw = self.parse_batches(batches)
        ahead = self._pipe.take(raw)  # None unless this pass was announced and read ahead
        # The last write-back had a whole pass to finish; waiting for it bounds the queue to one and
        # reports its failure (e.g. a full disk) at this pass, before anything changes.
        self._pipe.wait_writebacks()
        positions = None
        if ahead is not None:
            groups = [ahead.group]
        else:
            groups, positions = self._planned(raw)  # bad input: raise here, change nothing
        if self.in_pass:
            self.end_pass()
        pipelined = self._core.settings.pipeline and len(groups) == 1
        if not pipelined:
            # Rows loaded on demand since the last pass go back first: a full disk (every row kept in
            # RAM) is raised before the pass begins.
            self._core.write_back()
        self.plan = _PassPlan(groups, cursor=0)
        self.in_pass = True
        self._core.stats.begin_pass(self._core.passes)
        groups = [self._admitted_only(g) for g in groups]
        fetch = partial(self._core.fetch_many, touch=True)
        tier = self._core.device_tier
        if pipelined:
            plans = None
            if ahead is not None and ahead.relayout.version == tier.version:
                # Nothing changed in the device tier since the pass was announced: the relayout
                # worked out then holds, the rows read then are exactly those missing, and the
                # mini-batches were translated for the layout it makes.
                drained = tier.apply_relayout(ahead.relayout, ahead.rows, ahead.staged)
                plans = ahead.plans
            else:
                # No write-back is pending now, so rows the read-ahead lacks are read fresh.
                prepared = None
                if ahead is not None:
                    got = ahead.missing_rows()
                    prepared = {t: (k, got[t]) for t, k in ahead.relayout.missing.items()}
                drained = tier.rebuild(groups[0], prepared, fetch)
            self._pipe.submit_writeback(drained)
            self._translated(raw, groups[0], plans, positions)
        else:
            if len(groups) == 1:
                tier.rebuild(groups[0], None, fetch)  # nothing is resident: nothing leaves
                self._translated(raw, groups[0], None, positions)
            elif groups:
                self._load(groups[0], create=False)
        fault_point("pass.loaded")
        if self._announced is not None:
            announced, self._announced = self._announced, None
            self.prefetch(announced)

    def _translated(
        self,
        raw: list[dict[str, np.ndarray]],
        group: dict[str, np.ndarray],
        plans: list[Batch] | None,
        positions: list[dict[str, np.ndarray]] | None,
    ) -> None:
        """Attach the pass's translated mini-batches (see :mod:`hierps.training._batchplan`) to the working set
        ``group`` just laid out: ``plans`` if they were read ahead for this layout, else translated
        now (``positions``: each id's in the pass's keys, if known). Tables filtering admission are
        left to the generic gather."""
        keep = {t: k for t, k in group.items() if not self._core.tables[t].admission.filters}
        if plans is None or len(keep) != len(group):
            base = self._core.device_tier.layout({t: len(k) for t, k in group.items()})
            plans = translate(raw, keep, base, self._core.device, positions, self._core.coalesced)
        self.batches = PassBatches(list[Batch | None](plans), self._core.device_tier.generation)

    def prefetch(self, batches: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Announce the next pass so that its rows are read in the background while this one trains.

        Called during a pass it starts at once; called between passes it starts with the next
        :meth:`begin_pass` (after that pass's write-back is queued, which keeps reads fresh).
        """
        self._core.check_open()
        raw = self.parse_batches(batches, keep=True)  # bad input is refused here, not at the next begin_pass
        if not self._core.settings.pipeline:
            return
        if not self.in_pass:
            self._announced = raw
            return
        if any(self._core.tables[t].admission.filters for b in raw for t in b):
            return  # tables filtering admission are loaded at begin_pass, when admission is known
        if len(self.plan.groups) > 1:
            # This pass is loaded group by group: rows of its later groups are not resident yet, so
            # a read now would take their values from before this pass trains them. The next pass's
            # groups (its ids' alone) are planned on the worker meanwhile.
            self._plan_ahead = (raw, self._pipe.run_in_background(partial(self._plan_or_none, raw)))
            return
        # The worker finds its working set; a pass it does not fit in the device tier is left to
        # begin_pass, which splits it into groups loaded as training reaches them.
        self._pipe.submit_prepare(raw, self._core.device_tier.resident_keys())

    def end_pass(self) -> None:
        """Close the pass. Without the pipeline its working set is written back now; with it, when
        the next pass begins (rows it shares stay resident). Tables whose eviction settings ask
        for it (``every_passes``) are shrunk here. When the disk refuses rows of the write-back
        (``StoreFullError``: they stay in RAM), the pass is closed all the same, without its shrink or
        compaction, and then the error is raised.

        ``ConfigError`` when no pass is open (none begun, or this one closed already, even by an
        end_pass that raised): a pass counts once, so ``ttl_passes`` and ``last_pass`` count passes."""
        self._core.check_open()
        if not self.in_pass:
            raise ConfigError(
                f"end_pass: no pass is open ({self._core.passes} passes closed, none begun since). Call "
                "begin_pass(batches) first. An end_pass that raised (e.g. StoreFullError: its rows stay in "
                "RAM) closed its pass all the same; do not repeat it."
            )
        refused: OSError | None = None
        if not self._core.settings.pipeline:
            try:
                self._core.write_back()
            except OSError as exc:  # every row reached RAM (StoreCore.put_dirty): only the disk said no
                refused = exc
        self.plan = _PassPlan()
        self.batches = None
        self.in_pass = False
        self._core.passes += 1
        self._core.memory.tick = self._core.passes
        if refused is not None:
            self._core.stats.end_pass(self._core.ssd, self._core.memory, list(self._core.tables))
            raise refused
        due = [
            info
            for info in self._core.tables.values()
            if info.eviction.every_passes is not None and self._core.passes % info.eviction.every_passes == 0
        ]
        if due:
            self._pipe.drain()
            for info in due:
                self._features.shrink_table(info, info.eviction)
        self._pipe.run_in_background(self._compact) if self._core.settings.pipeline else self._compact()
        self._core.stats.end_pass(self._core.ssd, self._core.memory, list(self._core.tables))

    def _admitted_only(self, group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A pass's keys without those of admission-filtering tables that have no row yet."""
        out = {}
        for table, keys in group.items():
            if self._core.tables[table].admission.filters and len(keys):
                keys = keys[self._core.has_row(table, keys)]
            out[table] = keys
        return out

    def _compact(self) -> None:
        # The tier lock is held only to choose and to swap segments: the next pass's reads go on.
        for table in list(self._core.tables):
            self._core.ssd.compact(table, self._core.settings.max_segments, lock=self._pipe.lock)

    def parse_batches(self, batches: Any, keep: bool = False) -> list[dict[str, np.ndarray]]:
        """``{table: ids}`` or a sequence of them -> one ``{table: (n,) int64}`` per mini-batch (ids
        announced as :class:`hierps.Bags` carry their offsets: :class:`~hierps.training._batchplan.BagIds`);
        ``InvalidIdsError`` / ``OffsetsError`` / ``ConfigError`` (unknown table) for anything else.
        ``keep``: remember the result for the next call, if that one gets the same mappings of the same
        id objects (``prefetch`` keeps, for the ``begin_pass`` of the same pass)."""
        per_batch = [batches] if isinstance(batches, Mapping) else batches
        if isinstance(per_batch, (str, bytes)) or not isinstance(per_batch, Sequence):
            per_batch = None
        if per_batch is None or not all(isinstance(b, Mapping) for b in per_batch):
            raise InvalidIdsError(
                "batches: expected {table: ids} (the pass's ids) or a list of such, one per mini-batch. "
                f"Got {type(batches).__name__}"
                + (f" of {type(next(iter(batches))).__name__}" if per_batch else "")
                + "."
            )
        last, self._parsed = self._parsed, None
        if (
            last is not None
            and len(last[0]) == len(per_batch)
            and all(
                b is m and len(b) == len(v) and all(x is y for x, y in zip(b.values(), v))
                for b, (m, v) in zip(per_batch, last[0])
            )
        ):
            # The pass prefetch announced, begun with the same mappings of the same id objects:
            # parsed and checked then.
            return last[1]
        out = []
        for batch in per_batch:
            keys = {}
            for table, ids in batch.items():
                self._core.info(table)
                if isinstance(ids, Bags):
                    keys[table] = _announced_bags(table, ids)
                else:
                    keys[table] = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
            out.append(keys)
        if keep:
            self._parsed = ([(b, tuple(b.values())) for b in per_batch], out)
        return out

    def _planned(
        self, batches: list[dict[str, np.ndarray]]
    ) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]] | None]:
        """:meth:`_plan_groups`, reusing the plan of the same batches (announced, then begun): made
        here, or on the worker if it is done by now."""
        ahead, self._plan_ahead = self._plan_ahead, None
        if ahead is not None and ahead[1].done() and same_batches(ahead[0], batches):
            self._last_plan = ahead[1].result() or self._last_plan
        last = self._last_plan
        if last is not None and same_batches(last[0], batches):
            return last[1], last[2]
        groups, positions = self._plan_groups(batches)
        self._last_plan = (batches, groups, positions)
        return groups, positions

    def _plan_or_none(self, batches: list[dict[str, np.ndarray]]) -> _LastPlan | None:
        """:meth:`_plan_groups` on the worker; None where it fails (a mini-batch over the device
        budget: begin_pass plans the batches again, and raises there, changing nothing)."""
        try:
            groups, positions = self._plan_groups(batches)
        except Exception:  # noqa: BLE001 - raised again where the pass begins
            return None
        return batches, groups, positions

    def _plan_groups(
        self, batches: list[dict[str, np.ndarray]]
    ) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]] | None]:
        """Consecutive mini-batches merged while their distinct rows fit the device budget; for a
        pass that is one group, also each id's position in it (see :func:`union_positions`)."""
        budget = self._core.device_tier.budget
        if self._core.device_tier.bytes_for(_id_counts(batches)) <= budget:
            # Fits even counting repeats: one group, one sort per table.
            if not any(batches):
                return [], None
            keys, positions = union_positions(batches)
            return [keys], positions
        uniques = [{t: _ids.distinct(k) for t, k in b.items()} for b in batches]
        for keys in uniques:
            alone = self._core.device_tier.bytes_for({t: len(k) for t, k in keys.items()})
            if alone > budget:
                raise DeviceBudgetError(self._budget_message(alone))
        return [g for _, g in plan_groups(uniques, self._core.device_tier.bytes_for, budget)], None

    def _budget_message(self, need: int) -> str:
        return (
            f"one mini-batch needs {need} bytes of rows in the device tier, more than its budget of "
            f"{self._core.device_tier.budget} bytes. Raise device_budget or use smaller mini-batches."
        )

    def _load(self, keys: Mapping[str, np.ndarray], *, create: bool = True) -> None:
        """Make sorted unique keys resident in the device tier (those not resident yet).

        With ``create`` False, keys of admission-filtering tables that have no row are left out:
        they get one only when a training gather admits them.
        """
        self._pipe.wait_writebacks()
        for table, k in keys.items():
            if len(k) == 0:
                continue
            found, _ = self._core.device_tier.resolve(table, torch.from_numpy(k).to(self._core.device))
            missing = k[~found.cpu().numpy()]
            if len(missing) and not create and self._core.tables[table].admission.filters:
                missing = missing[self._core.stored(table, missing)]
            if len(missing):
                self._core.device_tier.insert(table, missing, self._core.fetch(table, missing, touch=True))

    def resident_slots(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """keys: (U,) sorted unique int64 on the device -> their slots, loading what is missing.

        When the missing rows do not fit next to the working set: in a pass split into groups,
        the working set is written back (the pass is split) and the next planned group is loaded
        along with them; otherwise (rows fetched on demand) the tier works as a cache: outside
        passes it lets its least recently used rows go in place (:meth:`_room_for`), and where
        that cannot free enough, or in a pass, it keeps its most recently used rows and moves them
        (:meth:`_make_room`).
        """
        self._core.check_open()
        tier = self._core.device_tier
        slots, found = tier.locate(table, keys)
        if found is None:
            return slots
        need = self._fitting(table, int(keys.numel()))
        missing = keys.numpy()[~found.numpy()] if keys.device.type == "cpu" else keys[~found].cpu().numpy()
        if self._room_for(table, len(missing), slots, found):  # load them beside, their slots known
            return self._load_missing(table, missing, slots, found, None)
        self._overflow(table, keys.cpu().numpy(), need)
        return tier.resolve(table, keys)[1]

    def _fitting(self, table: str, n: int) -> int:
        """The bytes ``n`` rows of ``table`` take in the device tier; ``DeviceBudgetError`` past its budget."""
        need = n * self._core.device_tier.row_bytes(table)
        if need > self._core.device_tier.budget:
            raise DeviceBudgetError(self._budget_message(need))
        return need

    def _overflow(self, table: str, keys: np.ndarray, need: int) -> None:
        """Make sorted unique ``keys`` (``need`` bytes) resident where no eviction in place made room:
        on demand the tier is rebuilt (:meth:`_make_room`); in a pass split into groups the working
        set is written back and the next planned group loaded along with them."""
        if len(self.plan.groups) <= 1:
            self._make_room(table, keys, need)
        else:
            self._core.write_back()
            load = {table: keys}
            self._load(load)
            plan = self.plan
            if plan.cursor + 1 < len(plan.groups):
                plan.cursor += 1
                nxt = plan.groups[plan.cursor]
                merged = {
                    t: _ids.union(nxt.get(t, _EMPTY), load.get(t, _EMPTY)) for t in nxt.keys() | load.keys()
                }
                if (
                    self._core.device_tier.bytes_for({t: len(k) for t, k in merged.items()})
                    <= self._core.device_tier.budget
                ):
                    self._load(nxt, create=False)

    def resident_each(
        self, table: str, ids: torch.Tensor, slots: torch.Tensor, found: torch.Tensor
    ) -> torch.Tensor:
        """ids (n,) int64 on the device, repeats allowed, and their probe (:meth:`DeviceTier.locate`
        found some of them: ``slots`` where ``found``) -> the slots of all, loading what is missing.

        Missing rows that fit beside the resident ones are loaded as such, once per key, and their
        slots filled in where they are missing; otherwise as :meth:`resident_slots` loads them.
        """
        tier = self._core.device_tier
        cpu = ids.device.type == "cpu"
        lacking = ~found.numpy() if cpu else ~found.cpu().numpy()
        ids_np = ids.numpy() if cpu else ids.cpu().numpy()
        keys, inverse, _ = distinct_ids(torch.from_numpy(ids_np[lacking]))
        missing, at = keys.numpy(), inverse.numpy()
        if not self._room_for(table, len(missing), slots, found):
            keys_all = _ids.distinct(ids_np)
            self._overflow(table, keys_all, self._fitting(table, len(keys_all)))
            return tier.resolve(table, ids)[1]
        return self._load_missing(table, missing, slots, found, at)

    def _load_missing(
        self, table: str, missing: np.ndarray, slots: torch.Tensor, found: torch.Tensor, at: np.ndarray | None
    ) -> torch.Tensor:
        """Load sorted unique ``missing`` keys (they fit) and fill their slots into a probe's ``slots``
        where not ``found``: each such entry is the key ``missing[at[i]]`` (``at`` None: ``missing`` in
        order). Returns the slots of all (the probe's own tensor on the CPU, filled in place)."""
        self._pipe.wait_writebacks()
        new = self._core.device_tier.insert(table, missing, self._core.fetch(table, missing, touch=True))
        if slots.device.type == "cpu":  # numpy masks: a few µs where torch's take tens
            slots.numpy()[~found.numpy()] = new.numpy() if at is None else new.numpy()[at]
            return slots
        slots = slots.clone()
        slots[~found] = new if at is None else new[torch.from_numpy(at).to(slots.device)]
        return slots

    def _room_for(self, table: str, m: int, slots: torch.Tensor, found: torch.Tensor) -> bool:
        """Whether ``m`` more rows of ``table`` fit beside the resident ones, made so where they do not
        by letting the least recently used rows go (:meth:`DeviceTier.evict`), down to
        :data:`_EVICT_TO` of the budget: outside passes, where no slot is planned or mapped
        ahead. The rows gathered since the last step and those at ``slots[found]`` (a probe of the
        lookup asking) stay, at their slots. False: the caller makes room by moving rows."""
        tier = self._core.device_tier
        need = m * tier.row_bytes(table)
        over = tier.bytes_used + need - tier.budget
        if over <= 0:
            return True
        if self.in_pass:  # slots may be planned or mapped for the pass's working set: move rows instead
            return False
        self._pipe.wait_writebacks()
        stay = slots[found] if slots.device.type != "cpu" else torch.from_numpy(slots.numpy()[found.numpy()])
        drained = tier.evict(over + int((1 - _EVICT_TO) * tier.budget), over, [(table, stay)])
        if drained is None:
            return False
        with self._pipe.lock:
            self._core.put_dirty(drained)
        self._core.stats.count_on_demand_eviction()
        return True

    def _make_room(self, table: str, keys: np.ndarray, need: int) -> None:
        """Make sorted unique ``keys`` resident when they do not fit and no eviction in place can make
        room (in a pass, or rows gathered since the last step fill the tier): the tier is rebuilt with its
        most recently used rows, up to half its budget (rows gathered since the last step first), and writes the
        others back. With skewed ids most rows of the next mini-batches are among those kept, so
        fetching on demand does not reload the hot rows after each overflow; and since half the
        budget is freed, overflows come at most once per half a budget of new rows."""
        tier = self._core.device_tier
        self._pipe.wait_writebacks()
        keep = tier.recent(max(tier.budget // 2 - need, 0))
        keep[table] = _ids.union(keep.get(table, _EMPTY), keys)
        drained = tier.rebuild(keep, None, partial(self._core.fetch_many, touch=True))
        with self._pipe.lock:
            self._core.put_dirty(drained)
        self._core.stats.count_on_demand_rebuild()


def _announced_bags(table: str, bags: Bags) -> np.ndarray:
    """The ids of ``bags`` carrying its offsets, checked as ``nn.EmbeddingBag`` checks them."""
    for what, value in (("ids", bags.ids), ("offsets", bags.offsets)):
        shape = tuple(value.shape) if isinstance(value, (torch.Tensor, np.ndarray)) else np.shape(value)
        if len(shape) != 1:
            raise OffsetsError(f"Bags of table {table!r}: {what} must be 1-D. Got shape {shape}.")
    flat = _ids.as_int64_array(bags.ids, what=f"ids for table {table!r}")
    offsets = _ids.as_int64_array(bags.offsets, what=f"offsets for table {table!r}")
    if len(offsets) and (offsets[0] != 0 or offsets[-1] > len(flat) or (offsets[1:] < offsets[:-1]).any()):
        raise OffsetsError(
            f"Bags of table {table!r}: offsets must start at 0, never decrease and stay within the "
            f"{len(flat)} ids (each bag starts where the last one ended). Got {offsets[:8].tolist()}..."
        )
    return bag_ids(flat, offsets)
