"""The store's passes replayed on keys alone: which tier each pass's rows come from.

The RAM tier is the store's own :class:`hierps.tiers.MemoryTier` (its LRU/LFU scores, its batch
eviction down to a fraction of the budget, its overflow to the sink), holding one-word rows but charging
each the bytes a real row costs, so its policy decides exactly as it would. Around it the replay
does what :class:`hierps.Store` does per pass:

- the working set of a pass is its distinct keys per table; with the pipeline on (and the pass in
  one group), rows shared with the previous pass stay in the device tier (a *device hit*), and
  the rows leaving it go to the RAM tier; without it the whole working set is loaded at
  ``begin_pass`` and written back at ``end_pass``;
- a row not in the device tier is a RAM hit if the RAM tier holds it (touching its score), else an
  SSD read if a write to the SSD tier ever held its key, else new;
- every row of a pass is trained (so dirty); a checkpoint puts the device tier's dirty rows into
  the RAM tier and flushes every dirty row to the SSD tier (the checkpoint's bytes);
- a pass given as its mini-batches whose working set exceeds the device budget loads in the
  groups :class:`hierps.training._passes.PassRunner` plans: the device tier is written back
  before it and between groups (the first mini-batch of a group loading, table by table, what fits
  beside the group before), the last group stays resident, and no read-ahead enters or leaves it;
  ``pass_loader`` cuts the passes again as ``PassLoader`` does, halving them after such a pass.

A store opened at a checkpoint (``restored``) holds every key on the SSD tier from the start.
Not replayed: admission filters (every key counts as admitted), feature eviction (``shrink``),
and the read-ahead of the next pass (whose reads see the RAM tier a write-back earlier).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hierps.errors import ConfigError
from hierps.tiers import MemoryTier
from hierps.training._passes import plan_groups

__all__ = ["PassCounts", "replay"]

Pass = Mapping[str, np.ndarray]
_EMPTY = np.empty(0, np.int64)


@dataclass(frozen=True)
class PassCounts:
    """Rows of one replayed pass (over the keys the replay kept), summed over tables."""

    working_set: int
    device_rows: int
    ram_rows: int
    ssd_rows: int
    new_rows: int
    rows_written: int
    """Rows the RAM tier handed to the SSD tier during the pass (evictions, overflow)."""
    checkpoint_rows: int
    """Rows a checkpoint after this pass wrote (0 when none was taken)."""
    checkpoint_replaced: int
    """Of those, rows whose key the SSD tier held already (their old version is located)."""
    device_bytes: float
    """Device bytes of the working set."""
    ids: int
    """Ids of the pass, repeats included."""
    ssd_bytes_read: float
    ssd_bytes_written: float
    memory_rows: int
    memory_bytes: float
    split: bool
    """The working set exceeded the device budget: the store loads it in groups, unpipelined."""
    groups: int
    """Groups the pass loaded in (1 unless split; 1 too when its mini-batches are unknown)."""
    batches: int
    """Mini-batches of the pass (0: unknown, the pass was given as its ids)."""
    oversized: bool
    """A mini-batch alone exceeds the device budget: the store refuses it (``DeviceBudgetError``)."""
    per_table: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def rows_loaded(self) -> int:
        return self.ram_rows + self.ssd_rows + self.new_rows


class _Sink:
    """Where the replayed RAM tier's dirty rows go: the set of keys the SSD tier holds."""

    def __init__(self, tables: Iterable[str], restored: bool = False) -> None:
        self.keys = {t: np.empty(0, np.int64) for t in tables}
        self.rows = dict.fromkeys(self.keys, 0)
        self.replaced = 0  # rows written whose key the tier held already (all of them, restored)
        self.restored = restored

    def write(self, table: str, keys: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None) -> None:
        held = len(keys) if self.restored else int(np.isin(keys, self.keys[table], assume_unique=True).sum())
        self.replaced += held
        self.keys[table] = np.union1d(self.keys[table], keys)
        self.rows[table] += len(keys)


class _KeyTier(MemoryTier):
    """The RAM tier with rows of one word, each charged the bytes of a real row of its table."""

    def __init__(self, budget: int, sink: _Sink, policy: str, charge: Mapping[str, int]) -> None:
        super().__init__(budget, sink, policy)
        self._charge = dict(charge)
        for table in charge:
            self.add_table(table, 1)

    def row_bytes(self, table: str) -> int:
        return self._charge[table]

    @property
    def bytes_used(self) -> int:
        return sum(self.num_rows(t) * c for t, c in self._charge.items())


