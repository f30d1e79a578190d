"""SIGKILL at each fault point of a training run: the store reopens at the last committed
checkpoint, with every row and optimizer state of it, and training resumes from there exactly as
an uninterrupted run that resumed from the same checkpoint.

One reference run (module scope) records the order in which fault points are reached and a copy
of the store after each checkpoint; each case kills a forked run at the first time a point is
reached after a given checkpoint returned. The table of cases is the one in docs/reliability.md.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crash_scenario as cs
import crash_sharded
import numpy as np
import pytest

import hierps
from hierps._store import store_parts
from hierps.rows._counters import NUM_COUNTERS
from hierps.storage._commit_log import snapshots
from hierps.tiers._reader import CheckpointReader


@pytest.fixture(scope="module")
def fast_dir(tmp_path_factory) -> Path:
    """A directory on tmpfs when there is one: no fsync cost, and SIGKILL does not need fsync."""
    with cs.tmpfs_dir("hierps-crash-", tmp_path_factory.mktemp("crash")) as path:
        yield path


@dataclass
class Reference:
    root: Path
    trace: list[str]
    resumed: dict[str | None, Any]

    def rows(self, tag: str) -> dict[str, np.ndarray]:
        with np.load(self.root / f"{tag}.npz") as f:
            return {t: f[t] for t in cs.TABLES}

    def resume_from(self, tag: str | None, work: Path) -> Any:
        """What an uninterrupted run gives when a job restarts from checkpoint ``tag`` (cached)."""
        if tag not in self.resumed:
            path = work / f"resume-{tag}"
            if tag is not None:
                shutil.copytree(self.root / f"snap-{tag}", path)
            self.resumed[tag] = cs.resume(path)
        return self.resumed[tag]


@pytest.fixture(scope="module")
def reference(fast_dir) -> Reference:
    root = fast_dir / "reference"
    rc = cs.run_forked(cs.scenario, root / "store", root, record=True)
    assert rc == 0
    return Reference(root, json.loads((root / "trace.json").read_text()), {})


def locate(trace: list[str], point: str, after: int) -> tuple[int, str | None]:
    """(n such that ``point:n`` is the first time ``point`` is reached after checkpoint #after
    returned, the tag of the last checkpoint committed when it is reached)."""
    start = trace.index(f"returned:{cs.TAGS[after - 1]}") if after else 0
    try:
        at = trace.index(point, start)
    except ValueError:
        raise AssertionError(f"the run never reaches {point} after checkpoint #{after}") from None
    # A checkpoint commits when its manifest replaces the temp file: the first json.after_replace
    # after checkpoint.before_manifest.
    commits = [
        trace.index("json.after_replace", i) for i, p in enumerate(trace) if p == "checkpoint.before_manifest"
    ]
    committed = sum(c <= at for c in commits)
    return trace[: at + 1].count(point), cs.TAGS[committed - 1] if committed else None


# (point, killed at its first hit after checkpoint #after returned, checkpoint the store reopens at)
CASES = [
    ("json.before_replace", 0, None),  # creating the store: marker written, not renamed
    ("store.step", 0, None),
    ("pass.write_back", 0, None),  # the write-back of the first pass, in the pipeline worker
    ("pass.loaded", 1, "c1"),
    ("store.step", 1, "c1"),
    ("pass.write_back", 1, "c1"),
    ("memory.evict", 1, "c1"),
    ("ssd.segment_begin", 1, "c1"),
    ("ssd.segment_rows_block", 1, "c1"),
    ("ssd.segment_rows_written", 1, "c1"),
    ("ssd.segment_written", 1, "c1"),
    ("ssd.compaction_begin", 1, "c1"),
    ("ssd.compaction", 1, "c1"),
    ("checkpoint.after_device_flush", 1, "c1"),
    ("memory.flush_table", 1, "c1"),
    ("checkpoint.after_memory_flush", 1, "c1"),
    ("checkpoint.after_sync", 1, "c1"),
    ("checkpoint.table_arrays", 1, "c1"),
    ("checkpoint.before_manifest", 1, "c1"),
    ("json.before_replace", 1, "c1"),
    ("json.after_replace", 1, "c2"),
    ("checkpoint.after_manifest", 1, "c2"),
    ("checkpoint.retire_manifest_removed", 1, "c2"),
    ("checkpoint.after_retire", 1, "c2"),
    ("ssd.gc_segment", 1, "c1"),  # a compaction's input no checkpoint names, deleted at once
    ("memory.evict", 2, "c2"),
    ("ssd.gc_segment", 2, "c2"),
    ("checkpoint.table_arrays", 2, "c2"),
    ("checkpoint.after_retire", 2, "c3"),
]


def test_reference_reopens_each_checkpoint(reference, fast_dir):
    """The snapshots the cases compare against hold what the run saw at each checkpoint."""
    for tag in cs.TAGS:
        opened, before, _, _ = reference.resume_from(tag, fast_dir)
        assert opened == tag
        for t in cs.TABLES:
            np.testing.assert_array_equal(before[t], reference.rows(tag)[t])


@pytest.mark.parametrize(("point", "after", "expect"), CASES, ids=[f"{p}@{a}" for p, a, _ in CASES])
def test_sigkill_reopens_at_last_checkpoint_and_resumes(reference, fast_dir, point, after, expect):
    n, committed = locate(reference.trace, point, after)
    assert committed == expect, f"the table says {expect}, the trace says {committed}"
    if point == "ssd.segment_rows_block":  # the kill lands between two blocks of one segment
        named = [p for p in reference.trace if p != "io"]  # file-system calls in between do not count
        hits = [i for i, p in enumerate(named) if p == point]
        # The first segment of more than one block written from there (smaller ones may come first),
        # still before the next checkpoint writes its manifest.
        n = next((k for k in range(n, len(hits) + 1) if named[hits[k - 1] + 1] == point), n)
        since = named.index(f"returned:{cs.TAGS[after - 1]}") if after else 0
        assert "checkpoint.before_manifest" not in named[since : hits[n - 1]]
        assert named[hits[n - 1] + 1] == point
    work = fast_dir / f"{point}@{after}"
    rc = cs.run_forked(cs.scenario, work / "store", work, fault=f"{point}:{n}")
    assert rc == -signal.SIGKILL, f"the run was not killed at {point}:{n} (exit code {rc})"
    check_reopened(work / "store", expect, reference, fast_dir)
    shutil.rmtree(work)


def test_sigkill_during_recovery_after_a_crash(reference, fast_dir):
    """Killed mid-checkpoint, then killed again while the next open collects what it left."""
    work = fast_dir / "double"
    n, _ = locate(reference.trace, "checkpoint.after_memory_flush", 1)
    assert cs.run_forked(cs.scenario, work / "store", work, fault=f"checkpoint.after_memory_flush:{n}") == -9
    assert cs.run_forked(cs.open_only, work / "store", work, fault="ssd.gc_segment:1") == -9
    check_reopened(work / "store", "c1", reference, fast_dir)
    shutil.rmtree(work)


def check_reopened(path: Path, expect: str | None, reference: Reference, fast_dir: Path) -> None:
    store = hierps.Store(path, device="cpu")
    try:
        tags = [c["tag"] for c in store.list_checkpoints()]
        assert (tags[-1] if tags else None) == expect
        # Nothing the killed run left half-done remains: every segment is named by a checkpoint,
        # every checkpoint directory has its manifest, no temp file is left.
        segments = {(p.parent.name, int(p.name)) for p in (path / "segments").glob("*/*") if p.name.isdigit()}
        assert segments <= store_parts(store).core.catalog.referenced_segments()
        ckpt_dirs = {int(p.name) for p in (path / "checkpoints").iterdir() if p.is_dir()}
        assert ckpt_dirs == set(store_parts(store).core.catalog.ids())
        assert not [p for p in path.rglob(".*tmp-*")]
        if expect is not None:  # a concurrent reader sees the same checkpoint
            reader = CheckpointReader(path)
            for t in cs.TABLES:
                keys = reader.keys(t)
                np.testing.assert_array_equal(
                    reader.read(t, keys)[1][:, :-NUM_COUNTERS], store.read_rows(t, keys)
                )
    finally:
        store.close()
    opened, before, after, steps = cs.resume(path)
    ref_opened, ref_before, ref_after, ref_steps = reference.resume_from(expect, fast_dir)
    assert opened == ref_opened == expect
    for t in cs.TABLES:  # weights and optimizer state, before and after training on
        np.testing.assert_array_equal(before[t], ref_before[t], err_msg=f"{t} at reopen")
        np.testing.assert_array_equal(after[t], ref_after[t], err_msg=f"{t} after resuming")
    assert steps == ref_steps


# -- a reshard: a rank killed while it fills its new part ------------------------------------------
# (rank killed, point, its n-th hit from the start of the open, the world size opening): into 3
# ranks the rows stream; into 1 (a divisor of 2) rank 0 adopts both old parts, rank 1's linked in.
RESHARD_CASES = [
    (1, "ssd.segment_written", 1, 3),  # its rows written as a segment, not yet in the live set
    (2, "checkpoint.before_manifest", 1, 3),  # its part of the reshard's checkpoint not committed
    (0, "sharded.before_commit", 1, 3),  # every part durable; no commit record
    (0, "ssd.adopted_segment", 1, 1),  # one old segment linked in, the others not yet
    (0, "reshard.adopted", 1, 1),  # every old segment linked in; no checkpoint names them
    (0, "checkpoint.before_manifest", 1, 1),  # the links synced; the reshard's checkpoint not committed
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("killed", "point", "n", "opening"),
    RESHARD_CASES,
    ids=[f"{p}:{n}@rank{r}-of{w}" for r, p, n, w in RESHARD_CASES],
)
def test_rank_killed_inside_a_reshard_leaves_the_saved_checkpoint_exact(
    sharded_reference, fast_dir, killed, point, n, opening
):
    work = fast_dir / f"reshard-{point}-{n}-{killed}-{opening}"
    shutil.copytree(sharded_reference / "store", work / "store")
    codes = crash_sharded.run_ranks(
        crash_sharded.reopen, work / "store", work, opening, f"{point}:{n}", killed
    )
    assert codes[killed] == -signal.SIGKILL, f"rank {killed} was not killed at {point}:{n} ({codes})"
    expected, _ = crash_sharded.rows_of(sharded_reference, "c2", 2)
    # The saved checkpoint at 2 ranks, exactly; then the reshard, done again.
    for world in (2, opening):
        assert crash_sharded.run_ranks(crash_sharded.reopen, work / "store", work, world) == [0] * world
        got, tags = crash_sharded.rows_of(work, "reopen", world)
        assert all(t == tags[0] for t in tags) and tags[0][-1] == "c2", tags
        assert got.keys() == expected.keys()
        for k, row in expected.items():
            np.testing.assert_array_equal(got[k], row, err_msg=f"key {k} at {world} ranks")
    shutil.rmtree(work)


def test_every_fault_point_is_documented_and_tested():
    root = Path(__file__).resolve().parent.parent
    source = "".join(p.read_text() for p in (root / "plugin").rglob("*.py"))
    in_code = set(re.findall(r'(?:fault_point\(|block_point=)"([a-z_.]+)"', source))
    doc = (root / "docs" / "reliability.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.]+)` *\|", doc, re.M))
    assert in_code == documented
    assert in_code == (
        {p for p, _, _ in CASES}
        | {p for _, p, _, _, _ in SHARDED_CASES}
        | {p for _, p, _, _ in RESHARD_CASES}
    )


# -- a sharded checkpoint: one of two ranks killed at each of its steps ---------------------------
# (rank killed, point, its n-th hit after c1 returned (c1: after=0, counted from the start), the
# checkpoint every rank reopens at, by how many ranks the store is reopened)
SHARDED_CASES = [
    (1, "sharded.part_written", 1, None, 2),  # c1 never committed: both ranks reopen empty
    (1, "checkpoint.before_manifest", 1, "c1", 2),  # rank 1's part not committed; rank 0's may be
    (1, "checkpoint.before_manifest", 1, "c1", 1),  # ... and one process takes over
    (0, "checkpoint.before_manifest", 1, "c1", 2),
    (1, "sharded.part_written", 1, "c1", 2),  # rank 1's part committed on its own; no commit record
    (0, "sharded.part_written", 1, "c1", 3),
    (0, "sharded.before_commit", 1, "c1", 2),  # every part durable; no commit record
    (0, "json.before_replace", 2, "c1", 2),  # the commit record in its temp file
    (0, "json.after_replace", 2, "c2", 2),  # the commit record renamed: committed
    (0, "sharded.committed", 1, "c2", 2),
    (1, "sharded.committed", 1, "c2", 1),
    (0, "sharded.commit_retired", 1, "c2", 2),  # c1's record deleted, its parts not yet
    (1, "checkpoint.after_retire", 1, "c2", 2),  # rank 1 retired its part of c1
]


@pytest.fixture(scope="module")
def sharded_reference(fast_dir) -> Path:
    out = fast_dir / "sharded-reference"
    assert crash_sharded.run_ranks(crash_sharded.scenario, out / "store", out, 2) == [0, 0]
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("killed", "point", "n", "expect", "world"),
    SHARDED_CASES,
    ids=[f"{p}:{n}@rank{r}-reopens-{e}-by{w}" for r, p, n, e, w in SHARDED_CASES],
)
def test_rank_killed_inside_a_sharded_checkpoint_reopens_every_rank_at_one_checkpoint(
    sharded_reference, fast_dir, killed, point, n, expect, world
):
    work = fast_dir / f"sharded-{point}-{n}-{killed}-{world}-{expect}"
    after = 0 if expect is None else 1
    codes = crash_sharded.run_ranks(
        crash_sharded.scenario, work / "store", work, 2, f"{after}/{point}:{n}", killed
    )
    assert codes[killed] == -signal.SIGKILL, f"rank {killed} was not killed at {point}:{n} ({codes})"
    # The restarted job: every rank at the same checkpoint, with exactly its rows and optimizer state
    # (resharded when it has another number of ranks).
    assert crash_sharded.run_ranks(crash_sharded.reopen, work / "store", work, world) == [0] * world
    got, tags = crash_sharded.rows_of(work, "reopen", world)
    assert all(t == tags[0] for t in tags) and (tags[0][-1] if tags[0] else None) == expect
    if expect is None:  # every row as a new store has it: the initializer's
        fresh = fast_dir / "sharded-fresh"
        if not fresh.exists():
            assert crash_sharded.run_ranks(crash_sharded.reopen, fresh / "store", fresh, 2) == [0, 0]
        expected, _ = crash_sharded.rows_of(fresh, "reopen", 2)
    else:
        expected, _ = crash_sharded.rows_of(sharded_reference, expect, 2)
    assert got.keys() == expected.keys()
    for k, row in expected.items():
        np.testing.assert_array_equal(got[k], row, err_msg=f"key {k}")
    # A part that never committed is gone: each rank holds exactly its parts of the checkpoints.
    kept = snapshots(work / "store")
    assert [s.tag for s in kept] == tags[0] and (not kept or kept[-1].world_size == world)
    for rank in range(world):
        ckpts = work / "store" / f"rank-{rank:05d}" / "checkpoints"
        assert {int(p.stem) for p in ckpts.glob("*.json")} == {
            s.parts[rank] for s in kept if rank < s.world_size
        }
    shutil.rmtree(work)
