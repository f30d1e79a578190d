"""Tables under Adagrad and Adam train bit for bit as torch's Adagrad and SparseAdam do.

torch's sparse optimizers other than SGD ``coalesce`` the gradient first, which sums each row's
duplicates in the order of a non-stable ``torch.sort`` of the ids; hierps sums such a table's
gradients in that order on every path (the generic gather, announced mini-batches, tables pooled
or looked up together, announced bags). The oracle tests hold every optimizer to a tolerance; these
hold Adagrad and Adam to equality.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from oracle import make_optimizers, train, twin_models, zipf_batches
from torch import nn

import hierps
from hierps.training._batchplan import add_in_sum_order, add_parts_in_sum_order, sum_order

VOCAB, DIM = 400, 8


@pytest.mark.parametrize("n", [600, 40_000])  # torch's sort of small and of large (radix-sorted) inputs
def test_summing_in_sum_order_is_what_coalesce_sums(n):
    rng = np.random.default_rng(n)
    ids = torch.from_numpy((rng.zipf(1.2, size=n) - 1) % 97)
    values = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
    coalesced = torch.sparse_coo_tensor(ids[None], values, (97, 16)).coalesce()
    rows, local = torch.unique(ids, return_inverse=True)
    assert torch.equal(coalesced.indices()[0], rows)
    summed = add_in_sum_order(torch.zeros(len(rows), 16), local, values, coalesced=True)
    assert torch.equal(summed, coalesced.values())
    in_order = add_in_sum_order(torch.zeros(len(rows), 16), local, values, coalesced=False)
    assert torch.equal(in_order, torch.zeros(len(rows), 16).index_add_(0, local, values))
    # local ids order as the ids do: the same positions
    assert torch.equal(sum_order(local), sum_order(ids))
    if n < 32_768:  # a non-stable sort: here the two orders round differently
        assert not torch.equal(summed, in_order)


@pytest.mark.parametrize("uniform", [False, True], ids=["mixed-parts", "coalesced-parts-of-one-length"])
def test_parts_summed_at_once_are_each_summed_as_coalesce_sums(uniform):
    """Parts of one length are ordered by one row-wise sort: each as its own sort orders it."""
    rng = np.random.default_rng(2)
    sizes, rows_of = [256, 256, 300, 256, 1, 40_000], [50, 80, 50, 3, 5, 97]
    coalesced = [True, True, True, False, True, True]
    if uniform:
        sizes, rows_of, coalesced = [256] * 4, [50, 80, 3, 256], [True] * 4
    rows, values, expected = [], [], []
    for n, u, c in zip(sizes, rows_of, coalesced):
        local = torch.from_numpy((rng.zipf(1.2, size=n) - 1) % u)
        v = torch.from_numpy(rng.standard_normal((n, 4)).astype(np.float32))
        if c:
            sparse = torch.sparse_coo_tensor(local[None], v, (u, 4), check_invariants=False).coalesce()
            part = torch.zeros(u, 4).index_copy_(0, sparse.indices()[0], sparse.values())
        else:
            part = torch.zeros(u, 4).index_add_(0, local, v)
        rows.append(local)
        values.append(v)
        expected.append(part)
    summed = add_parts_in_sum_order(torch.zeros(sum(rows_of), 4), rows, values, coalesced, rows_of)
    assert torch.equal(summed, torch.cat(expected))


def _bit_equal(ref: nn.Module, twin: nn.Module, ref_losses: list[float], twin_losses: list[float]) -> None:
    assert twin_losses == ref_losses
    rows = twin.emb.lookup(torch.arange(VOCAB))
    weight = ref.emb.weight.detach()
    assert torch.equal(rows, weight), f"{int((rows != weight).any(1).sum())} rows differ"


@pytest.mark.parametrize(
    ("opt", "kind", "mode", "weights", "pad"),
    [
        ("adagrad", "bag", "sum", False, None),
        ("adagrad", "bag", "mean", False, None),
        ("adagrad", "bag", "sum", True, None),
        ("adagrad", "plain", None, False, None),
        ("adagrad", "plain", None, False, 0),
        ("adam", "bag", "sum", True, None),
        ("adam", "plain", None, False, 0),
    ],
    ids=["sum", "mean", "weighted", "embedding", "padded", "adam-weighted", "adam-padded"],
)
@pytest.mark.parametrize("pass_batches", [None, 4], ids=["on-demand", "passes"])
def test_a_table_trains_bit_equal_to_torchs_sparse_optimizer(
    make_store, opt, kind, mode, weights, pad, pass_batches
):
    store = make_store(memory_budget="2KiB")  # most rows on SSD between passes
    ref, twin = twin_models(kind, VOCAB, DIM, store, opt, mode=mode or "sum", padding_idx=pad)
    batches = zipf_batches(10, batch=32, bag=6, vocab=VOCAB, seed=3, bags=kind == "bag", weights=weights)
    sparse_ref, dense_ref, dense_twin = make_optimizers(ref, twin, opt)
    ref_losses = train(ref, sparse_ref, dense_ref, batches)
    twin_losses = train(twin, None, dense_twin, batches, store=store, pass_batches=pass_batches)
    _bit_equal(ref, twin, ref_losses, twin_losses)


class _Towers(nn.Module):
    """Tables called each with its own offsets (as dlrm calls its 26), or one id per example."""

    def __init__(self, sizes: list[int], bags: bool) -> None:
        super().__init__()
        cls = nn.EmbeddingBag if bags else nn.Embedding
        self.emb = nn.ModuleList([cls(n, DIM, sparse=True) for n in sizes])
        self.head = nn.Linear(DIM * len(sizes), 1)

    def forward(self, feats: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        outs = [e(i, o) if o is not None else e(i).flatten(1) for e, (i, o) in zip(self.emb, feats)]
        return self.head(torch.cat(outs, dim=1)).squeeze(-1)


def _features(rng: np.random.Generator, sizes: list[int], batch: int, bags: bool):
    feats = []
    for n in sizes:
        if not bags:
            feats.append((torch.from_numpy((rng.zipf(1.3, size=(batch, 1)) - 1) % n), None))
            continue
        lengths = rng.integers(0, 8, size=batch)  # ragged, some bags empty
        ids = torch.from_numpy((rng.zipf(1.3, size=int(lengths.sum())) - 1) % n)
        feats.append((ids, torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))))
    return feats


def _forward_backward(models, dense, feats, labels, losses: list[list[float]]) -> None:
    """Each model's forward and backward of one mini-batch, and its dense step; its loss kept."""
    for j, model in enumerate(models):
        loss = nn.BCEWithLogitsLoss()(model(feats), labels)
        loss.backward()
        losses[j].append(loss.item())
        dense[j].step()
        dense[j].zero_grad()


