"""Running one measurement in a fresh process: ``python -m hierps.bench.run --worker SPEC --out FILE``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["spawn"]


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
