"""The store's passes replayed on keys alone: which tier each pass's rows come from.

The RAM tier is the store's own :class:`hierps.tiers.MemoryTier` (its LRU/LFU scores, its batch
eviction down to 7/8 of the budget, its overflow to the sink), holding one-word rows but charging
each the bytes a real row costs, so its policy decides exactly as it would. Around it the replay
does what :class:`hierps.Store` does per pass:

- the working set of a pass is its distinct keys per table; with the pipeline on (and the pass in
  one group), rows shared with the previous pass stay in the device tier (a *device hit*), and
  the rows leaving it go to the RAM tier; without it the whole working set is loaded at
  ``begin_pass`` and written back at ``end_pass``;
- a row not in the device tier is a RAM hit if the RAM tier holds it (touching its score), else an
  SSD read if a write to the SSD tier ever held its key, else new;
- every row of a pass is trained (so dirty); a checkpoint puts the device tier's dirty rows into
  the RAM tier and flushes every dirty row to the SSD tier (the checkpoint's bytes).

A store opened at a checkpoint (``restored``) holds every key on the SSD tier from the start.
Not replayed: admission filters (every key counts as admitted), feature eviction (``shrink``),
and the read-ahead of the next pass (whose reads see the RAM tier a write-back earlier).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from hierps.tiers import MemoryTier

__all__ = ["PassCounts", "replay"]


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
    passes: Iterable[Mapping[str, np.ndarray]],
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
) -> list[PassCounts]:
    """Replay ``passes`` (``{table: ids}`` each) through the store's tiers, budgets in bytes (already
    scaled to the keys kept); one :class:`PassCounts` per pass. Per table: ``ram_row_bytes`` and
    ``device_row_bytes`` what a row costs in those tiers, ``read_bytes`` / ``written_bytes`` what
    the SSD tier counts per row read / written. ``read_ahead``: each pass after the first is read
    while the one before trains (``prefetch``, as ``PassLoader`` and ``hierps demo`` do): its RAM
    hits are touched at that pass's clock. ``restored``: the tables already hold every key (a store
    opened at a checkpoint of the model): a row no tier above holds is read from the SSD tier.
    ``copied_in``: rows ``0..n-1`` of each table (``{table: n}``, in that order) were written into the
    store before the first pass, as ``hierps.deepspeed.initialize`` copies a model's tables in: the
    RAM tier keeps what its budget holds, the rest is on the SSD tier."""
    tables = list(ram_row_bytes)
    sink = _Sink(tables, restored)
    ram = _KeyTier(int(memory_budget), sink, policy, ram_row_bytes)
    for t, n in (copied_in or {}).items():  # Store.write of each table's rows: one put, at tick 0
        ram.put(t, np.arange(n, dtype=np.int64), np.zeros((n, 1), np.float32))
    resident = {t: np.empty(0, np.int64) for t in tables}
    dirty = False  # the device tier's rows were trained since the last write to RAM
    out = []
    for index, batch in enumerate(passes):
        ram.tick = index
        written0 = dict(sink.rows)
        work = {t: np.unique(np.asarray(batch.get(t, np.empty(0, np.int64)), np.int64)) for t in tables}
        ws_bytes = sum(len(k) * device_row_bytes[t] for t, k in work.items())
        split = ws_bytes > device_budget
        piped = pipeline and not split
        counts: dict[str, dict[str, int]] = {}
        if read_ahead and piped and index:
            ram.tick = index - 1
        for t, keys in work.items():
            missing = np.setdiff1d(keys, resident[t], assume_unique=True) if piped else keys
            hit, _ = ram.get(t, missing, touch=True)
            rest = missing[~hit]
            on_ssd = np.ones(len(rest), bool) if restored else np.isin(rest, sink.keys[t], assume_unique=True)
            counts[t] = {
                "working_set": len(keys),
                "device_rows": len(keys) - len(missing),
                "ram_rows": int(hit.sum()),
                "ssd_rows": int(on_ssd.sum()),
                "new_rows": int(len(rest) - on_ssd.sum()),
            }
        ram.tick = index
        for t, keys in work.items():
            if piped:
                leaving = np.setdiff1d(resident[t], keys, assume_unique=True)
                if dirty and len(leaving):
                    ram.put(t, leaving, np.zeros((len(leaving), 1), np.float32))
            else:
                if dirty and len(resident[t]):
                    ram.put(t, resident[t], np.zeros((len(resident[t]), 1), np.float32))
        if not piped:
            for t, keys in work.items():
                if len(keys):
                    ram.put(t, keys, np.zeros((len(keys), 1), np.float32))
            resident, dirty = {t: np.empty(0, np.int64) for t in tables}, False
        else:
            resident, dirty = work, True
        written = {t: sink.rows[t] - written0[t] for t in tables}
        ckpt = replaced = 0
        if checkpoint_every and (index + 1) % checkpoint_every == 0:
            before, replaced0 = sum(sink.rows.values()), sink.replaced
            if dirty:
                for t, keys in resident.items():
                    if len(keys):
                        ram.put(t, keys, np.zeros((len(keys), 1), np.float32))
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
                ids=sum(len(np.asarray(batch.get(t, ()))) for t in tables),
                ssd_bytes_read=float(ssd_read),
                ssd_bytes_written=float(sum(n * written_bytes[t] for t, n in written.items())),
                memory_rows=sum(ram.num_rows(t) for t in tables),
                memory_bytes=float(ram.bytes_used),
                split=split,
                per_table=counts,
            )
        )
    return out
