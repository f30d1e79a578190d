"""``hierps demo --online``: the online loop on the demo's data, in one process.

A producer thread writes the demo's synthetic click logs as Parquet files into a directory, one
file every ``interval`` seconds (write-then-rename), each ``seconds_per_file`` of event time. The
trainer follows the directory with :class:`hierps.online.ParquetStream`, in passes of
``pass_seconds`` of event time announced by a :class:`hierps.PassLoader`; after each pass it
checkpoints the store and publishes the changed rows as a delta
(:class:`hierps.online.Publisher`, a new base every ``compact_every`` deltas), and a serving
instance following the directory (``hierps.serving.open(..., follow=...)``) picks it up. Each pass
prints a line: its examples and loss, the delta's bytes and seconds, and the staleness: from the
pass's last training step to its rows being served, and from the moment the log file holding the
pass's last example landed to its rows being served.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import hierps
import hierps.serving
from hierps.config import parse_int, parse_number, parse_size
from hierps.demo.app import DemoConfig, build_model, table_names
from hierps.demo.data import CriteoSpec, generate
from hierps.integrations.loader import PassLoader
from hierps.online import ParquetStream, Publisher

__all__ = ["OnlineConfig", "run_online", "write_log_file"]

T0 = 1_800_000_000.0  # the first example's event time (seconds since the epoch)


@dataclass
class OnlineConfig:
    """Settings of the online demo; the defaults run in about a minute on two cores."""

    files: int = 10  # log files the producer writes
    rows_per_file: int = 8192
    seconds_per_file: float = 60.0  # event time each file covers
    pass_seconds: float = 60.0  # event time per pass
    interval: float = 1.0  # wall seconds between two files
    batch_size: int = 1024
    compact_every: int = 4  # deltas before a new base
    memory_budget: str = "4MiB"
    device_budget: str = "256MiB"
    directory: str | None = None  # where logs, store and serving directory go (default: a temporary one)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("files", "rows_per_file", "batch_size", "compact_every"):
            parse_int(name, getattr(self, name), 1)
        parse_int("seed", self.seed, 0)
        for name in ("seconds_per_file", "pass_seconds"):
            parse_number(name, getattr(self, name), low=0.0, low_open=True)
        parse_number("interval", self.interval, low=0.0)
        for name in ("memory_budget", "device_budget"):
            parse_size(getattr(self, name), name)


def write_log_file(directory: Path, index: int, rows: int, seconds: float, seed: int = 0) -> Path:
    """Log file ``index``: ``rows`` synthetic clicks (``d0..d12``, ``c0..c25``, ``label``) with event
    times ``ts`` spread over ``seconds`` from ``T0 + index * seconds``, written under a name starting
    with ``_`` and renamed into place once complete (what :class:`ParquetStream` expects)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = generate(CriteoSpec(seed=seed), rows, seed=seed * 100_003 + index)
    ts = T0 + index * seconds + np.arange(rows) * (seconds / rows)
    columns = {"ts": pa.array(ts)}
    columns |= {f"d{j}": pa.array(data.dense[:, j]) for j in range(data.dense.shape[1])}
    columns |= {f"c{j}": pa.array(data.sparse[:, j]) for j in range(data.sparse.shape[1])}
    columns["label"] = pa.array(data.labels)
    final = directory / f"part-{index:05d}.parquet"
    tmp = directory / f"_tmp-{final.name}"
    pq.write_table(pa.table(columns), tmp, row_group_size=4096)
    os.replace(tmp, final)
    return final


