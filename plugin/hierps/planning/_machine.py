"""The machine a plan's times are bounded by: its disk, RAM and device-transfer rates."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hierps.errors import ConfigError

__all__ = ["Machine", "checkpoint_costs", "load_machine", "measure_machine"]


@dataclass(frozen=True)
class Machine:
    """Rates in bytes per second; ``ssd_tier_read`` is the SSD tier's own cold read of rows (row
    bytes delivered per second, its read amplification included) when measured, else None (then a
    row read costs one page at the disk's rate)."""

    disk_read: float
    disk_write: float
    ram_copy: float
    ssd_tier_read: float | None = None
    device_copy: float | None = None
    """Host to device copies (None: rows stay on the host, the CPU is the device)."""
    random_read: float | None = None
    """Random 4 KiB reads per second of the disk, many in flight (``hierps bench --scale``'s probe),
    when measured: a row the SSD tier reads costs one (None: a page at ``disk_read``)."""
    checkpoint_latency: float | None = None
    """Seconds a checkpoint takes beyond its bytes, per table it writes a segment for (files made
    durable one by one: fsyncs of the segment's files, its directory, the manifest), from
    :func:`checkpoint_costs` (None: 0)."""
    segment_write: float | None = None
    """Bytes of segments the store writes per second, its writer's CPU work included, from
    :func:`checkpoint_costs` (None: ``disk_write``)."""
    replace_rate: float | None = None
    """Rows per second a segment write locates the older versions of (rows replacing stored ones,
    each in its own chunk), from :func:`checkpoint_costs` (None: free)."""
    name: str = "measured"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Machine:
        """A machine from :meth:`to_json`, or from the JSON of ``hierps bench`` (its ``machine``
        record: ``ram_copy``, ``disk_read``, ``ssd_tier_read``), whole or just that record."""
        if "machine" in data and isinstance(data["machine"], dict):
            data = data["machine"]
        if "disk_read" in data and isinstance(data["disk_read"], dict):
            disk: dict[str, Any] = data["disk_read"]
            tier = data.get("ssd_tier_read") or {}
            return cls(
                disk_read=float(disk["bytes_per_s"]),
                disk_write=float(disk.get("write_bytes_per_s", disk["bytes_per_s"])),
                ram_copy=float(data["ram_copy"]["bytes_per_s"]),
                ssd_tier_read=float(tier["bytes_per_s"]) if tier.get("bytes_per_s") else None,
                name="hierps bench",
            )
        names = {f.name for f in fields(cls)}
        unknown, missing = (
            sorted(set(data) - names),
            sorted({"disk_read", "disk_write", "ram_copy"} - set(data)),
        )
        if unknown or missing:
            raise ConfigError(
                f"machine: expected the keys disk_read, disk_write, ram_copy (bytes/s; optional ssd_tier_read, "
                f"device_copy, random_read (reads/s), checkpoint_latency (s), segment_write, replace_rate, name) or the JSON of `hierps bench`; missing {missing}, unknown {unknown}."
            )
        machine = cls(**data)
        for key in ("disk_read", "disk_write", "ram_copy"):
            if not float(getattr(machine, key)) > 0:
                raise ConfigError(
                    f"machine: {key} must be a positive rate in bytes/s. Got {getattr(machine, key)!r}."
                )
        return machine


def load_machine(source: str | os.PathLike[str] | dict[str, Any]) -> Machine:
    """A machine from a JSON file (see :meth:`Machine.from_json`) or an already-read mapping."""
    if isinstance(source, dict):
        return Machine.from_json(source)
    path = Path(source)
    try:
        return Machine.from_json(json.loads(path.read_text()))
    except OSError as exc:
        raise ConfigError(f"machine {str(path)!r}: cannot be read ({exc.strerror or exc}).") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"machine {str(path)!r}: not JSON ({exc}).") from None


def measure_machine(
    folder: str | os.PathLike[str] | None = None, nbytes: int = 128 << 20, random_reads: bool = False
) -> Machine:
    """Measure RAM copy and disk rates now (a few seconds): the probes of ``hierps bench``, smaller.
    ``folder`` should be on the disk the store will use (default: the system temp dir).
    ``random_reads``: also the disk's random 4 KiB reads, 16 in flight, over a file of ``nbytes``
    (``hierps bench --machine``)."""
    from hierps.bench.machine import disk_read, ram_copy
    from hierps.bench.scale import random_read

    ram = ram_copy(min(nbytes, 64 << 20), repeats=3)
    with tempfile.TemporaryDirectory(prefix="hierps-plan-", dir=folder) as tmp:
        disk = disk_read(Path(tmp), nbytes)
        random = random_read(Path(tmp), nbytes)["reads_per_s"] if random_reads else None
        latency, segment_write, replace_rate = checkpoint_costs(tmp)
    return Machine(
        disk_read=disk["bytes_per_s"],
        disk_write=disk["write_bytes_per_s"],
        ram_copy=ram["bytes_per_s"],
        random_read=random,
        checkpoint_latency=latency,
        segment_write=segment_write,
        replace_rate=replace_rate,
        name="measured",
    )


def checkpoint_costs(
    folder: str | os.PathLike[str] | None = None, repeats: int = 3
) -> tuple[float, float, float]:
    """(seconds a checkpoint takes per segment beyond its bytes, bytes of segment written per second,
    rows per second whose older version a write locates), from store checkpoints on the disk of
    ``folder`` (default: the system temp dir): of 256 and 8,192 new rows (dim 16, adagrad), then of
    2,048 rows replacing stored ones each in its own chunk (as rows a pass trained replace theirs).
    The writer's CPU work (checksums, filter, fences) is in the rates, as in a real checkpoint."""
    import numpy as np

    from hierps import Store
    from hierps.planning._sizes import segment_bytes
    from hierps.storage._segment import chunk_rows_for

    def timed(store: Store, keys: np.ndarray, width: int) -> float:
        store.write_rows("t", keys, np.zeros((len(keys), width), np.float32))
        t0 = time.perf_counter()
        store.checkpoint()
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory(prefix="hierps-plan-", dir=folder) as tmp:
        with Store(Path(tmp) / "s", memory_budget="64MiB", device="cpu", pipeline=False) as store:
            info = store.table("t", 16)
            fixed, per_row = segment_bytes(info.words)
            spread = 2_048 * chunk_rows_for(info.words)
            timed(store, np.arange(spread, dtype=np.int64), info.width)  # stored: the rows to replace
            first, new = spread, []
            for n in (256, 8_192):
                times = []
                for _ in range(repeats):
                    times.append(timed(store, np.arange(first, first + n, dtype=np.int64), info.width))
                    first += n
                new.append(statistics.median(times))
            stride = chunk_rows_for(info.words)
            replace = statistics.median(
                timed(store, np.arange(i, spread, stride, dtype=np.int64), info.width) for i in range(repeats)
            )
    nbytes = [fixed + per_row * n for n in (256, 8_192)]
    rate = (nbytes[1] - nbytes[0]) / max(new[1] - new[0], 1e-9)
    latency = max(new[0] - nbytes[0] / rate, 0.0)
    fresh_2048 = latency + (fixed + per_row * 2_048) / rate
    return latency, rate, 2_048 / max(replace - fresh_2048, 1e-9)
