"""Kills at random moments and random damage of any file, seeded so that every case can be rerun.

- **Kills**: the crash scenario of ``test_crash.py`` killed just before its n-th file-system call
  (a write, fsync, rename, deletion or mkdir of any thread: fault point ``io:<n>``), n drawn from
  the calls a whole run makes. The store must reopen at the checkpoint committed by then, hold
  exactly its rows, and train on exactly as an uninterrupted run resumed from it.
- **Damage**: one file of a checkpointed store, drawn at random (segments, their metadata,
  manifests, the marker, checkpoint arrays), flipped at a random byte, truncated at a random
  length, deleted, or overwritten by another file of the store. Opening the store and reading
  every row must either raise an error of :mod:`hierps.errors` or return exactly the rows of the
  checkpoint, never other rows and never a raw exception.

The CI runs a few seeds; ``-m slow`` runs many (``HIERPS_RANDOM_CASES`` sets how many).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import crash_scenario as cs
import numpy as np
import pytest
import test_crash
from test_crash import Reference, check_reopened

import hierps
from hierps.errors import HierpsError

# The fixtures of test_crash.py: a tmpfs directory, and the reference run (its trace and snapshots).
fast_dir = test_crash.fast_dir
reference = test_crash.reference
SHORT, LONG = 4, int(os.environ.get("HIERPS_RANDOM_CASES", "150"))


def _committed_before(trace: list[str], n: int) -> str | None:
    """The tag of the last checkpoint committed before the n-th ``io`` of ``trace``."""
    at = [i for i, p in enumerate(trace) if p == "io"][n - 1]
    commits = [
        trace.index("json.after_replace", i) for i, p in enumerate(trace) if p == "checkpoint.before_manifest"
    ]
    committed = sum(c < at for c in commits)
    return cs.TAGS[committed - 1] if committed else None


def _kill_case(reference: Reference, fast_dir: Path, seed: int) -> None:
    total = reference.trace.count("io")
    n = int(np.random.default_rng(seed).integers(1, total + 1))
    expect = _committed_before(reference.trace, n)
    work = fast_dir / f"io-{seed}"
    rc = cs.run_forked(cs.scenario, work / "store", work, fault=f"io:{n}")
    assert rc == -signal.SIGKILL, f"seed {seed}: the run was not killed at io:{n} of {total} (exit code {rc})"
    check_reopened(work / "store", expect, reference, fast_dir)
    shutil.rmtree(work)


@pytest.mark.parametrize("seed", range(SHORT))
def test_killed_at_a_random_file_system_call(reference, fast_dir, seed):
    _kill_case(reference, fast_dir, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SHORT, SHORT + LONG))
def test_killed_at_a_random_file_system_call_many(reference, fast_dir, seed):
    _kill_case(reference, fast_dir, seed)


# -- random damage ----------------------------------------------------------------------------------
def _damage(store: Path, seed: int) -> str:
    """Damage one file of ``store`` as ``seed`` draws it; says what was done."""
    rng = np.random.default_rng(seed)
    files = sorted(p for p in store.rglob("*") if p.is_file() and p.name != "LOCK")
    victim = files[int(rng.integers(len(files)))]
    data = victim.read_bytes()
    kind = ("flip", "truncate", "delete", "copy")[int(rng.integers(4))]
    if kind == "flip" and data:
        at = int(rng.integers(len(data)))
        victim.write_bytes(data[:at] + bytes([data[at] ^ (1 << int(rng.integers(8)))]) + data[at + 1 :])
    elif kind == "truncate":
        victim.write_bytes(data[: int(rng.integers(len(data) + 1))])
    elif kind == "delete":
        victim.unlink()
    else:  # another file of the store over it, one of the same size when there is one
        same = [p for p in files if p != victim and p.stat().st_size == len(data)]
        others = same or [p for p in files if p != victim]
        source = others[int(rng.integers(len(others)))]
        shutil.copy(source, victim)
        kind = f"copy of {source.relative_to(store)}"
    return f"{kind} {victim.relative_to(store)}"


def _read_everything(path: Path) -> dict[str, np.ndarray]:
    with hierps.Store(path, device="cpu") as store:
        rows = {t: store.read_rows(t, cs.KEYS).copy() for t in cs.TABLES}
    with hierps.CheckpointReader(path) as reader:
        for t in cs.TABLES:
            reader.read(t, reader.keys(t))
    return rows


def _damage_case(reference: Reference, fast_dir: Path, seed: int) -> None:
    work = fast_dir / f"damage-{seed}"
    shutil.copytree(reference.root / "snap-c3", work)
    what = _damage(work, seed)
    try:
        rows = _read_everything(work)
    except HierpsError:
        pass  # named and refused
    except Exception as exc:  # pragma: no cover - the failure this test exists to find
        raise AssertionError(f"seed {seed} ({what}): raw {type(exc).__name__}: {exc}") from exc
    else:
        for t in cs.TABLES:
            np.testing.assert_array_equal(rows[t], reference.rows("c3")[t], err_msg=f"seed {seed} ({what})")
    shutil.rmtree(work)


@pytest.mark.parametrize("seed", range(3 * SHORT))
def test_random_damage_is_refused_or_harmless(reference, fast_dir, seed):
    _damage_case(reference, fast_dir, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3 * SHORT, 3 * SHORT + 2 * LONG))
def test_random_damage_is_refused_or_harmless_many(reference, fast_dir, seed):
    _damage_case(reference, fast_dir, seed)
