"""Every single-process feature on a sharded store: W ranks on slices of the global batches give
what one ``hierps.Store`` gives on the whole of them.

The ranks are threads (:mod:`thread_world`), so worlds of 2 and 3 run in a second. The oracle is
one ``hierps.Store`` trained on the global batches: admission (exact counts at the owner,
chance admission drawn per key), the show / click counters of ``observe``, eviction every few
passes, ``shrink``, export, ``hierps inspect`` and serving from the export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from thread_world import ThreadTransport, run_ranks

import hierps
import hierps.serving
from hierps.lifecycle._inspection import inspect_path

DIM, GLOBAL, BAG, STEPS, PASS = 4, 12, 3, 12, 4
ALL_KEYS = (np.arange(90, dtype=np.int64) - 30) * 1_000_003
TABLES = {
    # exact counts: a key earns its row at its second sighting
    "counted": {
        "optimizer": {"type": "adagrad", "params": {"lr": 0.2}},
        "admission": {"min_count": 2},
        "eviction": {"ttl_passes": 1, "every_passes": 2},
    },
    # chance admission, drawn from (seed, table, key, sightings)
    "chance": {
        "optimizer": {"type": "adam", "params": {"lr": 0.05}},
        "admission": {"admit_probability": 0.4, "unadmitted": "zeros"},
    },
    "plain": {"optimizer": {"type": "sgd", "params": {"lr": 0.3}}},
}


def global_batches() -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Each pass draws from its own window of keys, so that rows go unseen and get evicted."""
    rng = np.random.default_rng(0)
    out = []
    for step in range(STEPS):
        window = ALL_KEYS[(step // PASS) * 20 : (step // PASS) * 20 + 50]
        ids = {t: window[(rng.zipf(1.4, size=(GLOBAL, BAG)) - 1) % len(window)] for t in TABLES}
        labels = rng.integers(0, 2, GLOBAL).astype(np.float32)
        out.append(({t: torch.from_numpy(v) for t, v in ids.items()}, torch.from_numpy(labels)))
    return out


def train(store: Any, rank: int, world: int) -> dict[str, Any]:
    """Train on this rank's slice of every global batch; -> what the store holds afterwards."""
    bags = {
        name: hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name=name, **settings)
        for name, settings in TABLES.items()
    }
    coef = torch.linspace(-1.0, 1.0, DIM)
    share = GLOBAL // world
    batches = global_batches()
    mine = [
        ({t: ids[t][rank * share : (rank + 1) * share] for t in ids}, y[rank * share : (rank + 1) * share])
        for ids, y in batches
    ]
    passes = [mine[i : i + PASS] for i in range(0, STEPS, PASS)]
    for p, group in enumerate(passes):
        store.begin_pass([{t: ids[t] for t in ids} for ids, _ in group])
        if p + 1 < len(passes):
            store.prefetch([{t: ids[t] for t in ids} for ids, _ in passes[p + 1]])
        for ids, labels in group:
            offsets = torch.arange(0, share * BAG, BAG)
            outs = [bags[t](ids[t].reshape(-1), offsets) for t in TABLES]
            out = sum(outs)
            # The mean over this rank's examples: the store divides sparse gradients by the world size.
            loss = ((out * coef).sum(1) + 0.5 * out.pow(2).sum(1)).mean()
            loss.backward()
            store.step()
            for t in TABLES:
                bags[t].observe(ids[t].reshape(-1), offsets, labels)
        store.end_pass()
    shrunk = store.shrink("plain", ttl_passes=2)
    store.checkpoint("final")
    keys = torch.from_numpy(ALL_KEYS)
    return {
        "rows": {t: store.lookup(t, keys).numpy() for t in TABLES},
        "has": {t: store.has_rows(t, ALL_KEYS) for t in TABLES},
        "counters": {t: store.counters(t, ALL_KEYS) for t in TABLES},
        "pending": {t: store.num_pending(t) for t in TABLES},
        "shrunk": shrunk,
        "steps": {t: store.tables[t].step for t in TABLES},
    }


def single(path: Path) -> dict[str, Any]:
    with hierps.Store(path, device="cpu", memory_budget="2KiB") as store:
        out = train(store, 0, 1)
        store.export(path.parent / f"{path.name}-export")
        return out


def sharded(path: Path, world: int) -> list[dict[str, Any]]:
    def rank_main(transport: ThreadTransport) -> dict[str, Any]:
        store = hierps.ShardedStore(path, transport, device="cpu", memory_budget="2KiB")
        try:
            out = train(store, transport.rank, world)
            out["manifest"] = store.export(path.parent / f"{path.name}-export")
            return out
        finally:
            store.close()

    return run_ranks(world, rank_main)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("single")
    return root, single(root / "store")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_training_with_every_feature_equals_one_process(one_process, tmp_path, world):
    ref_root, ref = one_process
    results = sharded(tmp_path / "store", world)
    assert any(ref["pending"].values()) and any(not h.all() for h in ref["has"].values())  # admission bit
    assert sum(ref["shrunk"].values()) > 0  # rows evicted
    for got in results:  # every rank sees the same global answers
        for t in TABLES:
            # admission is exact: the same keys have rows, the same keys wait
            np.testing.assert_array_equal(got["has"][t], ref["has"][t], err_msg=t)
            assert got["pending"][t] == ref["pending"][t], t
            for name, values in ref["counters"][t].items():
                np.testing.assert_array_equal(got["counters"][t][name], values, err_msg=f"{t} {name}")
            np.testing.assert_allclose(got["rows"][t], ref["rows"][t], rtol=1e-5, atol=1e-6, err_msg=t)
            assert got["steps"][t] == ref["steps"][t]
        assert got["shrunk"] == ref["shrunk"]
    # The export of the shards serves what the one-process export serves.
    keys = ALL_KEYS
    with (
        hierps.serving.open(ref_root / "store-export") as one,
        hierps.serving.open(tmp_path / "store-export") as many,
    ):
        for t in TABLES:
            np.testing.assert_allclose(many.lookup(t, keys), one.lookup(t, keys), rtol=1e-5, atol=1e-6)
    assert results[0]["manifest"]["ranks"] == world
    assert all(r["manifest"]["checkpoint"] == results[0]["manifest"]["checkpoint"] for r in results)
    # hierps inspect on the shards reports the rows of the one process.
    one_report, many_report = inspect_path(ref_root / "store"), inspect_path(tmp_path / "store")
    assert len(many_report["stores"]) == world
    for t in TABLES:
        for field in ("rows_ssd", "pending_keys", "shows", "clicks"):
            total = sum(s["tables"][t][field] for s in many_report["stores"])
            assert total == one_report["stores"][0]["tables"][t][field], (t, field)


def test_observe_with_mismatched_clicks_raises_on_every_rank(tmp_path):
    def rank_main(transport: ThreadTransport) -> str:
        store = hierps.ShardedStore(tmp_path / "s", transport, device="cpu")
        try:
            store.table("t", DIM)
            with pytest.raises(hierps.ConfigError, match="clicks for 3 ids") as err:
                store.observe("t", torch.tensor([1, 2, 3]), torch.tensor([1.0, 0.0]))
            return str(err.value)
        finally:
            store.close()

    assert len(run_ranks(2, rank_main)) == 2
