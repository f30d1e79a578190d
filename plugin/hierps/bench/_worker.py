"""Running one measurement in a fresh process: ``python -m hierps.bench.run --worker SPEC --out FILE``."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["median_record", "one_rank_ds_config", "single_rank_env", "spawn"]


def spawn(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``spec`` in a fresh ``python -m hierps.bench.run --worker`` process; its record or ``{"error"}``."""
    out = Path(spec["tmp"]) / "result.json"
    Path(spec["tmp"]).mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "OMP_NUM_THREADS": str(spec["config"]["threads"]),
    }
    cmd = [sys.executable, "-m", "hierps.bench.run", "--worker", json.dumps(spec), "--out", str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stderr or proc.stdout or f"exit status {proc.returncode}")[-2000:]}
    return json.loads(out.read_text(encoding="utf-8"))


def single_rank_env() -> None:
    """Set the launcher variables of a one-rank job where none are set (a worker runs no launcher)."""
    from hierps.integrations.rendezvous import free_port

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    for key, value in {**env, "LOCAL_RANK": "0", "LOCAL_SIZE": "1"}.items():
        os.environ.setdefault(key, value)


def one_rank_ds_config(batch_size: int, section: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """The DeepSpeed config of a bench's one-rank run: its micro-batch, no accumulation, clipping or
    ZeRO, no progress lines, ``settings`` and the ``hierarchical_ps`` section."""
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 1 << 30,
        **settings,
        "hierarchical_ps": section,
    }


def median_record(runs: list[dict[str, Any]], by: str = "seconds") -> dict[str, Any]:
    """The run of median ``by`` (lower middle for an even count), with every run's examples/s and
    the median peak RSS."""
    ok = [r for r in runs if by in r]
    if not ok:
        return {"error": runs[0].get("error", "no run finished") if runs else "not run"}
    ordered = sorted(ok, key=lambda r: r[by])
    record = dict(ordered[(len(ordered) - 1) // 2])
    record["all_examples_per_s"] = [r["examples_per_s"] for r in ok]
    record["examples_per_s"] = statistics.median(record["all_examples_per_s"])
    record["peak_rss_bytes"] = int(statistics.median(r["peak_rss_bytes"] for r in ok))
    record["failed_runs"] = len(runs) - len(ok)
    return record
