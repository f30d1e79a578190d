"""examples/online: a trainer SIGKILLed in the middle of the stream and started again is the run never killed.

A producer fills a directory with Parquet logs; the trainer follows it in passes of event time,
checkpointing and publishing a delta after each pass; serving follows the published directory.
The killed-and-restarted trainer must end with the uninterrupted one's per-step losses (each step's
last record: a restart redoes the steps after its checkpoint), dense parameters and served rows,
bit for bit, and serving must give the rows of the last published checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import hierps.serving

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "online"
FILES, ROWS = 6, 1024  # six passes of one file (60 s of event time) each, two steps of 512


def env() -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(k, None)
    return out


def trainer(logs: Path, work: Path, serve: Path) -> list[str]:
    return [
        sys.executable,
        str(EXAMPLE / "train.py"),
        f"--logs={logs}",
        f"--work={work}",
        f"--serve={serve}",
        "--wait=0",
        f"--steps-log={work}/steps.jsonl",
        f"--dump={work}/dense.npy",
        "--compact-every=3",
    ]


def steps(work: Path) -> dict[int, float]:
    out = {}
    for line in (work / "steps.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line a SIGKILL cut
            continue
        out[record["step"]] = record["loss"]  # a restart's record of a step replaces the killed run's
    return out


def served(directory: Path) -> dict[str, np.ndarray]:
    tables = hierps.serving.open(directory)
    try:
        return {name: tables.lookup(name, np.sort(tables.keys(name))) for name in tables.tables}
    finally:
        tables.close()


@pytest.mark.distributed
def test_a_killed_online_trainer_resumes_at_the_stream_position_bit_exactly(tmp_path):
    logs = tmp_path / "logs"
    produce = [sys.executable, str(EXAMPLE / "produce.py"), str(logs), f"--files={FILES}", f"--rows={ROWS}"]
    subprocess.run([*produce, "--interval=0"], check=True, env=env(), timeout=120)
    whole = tmp_path / "whole"
    run = subprocess.run(
        trainer(logs, whole, whole / "serve"), env=env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.count("published") == FILES, run.stdout

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        trainer(logs, killed, killed / "serve"), env=env(), stdout=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # mid-stream: after the second pass's first step
        if (killed / "steps.jsonl").exists() and len(steps(killed)) >= 5:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = max(steps(killed))
    assert 5 <= killed_at < FILES * ROWS // 512
    run = subprocess.run(
        trainer(logs, killed, killed / "serve"), env=env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]

    assert steps(killed) == steps(whole)  # every step once more after the checkpoint, with equal losses
    assert sorted(steps(whole)) == list(range(1, FILES * ROWS // 512 + 1))
    np.testing.assert_array_equal(np.load(killed / "dense.npy"), np.load(whole / "dense.npy"))
    want, got = served(whole / "serve"), served(killed / "serve")
    assert sorted(got) == sorted(want) and len(want) == 26
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_the_online_demo_publishes_every_pass_and_serves_it(tmp_path):
    from hierps.demo.online import OnlineConfig, run_online

    lines: list[str] = []
    cfg = OnlineConfig(
        files=3, rows_per_file=2048, interval=0.0, batch_size=512, compact_every=1, directory=str(tmp_path)
    )
    history = run_online(cfg, out=lines.append)["passes"]
    assert [h["pass"] for h in history] == [1, 2, 3] and all(h["examples"] == 2048 for h in history)
    assert [h["delta"] for h in history] == ["base", "delta", "base"]  # a new base after each delta
    assert all(h["delta_bytes"] > 0 and h["staleness_train_s"] >= 0 for h in history)
    assert lines[-1].startswith("3 passes published; staleness after the last step")
    tables = hierps.serving.open(tmp_path / "serve")
    assert tables.checkpoint == history[-1]["checkpoint"] and len(tables.tables) == 26
    tables.close()
