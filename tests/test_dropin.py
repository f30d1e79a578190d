"""The drop-in path as a newcomer meets it: what the swap did, stale weights, evaluation, loaders."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from oracle import TinyModel, zipf_batches
from test_deepspeed import BAG, BATCH, DIM, LOSS, VOCAB, ds_config, engines, process_group, train_torch, twins
from torch import nn

import hierps
from hierps._store import store_parts
from hierps.errors import ConfigError, DeviceBudgetError, StaleWeightError
from hierps.integrations import deepspeed as hds
from hierps.integrations.loader import BatchIds, PassLoader, infer_batch_ids
from hierps.integrations.swap import DenseEmbeddingWarning

__all__ = ["engines", "process_group"]  # fixtures shared with test_deepspeed


class Fields(nn.Module):
    """Like the CTR libraries' models: ids are columns of one float tensor, read with ``x[:, j:j+1].long()``."""

    def __init__(self, sizes=(VOCAB, 300, 7), shared=False):
        super().__init__()
        self.embedding_dict = nn.ModuleDict({f"C{j}": nn.Embedding(n, DIM) for j, n in enumerate(sizes)})
        self.shared = shared
        self.head = nn.Linear(1 + len(sizes) * DIM, 1)

    def forward(self, x):
        tables = list(self.embedding_dict.values())
        emb = [t(x[:, 1 + j : 2 + j].long()).flatten(1) for j, t in enumerate(tables)]
        if self.shared:  # one module called twice in a batch: its ids have no single place
            emb[0] = emb[0] + tables[0](x[:, 2:3].long()).flatten(1)
        return self.head(torch.cat([x[:, :1], *emb], dim=1)).squeeze(1)


