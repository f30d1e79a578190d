"""The sharded fast path: passes routed once, only rows and gradients per mini-batch.

Ranks are threads (:mod:`thread_world`); the oracle is one ``hierps.Store`` trained on the
global batches. Checked: the same rows as one process at world sizes 2 and 3 (pooled tables of
two dims and a plain ``Embedding``), no key travelling per mini-batch, all-to-all bytes within
1.3x of the rows and gradients that must travel, mini-batches other than the announced ones
(every rank falls back together, same results: the whole mini-batch, or the second table of a
pooled pair on one rank only), and a NaN on one rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from thread_world import ThreadTransport, run_ranks

import hierps
from hierps.sharding import owner_of

GLOBAL, STEPS, PASS = 12, 12, 4
KEYS = (np.arange(200, dtype=np.int64) - 60) * 7_919
# (name, dim, optimizer): two tables pool together (dim 16), one on its own (dim 24).
BAGS = [("a", 16, "adagrad"), ("b", 16, "adagrad"), ("c", 24, "adam")]
PARAMS = {"adagrad": {"lr": 0.3}, "adam": {"lr": 0.05}, "sgd": {"lr": 0.4}}


def global_batches(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        batch = {name: KEYS[(rng.zipf(1.3, GLOBAL) - 1) % len(KEYS)] for name, _, _ in BAGS}
        batch["e"] = KEYS[(rng.zipf(1.3, (GLOBAL, 2)) - 1) % len(KEYS)]  # an Embedding of 2 ids per example
        out.append(batch)
    return out


Bags = list[tuple[str, int, str]]


class Model(torch.nn.Module):
    def __init__(self, store: Any, bags: Bags = BAGS) -> None:
        super().__init__()
        self.names = [name for name, _, _ in bags]
        self.bags = torch.nn.ModuleDict(
            {
                name: hierps.EmbeddingBag(
                    None,
                    dim,
                    mode="sum",
                    store=store,
                    name=name,
                    optimizer={"type": opt, "params": PARAMS[opt]},
                )
                for name, dim, opt in bags
            }
        )
        self.emb = hierps.Embedding(
            None, 16, store=store, name="e", optimizer={"type": "sgd", "params": PARAMS["sgd"]}
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n = batch["a"].shape[0]
        offsets = torch.arange(n)
        outs = [self.bags[name](batch[name], offsets) for name in self.names]
        x = torch.cat([outs[0] * outs[1], outs[2], self.emb(batch["e"]).sum(1)], dim=1)
        return (x.sum(1) + 0.5 * x.pow(2).sum(1)).mean()  # the mean over this rank's examples


def train(
    store: Any, rank: int, world: int, ran: list[dict[str, np.ndarray]] | None = None, bags: Bags = BAGS
) -> dict[str, Any]:
    """Train on this rank's slice of the global batches (``ran``: the ids really run, if they are
    not the announced ones)."""
    model = Model(store, bags)
    share = GLOBAL // world
    announced = [{t: v[rank * share : (rank + 1) * share] for t, v in b.items()} for b in global_batches()]
    actual = [
        {t: v[rank * share : (rank + 1) * share] for t, v in b.items()} for b in (ran or global_batches())
    ]
    for p in range(0, STEPS, PASS):
        store.begin_pass(announced[p : p + PASS])
        if p + PASS < STEPS:
            store.prefetch(announced[p + PASS : p + 2 * PASS])
        for batch in actual[p : p + PASS]:
            model({t: torch.from_numpy(v) for t, v in batch.items()}).backward()
            store.step()
        store.end_pass()
    sent = getattr(store, "bytes_sent", 0)  # routing, rows and gradients of the whole training
    keys = torch.from_numpy(KEYS)
    return {
        "rows": {t: store.lookup(t, keys).numpy() for t in ["a", "b", "c", "e"]},
        "sent": sent,
        "fetched": getattr(store, "rows_fetched", 0),
    }


def one_process(
    path: Path, ran: list[dict[str, np.ndarray]] | None = None, bags: Bags = BAGS
) -> dict[str, Any]:
    with hierps.Store(path, device="cpu", memory_budget="4KiB") as store:
        return train(store, 0, 1, ran, bags)


def sharded(
    path: Path, world: int, ran: list[dict[str, np.ndarray]] | None = None, bags: Bags = BAGS
) -> list[dict[str, Any]]:
    def rank_main(transport: ThreadTransport) -> dict[str, Any]:
        store = hierps.ShardedStore(path, transport, device="cpu", memory_budget="4KiB")
        try:
            return train(store, transport.rank, world, ran, bags)
        finally:
            store.close()

    return run_ranks(world, rank_main)


def minimum_bytes(rank: int, world: int) -> int:
    """Rows out and gradients back: each distinct key a mini-batch of ``rank`` needs from another
    rank costs its row (dim floats) one way and its gradient the other."""
    share, total = GLOBAL // world, 0
    dims = {name: dim for name, dim, _ in BAGS} | {"e": 16}
    for batch in global_batches():
        for t, ids in batch.items():
            keys = np.unique(ids[rank * share : (rank + 1) * share])
            total += 2 * 4 * dims[t] * int((owner_of(keys, world) != rank).sum())
    return total


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    return one_process(tmp_path_factory.mktemp("one") / "store")


@pytest.mark.parametrize("world", [2, 3])
def test_fast_path_equals_one_process_and_sends_only_rows_and_gradients(reference, tmp_path, world):
    results = sharded(tmp_path / "store", world)
    for got in results:
        for t, rows in reference["rows"].items():
            np.testing.assert_allclose(got["rows"][t], rows, rtol=1e-5, atol=1e-6, err_msg=t)
        assert got["fetched"] == 0  # no mini-batch went key by key
    need = sum(minimum_bytes(rank, world) for rank in range(world))
    sent = sum(got["sent"] for got in results)
    assert need <= sent <= 1.3 * need, (sent, need)


def test_mini_batches_other_than_the_announced_fall_back_together(tmp_path):
    ran = global_batches()
    ran[5] = global_batches(seed=9)[5]  # the sixth mini-batch is not the one announced
    ref = one_process(tmp_path / "one", ran)
    results = sharded(tmp_path / "store", 2, ran)
    for got in results:
        for t, rows in ref["rows"].items():
            np.testing.assert_allclose(got["rows"][t], rows, rtol=1e-5, atol=1e-6, err_msg=t)
    assert all(r["fetched"] > 0 for r in results)  # the rest of that pass went key by key


@pytest.mark.parametrize("opt", ["adagrad", "adam"])
def test_a_second_table_other_than_announced_on_one_rank_falls_back_on_every_rank(tmp_path, opt):
    """Mini-batch 5 runs the announced ids of table "a" everywhere, and of table "b" (pooled with
    "a", so its rows were fetched with a's) on rank 0 only: both ranks go key by key from table "b"
    on, and step exactly what one process steps (with Adam, b's announced rows, which no forward
    took, are not stepped with zero gradients)."""
    bags = [("a", 8, opt), ("b", 8, opt), ("c", 24, "adam")]  # a and b pool together, e (dim 16) apart
    ran = global_batches()
    share = GLOBAL // 2
    ran[5]["b"] = np.concatenate([ran[5]["b"][:share], global_batches(seed=9)[5]["b"][share:]])
    assert not np.array_equal(ran[5]["b"][share:], global_batches()[5]["b"][share:])
    ref = one_process(tmp_path / "one", ran, bags)
    results = sharded(tmp_path / "store", 2, ran, bags)
    for got in results:
        for t, rows in ref["rows"].items():
            np.testing.assert_allclose(got["rows"][t], rows, rtol=1e-5, atol=1e-6, err_msg=t)
        assert got["fetched"] > 0  # the rest of that pass went key by key


def test_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    def rank_main(transport: ThreadTransport) -> tuple[np.ndarray, np.ndarray]:
        store = hierps.ShardedStore(tmp_path / "s", transport, device="cpu")
        try:
            bag = hierps.EmbeddingBag(None, 4, mode="sum", store=store, name="a")
            ids = torch.from_numpy(KEYS[transport.rank * 10 : transport.rank * 10 + 20])
            store.begin_pass([{"a": ids}])
            before = store.lookup("a", torch.from_numpy(KEYS[:40])).numpy()
            out = bag(ids, torch.arange(ids.numel()))
            scale = float("nan") if transport.rank == 1 else 1.0
            (out.sum() * scale).backward()
            with pytest.raises(hierps.NonFiniteGradientError, match="some rank"):
                store.step()
            store.end_pass()
            return before, store.lookup("a", torch.from_numpy(KEYS[:40])).numpy()
        finally:
            store.close()

    for before, after in run_ranks(2, rank_main):
        np.testing.assert_array_equal(after, before)


def test_end_pass_outside_a_pass_is_refused_on_every_rank(tmp_path):
    def rank_main(transport: ThreadTransport) -> int:
        store = hierps.ShardedStore(tmp_path / "s", transport, device="cpu")
        try:
            bag = hierps.EmbeddingBag(None, 4, mode="sum", store=store, name="a")
            ids = torch.from_numpy(KEYS[transport.rank * 10 : transport.rank * 10 + 20])
            with store.run_pass([{"a": ids}]):
                bag(ids, torch.arange(ids.numel())).sum().backward()
                store.step()
            with pytest.raises(hierps.ConfigError, match="end_pass: no pass is open"):
                store.end_pass()  # repeated: the pass counts once
            return store.local.passes
        finally:
            store.close()

    assert run_ranks(2, rank_main) == [1, 1]
