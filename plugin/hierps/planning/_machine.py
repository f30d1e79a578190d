"""The machine a plan's times are bounded by: its disk, RAM and device-transfer rates."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hierps.errors import ConfigError

__all__ = ["Machine", "load_machine", "measure_machine"]


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
        names = {"disk_read", "disk_write", "ram_copy", "ssd_tier_read", "device_copy", "name"}
        unknown, missing = (
            sorted(set(data) - names),
            sorted({"disk_read", "disk_write", "ram_copy"} - set(data)),
        )
        if unknown or missing:
            raise ConfigError(
                f"machine: expected the keys disk_read, disk_write, ram_copy (bytes/s; optional ssd_tier_read, "
                f"device_copy, name) or the JSON of `hierps bench`; missing {missing}, unknown {unknown}."
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


def measure_machine(folder: str | os.PathLike[str] | None = None, nbytes: int = 128 << 20) -> Machine:
    """Measure RAM copy and disk rates now (a few seconds): the probes of ``hierps bench``, smaller.
    ``folder`` should be on the disk the store will use (default: the system temp dir)."""
    from hierps.bench.machine import disk_read, ram_copy

    ram = ram_copy(min(nbytes, 64 << 20), repeats=3)
    with tempfile.TemporaryDirectory(prefix="hierps-plan-", dir=folder) as tmp:
        disk = disk_read(Path(tmp), nbytes)
    return Machine(
        disk_read=disk["bytes_per_s"],
        disk_write=disk["write_bytes_per_s"],
        ram_copy=ram["bytes_per_s"],
        name="measured",
    )