def field_data(n=BATCH * 12, sizes=(VOCAB, 300, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    cols = [torch.randn(n, 1, generator=g)]
    for size in sizes:
        zipf = torch.distributions.Pareto(1.0, 0.8).sample((n, 1)).long() - 1
        cols.append((zipf % size).float())
    return torch.cat(cols, dim=1), torch.randint(0, 2, (n,), generator=g).float()


def config(path, **section):
    cfg = ds_config(path, **section)
    cfg["hierarchical_ps"]["modules"] = section.get("modules", "auto")
    cfg["hierarchical_ps"]["optimizer"] = {"type": "sgd", "params": {"lr": 0.5}}
    cfg["hierarchical_ps"]["memory_budget"] = "1MiB"
    return cfg


# -- the swap, as it is reported ------------------------------------------------------------------
def test_auto_that_swaps_nothing_says_so_and_the_report_names_every_table(engines, tmp_path):
    model = Fields()
    with pytest.warns(
        DenseEmbeddingWarning, match=r'"auto" swapped none of the model\'s 3 .*largest has 400 rows'
    ):
        engine, *_ = engines(
            model=model, optimizer=torch.optim.Adam(model.parameters()), config=config(tmp_path)
        )
    report = engine.hierps_swap
    assert report.swapped == {} and set(report.dense) == {
        "embedding_dict.C0",
        "embedding_dict.C1",
        "embedding_dict.C2",
    }
    assert report.dense["embedding_dict.C0"] == "400 rows < auto_min_rows=10,000"
    assert report.line().startswith("hierarchical_ps: 0 of 3 embedding modules in the store: none; dense")


def test_auto_that_leaves_small_tables_dense_warns_and_reports_why(engines, tmp_path):
    model = Fields()
    with pytest.warns(DenseEmbeddingWarning, match=r"embedding_dict.C2 \(7 rows < auto_min_rows=100\)"):
        engine, *_ = engines(
            model=model,
            optimizer=torch.optim.Adam(model.parameters()),
            config=config(tmp_path, auto_min_rows=100),
        )
    assert engine.hierps_swap.swapped == {"embedding_dict.C0": VOCAB, "embedding_dict.C1": 300}
    assert engine.hierps_swap.line() == (
        "hierarchical_ps: 2 of 3 embedding modules in the store: embedding_dict.C0 (400 rows), "
        "embedding_dict.C1 (300 rows); dense, trained by DeepSpeed: embedding_dict.C2 (7 rows < auto_min_rows=100)"
    )


def test_a_list_of_modules_is_the_users_choice_no_warning(engines, tmp_path):
    model = Fields()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DenseEmbeddingWarning)
        engine, *_ = engines(
            model=model,
            optimizer=torch.optim.Adam(model.parameters()),
            config=config(tmp_path, modules=["embedding_dict.C1"]),
        )
    assert engine.hierps_swap.dense["embedding_dict.C0"] == "not listed in modules"


# -- references to the old weights ----------------------------------------------------------------
def test_old_weights_fail_loudly_and_the_rows_live_on_in_the_store(engines, tmp_path):
    model = Fields()
    old_module = model.embedding_dict["C0"]
    kept = list(model.embedding_dict.parameters())  # as a model keeps weights for L2 regularisation
    rows = old_module.weight.detach().clone()
    engine, *_ = engines(
        model=model, optimizer=torch.optim.Adam(model.parameters()), config=config(tmp_path, auto_min_rows=1)
    )
    assert kept[0].shape == (VOCAB, DIM) and kept[0].dtype == torch.float32  # metadata still reads
    with pytest.raises(StaleWeightError, match=r"'embedding_dict.C0'.*lookup\(ids\).*L2 regularisation"):
        sum((w**2).sum() for w in kept)
    with pytest.raises(StaleWeightError, match="embedding_dict.C0"):
        old_module(torch.tensor([1, 2]))
    assert "StaleWeight(table='embedding_dict.C0'" in repr(kept[0])
    torch.testing.assert_close(
        engine.module.embedding_dict["C0"].lookup(torch.arange(VOCAB)), rows, rtol=0, atol=0
    )
    x, y = field_data(BATCH)
    engine.backward(LOSS(engine(x), y))
    engine.step()  # training goes on through the store


def test_a_tied_weight_is_refused_before_anything_is_built(tmp_path):
    model = Fields()
    model.out = nn.Linear(DIM, VOCAB, bias=False)
    model.out.weight = model.embedding_dict["C0"].weight
    with pytest.raises(ConfigError, match=r"'embedding_dict.C0' is also 'out.weight' \(tied weights\)"):
        hds.initialize(
            model=model,
            optimizer=torch.optim.Adam(model.parameters()),
            config=config(tmp_path, auto_min_rows=1),
        )
    assert isinstance(model.embedding_dict["C0"], nn.Embedding) and not (tmp_path / "rank-00000").exists()


# -- evaluation batches larger than the device tier -----------------------------------------------
@pytest.mark.parametrize("kind", ["bag", "emb"])
@pytest.mark.parametrize("admission", [None, {"min_count": 1}])
def test_evaluation_reads_rows_in_pieces_and_gives_the_outputs_of_torch(make_store, kind, admission):
    row_bytes = (DIM * 2 + 5) * 4 + 25  # dim floats, adagrad state, counters, bookkeeping
    store = make_store(device_budget=60 * row_bytes, memory_budget="4KiB")
    torch.manual_seed(3)
    ref = TinyModel(
        nn.EmbeddingBag(VOCAB, DIM, mode="sum") if kind == "bag" else nn.Embedding(VOCAB, DIM), DIM
    )
    model = copy.deepcopy(ref)
    cls = hierps.EmbeddingBag if kind == "bag" else hierps.Embedding
    model.emb = cls.from_module(ref.emb, store=store, name="t", admission=admission)
    store.checkpoint()  # rows on SSD, the RAM tier mostly empty
    train = zipf_batches(3, batch=4, bag=BAG, vocab=VOCAB, bags=kind == "bag")
    for b in train:  # a few small training steps: some rows resident, some dirty
        model(b.ids, b.offsets).sum().backward()
        store.step()
    ids = torch.arange(VOCAB).reshape(80, 5)  # every row: far more than the 60 the device tier holds
    big = (ids.reshape(-1), torch.arange(0, VOCAB, 5)) if kind == "bag" else (ids, None)
    resident = store.num_rows("t")["device"]
    with torch.no_grad():
        out = model(*big)
    model.eval()
    out_eval = model(*big)
    model.train()
    ref.emb.weight.data.copy_(store.lookup("t", torch.arange(VOCAB)))
    with torch.no_grad():
        expected = ref(*big)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out_eval, expected, rtol=0, atol=0)
    assert store.num_rows("t")["device"] == resident  # evaluation left the working set as it was
    with pytest.raises(DeviceBudgetError, match="more than its budget"):
        model(*big)  # a training batch that cannot fit


