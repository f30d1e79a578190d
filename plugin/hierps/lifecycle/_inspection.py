"""What a store directory holds, read from its latest checkpoint without opening the store.

:func:`inspect_path` works on a closed store, on one another process is training in (it takes no
lock and reads only committed checkpoints), and on a directory of per-rank stores (each rank's
part of the latest checkpoint committed for all of them; every rank directory, at its latest
checkpoint, when none is). Rows are
counted as of the latest checkpoint, where every row lives on SSD; the RAM and device tiers of a
running store are not visible from outside (``Store.num_rows`` gives them in-process).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from hierps.lifecycle._export import checkpoint_sources, store_dirs
from hierps.rows._counters import CLICK, COUNT, SHOW, count_histogram
from hierps.storage._commit_log import snapshots
from hierps.tiers._reader import CheckpointReader

__all__ = ["format_report", "inspect_path"]


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def inspect_path(path: str | os.PathLike[str], counts: bool = True) -> dict[str, Any]:
    """A report on a store directory (or a directory of ``rank-*`` stores), as plain JSON-able data.

    ``counts``: also read every row's counters for a histogram of sighting counts (reads the
    whole table from SSD; pass False on huge stores).
    """
    return {"path": str(Path(path)), "stores": [_inspect_store(s, counts, c) for s, c in _stores(path)]}


def _stores(path: str | os.PathLike[str]) -> list[tuple[Path, int | None]]:
    """The stores to report and the checkpoint of each (None: its latest): for a directory of
    per-rank stores, each rank's part of the latest checkpoint committed for all ranks."""
    dirs = store_dirs(path)
    if dirs == [Path(path)] or not snapshots(Path(path)):
        return [(s, None) for s in dirs]
    return [(s, c) for s, c in checkpoint_sources(path, None)[0]]


def _inspect_store(store: Path, counts: bool, ckpt: int | None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "path": str(store),
        "bytes_on_disk": _disk_bytes(store),
        "checkpoints": [],
        "tables": {},
    }
    ckpt_root = store / "checkpoints"
    if not ckpt_root.is_dir() or not any(p.suffix == ".json" for p in ckpt_root.iterdir()):
        return report
    reader = CheckpointReader(store, ckpt)
    for ckpt in reader.catalog.ids():
        m = reader.catalog.manifest(ckpt)
        report["checkpoints"].append({"id": ckpt, "tag": m.tag, "created": m.created, "passes": m.passes})
    report["checkpoint"] = reader.checkpoint_id
    report["passes"] = reader.meta.passes
    for name, entry in reader.meta.tables.items():
        info = reader.infos[name]
        table: dict[str, Any] = {
            "dim": info.dim,
            "width": info.width,
            "weights_dtype": info.weights_dtype,
            "state_dtype": info.state_dtype,
            "row_bytes": info.layout.row_bytes,
            "optimizer": info.optimizer.type,
            "steps": info.step,
            "rows_ssd": entry.rows,
            "segments": len(entry.segments),
            "bytes_on_disk": _disk_bytes(store / "segments" / name),
            "pending_keys": int(len(reader.pending_keys(name))),
            "admission": info.admission.to_json(),
            "eviction": info.eviction.to_json(),
        }
        if counts:
            hist, shows, clicks = np.zeros(1, np.int64), 0.0, 0.0
            for _keys, block in reader.scan_counters(name):
                hist = count_histogram(block[:, COUNT], hist)
                shows += float(block[:, SHOW].astype(np.float64).sum())
                clicks += float(block[:, CLICK].astype(np.float64).sum())
            table["count_histogram"] = [
                {"count": _bucket(b), "rows": int(n)} for b, n in enumerate(hist) if n
            ]
            table["shows"], table["clicks"] = shows, clicks
        report["tables"][name] = table
    return report


def _bucket(b: int) -> str:
    """The label of histogram bucket ``b`` of :func:`hierps.rows._counters.count_histogram`."""
    if b == 0:
        return "0"
    lo, hi = 1 << (b - 1), (1 << b) - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


def format_report(report: dict[str, Any]) -> str:
    """The report of :func:`inspect_path` as text for a terminal."""
    lines = []
    for s in report["stores"]:
        lines.append(f"store {s['path']}  ({_size(s['bytes_on_disk'])} on disk)")
        if not s["checkpoints"]:
            lines.append("  no checkpoint yet: nothing is durable")
            continue
        lines.append(
            "  checkpoints: "
            + ", ".join(f"{c['id']}" + (f" ({c['tag']})" if c["tag"] else "") for c in s["checkpoints"])
        )
        lines.append(f"  latest: {s['checkpoint']} after {s['passes']} passes")
        for name, t in s["tables"].items():
            lines.append(
                f"  table {name}: dim {t['dim']}, {t['optimizer']} ({t['width']} floats a row, stored in "
                f"{t['row_bytes']} bytes: weights {t['weights_dtype']}, state {t['state_dtype']}), "
                f"{t['steps']} steps"
            )
            lines.append(
                f"    rows on SSD {t['rows_ssd']}, pending admission {t['pending_keys']}, "
                f"{t['segments']} segments, {_size(t['bytes_on_disk'])} on disk"
            )
            if t.get("admission") and t["admission"].get("min_count") != 1:
                lines.append(f"    admission {_settings(t['admission'])}")
            if t.get("eviction") and (
                t["eviction"].get("ttl_passes") or t["eviction"].get("min_decayed_count")
            ):
                lines.append(f"    eviction {_settings(t['eviction'])}")
            if "count_histogram" in t:
                lines.append(f"    shows {t['shows']:.0f}, clicks {t['clicks']:.0f}; rows by times seen:")
                for b in t["count_histogram"]:
                    lines.append(f"      {b['count']:>13}  {b['rows']}")
    return "\n".join(lines)


def _settings(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items() if v is not None)


def _size(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"
