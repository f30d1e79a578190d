"""The plan: bytes per tier, where each pass's rows come from, and how long passes, checkpoints,
restores and reshards take, for tables, budgets, traffic and a machine.

Figures are per rank (a sharded store gives each rank ``1 / world_size`` of the keys, by hash,
and each rank its own budgets), except ``total_*``. Byte sizes come from :mod:`._sizes` (the
store's own layout and writer), hit rates from replaying the traffic through the store's RAM
tier (:mod:`._simulate`), times from the machine's rates: a lower bound when the pipeline
overlaps every stage, an upper bound when they run one after the other. Training compute is not
in them: they bound what the store adds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hierps.config import DEFAULT_KEEP_CHECKPOINTS, EVICTION_POLICIES, TableSpec, parse_size
from hierps.errors import ConfigError
from hierps.planning._machine import Machine
from hierps.planning._simulate import PassCounts, replay
from hierps.planning._sizes import RowBytes, row_bytes
from hierps.planning._traffic import BatchTraffic, PowerLaw, SampledTraffic, Traffic
from hierps.tiers._ssd import small_runs_held

__all__ = ["PassPlan", "Plan", "TablePlan", "TableInput", "format_plan", "plan"]

# Rows one page read brings when the SSD tier's own read rate is not measured: a lookup reads the
# one page-sized chunk that holds the row.
_PAGE = 4096
# A segment set holds at most twice the live rows before compaction merges it, and a merge writes
# its output (at most the live rows) before its inputs go: the disk's peak is three times the live rows.
_STEADY, _PEAK = 2.0, 3.0


@dataclass(frozen=True)
class TableInput:
    """One table to plan for: ``keys`` rows it will hold (None: the distinct keys of the traffic),
    ``dim`` weights, its settings (optimizer, precisions) as a :class:`hierps.TableSpec`."""

    dim: int
    keys: int | None = None
    spec: TableSpec = field(default_factory=TableSpec)


@dataclass(frozen=True)
class TablePlan:
    """One table: its row in bytes per tier, its rows per rank, their bytes on disk and in the index."""

    name: str
    dim: int
    optimizer: str
    weights_dtype: str
    state_dtype: str
    keys: int
    keys_per_rank: int
    row: dict[str, float]
    ssd_bytes: float
    index_bytes: float


@dataclass(frozen=True)
class PassPlan:
    """One pass, per rank: rows of its working set, where they come from, SSD traffic, stage times."""

    pass_index: int
    working_set: float
    working_set_bytes: float
    device_hit_rate: float
    """Rows of the working set resident from the previous pass (pipeline on)."""
    rows_loaded: float
    ram_hit_rate: float
    """Of the rows loaded (as :class:`hierps.PassRecord` counts them)."""
    ssd_hit_rate: float
    new_rate: float
    ssd_rows: float
    ssd_bytes_read: float
    ssd_bytes_written: float
    checkpoint_rows: float
    """Rows a checkpoint after the pass writes (the SSD tier counts their bytes in the next pass's
    ``ssd_bytes_written``)."""
    checkpoint_bytes: float
    """Disk bytes of those rows' segment."""
    checkpoint_seconds: float
    """Time of that checkpoint on the machine (0 without one, or without a checkpoint)."""
    memory_bytes: float
    seconds_low: float
    seconds_high: float
    stage_seconds: dict[str, float]
    groups: int = 1
    """Groups the pass loads in: more than one when its working set exceeds the device budget."""
    batches: int = 0
    """Mini-batches of the pass (0: the traffic gives passes, not their mini-batches)."""


