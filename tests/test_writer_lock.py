"""The writer lock belongs to the process that opened the store, not to the children it forks.

DataLoader workers and ``multiprocessing`` fork children inherit the lock's open file
description; the store drops the child's copy at fork, so closing the store, or killing the
trainer, frees the store for the next writer while such children live on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import hierps
from hierps import errors


def _fork_waiting_child(store: hierps.Store) -> tuple[int, int]:
    """A child that tries the store (must be refused), reports, then waits until its pipe closes."""
    report_r, report_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(report_r)
        os.close(hold_w)
        try:
            store.checkpoint()
            answer = b"used"
        except errors.StoreClosedError as exc:
            answer = b"refused" if b"forked child" in str(exc).encode() else b"other"
        os.write(report_w, answer)
        os.read(hold_r, 1)  # until the parent closes the pipe (or dies)
        os._exit(0)
    os.close(report_w)
    os.close(hold_r)
    assert os.read(report_r, 16) == b"refused"
    os.close(report_r)
    return pid, hold_w


def test_a_forked_child_does_not_keep_the_lock_after_close(tmp_path):
    store = hierps.Store(tmp_path / "s", device="cpu")
    store.table("t", 4)
    store.write("t", [1, 2], np.ones((2, 4), np.float32))
    store.checkpoint()
    pid, hold = _fork_waiting_child(store)
    try:
        with pytest.raises(errors.StoreLockedError):  # the parent still holds it
            hierps.Store(tmp_path / "s", device="cpu")
        store.close()
        with hierps.Store(tmp_path / "s", device="cpu") as again:  # the child lives on
            np.testing.assert_array_equal(again.lookup("t", [1]).numpy(), 1.0)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
    finally:
        os.close(hold)
        os.waitpid(pid, 0)


_TRAINER = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    import numpy as np
    import hierps

    def wait():
        time.sleep(600)

    store = hierps.Store(sys.argv[1], device="cpu")
    store.table("t", 4)
    store.write("t", [1], np.ones((1, 4), np.float32))
    store.checkpoint()
    child = multiprocessing.get_context("fork").Process(target=wait)
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_killed_trainer_leaves_no_lock_with_its_live_children(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(tmp_path / "s")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # the fork child is alive
        with hierps.Store(tmp_path / "s", device="cpu") as store:
            assert store.checkpoint_id == 1
    finally:
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