@pytest.mark.parametrize(
    "bags", [True, False], ids=["own-offsets-announced-as-bags", "embeddings-looked-up-together"]
)
def test_tables_trained_together_are_bit_equal_to_torchs_adagrad(make_store, bags):
    """Announced mini-batches whose tables are pooled by one embedding_bag over their joined bags
    (or looked up by one index_select), each summed by one more: torch's Adagrad, bit for bit."""
    sizes = [300, 120, 50]
    torch.manual_seed(0)
    ref = _Towers(sizes, bags)
    twin = copy.deepcopy(ref)
    store = make_store(memory_budget="4KiB")
    swap = hierps.EmbeddingBag if bags else hierps.Embedding
    twin.emb = nn.ModuleList(
        [
            swap.from_module(
                e, store=store, name=f"t{k}", optimizer={"type": "adagrad", "params": {"lr": 0.3}}
            )
            for k, e in enumerate(ref.emb)
        ]
    )
    sparse_ref = torch.optim.Adagrad(ref.emb.parameters(), lr=0.3)
    dense = [torch.optim.SGD(m.head.parameters(), lr=0.1) for m in (ref, twin)]
    rng = np.random.default_rng(5)
    batches = [
        (_features(rng, sizes, 64, bags), torch.from_numpy(rng.random(64).astype(np.float32)))
        for _ in range(8)
    ]
    losses: list[list[float]] = [[], []]
    for i, (feats, labels) in enumerate(batches):
        if i % 4 == 0:
            group = batches[i : i + 4]
            store.begin_pass(
                [
                    {f"t{k}": hierps.Bags(ids, o) if bags else ids for k, (ids, o) in enumerate(f)}
                    for f, _ in group
                ]
            )
        _forward_backward((ref, twin), dense, feats, labels, losses)
        sparse_ref.step()
        sparse_ref.zero_grad()
        store.step()
        if i % 4 == 3:
            store.end_pass()
    assert losses[1] == losses[0]
    for k, (e, n) in enumerate(zip(ref.emb, sizes)):
        assert torch.equal(twin.emb[k].lookup(torch.arange(n)), e.weight.detach()), f"table t{k}"