@dataclass(frozen=True)
class Plan:
    """The answer of :func:`plan` (see the module's docstring); ``to_json`` for files, ``format_plan`` for people."""

    tables: list[TablePlan]
    passes: list[PassPlan]
    world_size: int
    memory_budget: int
    device_budget: int
    device_bytes: float
    """Peak working-set bytes of a pass in the device tier."""
    ram_bytes: float
    """Peak bytes the RAM tier holds (at most its budget)."""
    ssd_live_bytes: float
    ssd_steady_bytes: float
    ssd_peak_bytes: float
    """Disk with compaction headroom: steady state (twice the live rows), peak during a merge (three
    times); with checkpoints, both plus the small runs that the kept checkpoints may still name after
    compaction merged them (per table at most 3 x 10 MiB, and 3 x its steady bytes)."""
    index_ram_bytes: float
    checkpoint_bytes_per_pass: float
    checkpoint_seconds: float
    restore_seconds: float
    reshard_seconds: float
    total_ssd_bytes: float
    total_ram_bytes: float
    total_device_bytes: float
    sample_fraction: float
    """Fraction of each rank's keys the replay kept (budgets scaled alike)."""
    traffic: dict[str, Any]
    machine: dict[str, Any] | None
    warnings: list[str]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        d = dict(data)
        d["tables"] = [TablePlan(**t) for t in d["tables"]]
        d["passes"] = [PassPlan(**p) for p in d["passes"]]
        return cls(**d)

    def mean(self, name: str, skip_first: int = 0) -> float:
        """The mean of a :class:`PassPlan` field over the passes after the first ``skip_first``."""
        rows = self.passes[skip_first:] or self.passes
        return sum(getattr(p, name) for p in rows) / max(len(rows), 1)