# -- passes without a PassLoader ------------------------------------------------------------------
def test_batch_ids_are_found_in_float_columns_and_narrowed_over_batches():
    x = torch.tensor([[0.5, 3.0, 3.0], [0.1, 4.0, 5.0]])
    seen = {"a": [torch.tensor([3, 4])], "b": [torch.tensor([3, 5])]}
    found = infer_batch_ids([x, torch.zeros(2)], seen)
    assert found == {"a": [BatchIds((0,), (1, 2))], "b": [BatchIds((0,), (2, 3))]}
    same = {"a": [torch.tensor([3, 4])], "b": [torch.tensor([3, 4])]}
    twice = infer_batch_ids([x[:, [0, 1, 1]]], same)
    assert twice["a"] == [BatchIds((0,), (1, 2)), BatchIds((0,), (2, 3))]  # ambiguous on this batch
    later = torch.tensor([[0.0, 1.0, 2.0], [0.0, 6.0, 6.0]])
    assert infer_batch_ids([later], {"a": [torch.tensor([1, 6])], "b": [torch.tensor([2, 6])]}, twice) == {
        "a": [BatchIds((0,), (1, 2))],
        "b": [BatchIds((0,), (2, 3))],
    }
    assert infer_batch_ids([x], {"a": [torch.tensor([3, 4]), torch.tensor([3, 5])]}) is None  # called twice
    assert BatchIds((0,), (1, 2)).to_json() == {"path": [0], "columns": [1, 2]}