@pytest.mark.parametrize(
    ("device_budget", "run"),
    [("6KiB", None), ("1MiB", None), ("1MiB", 100)],
    ids=["room-made-mid-forward", "all-resident", "all-resident-summed-in-runs"],
)
def test_embeddings_on_demand_are_bit_equal_and_count_each_sighting(
    make_store, monkeypatch, device_budget, run
):
    """Plain nn.Embedding tables looked up on demand (the rows of the ids themselves, repeats
    included, summed per key by the step), with a device tier holding them all or too small for a
    mini-batch's three tables (it makes room in the middle of forwards), the tables' ids summed at
    once or in runs of one table each: torch's Adagrad bit for bit, and each key's counters count
    every sighting, those of a forward without backward too."""
    if run is not None:
        monkeypatch.setattr("hierps.training._trainer.NATIVE_UNIQUE_MAX", run)
    sizes = [300, 120, 50]
    torch.manual_seed(0)
    ref = _Towers(sizes, bags=False)
    twin = copy.deepcopy(ref)
    store = make_store(memory_budget="4KiB", device_budget=device_budget)
    twin.emb = nn.ModuleList(
        [
            hierps.Embedding.from_module(
                e, store=store, name=f"t{k}", optimizer={"type": "adagrad", "params": {"lr": 0.3}}
            )
            for k, e in enumerate(ref.emb)
        ]
    )
    sparse_ref = torch.optim.Adagrad(ref.emb.parameters(), lr=0.3)
    dense = [torch.optim.SGD(m.head.parameters(), lr=0.1) for m in (ref, twin)]
    rng = np.random.default_rng(7)
    seen: list[list[np.ndarray]] = [[] for _ in sizes]
    losses: list[list[float]] = [[], []]
    for _ in range(8):
        feats = _features(rng, sizes, 64, bags=False)
        labels = torch.from_numpy(rng.random(64).astype(np.float32))
        _forward_backward((ref, twin), dense, feats, labels, losses)
        twin.emb[0](feats[0][0][:5])  # a forward without backward: its ids are seen, nothing trains
        for k, (ids, _) in enumerate(feats):
            seen[k].append(ids.reshape(-1).numpy())
        seen[0].append(feats[0][0][:5].reshape(-1).numpy())
        sparse_ref.step()
        sparse_ref.zero_grad()
        store.step()
    made_room = store.stats.on_demand_rebuilds + store.stats.on_demand_evictions
    assert (made_room > 0) == (device_budget == "6KiB")
    assert losses[1] == losses[0]
    for k, (e, n) in enumerate(zip(ref.emb, sizes)):
        assert torch.equal(twin.emb[k].lookup(torch.arange(n)), e.weight.detach()), f"table t{k}"
        keys, counts = np.unique(np.concatenate(seen[k]), return_counts=True)
        got = store.counters(f"t{k}", keys)
        np.testing.assert_array_equal(got["count"], counts, err_msg=f"table t{k}")
        np.testing.assert_array_equal(got["decayed"], counts, err_msg=f"table t{k}")