def plan(
    tables: Mapping[str, TableInput],
    traffic: Traffic,
    *,
    memory_budget: int | str = "1GiB",
    device_budget: int | str = "1GiB",
    world_size: int = 1,
    pipeline: bool = True,
    eviction: str = "lru",
    checkpoint_every: int | None = 1,
    machine: Machine | None = None,
    max_ids_per_pass: int = 2_000_000,
    read_ahead: bool = False,
    restored: bool = False,
    copied_in: bool = False,
    pass_loader: bool = False,
) -> Plan:
    """Plan a store of ``tables`` (name -> :class:`TableInput`) for ``traffic`` (passes of ids,
    :class:`SampledTraffic` or :class:`PowerLaw`), at ``world_size`` ranks each with these budgets.

    The traffic is spatially sampled down to about ``max_ids_per_pass`` ids a pass per rank (its
    ``fraction`` when set below 1 is kept). ``checkpoint_every``: passes between checkpoints
    (None: none). ``machine``: rates for the times (None: no times, 0 in the record).
    ``read_ahead``: each pass is announced while the one before trains (``store.prefetch``, as
    ``PassLoader`` and ``hierps demo`` do), so its rows are read before that pass's write-back.
    ``restored``: the tables already hold every key (the store opens at a checkpoint): rows are read
    from the SSD tier, none is new. ``copied_in``: each table's ``keys`` rows (ids ``0..keys-1``) are
    copied into the store before the first pass, as ``hierps.deepspeed.initialize`` copies a model's
    ``nn.Embedding`` / ``nn.EmbeddingBag`` tables in (not built on the meta device): the RAM tier holds
    what its budget takes of them, in table order, and the rest starts on the SSD tier.
    ``pass_loader``: the passes are cut by a ``PassLoader`` (the traffic needs ``examples_per_batch``):
    after a pass that loads in groups (over the device budget), the next passes have half as many
    mini-batches, down to one.
    """
    if not tables:
        raise ConfigError("plan: no tables given; give at least one table with its dim.")
    if world_size < 1:
        raise ConfigError(f"world_size: expected at least 1. Got {world_size} instead.")
    if eviction not in EVICTION_POLICIES:
        raise ConfigError(f"eviction: expected one of {EVICTION_POLICIES}. Got {eviction!r} instead.")
    mem, dev = parse_size(memory_budget, "memory_budget"), parse_size(device_budget, "device_budget")
    sizes = {t: row_bytes(i.dim, i.spec) for t, i in tables.items()}
    unknown = sorted(set(_traffic_tables(traffic)) - set(tables))
    if unknown:
        raise ConfigError(f"traffic has ids for table {unknown[0]!r}, which the plan has no table for.")
    if copied_in:
        unsized = [t for t, i in tables.items() if i.keys is None]
        if unsized:
            raise ConfigError(f"copied_in: table {unsized[0]!r} has no keys; give each table's rows (keys=).")
        if world_size != 1:
            raise ConfigError(
                "copied_in: planned for one rank only (a sharded copy-in splits rows by owner)."
            )
    if pass_loader and traffic.examples_per_batch is None:
        raise ConfigError(
            "pass_loader: the traffic needs its mini-batches; give it examples_per_batch (the loader's batch size)."
        )
    fraction = _choose_fraction(traffic, world_size, max_ids_per_pass)
    if copied_in and fraction < 1:
        raise ConfigError(
            f"copied_in: the traffic would be sampled down to {fraction:.3f} of its ids, and a copy-in "
            "cannot be; raise max_ids_per_pass."
        )
    traffic.fraction = fraction / world_size
    counts = replay(
        traffic.passes(),
        ram_row_bytes={t: int(s.ram) for t, s in sizes.items()},
        device_row_bytes={t: s.device for t, s in sizes.items()},
        read_bytes={t: s.ssd_traffic for t, s in sizes.items()},
        written_bytes={t: s.ssd_written for t, s in sizes.items()},
        memory_budget=mem * fraction,
        device_budget=dev * fraction,
        policy=eviction,
        pipeline=pipeline,
        checkpoint_every=checkpoint_every,
        read_ahead=read_ahead,
        restored=restored,
        copied_in={t: int(i.keys or 0) for t, i in tables.items()} if copied_in else None,
        pass_loader=pass_loader,
    )
    seen = _distinct_seen(counts)
    tplans = [
        _table_plan(name, inp, sizes[name], world_size, seen.get(name, 0) / fraction)
        for name, inp in tables.items()
    ]
    ssd_per_key = {t.name: sizes[t.name].ssd for t in tplans}
    passes = [_pass_plan(i, c, fraction, sizes, ssd_per_key, machine) for i, c in enumerate(counts)]
    live = sum(t.ssd_bytes for t in tplans)
    # The checkpoints a new store keeps name the small runs merged away since (the steady state's own
    # rows aside).
    held = (
        sum(small_runs_held(_STEADY * t.ssd_bytes, DEFAULT_KEEP_CHECKPOINTS) for t in tplans)
        if checkpoint_every
        else 0.0
    )
    index = sum(t.index_bytes for t in tplans)
    ckpt = sum(p.checkpoint_bytes for p in passes) / max(len(passes), 1)
    warnings = _warnings(counts, passes, mem, dev, pipeline, tables, world_size)
    device_bytes = max((p.working_set_bytes for p in passes), default=0.0)
    ram_bytes = max((p.memory_bytes for p in passes), default=0.0)
    return Plan(
        tables=tplans,
        passes=passes,
        world_size=world_size,
        memory_budget=mem,
        device_budget=dev,
        device_bytes=device_bytes,
        ram_bytes=ram_bytes,
        ssd_live_bytes=live,
        ssd_steady_bytes=_STEADY * live + held,
        ssd_peak_bytes=_PEAK * live + held,
        index_ram_bytes=index,
        checkpoint_bytes_per_pass=ckpt,
        checkpoint_seconds=sum(p.checkpoint_seconds for p in passes) / max(len(passes), 1),
        restore_seconds=index / machine.disk_read if machine else 0.0,
        reshard_seconds=live / machine.disk_read + live / machine.disk_write if machine else 0.0,
        total_ssd_bytes=live * world_size,
        total_ram_bytes=(ram_bytes + index) * world_size,
        total_device_bytes=device_bytes * world_size,
        sample_fraction=fraction,
        traffic=traffic.describe(),
        machine=machine.to_json() if machine else None,
        warnings=warnings,
    )


