"""Pipelined passes give bit for bit the parameters of unpipelined ones; compaction loses nothing."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

import hierps
from hierps._store import store_parts

VOCAB, DIM = 2000, 8
KEYS = (np.arange(VOCAB, dtype=np.int64) - 700) * 104_729


def _passes(n_passes: int, batches_per_pass: int, seed: int = 0):
    """Overlapping passes: each draws most of its ids from a window shared with its neighbours."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(n_passes):
        lo = (p * 150) % (VOCAB - 600)
        group = []
        for _ in range(batches_per_pass):
            local = lo + (rng.zipf(1.2, size=(32, 3)) - 1) % 600
            group.append(
                (torch.from_numpy(KEYS[local].reshape(-1)), torch.from_numpy(rng.random(32, np.float32)))
            )
        out.append(group)
    return out


def _train(store: hierps.Store, passes, prefetch: bool) -> tuple[np.ndarray, list[float]]:
    torch.manual_seed(0)
    bag = hierps.EmbeddingBag(
        None, DIM, mode="mean", store=store, name="t", optimizer={"type": "adam", "params": {"lr": 0.02}}
    )
    head = nn.Linear(DIM, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    losses = []
    for i, group in enumerate(passes):
        store.begin_pass([{"t": ids} for ids, _ in group])
        if prefetch and i + 1 < len(passes):
            store.prefetch([{"t": ids} for ids, _ in passes[i + 1]])
        for ids, y in group:
            loss = nn.functional.mse_loss(head(bag(ids, torch.arange(0, ids.numel(), 3))).squeeze(-1), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            store.step()
            losses.append(loss.item())
        store.end_pass()
    store.checkpoint()
    return store.read_rows("t", KEYS), losses


def test_pipelined_equals_unpipelined_bit_for_bit(make_store):
    passes = _passes(12, 4)
    plain = make_store("plain", memory_budget="8KiB", pipeline=False, max_segments=3)
    piped = make_store("piped", memory_budget="8KiB", pipeline=True, max_segments=3)
    rows_plain, loss_plain = _train(plain, passes, prefetch=False)
    rows_piped, loss_piped = _train(piped, passes, prefetch=True)
    np.testing.assert_array_equal(rows_piped, rows_plain)
    assert loss_piped == loss_plain
    assert store_parts(piped).core.memory.evicted_rows > 0 and store_parts(piped).core.ssd.bytes_read > 0
    assert piped._pipe.prepare_seconds > 0 and piped._pipe.writeback_seconds > 0


def test_prefetch_of_another_pass_is_ignored_safely(make_store):
    passes = _passes(6, 3, seed=1)
    ref = make_store("ref", memory_budget="4KiB", pipeline=False)
    rows_ref, _ = _train(ref, passes, prefetch=False)
    odd = make_store("odd", memory_budget="4KiB")
    torch.manual_seed(0)
    # Announce the wrong passes: the read-ahead must be dropped, never used.
    wrong = _passes(6, 3, seed=2)
    bag = hierps.EmbeddingBag(
        None, DIM, mode="mean", store=odd, name="t", optimizer={"type": "adam", "params": {"lr": 0.02}}
    )
    head = nn.Linear(DIM, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    for i, group in enumerate(passes):
        odd.begin_pass([{"t": ids} for ids, _ in group])
        odd.prefetch([{"t": ids} for ids, _ in wrong[i]])
        for ids, y in group:
            nn.functional.mse_loss(head(bag(ids, torch.arange(0, ids.numel(), 3))).squeeze(-1), y).backward()
            opt.step()
            opt.zero_grad()
            odd.step()
        odd.end_pass()
    np.testing.assert_array_equal(odd.read_rows("t", KEYS), rows_ref)


@pytest.mark.parametrize("pipeline", [False, True])
def test_compaction_never_loses_a_row(make_store, pipeline):
    passes = _passes(16, 3, seed=3)
    reference = make_store("big", memory_budget="64MiB", max_segments=1000, pipeline=False)
    rows_ref, _ = _train(reference, passes, prefetch=False)
    assert store_parts(reference).core.ssd.bytes_read == 0
    small = make_store("small", memory_budget="2KiB", max_segments=2, pipeline=pipeline)
    rows, _ = _train(small, passes, prefetch=pipeline)
    np.testing.assert_array_equal(rows, rows_ref)
    # Compaction keeps the count near max_segments (a checkpoint flush may add one or two).
    assert len(store_parts(small).core.ssd.segments("t")) <= 5 < store_parts(small).core.ssd.next_segment - 1
    # ... and after reopening, from disk alone.
    path = small.path
    small.close()
    reopened = hierps.Store(path, device="cpu")
    try:
        np.testing.assert_array_equal(reopened.read_rows("t", KEYS), rows_ref)
    finally:
        reopened.close()


def _bag_batches(seed: int) -> list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]:
    """Batches of 8 of 80 examples (an epoch and a half, shuffled), two tables, each example with its
    own bag of 0-4 power-law raw ids per table."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 5, (80, 2))
    ids = [[((1 - rng.random(n)) ** (-1 / 0.7)).astype(np.int64) * 7919 for n in row] for row in lens]
    labels = rng.integers(0, 2, 80).astype(np.float32)
    order = np.concatenate([rng.permutation(80), rng.permutation(80)[:48]])
    out = []
    for start in range(0, len(order), 8):
        rows = order[start : start + 8]
        bags = []
        for k in range(2):
            offsets = np.cumsum([0, *[len(ids[r][k]) for r in rows[:-1]]]).astype(np.int64)
            bags.append(
                (torch.from_numpy(np.concatenate([ids[r][k] for r in rows])), torch.from_numpy(offsets))
            )
        out.append((bags, torch.from_numpy(labels[rows])))
    return out


def _train_bags(store: hierps.Store, batches) -> tuple[list[float], list[np.ndarray]]:
    from hierps.integrations.loader import PassLoader

    embs = [
        hierps.EmbeddingBag(None, 4, mode="sum", store=store, name=f"t{k}", optimizer="adagrad")
        for k in range(2)
    ]
    head = torch.linspace(-1, 1, 8)
    loader = PassLoader(
        batches, lambda b: {f"t{k}": hierps.Bags(*b[0][k]) for k in range(2)}, store, pass_batches=4
    )
    losses = []
    for bags, y in loader:
        x = torch.cat([e(i, o) for e, (i, o) in zip(embs, bags)], 1)
        loss = nn.functional.binary_cross_entropy_with_logits(x @ head, y)
        loss.backward()
        store.step()
        losses.append(loss.item())
    keys = np.unique(np.concatenate([b[0][k][0].numpy() for b in batches for k in range(2)]))
    return losses, [store.read_rows(f"t{k}", keys) for k in range(2)]


def test_a_pass_loaded_group_by_group_is_not_read_ahead_past(make_store):
    """A device tier of about one mini-batch splits each pass of 4 into groups. The next pass's
    read-ahead, announced then, would take the rows of this pass's later groups from before this
    pass trains them: the store does not read ahead there, and trains exactly as when every row fits."""
    batches = _bag_batches(2)
    loss_small, rows_small = _train_bags(
        make_store("small", memory_budget="2KiB", device_budget=2000), batches
    )
    loss_whole, rows_whole = _train_bags(
        make_store("whole", memory_budget="2KiB", device_budget="1MiB"), batches
    )
    assert loss_small == loss_whole
    for small, whole in zip(rows_small, rows_whole):
        np.testing.assert_array_equal(small, whole)


def test_the_next_pass_of_one_loaded_group_by_group_is_planned_on_the_worker(make_store, monkeypatch):
    """While a pass is loaded group by group, the next pass (announced then) is not read ahead, but its
    groups are planned on the worker, and its begin_pass takes that plan: each pass is planned once (on
    the worker where it was announced during such a pass), and the training is exactly as when every
    row fits."""
    import threading

    from hierps.training import _passes

    threads: list[str] = []
    plan_groups, planned = _passes.PassRunner._plan_groups, _passes.PassRunner._planned

    def recording(self, batches):
        threads.append(threading.current_thread().name)
        return plan_groups(self, batches)

    def waiting(self, batches):  # the worker's plan done by then, whatever the timing
        if self._plan_ahead is not None:
            self._plan_ahead[1].result()
        return planned(self, batches)

    monkeypatch.setattr(_passes.PassRunner, "_plan_groups", recording)
    monkeypatch.setattr(_passes.PassRunner, "_planned", waiting)
    batches = _bag_batches(3)
    loss_small, rows_small = _train_bags(
        make_store("small", memory_budget="2KiB", device_budget=2000), batches
    )
    monkeypatch.undo()
    loss_whole, rows_whole = _train_bags(
        make_store("whole", memory_budget="2KiB", device_budget="1MiB"), batches
    )
    passes = len(batches) // 4
    assert len(threads) == passes and "hierps-pass_0" in threads, threads  # none planned twice
    assert loss_small == loss_whole
    for small, whole in zip(rows_small, rows_whole):
        np.testing.assert_array_equal(small, whole)


def test_the_ram_tiers_lru_clock_does_not_depend_on_when_the_worker_runs(make_store):
    """The worker's read-ahead scores the RAM tier's rows at the pass that asked for it, even when it
    gets to them after that pass ended (as when it waits for the disk): which rows the RAM tier
    evicts, and so where later rows come from and what a plan predicts, does not depend on timing."""
    store = make_store(memory_budget="1MiB", device_budget="1MiB")
    bag = hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name="t")
    first, second = np.arange(100, dtype=np.int64), np.arange(100, 200, dtype=np.int64)
    store.begin_pass([{"t": first}])
    bag(torch.from_numpy(first), torch.arange(0, 100, 10)).sum().backward()
    store.step()
    store.end_pass()
    store.begin_pass([{"t": second}])  # the first pass's rows go back to RAM, scored 1
    pipe, submit = store._pipe, store._pipe._submit
    pipe._submit = lambda fn, *args: submit(lambda: (time.sleep(0.2), fn(*args))[1])  # a slow worker
    store.prefetch([{"t": first}])  # asked during pass 1, read during pass 2
    store.end_pass()
    assert store_parts(store).core.memory.tick == 2
    store.begin_pass([{"t": first}])
    memory = store_parts(store).core.memory
    assert memory.scores("t", first).tolist() == [1] * 100
    store.end_pass()
    assert store.stats.history[-1].ram_rows == 100  # read ahead from RAM