def train_fields(engine, batches):
    losses = []
    for x, y in batches:
        loss = LOSS(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def torch_fields(model, batches):
    opt = torch.optim.SGD(model.embedding_dict.parameters(), lr=0.5)
    dense = torch.optim.Adam(model.head.parameters(), lr=0.01)
    losses = []
    for x, y in batches:
        loss = LOSS(model(x), y)
        loss.backward()
        losses.append(loss.item())
        for o in (opt, dense):
            o.step()
            o.zero_grad()
    return losses


@pytest.mark.parametrize(
    "batch_ids", [None, {f"embedding_dict.C{j}": {"path": [0], "columns": [1 + j, 2 + j]} for j in range(3)}]
)
def test_the_loader_of_training_data_trains_in_passes_like_torch(engines, tmp_path, batch_ids):
    torch.manual_seed(5)
    ref = Fields()
    model = copy.deepcopy(ref)
    data = torch.utils.data.TensorDataset(*field_data())
    section = {"auto_min_rows": 1, "pass_batches": 4} | ({"batch_ids": batch_ids} if batch_ids else {})
    engine, _, loader, _ = engines(
        model=model,
        optimizer=torch.optim.Adam(model.head.parameters(), lr=0.01),
        config=config(tmp_path, **section),
        training_data=data,
    )
    assert isinstance(loader, PassLoader)
    # DeepSpeed's loader shuffles (seeded, the same order each epoch): torch trains on its order.
    expected = torch_fields(ref, list(loader.loader))
    store = engine.hierps_store
    losses = train_fields(engine, loader)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert store.passes == 3  # 12 batches in passes of 4 (found: the first batch on demand, then 4 + 4 + 3)
    for j, table in enumerate(ref.embedding_dict.values()):
        rows = engine.module.embedding_dict[f"C{j}"].lookup(torch.arange(table.num_embeddings))
        torch.testing.assert_close(rows, table.weight.detach(), rtol=1e-5, atol=1e-6)


def test_a_loader_that_cannot_find_the_ids_says_so_and_trains_on_demand(engines, tmp_path):
    model = Fields(shared=True)
    data = torch.utils.data.TensorDataset(*field_data(BATCH * 4))
    engine, _, loader, _ = engines(
        model=model,
        optimizer=torch.optim.Adam(model.head.parameters(), lr=0.01),
        config=config(tmp_path, auto_min_rows=1),
        training_data=data,
    )
    with pytest.warns(UserWarning, match=r"could not find where the ids of \['embedding_dict.C0'"):
        assert len(train_fields(engine, loader)) == 4
    assert engine.hierps_store.passes == 0


def test_on_demand_the_device_tier_keeps_its_hot_rows_and_trains_like_torch(engines, tmp_path):
    row_bytes = (DIM + 5) * 4 + 25  # sgd: weights and counters, and the device tier's bookkeeping
    ref, model = twins()
    batches = zipf_batches(30, batch=BATCH, bag=BAG, vocab=VOCAB, seed=7)
    expected = train_torch(ref, "sgd", batches, gas=1)
    budget_rows = 2 * BATCH * BAG  # 160 of the 400 rows
    engine, *_ = engines(
        model=model,
        optimizer=torch.optim.Adam(model.head.parameters(), lr=0.01),
        config=ds_config(tmp_path, opt="sgd", device_budget=budget_rows * row_bytes),
    )
    store = engine.hierps_store
    losses, previous, checked = [], torch.empty(0, dtype=torch.int64), 0
    for b in batches:
        evictions = store.stats.on_demand_evictions
        loss = LOSS(engine(b.ids, b.offsets).float(), b.labels)
        current = b.ids.unique()
        if store.stats.on_demand_evictions > evictions and len(previous) + len(current) <= budget_rows // 2:
            found, _ = store_parts(store).core.device_tier.resolve("emb", previous)
            assert bool(found.all())  # the overflow kept the rows of the last step
            checked += 1
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        previous = current
    # The tier worked as a cache: it let rows go in place, never rebuilding itself.
    assert store.stats.on_demand_rebuilds == 0
    assert (
        checked >= 2
        and store_parts(store).core.device_tier.bytes_used <= store_parts(store).core.device_tier.budget
    )
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    rows = engine.module.emb.lookup(torch.arange(VOCAB))
    torch.testing.assert_close(rows, ref.emb.weight.detach(), rtol=1e-5, atol=1e-6)


def test_recent_rows_are_those_of_the_latest_steps(tmp_path):
    from hierps.tiers import DeviceTier

    tier = DeviceTier(10_000, torch.device("cpu"))
    for t in ("a", "b"):
        tier.add_table(t, 4)
    tier.insert("a", np.array([1, 5, 9]), np.zeros((3, 4), np.float32))
    tier.tick()
    tier.insert("b", np.array([2, 3]), np.zeros((2, 4), np.float32))
    tier.tick()
    _, slots = tier.resolve("a", torch.tensor([9]))
    tier.touch("a", slots)
    row = tier.row_bytes("a")
    assert {t: k.tolist() for t, k in tier.recent(row).items()} == {"a": [9], "b": []}
    assert {t: k.tolist() for t, k in tier.recent(3 * row).items()} == {"a": [9], "b": [2, 3]}
    assert {t: k.tolist() for t, k in tier.recent(10 * row).items()} == {"a": [1, 5, 9], "b": [2, 3]}


def test_a_pass_too_large_for_the_device_tier_makes_the_next_ones_smaller(make_store):
    row_bytes = (DIM * 2 + 5) * 4 + 25  # adagrad: weights, state, counters, bookkeeping
    store = make_store(device_budget=50 * row_bytes)
    store.table("t", DIM)
    batches = [{"ids": torch.arange(20 * i, 20 * i + 20)} for i in range(12)]  # 20 new rows each
    sizes = []
    begin = store.begin_pass
    store.begin_pass = lambda b: (sizes.append(len(b)), begin(b))[1]
    seen = [int(b["ids"][0]) for b in PassLoader(batches, {"t": "ids"}, store, pass_batches=4)]
    assert seen == list(range(0, 240, 20))
    # 4 batches are 80 rows, more than the 50 the tier holds: split in groups; then passes of 2 (40 rows).
    assert sizes == [4, 2, 2, 2, 2]