def _traffic_tables(traffic: Traffic) -> list[str]:
    if isinstance(traffic, SampledTraffic):
        return list(traffic.ids)
    if isinstance(traffic, PowerLaw):
        return list(traffic.tables)
    if isinstance(traffic, BatchTraffic):
        return sorted({t for b in traffic.batches for t in b})
    return []


def _choose_fraction(traffic: Traffic, world_size: int, max_ids: int) -> float:
    """Fraction of a rank's keys to replay: all of them unless a pass brings over ``max_ids`` ids
    (or a power law spans over ``max_ids`` keys) per rank."""
    if traffic.fraction < 1.0:
        return min(1.0, traffic.fraction * world_size)
    if isinstance(traffic, SampledTraffic):
        per_pass = traffic.examples_per_pass * sum(
            int(math.prod(a.shape[1:])) if a.ndim > 1 else 1 for a in traffic.ids.values()
        )
    elif isinstance(traffic, PowerLaw):
        per_pass = traffic.examples_per_pass * sum(d.ids_per_example for d in traffic.tables.values())
        # A power law is drawn over every key it keeps: keep at most ``max_ids`` keys a rank too.
        keys = sum(d.keys for d in traffic.tables.values())
        per_pass = max(per_pass, keys)
    elif isinstance(traffic, BatchTraffic):
        per_pass = round(traffic.ids_per_pass)
    else:
        return 1.0
    return min(1.0, max_ids / max(per_pass / world_size, 1))


def _distinct_seen(counts: list[PassCounts]) -> dict[str, int]:
    """Distinct keys the replay stored per table: every key ever loaded new."""
    out: dict[str, int] = {}
    for c in counts:
        for t, row in c.per_table.items():
            out[t] = out.get(t, 0) + row["new_rows"]
    return out


def _table_plan(name: str, inp: TableInput, size: RowBytes, world: int, seen: float) -> TablePlan:
    keys = inp.keys if inp.keys is not None else round(seen * world)
    per_rank = math.ceil(keys / world)
    spec = inp.spec
    return TablePlan(
        name=name,
        dim=inp.dim,
        optimizer=spec.optimizer.type if spec.optimizer else "adagrad",
        weights_dtype=spec.weights_dtype or "fp32",
        state_dtype=spec.state_dtype or "fp32",
        keys=keys,
        keys_per_rank=per_rank,
        row=size.to_json(),
        ssd_bytes=per_rank * size.ssd + size.ssd_fixed,
        index_bytes=per_rank * size.index,
    )


def _pass_plan(
    index: int,
    c: PassCounts,
    f: float,
    sizes: Mapping[str, RowBytes],
    ssd_per_key: Mapping[str, float],
    machine: Machine | None,
) -> PassPlan:
    loaded = max(c.rows_loaded, 1)
    ckpt_bytes = 0.0
    moved = 0.0  # bytes of rows copied between RAM and the device tier (loads and write-backs)
    for t, row in c.per_table.items():
        loaded_t = row["ram_rows"] + row["ssd_rows"] + row["new_rows"]
        moved += 2 * loaded_t * sizes[t].words * 4
    if c.checkpoint_rows:
        mean_ssd = sum(ssd_per_key.values()) / len(ssd_per_key)
        ckpt_bytes = c.checkpoint_rows * mean_ssd / f
    pages = sum(row["ssd_rows"] * sizes[t].chunk_pages for t, row in c.per_table.items()) / f
    stages = _stage_seconds(c, f, moved / f, pages, machine)
    return PassPlan(
        pass_index=index,
        working_set=c.working_set / f,
        working_set_bytes=c.device_bytes / f,
        device_hit_rate=c.device_rows / max(c.working_set, 1),
        rows_loaded=c.rows_loaded / f,
        ram_hit_rate=c.ram_rows / loaded,
        ssd_hit_rate=c.ssd_rows / loaded,
        new_rate=c.new_rows / loaded,
        ssd_rows=c.ssd_rows / f,
        ssd_bytes_read=c.ssd_bytes_read / f,
        ssd_bytes_written=c.ssd_bytes_written / f,
        checkpoint_rows=c.checkpoint_rows / f,
        checkpoint_bytes=ckpt_bytes,
        checkpoint_seconds=_checkpoint_seconds(
            ckpt_bytes,
            c.checkpoint_replaced / f,
            sum(1 for row in c.per_table.values() if row["working_set"]),
            machine,
        )
        if c.checkpoint_rows
        else 0.0,
        memory_bytes=c.memory_bytes / f,
        seconds_low=max(stages.values(), default=0.0),
        seconds_high=sum(stages.values()),
        stage_seconds=stages,
        groups=c.groups,
        batches=c.batches,
    )


