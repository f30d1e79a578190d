"""Forked processes (a DataLoader's workers) and the store's background threads.

A process forked while another of its threads holds a lock gets that lock held forever: the
thread is not copied. The store's read threads are made anew in a child (under a lock of their own,
reset at the fork), and a :class:`hierps.PassLoader` over a loader that forks its workers at each
``iter()`` first lets the store's background work finish, so that no task of it is mid-way when the
workers are made.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import hierps
from hierps.integrations.loader import PassLoader
from hierps.storage import _reads


def test_a_forked_child_makes_read_threads_while_a_parent_thread_held_their_lock(tmp_path):
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _reads._pool_lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        pid = os.fork()
        if pid == 0:  # the child: SIGALRM ends it if it waits for the lock its parent's thread held
            code = 1
            try:
                signal.alarm(10)
                code = 0 if _reads._executor().submit(lambda: 7).result(timeout=10) == 7 else 2
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_pass_loader_forks_its_workers_only_while_the_store_is_idle(tmp_path):
    """Three epochs of a DataLoader forking 2 workers at each iter(), over a store whose background
    worker is slow: at every fork no task of the store's pipeline is still running."""
    store = hierps.Store(tmp_path / "s", device_budget="64KiB", memory_budget="4KiB", seed=1)
    bag = hierps.EmbeddingBag(None, 4, mode="sum", store=store, name="t")
    pipe = store._pipe
    submit = pipe._submit
    pipe._submit = lambda fn, *args: submit(lambda: (time.sleep(0.3), fn(*args))[1])  # a slow worker
    busy_at_fork: list[int] = []

    def before_fork() -> None:
        if watching:
            busy_at_fork.append(sum(not f.done() for f in pipe._tasks))

    watching = True
    os.register_at_fork(before=before_fork)
    try:
        ids = torch.from_numpy(np.random.default_rng(0).integers(0, 5_000, (48, 3)))
        data = DataLoader(TensorDataset(ids), batch_size=8, num_workers=2)
        loader = PassLoader(data, {"t": 0}, store, pass_batches=2)
        steps = 0
        for _ in range(3):
            for (batch,) in loader:
                bag(batch).sum().backward()
                store.step()
                steps += 1
    finally:
        watching = False
        store.close()
    assert steps == 18
    assert len(busy_at_fork) >= 6  # two workers an epoch, forked at each iter()
    assert busy_at_fork == [0] * len(busy_at_fork)
