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
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from procs import kill_tree, launcher, outcome

import hierps.serving

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "online"
FILES, ROWS, BATCH = 6, 2048, 512  # six passes of one file (60 s of event time) each


def env() -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(k, None)
    return out


def trainer(logs: Path, work: Path, world: int) -> list[str]:
    cmd = launcher(world)
    return [
        *cmd,
        str(EXAMPLE / "train.py"),
        f"--stream={logs}",
        f"--work={work}",
        f"--serve={work / 'serve'}",
        f"--batch-size={BATCH}",
        "--wait=0",
        f"--steps-log={work}/steps.jsonl",
        f"--dump={work}/dense.npy",
        "--compact-every=3",
    ]


def steps(work: Path, world: int, rank: int = 0) -> dict[int, float]:
    path = work / ("steps.jsonl" if world == 1 else f"steps.jsonl.rank{rank}")
    out: dict[int, float] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
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


def finish(cmd: list[str]) -> str:
    return started(cmd)()


def started(cmd: list[str]) -> Callable[[], str]:
    """Start ``cmd``; what it returns waits for its end, checks that it succeeded and gives its output."""
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def output() -> str:
        out, err = outcome(proc)
        assert proc.returncode == 0, out[-2000:] + err[-3000:]
        return out

    return output


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "kills"), [(1, [4, 10]), (2, [5])])
def test_a_killed_online_trainer_resumes_at_the_stream_position_bit_exactly(tmp_path, world, kills):
    """Killed (every process of it, SIGKILL) once it has logged step k, wherever it then is (mid-pass,
    in a checkpoint, in a publish), and started again; at two ranks each rank takes its share of the
    stream's batches and the store is sharded."""
    logs = tmp_path / "logs"
    produce = [sys.executable, str(EXAMPLE / "produce.py"), str(logs), f"--files={FILES}", f"--rows={ROWS}"]
    subprocess.run([*produce, "--interval=0"], check=True, env=env(), timeout=120)
    total = FILES * ROWS // (BATCH * world)
    whole = tmp_path / "whole"
    whole_output = started(trainer(logs, whole, world))  # beside the killed runs
    killed = tmp_path / "killed"
    try:
        for kill in kills:
            proc = subprocess.Popen(
                trainer(logs, killed, world), env=env(), stdout=subprocess.DEVNULL, start_new_session=True
            )
            deadline = time.monotonic() + 240
            while (
                time.monotonic() < deadline
                and max(steps(killed, world), default=0) < kill
                and proc.poll() is None
            ):
                time.sleep(0.02)
            kill_tree(proc)
            assert kill <= max(steps(killed, world)) < total
        finish(trainer(logs, killed, world))
    finally:  # (no run outlives the test)
        published = whole_output().count("published")
    assert published == FILES
    for rank in range(world):  # every step once more after the checkpoint, with equal losses
        assert steps(killed, world, rank) == steps(whole, world, rank)
        assert sorted(steps(whole, world, rank)) == list(range(1, total + 1))
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