def run_online(cfg: OnlineConfig, out: Callable[[str], Any] = print) -> dict[str, Any]:
    """Run the loop until the producer is done and the stream ran dry; per-pass records."""
    tmp = tempfile.TemporaryDirectory(prefix="hierps-online-") if cfg.directory is None else None
    root = Path(tmp.name if tmp is not None else str(cfg.directory))
    logs, serve = root / "logs", root / "serve"
    logs.mkdir(parents=True, exist_ok=True)
    landed: dict[int, float] = {}  # file index -> when it was renamed into place

    def produce() -> None:
        for k in range(cfg.files):
            write_log_file(logs, k, cfg.rows_per_file, cfg.seconds_per_file, cfg.seed)
            landed[k] = time.time()
            time.sleep(cfg.interval)

    producer = threading.Thread(target=produce, name="hierps-demo-producer", daemon=True)
    store = hierps.Store(
        root / "store", memory_budget=cfg.memory_budget, device_budget=cfg.device_budget, seed=cfg.seed
    )
    served: hierps.serving.ServingTables | None = None
    try:
        names = table_names(26)
        model = build_model(store, DemoConfig(batch_size=cfg.batch_size, seed=cfg.seed))
        dense_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss_fn = nn.BCEWithLogitsLoss()
        stream = ParquetStream(
            logs,
            batch_size=cfg.batch_size,
            pass_seconds=cfg.pass_seconds,
            time_column="ts",
            wait=cfg.interval * 3 + 1,
            poll_seconds=0.05,
        )
        loader = PassLoader(stream, lambda b: {n: b[f"c{i}"] for i, n in enumerate(names)}, store)
        publisher = Publisher(store, serve, compact_every=cfg.compact_every)
        out(
            f"hierps demo --online: {cfg.files} log files of {cfg.rows_per_file} examples ({cfg.seconds_per_file:g} s "
            f"of event time each), one every {cfg.interval:g} s; passes of {cfg.pass_seconds:g} s; logs, store and "
            f"serving directory under {root}"
        )
        producer.start()
        history: list[dict[str, Any]] = []
        losses: list[float] = []
        started = time.perf_counter()
        last_ts = T0
        for batch in loader:
            dense = torch.stack([batch[f"d{j}"] for j in range(13)], dim=1).float()
            sparse = torch.stack([batch[f"c{j}"] for j in range(26)], dim=1)
            loss = loss_fn(model(dense, sparse), batch["label"].float())
            loss.backward()
            dense_opt.step()
            dense_opt.zero_grad()
            store.step()
            losses.append(loss.item())
            last_ts = float(batch["ts"].max())
            if not loader.at_pass_end:
                continue
            trained = time.time()
            ckpt = store.checkpoint(f"pass{store.passes + 1}")
            delta = publisher.publish()
            if served is None:
                served = hierps.serving.open(serve, follow=0.05)
            while served.checkpoint != ckpt:
                served.wait_for_poll(10)
            seen = time.time()
            file = int((last_ts - T0) // cfg.seconds_per_file)
            record: dict[str, Any] = {
                "pass": len(history) + 1,
                "examples": len(losses) * cfg.batch_size,
                "loss": float(np.mean(losses)),
                "checkpoint": ckpt,
                "delta": delta.kind if delta is not None else None,
                "delta_bytes": delta.bytes if delta is not None else 0,
                "delta_seconds": delta.seconds if delta is not None else 0.0,
                "pass_seconds": time.perf_counter() - started,
                "staleness_train_s": seen - trained,
                "staleness_log_s": seen - landed.get(file, seen),
            }
            history.append(record)
            out(
                f"pass {record['pass']:3d}  {record['examples']:6d} examples  loss {record['loss']:.4f}  "
                f"{record['delta']} {record['delta_bytes'] / 2**10:7.1f} KiB in {record['delta_seconds']:.2f}s  "
                f"served {record['staleness_train_s']:.2f}s after its last step, "
                f"{record['staleness_log_s']:.2f}s after its last log file landed  (pass {record['pass_seconds']:.1f}s)"
            )
            losses, started = [], time.perf_counter()
        producer.join()
        if history:
            stale = [h["staleness_train_s"] for h in history]
            out(
                f"{len(history)} passes published; staleness after the last step: median {np.median(stale):.2f}s, "
                f"max {max(stale):.2f}s; serving chain {len(served.applied) if served is not None else 0} export(s)"
            )
        return {"passes": history}
    finally:
        if served is not None:
            served.close()
        store.close()
        if tmp is not None:
            tmp.cleanup()