def _stage_seconds(
    c: PassCounts, f: float, moved: float, pages: float, machine: Machine | None
) -> dict[str, float]:
    """Seconds of each stage a pass's rows go through, at the machine's rates; ``pages``: the pages
    of the chunks its SSD reads fetch."""
    if machine is None:
        return {}
    read = c.ssd_bytes_read / f
    out = {
        "ssd_read": _ssd_read_seconds(read, pages, machine),
        "ssd_write": (c.ssd_bytes_written / f) / (machine.segment_write or machine.disk_write),
        "ram": moved / machine.ram_copy,
    }
    if machine.device_copy:
        out["device_copy"] = moved / machine.device_copy
    return out


def _checkpoint_seconds(nbytes: float, replaced: float, tables: int, machine: Machine | None) -> float:
    """A checkpoint of ``nbytes`` of segments, one per table, ``replaced`` of its rows replacing stored
    ones: the bytes at the store's segment write rate (else the disk's), the machine's latency of a
    segment made durable per table, and the lookup of each replaced row's old segment."""
    if machine is None:
        return 0.0
    return (
        nbytes / (machine.segment_write or machine.disk_write)
        + tables * (machine.checkpoint_latency or 0.0)
        + (replaced / machine.replace_rate if machine.replace_rate else 0.0)
    )


def _ssd_read_seconds(row_bytes: float, pages: float, machine: Machine) -> float:
    """Seconds the SSD tier takes to read rows scattered over its segments, each in a chunk of its own
    (``pages``: their chunks' 4 KiB pages): at its own measured rate, else the pages at the disk's
    random 4 KiB rate, else at its sequential rate."""
    if machine.ssd_tier_read:
        return row_bytes / machine.ssd_tier_read
    if machine.random_read:
        return pages / machine.random_read
    return pages * _PAGE / machine.disk_read


def _warnings(
    counts: list[PassCounts],
    passes: list[PassPlan],
    memory_budget: int,
    device_budget: int,
    pipeline: bool,
    tables: Mapping[str, TableInput],
    world: int,
) -> list[str]:
    out = []
    oversized = [p.pass_index for p, c in zip(passes, counts, strict=True) if c.oversized]
    if oversized:
        out.append(
            f"device_budget {_fmt(device_budget)} cannot hold one mini-batch's rows (passes "
            f"{_some(oversized)}): the store refuses such a mini-batch (DeviceBudgetError). Raise "
            "device_budget or use smaller mini-batches."
        )
    split = [p.pass_index for p, c in zip(passes, counts, strict=True) if c.split]
    if split:
        need = max(p.working_set_bytes for p in passes)
        out.append(
            f"device_budget {_fmt(device_budget)} cannot hold a pass's working set ({_fmt(need)} per rank at "
            f"the peak; passes {_some(split)}): those passes load in groups one after another, without "
            "the pipeline (a PassLoader halves the passes after each). Raise device_budget, or make "
            "passes shorter."
        )
    need = max((p.working_set_bytes for p in passes), default=0.0)
    if need > memory_budget:
        out.append(
            f"memory_budget {_fmt(memory_budget)} cannot hold a pass's working set ({_fmt(need)} per rank): "
            "its rows are evicted to the SSD tier before the next pass can reuse them. Raise memory_budget, "
            "or expect the SSD hit rates above."
        )
    if not pipeline:
        out.append("pipeline off: no row stays in the device tier between passes (device hit rate 0).")
    for name, inp in tables.items():
        if inp.spec.admission is not None and inp.spec.admission.filters:
            out.append(f"table {name!r} filters admission: the replay counts every key as admitted.")
    return out