def replay(
    passes: Iterable[Pass | Sequence[Pass]],
    *,
    ram_row_bytes: Mapping[str, int],
    device_row_bytes: Mapping[str, float],
    read_bytes: Mapping[str, int],
    written_bytes: Mapping[str, int],
    memory_budget: float,
    device_budget: float,
    policy: str = "lru",
    pipeline: bool = True,
    checkpoint_every: int | None = None,
    read_ahead: bool = False,
    restored: bool = False,
    copied_in: Mapping[str, int] | None = None,
    pass_loader: bool = False,
) -> list[PassCounts]:
    """Replay ``passes`` through the store's tiers, budgets in bytes (already scaled to the keys
    kept); one :class:`PassCounts` per pass. A pass is ``{table: ids}`` (its mini-batches unknown: it
    loads whole) or a list of them, one per mini-batch in order (a pass over the device budget then
    loads in the groups the store would plan). Per table: ``ram_row_bytes`` and ``device_row_bytes``
    what a row costs in those tiers, ``read_bytes`` / ``written_bytes`` what the SSD tier counts per
    row read / written. ``read_ahead``: each pass after the first is read while the one before
    trains (``prefetch``, as ``PassLoader`` and ``hierps demo`` do) unless either is split into
    groups: its RAM hits are touched at that pass's clock. ``restored``: the tables already hold
    every key (a store opened at a checkpoint of the model): a row no tier above holds is read from
    the SSD tier. ``copied_in``: rows ``0..n-1`` of each table (``{table: n}``, in that order) were
    written into the store before the first pass, as ``hierps.deepspeed.initialize`` copies a model's
    tables in: the RAM tier keeps what its budget holds, the rest is on the SSD tier.
    ``pass_loader``: the passes (lists of mini-batches) are cut again from their mini-batches as
    ``PassLoader`` cuts them: the first pass's length at first, halved after each pass that is split."""
    tables = list(ram_row_bytes)
    sink = _Sink(tables, restored)
    ram = _KeyTier(int(memory_budget), sink, policy, ram_row_bytes)
    for t, n in (copied_in or {}).items():  # Store.write of each table's rows: one put, at tick 0
        ram.put(t, np.arange(n, dtype=np.int64), np.zeros((n, 1), np.float32))
    resident = _no_keys(tables)
    dirty = False  # the device tier's rows were trained since the last write to RAM
    ahead_ok = False  # the last pass loaded in one group: it read this one ahead
    out: list[PassCounts] = []

    def row_bytes(counts: dict[str, int]) -> float:
        return sum(n * device_row_bytes[t] for t, n in counts.items())

    def device_bytes(keys: Mapping[str, np.ndarray]) -> float:
        return row_bytes({t: len(k) for t, k in keys.items()})

    def fetch(counts: dict[str, dict[str, int]], table: str, keys: np.ndarray) -> None:
        """Rows of ``keys`` (none resident) loaded into the device tier: from RAM, the SSD tier, or new."""
        hit, _ = ram.get(table, keys, touch=True)
        rest = keys[~hit]
        on_ssd = len(rest) if restored else int(np.isin(rest, sink.keys[table], assume_unique=True).sum())
        c = counts[table]
        c["ram_rows"] += int(hit.sum())
        c["ssd_rows"] += on_ssd
        c["new_rows"] += len(rest) - on_ssd

    def write_back(keys: Mapping[str, np.ndarray]) -> None:
        # As StoreCore.put_dirty: the rows evicted meanwhile reach the sink per table, at the end.
        with ram.deferred_writes():
            for t, k in keys.items():
                if len(k):
                    ram.put(t, k, np.zeros((len(k), 1), np.float32))

    cut = _LoaderCut(passes) if pass_loader else None
    for index, given in enumerate(cut if cut is not None else passes):
        known = not isinstance(given, Mapping)  # the pass's mini-batches are known
        raw: list[Pass] = [given] if isinstance(given, Mapping) else list(given)
        batches = [{t: np.unique(np.asarray(b.get(t, _EMPTY), np.int64)) for t in tables} for b in raw]
        ram.tick = index
        written0 = dict(sink.rows)
        work = (
            batches[0]
            if len(batches) == 1
            else {t: np.unique(np.concatenate([b[t] for b in batches])) for t in tables}
        )
        ws_bytes = device_bytes(work)
        groups = (
            plan_groups(batches, row_bytes, device_budget)
            if known and ws_bytes > device_budget
            else [(0, work)]
        )
        split = ws_bytes > device_budget
        oversized = known and any(device_bytes(b) > device_budget for b in batches)
        piped = pipeline and not split
        counts = {
            t: {"working_set": len(work[t]), "device_rows": 0, "ram_rows": 0, "ssd_rows": 0, "new_rows": 0}
            for t in tables
        }
        if piped:
            if read_ahead and index and ahead_ok:
                ram.tick = index - 1
            for t, keys in work.items():
                missing = np.setdiff1d(keys, resident[t], assume_unique=True)
                counts[t]["device_rows"] = len(keys) - len(missing)
                fetch(counts, t, missing)
            ram.tick = index
            if dirty:  # the rows leaving the device tier
                write_back({t: np.setdiff1d(resident[t], work[t], assume_unique=True) for t in tables})
            resident, dirty = work, True
        else:
            if dirty:  # begin_pass writes the device tier back before a pass loaded in groups
                write_back(resident)
            if not known:  # the pass loads whole, and goes back at its end
                for t, keys in work.items():
                    fetch(counts, t, keys)
                write_back(work)
                resident, dirty = _no_keys(tables), False
            else:
                resident = _no_keys(tables)
                for g, (start, group) in enumerate(groups):
                    if g:
                        # The group's first mini-batch gathers table by table: missing rows that fit
                        # beside the resident ones are loaded; the first that does not writes the
                        # device tier back and loads the whole group (those rows again, from RAM).
                        first = batches[start]
                        used = device_bytes(resident)
                        for t in tables:
                            missing = np.setdiff1d(first[t], resident[t], assume_unique=True)
                            if used + len(missing) * device_row_bytes[t] > device_budget:
                                break
                            fetch(counts, t, missing)
                            resident[t] = np.union1d(resident[t], missing)
                            used += len(missing) * device_row_bytes[t]
                        write_back(resident)
                    for t in tables:
                        fetch(counts, t, group[t])
                    resident = dict(group)
                dirty = True
                if not pipeline:  # end_pass writes back
                    write_back(resident)
                    resident, dirty = _no_keys(tables), False
        ahead_ok = len(groups) == 1
        written = {t: sink.rows[t] - written0[t] for t in tables}
        ckpt = replaced = 0
        if checkpoint_every and (index + 1) % checkpoint_every == 0:
            before, replaced0 = sum(sink.rows.values()), sink.replaced
            if dirty:
                write_back(resident)
                dirty = False
            ram.flush()
            ckpt, replaced = sum(sink.rows.values()) - before, sink.replaced - replaced0
        ssd_read = sum(c["ssd_rows"] * read_bytes[t] for t, c in counts.items())
        out.append(
            PassCounts(
                working_set=sum(c["working_set"] for c in counts.values()),
                device_rows=sum(c["device_rows"] for c in counts.values()),
                ram_rows=sum(c["ram_rows"] for c in counts.values()),
                ssd_rows=sum(c["ssd_rows"] for c in counts.values()),
                new_rows=sum(c["new_rows"] for c in counts.values()),
                rows_written=sum(written.values()),
                checkpoint_rows=ckpt,
                checkpoint_replaced=replaced,
                device_bytes=ws_bytes,
                ids=sum(len(np.asarray(b.get(t, _EMPTY))) for b in raw for t in tables),
                ssd_bytes_read=float(ssd_read),
                ssd_bytes_written=float(sum(n * written_bytes[t] for t, n in written.items())),
                memory_rows=sum(ram.num_rows(t) for t in tables),
                memory_bytes=float(ram.bytes_used),
                split=split,
                groups=len(groups),
                batches=len(batches) if known else 0,
                oversized=oversized,
                per_table=counts,
            )
        )
        if cut is not None and len(groups) > 1:
            cut.shrink()
    return out


def _no_keys(tables: Iterable[str]) -> dict[str, np.ndarray]:
    return {t: _EMPTY for t in tables}


class _LoaderCut:
    """Passes cut from the mini-batches of ``passes`` as ``PassLoader`` cuts them: as many as the
    first pass has, halved (down to one) by :meth:`shrink` after a pass loaded in groups."""

    def __init__(self, passes: Iterable[Pass | Sequence[Pass]]) -> None:
        self._passes = iter(passes)
        self.size = 0

    def shrink(self) -> None:
        self.size = max(1, self.size // 2)

    def __iter__(self) -> Iterator[list[Pass]]:
        first = next(self._passes, None)
        if first is None:
            return
        if isinstance(first, Mapping):
            raise ConfigError(
                "pass_loader: the traffic's passes need their mini-batches (examples_per_batch)."
            )
        self.size = len(first)
        rest = (b for p in self._passes for b in ([p] if isinstance(p, Mapping) else p))
        stream = itertools.chain(first, rest)
        while batch := list(itertools.islice(stream, self.size)):
            yield batch
