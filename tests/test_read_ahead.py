"""Evaluation read-ahead: announced evaluation mini-batches have their rows read in the background,
and their forwards read exactly what they would have read alone, changing no tier."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

import hierps
from hierps._store import store_parts
from hierps.integrations.loader import PassLoader

KEYS = np.arange(2_000, dtype=np.int64) * 104_729 + 5


def _trained(make_store, name: str = "s") -> tuple[hierps.Store, dict[str, hierps.EmbeddingBag]]:
    """Two tables trained on a few mini-batches, most rows on SSD (a 16 KiB RAM tier), checkpointed."""
    store = make_store(name, memory_budget="16KiB", device_budget="256KiB", optimizer="adagrad")
    mods = {t: hierps.EmbeddingBag(None, 8, mode="sum", store=store, name=t) for t in ("a", "b")}
    rng = np.random.default_rng(0)
    for _ in range(4):
        batch = {t: torch.from_numpy(KEYS[rng.integers(0, 1_500, 64)]) for t in mods}
        with store.run_pass([batch]):
            sum(m(batch[t], torch.arange(0, 64, 4)).square().sum() for t, m in mods.items()).backward()
            store.step()
    store.checkpoint()
    return store, mods


def _eval_batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(seed)  # ids trained and never seen (the initializer's rows)
    return [
        (
            torch.from_numpy(KEYS[rng.integers(0, 2_000, 48)]),
            torch.from_numpy(KEYS[rng.integers(0, 2_000, 30)]),
            torch.tensor([0, 7, 7, 20]),
        )
        for _ in range(n)
    ]


def _evaluate(mods, batches) -> list[torch.Tensor]:
    with torch.no_grad():
        return [
            torch.cat([mods["a"](a, torch.tensor([0, 16, 40, 41])), mods["b"](b, o)], 1)
            for a, b, o in batches
        ]


def test_evaluation_read_ahead_gives_the_rows_a_forward_reads_and_changes_no_tier(make_store):
    store, mods = _trained(make_store)
    batches = _eval_batches(1, 9)
    plain = _evaluate(mods, batches)
    usage = store.usage()
    target = SimpleNamespace(hierps_store=store, hierps_modules=mods)
    loader = PassLoader(
        batches, lambda b: {"a": b[0], "b": hierps.Bags(b[1], b[2])}, target, 4, evaluate=True
    )
    ahead = [_evaluate(mods, [batch])[0] for batch in loader]  # each forward as the loader yields it
    for x, y in zip(ahead, plain):
        assert torch.equal(x, y)
    parts = store_parts(store)
    tier = parts.core.device_tier
    lacking = 0  # the keys of each forward that neither the device nor the RAM tier holds
    for a, b, _ in batches:
        for table, ids in (("a", a), ("b", b)):
            keys = torch.unique(ids)
            found, _ = tier.resolve(table, keys)
            lacking += int(
                (~found & ~torch.from_numpy(parts.core.memory.contains(table, keys.numpy()))).sum()
            )
    assert parts.trainer.read_ahead.rows_given == lacking > 250  # every one of them read ahead
    after = store.usage()
    assert (after.memory_rows, after.ssd_rows, after.ssd_bytes_written) == (
        usage.memory_rows,
        usage.ssd_rows,
        usage.ssd_bytes_written,
    )
    assert store.passes == 4  # no pass was begun


def test_a_row_changed_after_its_read_ahead_is_read_again(make_store):
    store, mods = _trained(make_store)
    batches = _eval_batches(2, 2)
    store.read_ahead([{"a": a, "b": b} for a, b, _ in batches])
    keys = np.unique(batches[0][0].numpy())
    new = np.full((len(keys), 8), 0.25, np.float32)
    store.write("a", keys, new)  # after the read was announced
    out = _evaluate(mods, batches[:1])[0]
    fresh = _evaluate(mods, batches[:1])[0]
    assert torch.equal(out, fresh)
    assert torch.equal(store.lookup("a", torch.from_numpy(keys)), torch.from_numpy(new))
    assert store_parts(store).trainer.read_ahead.rows_given == 0