def _some(indices: list[int]) -> str:
    return f"{indices[:5]}{'...' if len(indices) > 5 else ''}"


def format_plan(p: Plan) -> str:
    """The plan as a few lines of text: bytes per tier, hit rates, times, warnings."""
    lines = [f"hierps plan: {len(p.tables)} tables, {p.world_size} rank(s); per rank:"]
    for t in p.tables:
        lines.append(
            f"  {t.name}: {t.keys:,} keys (dim {t.dim}, {t.optimizer}, {t.weights_dtype}/{t.state_dtype}): "
            f"row {t.row['ram']:.0f} B in RAM, {t.row['ssd']:.1f} B on SSD, index {t.row['index']:.2f} B/key"
        )
    lines += [
        f"  device: {_fmt(p.device_bytes)} working set (budget {_fmt(p.device_budget)})",
        f"  RAM:    {_fmt(p.ram_bytes)} rows (budget {_fmt(p.memory_budget)}) + {_fmt(p.index_ram_bytes)} SSD index",
        f"  SSD:    {_fmt(p.ssd_live_bytes)} live, {_fmt(p.ssd_steady_bytes)} steady, {_fmt(p.ssd_peak_bytes)} peak "
        "(compaction headroom)",
        f"  checkpoint: {_fmt(p.checkpoint_bytes_per_pass)} per pass",
    ]
    skip = 1 if len(p.passes) > 1 else 0
    if any(q.batches for q in p.passes):
        sizes = sorted({q.batches for q in p.passes}, reverse=True)
        split = sum(1 for q in p.passes if q.groups > 1)
        lines.append(
            f"  passes: {len(p.passes)} of {'/'.join(map(str, sizes))} mini-batches; {split} load in groups "
            "(over the device budget)"
        )
    lines.append(
        f"  per pass (after the first): device hit {p.mean('device_hit_rate', skip):.1%}, of rows loaded: RAM "
        f"{p.mean('ram_hit_rate', skip):.1%}, SSD {p.mean('ssd_hit_rate', skip):.1%}, new "
        f"{p.mean('new_rate', skip):.1%}; SSD reads {p.mean('ssd_rows', skip):,.0f} rows "
        f"({_fmt(p.mean('ssd_bytes_read', skip))}), writes {_fmt(p.mean('ssd_bytes_written', skip))}"
    )
    if p.machine is not None:
        lines.append(
            f"  times: pass store work {p.mean('seconds_low', skip):.2f}-{p.mean('seconds_high', skip):.2f} s, "
            f"checkpoint {p.checkpoint_seconds:.2f} s, restore {p.restore_seconds:.2f} s, reshard "
            f"{p.reshard_seconds:.1f} s (machine: {p.machine['name']})"
        )
    lines.append(
        f"  totals: SSD {_fmt(p.total_ssd_bytes)}, RAM {_fmt(p.total_ram_bytes)}, device {_fmt(p.total_device_bytes)}"
    )
    lines += [f"  warning: {w}" for w in p.warnings]
    if p.sample_fraction < 1:
        lines.append(f"  (replayed {p.sample_fraction:.3g} of each rank's keys, budgets scaled alike)")
    return "\n".join(lines)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
