"""``hierps bench --serving``: serving an export at 10^6 and 10^7 rows (``--full``: also 10^8).

Per table size N, the store of ``hierps bench --scale`` (table ``"t"``, dim 16, adagrad) is
written and exported by that bench's own phases; then each of these phases runs in a fresh
process (so that its peak RSS is its own), the export's files dropped from the page cache first:

1. ``open``: :func:`hierps.serving.open`: seconds, and the bytes of RAM its key index takes;
2. ``serve``: lookups through :func:`hierps.serving.open` with a ``cache_bytes`` row cache:
   latency (p50 / p99 over ``samples`` lookups) of batches of 1 and 1,024 ids, *cold* (ids drawn
   uniformly from all N keys, the export's files dropped from the page cache before each lookup,
   so its reads reach the device) and *warm* (ids from a hot set of half the cache's capacity,
   looked up once before: served from the row cache); then lookups per second of batches of
   1,024 ids for ``throughput_seconds``, cold (uniform ids, the page cache dropped at the start)
   and warm (the hot set);
3. ``numpy``: the baseline: the export's keys and values loaded into RAM (numpy arrays), looked up
   with ``np.searchsorted`` with the same batches: its load seconds, latency, lookups per second.

A disk probe in the same run measures the sequential write bandwidth (and random 4 KiB reads), so
that the export's write rate is reported against it. Goals: open ≤ 2 s; the ``serve`` phase's
peak RSS ≤ a bare ``import hierps, torch`` + the cache + 2 B/key + 150 MiB; a key index ≤ 2 B/key;
the export writing at ≥ 40% of the sequential write bandwidth.
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hierps.bench import scale

__all__ = [
    "GOALS",
    "PHASES",
    "ServingConfig",
    "check_goals",
    "run_phase",
    "run_serving",
    "spawn_phase",
]

_MiB = 1 << 20
PHASES = ("write", "export", "open", "serve", "numpy")
BATCHES = (1, 1024)
_RSS_SLACK = 150 * _MiB  # fixed overhead allowed beyond a bare import, the cache and 2 B per key
_LOAD_ROWS = 1 << 18  # rows per lookup when the numpy baseline loads a table whole
GOALS = [
    ("open", "hierps.serving.open <= 2 s (cold) at every size", 2.0),
    ("rss", "serve phase peak RSS <= bare import + cache + 2 B/key + 150 MiB", 1.0),
    ("index", "key index <= 2 B/key", 2.0),
    ("export", "export writes at >= 40% of the disk's sequential write bandwidth", 0.4),
]


@dataclass
class ServingConfig(scale.StoreBenchConfig):
    """Settings of one ``hierps bench --serving`` run (the store's: those of ``hierps bench --scale``)."""

    cache_bytes: str = "64MiB"
    samples: int = 200  # lookups timed per batch size, cold and warm
    throughput_seconds: float = 3.0

    def __post_init__(self) -> None:
        from hierps.config import parse_size

        super().__post_init__()
        parse_size(self.cache_bytes, "cache_bytes")


def spawn_phase(phase: str, conf: dict[str, Any], workdir: Path, **paths: Any) -> dict[str, Any]:
    """Run ``phase`` in a fresh worker process; its record, or ``{"error": ...}``."""
    return scale.spawn_phase(phase, conf, workdir, task="serving", **paths)


# -- measuring lookups ------------------------------------------------------------------------------
def _latencies(
    lookup: Callable[[np.ndarray], object], batches: np.ndarray, before: Callable[[], None] | None = None
) -> dict[str, float]:
    """p50 / p99 seconds of ``lookup`` over each row of ``batches`` (s, b), ``before()`` (untimed) before each."""
    seconds = []
    for ids in batches:
        if before is not None:
            before()
        t0 = time.perf_counter()
        lookup(ids)
        seconds.append(time.perf_counter() - t0)
    return {"p50": float(np.percentile(seconds, 50)), "p99": float(np.percentile(seconds, 99))}


def _rate(lookup: Callable[[np.ndarray], object], draw: Callable[[], np.ndarray], seconds: float) -> float:
    """Ids looked up per second, batches of ``draw()`` for about ``seconds``."""
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ids = draw()
        lookup(ids)
        done += len(ids)
    return done / (time.perf_counter() - t0)


def _measure(
    lookup: Callable[[np.ndarray], object],
    conf: dict[str, Any],
    rows: int,
    hot: np.ndarray,
    cold: Callable[[], None],
) -> dict[str, Any]:
    """Cold and warm latency of each batch size, then cold and warm lookups/s. ``cold()`` drops the
    files from the page cache: before each cold lookup timed, and before the cold rate."""
    rng = np.random.default_rng(conf["seed"] + 3)
    out: dict[str, Any] = {"cold": {}, "warm": {}}
    for b in BATCHES:
        out["cold"][str(b)] = _latencies(lookup, rng.integers(0, rows, (conf["samples"], b)), cold)
    for start in range(0, len(hot), 1024):
        lookup(hot[start : start + 1024])
    for b in BATCHES:
        out["warm"][str(b)] = _latencies(lookup, rng.choice(hot, (conf["samples"], b)))
    cold()
    out["cold_per_s"] = _rate(lookup, lambda: rng.integers(0, rows, 1024), conf["throughput_seconds"])
    out["warm_per_s"] = _rate(lookup, lambda: rng.choice(hot, 1024), conf["throughput_seconds"])
    return out


def _hot(conf: dict[str, Any], rows: int, capacity: int) -> np.ndarray:
    """The warm set: distinct ids, half the cache's capacity (at least 1024, at most the table)."""
    n = min(rows, max(1024, capacity // 2))
    return np.random.default_rng(conf["seed"] + 4).choice(rows, n, replace=False).astype(np.int64)


def _dropper(path: str) -> Callable[[], None]:
    """What drops the export at ``path`` from the page cache."""
    from hierps.bench.machine import drop_from_page_cache

    def drop() -> None:
        drop_from_page_cache(Path(path))

    return drop


def _cache_rows(export: str, conf: dict[str, Any]) -> int:
    """Rows the serve phase's cache holds (the baseline takes the same hot set)."""
    import hierps.serving

    with hierps.serving.open(export, cache_bytes=conf["cache_bytes"]) as tables:
        return tables.cache_info()["capacity_rows"]


# -- the phases (each in its own process) ---------------------------------------------------------
def _open_phase(spec: dict[str, Any]) -> dict[str, Any]:
    import hierps.serving

    t0 = time.perf_counter()
    tables = hierps.serving.open(spec["export"], cache_bytes=spec["config"]["cache_bytes"])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "index_bytes": tables.index_bytes, "num_rows": tables.num_rows("t")}


def _serve_phase(spec: dict[str, Any]) -> dict[str, Any]:
    import hierps.serving

    conf, rows = spec["config"], spec["rows"]
    t0 = time.perf_counter()
    tables = hierps.serving.open(spec["export"], cache_bytes=conf["cache_bytes"])
    opened = time.perf_counter() - t0
    hot = _hot(conf, rows, tables.cache_info()["capacity_rows"])
    record = _measure(lambda ids: tables.lookup("t", ids), conf, rows, hot, _dropper(spec["export"]))
    return {
        **record,
        "seconds": time.perf_counter() - t0,
        "open_seconds": opened,
        "index_bytes": tables.index_bytes,
        "cache": tables.cache_info(),
        "hot_ids": len(hot),
    }


def _load_whole(export: str) -> tuple[np.ndarray, np.ndarray]:
    """Table ``"t"`` of ``export`` whole: keys (n,) int64 sorted, values (n, dim) float32, read
    through :func:`hierps.serving.open` (every chunk checked) in sorted blocks, without a cache."""
    import hierps.serving

    with hierps.serving.open(export, cache_bytes=0) as tables:
        keys = tables.keys("t")
        values = np.empty((len(keys), tables.tables["t"]), np.float32)
        for start in range(0, len(keys), _LOAD_ROWS):
            values[start : start + _LOAD_ROWS] = tables.lookup("t", keys[start : start + _LOAD_ROWS])
    return keys, values


def _numpy_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """The export's keys and values in RAM as numpy arrays, looked up with ``np.searchsorted``."""
    conf, rows = spec["config"], spec["rows"]
    t0 = time.perf_counter()
    keys, values = _load_whole(spec["export"])
    loaded = time.perf_counter() - t0

    def lookup(ids: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
        out = values[at]
        out[keys[at] != ids] = 0.0
        return out

    hot = _hot(conf, rows, _cache_rows(spec["export"], conf))
    record = _measure(lookup, conf, rows, hot, lambda: None)
    return {
        **record,
        "seconds": time.perf_counter() - t0,
        "load_seconds": loaded,
        "bytes": keys.nbytes + values.nbytes,
    }


RUNNERS: dict[str, scale.Runner] = {
    "disk": scale.RUNNERS["disk"],
    "write": scale.RUNNERS["write"],
    "export": scale.RUNNERS["export"],
    "open": (_open_phase, "export"),
    "serve": (_serve_phase, "export"),
    "numpy": (_numpy_phase, "export"),
}


def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one phase in this process (the worker's ``"serving"`` task)."""
    return scale.run_phase(spec, RUNNERS)


# -- the run --------------------------------------------------------------------------------------
def rss_limit(conf: dict[str, Any], rows: int, bare: int) -> int:
    """The serve phase's bound: a bare import + the cache + 2 B per key + 150 MiB."""
    from hierps.config import parse_size

    return bare + parse_size(conf["cache_bytes"], "cache_bytes") + 2 * rows + _RSS_SLACK


def _run_size(conf: dict[str, Any], rows: int, root: Path, out: Callable[[str], Any]) -> dict[str, Any]:
    store = root / "store"
    paths: dict[str, Any] = {"rows": rows, "store": str(store), "export": str(root / "export")}
    phases: dict[str, dict[str, Any]] = {}
    try:
        for i, phase in enumerate(PHASES):
            t0 = time.perf_counter()
            phases[phase] = spawn_phase(phase, conf, root / f"{i}-{phase}", **paths)
            state = "failed" if "error" in phases[phase] else f"{phases[phase]['seconds']:.1f} s"
            out(f"  {rows:,} rows, {phase}: {state} ({time.perf_counter() - t0:.0f} s with the process)")
            if "error" in phases[phase]:
                break
            if phase == "export":
                shutil.rmtree(store, ignore_errors=True)  # the disk it took goes to the next size
    finally:
        if not conf["keep"]:
            shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "phases": phases}


def run_serving(cfg: ServingConfig, out: Callable[[str], Any] = print) -> dict[str, Any]:
    """Probe the disk, then every phase per size; print the report; the JSON-ready results."""
    out(
        f"hierps bench --serving: table 't', dim {cfg.dim}; cache {cfg.cache_bytes}; {cfg.samples} lookups per "
        f"latency; sizes {', '.join(f'{n:,}' for n in cfg.sizes)}"
    )
    kind = scale.BenchKind("serving", _run_size, check_goals, format_report)
    return scale.run_sizes(scale.phase_config(cfg), kind, out)


# -- the report -----------------------------------------------------------------------------------
def _finished(results: dict[str, Any], phase: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for size in results.get("sizes", []):
        record = size["phases"].get(phase, {})
        if "seconds" in record:
            yield size, record


def _write_rate(results: dict[str, Any]) -> float | None:
    return results.get("disk", {}).get("sequential", {}).get("write_bytes_per_s")


def _export_rate(record: dict[str, Any]) -> float:
    return record["io"]["write_bytes"] / record["seconds"]


def check_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per goal: ``{"key", "goal", "value", "met", "note"}`` (value None: not measured).
    Each size gets its RSS limit (``rss_limit_bytes``) first."""
    for size in results.get("sizes", []):
        size["rss_limit_bytes"] = rss_limit(results["config"], size["rows"], results["bare_import_rss_bytes"])
    opens = [(s["rows"], r["seconds"]) for s, r in _finished(results, "open")]
    serves = [(s["rows"], r["peak_rss_bytes"] / s["rss_limit_bytes"]) for s, r in _finished(results, "serve")]
    index = [(s["rows"], r["index_bytes"] / s["rows"]) for s, r in _finished(results, "open")]
    disk = _write_rate(results)
    exports = [(s["rows"], _export_rate(r) / disk) for s, r in _finished(results, "export")] if disk else []
    values = {
        "open": max(opens, key=lambda x: x[1], default=None),
        "rss": max(serves, key=lambda x: x[1], default=None),
        "index": max(index, key=lambda x: x[1], default=None),
        "export": min(exports, key=lambda x: x[1], default=None),
    }
    report = []
    for key, goal, threshold in GOALS:
        worst = values[key]
        met = None if worst is None else (worst[1] >= threshold if key == "export" else worst[1] <= threshold)
        note = "not measured" if worst is None else f"worst at {worst[0]:,} rows"
        report.append(
            {"key": key, "goal": goal, "value": None if worst is None else worst[1], "met": met, "note": note}
        )
    return report


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def _lookup_line(rows: int, what: str, r: dict[str, Any]) -> str:
    parts = [
        f"{kind} b={b}: p50 {_ms(r[kind][str(b)]['p50'])} / p99 {_ms(r[kind][str(b)]['p99'])} ms"
        for kind in ("cold", "warm")
        for b in BATCHES
    ]
    return (
        f"{rows:>11,} {what:8s} "
        + "; ".join(parts)
        + f"; {r['cold_per_s']:,.0f} ids/s cold, {r['warm_per_s']:,.0f} warm"
    )


def format_report(results: dict[str, Any], out: Callable[[str], Any] = print) -> None:
    """Per size: the phases' seconds and peak RSS, lookup latencies and rates against numpy; the goals."""
    out("")
    disk = results.get("disk", {})
    if "sequential" in disk:
        out(
            f"disk: sequential write {disk['sequential']['write_bytes_per_s'] / 1e9:.2f} GB/s, read "
            f"{disk['sequential']['bytes_per_s'] / 1e9:.2f} GB/s; {disk['random_4k']['reads_per_s']:,.0f} random "
            "4 KiB reads/s"
        )
    if "bare_import_rss_bytes" in results:
        out(
            f"a bare `import hierps, torch` process: peak RSS {results['bare_import_rss_bytes'] / _MiB:.0f} MiB"
        )
    out(f"{'rows':>11s} {'phase':8s} {'seconds':>8s} {'RSS MiB':>8s}")
    for size in results.get("sizes", []):
        for phase, r in size["phases"].items():
            if "error" in r:
                out(
                    f"{size['rows']:>11,} {phase:8s} failed: {(r['error'].strip().splitlines() or ['?'])[-1]}"
                )
            else:
                out(f"{size['rows']:>11,} {phase:8s} {r['seconds']:8.2f} {r['peak_rss_bytes'] / _MiB:8.0f}")
    out("")
    rate = _write_rate(results)
    for size, r in _finished(results, "export"):
        vs = f" = {_export_rate(r) / rate:.2f}x the disk's sequential write" if rate else ""
        out(f"{size['rows']:>11,} export: {_export_rate(r) / 1e6:,.0f} MB/s written{vs}")
    for size, r in _finished(results, "open"):
        out(
            f"{size['rows']:>11,} open: {r['seconds']:.3f} s; key index {r['index_bytes'] / size['rows']:.2f} B/key"
        )
    for phase in ("serve", "numpy"):
        for size, r in _finished(results, phase):
            out(_lookup_line(size["rows"], "hierps" if phase == "serve" else "numpy", r))
    for g in results.get("goals", []):
        state = {True: "MET    ", False: "NOT MET", None: "n/a    "}[g["met"]]
        value = "-" if g["value"] is None else f"{g['value']:.2f}"
        out(f"{state} {g['goal']}: {value} ({g['note']})")


# -- command line ---------------------------------------------------------------------------------
def config_from_args(args: argparse.Namespace) -> ServingConfig:
    from hierps.config import parse_size

    sizes = tuple(args.sizes or ServingConfig.sizes)
    given = {
        "sizes": (*sizes, scale.FULL_SIZE) if args.full and scale.FULL_SIZE not in sizes else sizes,
        "cache_bytes": args.cache_bytes,
        "threads": args.threads,
        "tmp": args.tmp,
        "keep": args.keep or None,
        "disk_bytes": parse_size(args.disk_bytes, "--disk-bytes") if args.disk_bytes else None,
    }
    return ServingConfig(**{k: v for k, v in given.items() if v is not None})


def run_from_args(args: argparse.Namespace) -> int:
    """``hierps bench --serving``: run, print the report, write ``--json``."""
    return 2 if scale.run_cli(args, "serving", config_from_args, run_serving) is None else 0
