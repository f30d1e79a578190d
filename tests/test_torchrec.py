"""hierps.integrations.torchrec: TorchRec's collections and models with their tables in the store.

The reference for training is TorchRec's own training path: ``DistributedModelParallel`` with a
table-wise plan on the ``fused`` compute kernel, i.e. FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``
on the CPU with the optimizer that ``apply_optimizer_in_backward`` gives the tables fused into its
backward (EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD): the sparse update TorchRec models train
with. (DMP's default plan for one CPU rank is data-parallel tables on the dense kernel, trained by a
dense optimizer: not the sparse path, hence the constraints.) The tolerance is TorchRec's for float32
in its own sharded-vs-unsharded tests (``torchrec/distributed/test_utils/test_model.py``,
``_get_default_rtol_and_atol``: rtol 1e-4, atol 1e-5). Measured here over 12 steps: SGD bit-identical
(losses, rows, dense layers); Adagrad and row-wise Adagrad with the same losses and rows within 1.4e-7
(two kernels summing the same floats in another order), while the rows move by 8e-3 (SGD) to 0.55
(Adagrad) from their initial values: a wrong step fails by orders of magnitude.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

torchrec = pytest.importorskip("torchrec", reason="torchrec is not installed (make setup installs it)")
pytest.importorskip("deepspeed", reason="the shared single-rank process group comes from DeepSpeed")

from test_deepspeed import engines, launcher_group  # noqa: E402
from torchrec import (  # noqa: E402
    EmbeddingBagConfig,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)
from torchrec.distributed import DistributedModelParallel  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import DataType  # noqa: E402
from torchrec.optim import RowWiseAdagrad  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402

import hierps  # noqa: E402
from hierps.bench.dlrm_ref import shard_fused  # noqa: E402
from hierps.errors import ConfigError, NotSupportedError, StaleWeightError  # noqa: E402
from hierps.integrations import deepspeed as hds  # noqa: E402
from hierps.integrations import torchrec as htr  # noqa: E402

__all__ = ["engines"]  # a fixture shared with test_deepspeed

RTOL, ATOL = 1e-4, 1e-5  # TorchRec's float32 tolerance (see the module docstring)
TABLES, ROWS, DIM, BATCH, STEPS = 3, 40, 8, 16, 12
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchrec_dlrm" / "train.py"


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """One gloo rank for DistributedModelParallel (and DeepSpeed): the suite's shared group."""
    yield from launcher_group()


def close(a, b):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def kjt(keys, batch, rows, g, *, max_len=4, weighted=False, dtype=torch.int64):
    """A random KJT: ``batch`` bags per key of 0..max_len ids in [0, rows) (empty bags and repeats)."""
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g).to(dtype)
    weights = torch.rand(values.shape, generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)


def dlrm() -> DLRM:
    torch.manual_seed(0)  # the same initial values for every build
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(TABLES)
    ]
    return DLRM(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=tables),
        dense_in_features=4,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
    )


def dlrm_batches(steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    keys = [f"f{i}" for i in range(TABLES)]
    return [
        (
            torch.randn(BATCH, 4, generator=g),
            kjt(keys, BATCH, ROWS, g),
            torch.randint(0, 2, (BATCH,), generator=g).float(),
        )
        for _ in range(steps)
    ]


def bce(model, batch):
    dense, sparse, labels = batch
    return F.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(1), labels)


# (TorchRec optimizer class fused into the backward, its arguments; the hierps optimizer of the same rule)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 1.0}, {"type": "sgd", "params": {"lr": 1.0}}),
    "adagrad": (
        torch.optim.Adagrad,
        {"lr": 0.1, "eps": 1e-8},
        {"type": "adagrad", "params": {"lr": 0.1, "eps": 1e-8}},
    ),
    "rowwise_adagrad": (
        RowWiseAdagrad,
        {"lr": 0.1, "eps": 1e-8},
        {"type": "rowwise_adagrad", "params": {"lr": 0.1, "eps": 1e-8}},
    ),
}
FUSED = {"sgd": "exact_sgd", "adagrad": "exact_adagrad", "rowwise_adagrad": "exact_row_wise_adagrad"}
DENSE_LR = 0.1
TABLE = (
    "sparse_arch.embedding_bag_collection.embedding_bags.t{}"  # a table's module, and its name in the store
)
WEIGHT = TABLE + ".weight"


def train_torchrec_fused(opt, batches):
    """TorchRec's path: DMP, table-wise, fused kernel, the optimizer applied in the backward."""
    model = dlrm()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cls, params, _ = OPTIMIZERS[opt]
    dmp = shard_fused(model, model.sparse_arch.embedding_bag_collection, cls, params)
    # the tables are one FBGEMM TBE on the CPU, its optimizer fused: the path claimed above
    tbe = dmp.module.sparse_arch.embedding_bag_collection._lookups[0]._emb_modules[0]._emb_module
    assert type(tbe).__name__ == "SplitTableBatchedEmbeddingBagsCodegen" and str(tbe.optimizer) == FUSED[opt]
    state = dmp.state_dict()
    with (
        torch.no_grad()
    ):  # sharding allocates the tables afresh: the unsharded model's rows, as hierps gets them
        for i in range(TABLES):
            state[WEIGHT.format(i)].local_shards()[0].tensor.copy_(init[WEIGHT.format(i)])
    dense = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=DENSE_LR)
    losses = []
    for b in batches:
        loss = bce(dmp, b)
        loss.backward()
        dense.step()
        dense.zero_grad()
        losses.append(loss.item())
    state = dmp.state_dict()
    rows = [state[WEIGHT.format(i)].local_shards()[0].tensor.detach().clone() for i in range(TABLES)]
    dense_state = {k: v for k, v in state.items() if "embedding_bags" not in k}
    return losses, rows, dense_state, init


def train_hierps(model, store, batches):
    dense = torch.optim.SGD(model.parameters(), lr=DENSE_LR)
    losses = []
    for b in batches:
        loss = bce(model, b)
        loss.backward()
        dense.step()
        dense.zero_grad()
        store.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_dlrm_trains_like_torchrec_fused_tables(opt, make_store):
    batches = dlrm_batches()
    ref_losses, ref_rows, ref_dense, init = train_torchrec_fused(opt, batches)

    model = dlrm()
    store = make_store(optimizer=OPTIMIZERS[opt][2])
    twins = htr.swap_torchrec(model, store)
    assert list(twins) == ["sparse_arch.embedding_bag_collection"]
    assert sorted(store.tables) == [TABLE.format(i) for i in range(TABLES)]
    losses = train_hierps(model, store, batches)

    close(torch.tensor(losses), torch.tensor(ref_losses))
    bags = model.sparse_arch.embedding_bag_collection.embedding_bags
    for i in range(TABLES):
        rows = bags[f"t{i}"].lookup(torch.arange(ROWS))
        close(rows, ref_rows[i])
        assert (ref_rows[i] - init[WEIGHT.format(i)]).abs().max() > 100 * ATOL  # the rows did train
    state = model.state_dict()
    for name, value in ref_dense.items():
        close(state[name], value)


def test_dlrm_in_passes_trains_as_on_demand(make_store):
    """Passes announced with batch_ids (rows loaded ahead, the announced fast path) give the floats
    of rows fetched on demand, bit for bit."""
    batches = dlrm_batches()
    on_demand = dlrm()
    store = make_store("on_demand", optimizer=OPTIMIZERS["adagrad"][2])
    htr.swap_torchrec(on_demand, store)
    expected = train_hierps(on_demand, store, batches)

    model = dlrm()
    passed = make_store("passes", optimizer=OPTIMIZERS["adagrad"][2], device_budget="1MiB")
    ebc = htr.swap_torchrec(model, passed)["sparse_arch.embedding_bag_collection"]
    assert sorted(ebc.batch_ids(batches[0][1])) == sorted(passed.tables)
    losses = []
    for start in range(0, STEPS, 4):
        group = batches[start : start + 4]
        with passed.run_pass([ebc.batch_ids(sparse) for _, sparse, _ in group]):
            losses += train_hierps(model, passed, group)
    assert passed.passes == STEPS // 4
    assert losses == expected
    for i in range(TABLES):
        assert torch.equal(
            passed.lookup(TABLE.format(i), torch.arange(ROWS)),
            store.lookup(TABLE.format(i), torch.arange(ROWS)),
        )


def ebc_pair(make_store, tables, *, weighted=False):
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    store = make_store(optimizer={"type": "sgd", "params": {"lr": 0.5}})
    return ref, htr.EmbeddingBagCollection.from_collection(ref, store=store, prefix="ebc."), store


def step_both(ref, mine, store, out_ref, out_mine):
    """One SGD step (lr 0.5) of the same loss on TorchRec's module (torch SGD) and on the store."""
    probe = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7))
    (out_ref * probe).sum().backward()
    (out_mine * probe).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    store.step()


@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_outputs_and_steps_like_torchrec(make_store, weighted):
    pooling = [PoolingType.SUM, PoolingType.SUM if weighted else PoolingType.MEAN, PoolingType.SUM]
    tables = [
        EmbeddingBagConfig(
            name="a", embedding_dim=3, num_embeddings=20, feature_names=["f1", "f3"], pooling=pooling[0]
        ),
        EmbeddingBagConfig(
            name="b", embedding_dim=4, num_embeddings=30, feature_names=["f2"], pooling=pooling[1]
        ),
        # f1 read by two tables: TorchRec names their outputs f1@a and f1@c
        EmbeddingBagConfig(
            name="c", embedding_dim=2, num_embeddings=20, feature_names=["f1"], pooling=pooling[2]
        ),
    ]
    ref, mine, store = ebc_pair(make_store, tables, weighted=weighted)
    g = torch.Generator().manual_seed(3)
    features = kjt(
        ["f3", "f1", "f2"], 5, 20, g, weighted=weighted, dtype=torch.int32
    )  # keys in another order
    expected, got = ref(features), mine(features)
    assert isinstance(got, KeyedTensor)
    assert got.keys() == expected.keys() == ["f1@a", "f3", "f2", "f1@c"]
    assert got.length_per_key() == expected.length_per_key() and got.key_dim() == expected.key_dim()
    torch.testing.assert_close(got.values(), expected.values(), rtol=0, atol=1e-6)
    step_both(ref, mine, store, expected.values(), got.values())
    for name, bag in mine.embedding_bags.items():
        n = ref.embedding_bags[name].num_embeddings
        close(bag.lookup(torch.arange(n)), ref.embedding_bags[name].weight.detach())
    assert list(mine.state_dict()) == list(ref.state_dict())  # TorchRec's keys
    close(mine.state_dict()["embedding_bags.b.weight"], ref.state_dict()["embedding_bags.b.weight"])


def test_ebc_expands_inverse_indices_like_torchrec(make_store):
    """A deduplicated KJT (variable batch per feature, inverse indices to the batch of 4)."""
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=3, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(name="b", embedding_dim=2, num_embeddings=10, feature_names=["f2"]),
    ]
    ref, mine, _ = ebc_pair(make_store, tables)
    features = KeyedJaggedTensor(
        keys=["f1", "f2"],
        values=torch.tensor([1, 2, 3, 4, 5, 6, 7]),
        lengths=torch.tensor([2, 1, 1, 2, 1]),
        stride_per_key_per_rank=[[2], [3]],
        inverse_indices=(["f1", "f2"], torch.tensor([[0, 1, 1, 0], [2, 1, 0, 2]])),
    )
    expected, got = ref(features), mine(features)
    assert got.values().shape == (4, 5)
    torch.testing.assert_close(got.values(), expected.values(), rtol=0, atol=1e-6)


def test_ec_outputs_and_steps_like_torchrec(make_store):
    tables = [
        EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=20, feature_names=["f1", "f2"]),
        EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=10, feature_names=["f3"]),
    ]
    torch.manual_seed(0)
    ref = torchrec.EmbeddingCollection(tables=tables, need_indices=True)
    store = make_store(optimizer={"type": "sgd", "params": {"lr": 0.5}})
    mine = htr.EmbeddingCollection.from_collection(ref, store=store)
    features = kjt(["f1", "f2", "f3"], 4, 10, torch.Generator().manual_seed(4))
    expected, got = ref(features), mine(features)
    assert list(got) == list(expected) == ["f1", "f2", "f3"]
    for name, jt in got.items():
        assert isinstance(jt, JaggedTensor)
        torch.testing.assert_close(jt.values(), expected[name].values(), rtol=0, atol=0)
        assert torch.equal(jt.lengths(), expected[name].lengths()) and torch.equal(
            jt.weights(), expected[name].weights()
        )
    out_ref = torch.cat([expected[n].values() for n in expected])
    step_both(ref, mine, store, out_ref, torch.cat([got[n].values() for n in got]))
    for name, emb in mine.embeddings.items():
        close(emb.lookup(torch.arange(emb.num_embeddings)), ref.embeddings[name].weight.detach())
    assert (
        mine.embedding_dim() == 4
        and mine.need_indices()
        and mine.embedding_names_by_table() == [["f1", "f2"], ["f3"]]
    )


def test_built_directly_rows_follow_the_configs_init_and_raw_ids_beyond_num_embeddings(make_store):
    store = make_store()
    tables = [
        EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=100, feature_names=["u"]),
        EmbeddingBagConfig(
            name="v",
            embedding_dim=4,
            num_embeddings=100,
            feature_names=["v"],
            weight_init_min=2.0,
            weight_init_max=3.0,
        ),
        EmbeddingBagConfig(
            name="h", embedding_dim=4, num_embeddings=10, feature_names=["h"], data_type=DataType.FP16
        ),
    ]
    ebc = htr.EmbeddingBagCollection(tables, store=store, prefix="m.")
    assert sorted(store.tables) == ["m.embedding_bags.h", "m.embedding_bags.u", "m.embedding_bags.v"]
    u = ebc.embedding_bags["u"].lookup(torch.arange(100))
    assert u.abs().max() <= 0.1 and u.std() > 0.03  # uniform within +-sqrt(1/100)
    v = ebc.embedding_bags["v"].lookup(torch.arange(100))
    assert v.min() >= 2.0 and v.max() <= 3.0
    assert store.info("m.embedding_bags.h").weights_dtype == "fp16"  # the config's data type
    # ids are raw keys: 10**12 has a row of its own where TorchRec's table would index out of range
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "v", "h"], values=torch.tensor([10**12, 3, 4]), lengths=torch.tensor([1, 1, 1])
    )
    out = ebc(features).values()
    assert out.shape == (1, 12) and torch.isfinite(out).all()


def test_unsupported_configs_say_what_and_why(make_store):
    store = make_store()

    def bag(**kw):
        return EmbeddingBagConfig(
            **{"name": "t", "embedding_dim": 4, "num_embeddings": 10, "feature_names": ["f"], **kw}
        )

    with pytest.raises(NotSupportedError, match="INT8, a quantised inference format"):
        htr.EmbeddingBagCollection([bag(data_type=DataType.INT8)], store=store)
    with pytest.raises(NotSupportedError, match="pooling NONE"):
        htr.EmbeddingBagCollection([bag(pooling=PoolingType.NONE)], store=store)
    with pytest.raises(ConfigError, match="is_weighted=True needs SUM pooling"):
        htr.EmbeddingBagCollection([bag(pooling=PoolingType.MEAN)], is_weighted=True, store=store)
    with pytest.raises(ConfigError, match="custom init_fn"):
        htr.EmbeddingBagCollection([bag(init_fn=torch.nn.init.normal_)], store=store)
    htr.EmbeddingBagCollection(
        [bag(init_fn=torch.nn.init.normal_)], store=store, initializer="normal"
    )  # told how
    with pytest.raises(ConfigError, match="appears twice"):
        htr.EmbeddingBagCollection([bag(), bag()], store=store)
    with pytest.raises(ConfigError, match="one embedding_dim"):
        htr.EmbeddingCollection(
            [
                EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=5),
                EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=5),
            ],
            store=store,
        )
    with pytest.raises(ConfigError, match="from_collection"):
        htr.swap_torchrec(torchrec.EmbeddingBagCollection(tables=[bag(name="x")]), store)


def test_sharded_models_are_refused(make_store):
    model = dlrm()
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    with pytest.raises(NotSupportedError, match="before DistributedModelParallel"):
        htr.swap_torchrec(dmp, make_store())


def test_swap_frees_the_old_weights_and_warm_starts_from_a_torchrec_checkpoint(make_store):
    model, plain = dlrm(), dlrm()
    old_ebc = model.sparse_arch.embedding_bag_collection
    with torch.no_grad():
        plain.sparse_arch.embedding_bag_collection.embedding_bags["t1"].weight.add_(1.0)
    htr.swap_torchrec(model, make_store())
    with pytest.raises(StaleWeightError, match="t1"):
        old_ebc.embedding_bags["t1"].weight.sum()
    assert not [n for n, _ in model.named_parameters() if "embedding_bags" in n]
    model.load_state_dict(plain.state_dict())  # a plain TorchRec checkpoint, the same keys
    close(
        model.sparse_arch.embedding_bag_collection.embedding_bags["t1"].lookup(torch.arange(ROWS)),
        plain.sparse_arch.embedding_bag_collection.embedding_bags["t1"].weight.detach(),
    )


def test_adapt_collections_keeps_the_very_parameters_and_the_outputs():
    """What initialize does first: the collections hold the same weight Parameters (the client
    optimizer's), as torch modules it can swap, and compute what TorchRec's did; undo restores them."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.ebc = torchrec.EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="a", embedding_dim=3, num_embeddings=20, feature_names=["f1", "f2"])]
    )
    model.ec = torchrec.EmbeddingCollection(
        tables=[EmbeddingConfig(name="b", embedding_dim=3, num_embeddings=20, feature_names=["f3"])]
    )
    model.again = model.ebc  # a collection held twice stays one
    before = {n: p for n, p in model.named_parameters()}
    old_ebc, old_ec = model.ebc, model.ec
    features = kjt(["f1", "f2", "f3"], 3, 20, torch.Generator().manual_seed(5))
    expected_kt, expected_jts = model.ebc(features), model.ec(features)
    undo: list = []
    twins = htr.adapt_collections(model, undo=undo)
    assert list(twins) == ["ebc", "ec"] and model.again is model.ebc
    assert isinstance(model.ebc, htr.EmbeddingBagCollection) and isinstance(model.ec, htr.EmbeddingCollection)
    assert {n: p for n, p in model.named_parameters()} == before  # same names, same objects
    assert type(model.ebc.embedding_bags["a"]) is torch.nn.EmbeddingBag
    torch.testing.assert_close(model.ebc(features).values(), expected_kt.values(), rtol=0, atol=1e-6)
    assert torch.equal(model.ec(features)["f3"].values(), expected_jts["f3"].values())
    for parent, attr, original in reversed(undo):
        setattr(parent, attr, original)
    assert model.ebc is old_ebc and model.again is old_ebc and model.ec is old_ec


def test_deepspeed_initialize_swaps_the_tables_of_a_torchrec_model(engines, tmp_path, make_store):
    """Under hierps.deepspeed.initialize a TorchRec model needs nothing: "modules" names its collection's
    tables by TorchRec's qualified names (the table left out stays dense, trained by DeepSpeed), a
    PassLoader announces passes with batch_ids, and it trains as the same swap made by hand."""
    batches = dlrm_batches(steps=6)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "hierarchical_ps": {
            "path": str(tmp_path / "ds"),
            "modules": [TABLE.format(0), TABLE.format(2)],
            "optimizer": OPTIMIZERS["adagrad"][2],
        },
    }
    model = dlrm()
    engine, *_ = engines(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=DENSE_LR), config=config
    )
    assert sorted(engine.hierps_swap.swapped) == [TABLE.format(0), TABLE.format(2)]
    assert list(engine.hierps_swap.dense) == [TABLE.format(1)]
    assert isinstance(engine.module.sparse_arch.embedding_bag_collection, htr.EmbeddingBagCollection)
    ebc = engine.module.sparse_arch.embedding_bag_collection
    assert sorted(ebc.batch_ids(batches[0][1])) == [TABLE.format(0), TABLE.format(2)]
    losses = []
    for b in hds.PassLoader(batches, lambda b: ebc.batch_ids(b[1]), engine, pass_batches=3):
        loss = bce(engine, b)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.hierps_store.passes == 2

    # The same model trained by hand: t0 and t2 in a store, t1 dense beside the dense layers.
    ref = dlrm()
    store = make_store(optimizer=OPTIMIZERS["adagrad"][2])
    htr.adapt_collections(ref)
    bags = ref.sparse_arch.embedding_bag_collection.embedding_bags
    for t in ("t0", "t2"):
        bags[t] = hierps.EmbeddingBag.from_module(bags[t], store=store, name=TABLE.format(t[1]))
    expected = train_hierps(ref, store, batches)
    close(torch.tensor(losses), torch.tensor(expected))
    got = engine.module.sparse_arch.embedding_bag_collection.embedding_bags
    for t in ("t0", "t2"):
        close(got[t].lookup(torch.arange(ROWS)), bags[t].lookup(torch.arange(ROWS)))
    close(got["t1"].weight.detach(), bags["t1"].weight.detach())


def test_example_trains(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("torchrec_dlrm_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.main(
        ["--path", str(tmp_path / "store"), "--steps", "40", "--batch-size", "64", "--rows", "2000"]
    )
    assert len(losses) == 40 and all(0.0 < x < 2.0 for x in losses)
    assert sum(losses[-10:]) < sum(losses[:10])  # the rows learn the hidden weights
    assert (tmp_path / "store").is_dir() and "checkpoint in" in capsys.readouterr().out


def test_hierps_imports_without_torchrec_and_the_adapter_says_how_to_install_it():
    code = (
        "import sys; sys.modules['torchrec'] = None\n"  # torchrec not importable
        "import hierps, hierps.integrations.config, hierps.integrations.swap\n"
        "try:\n    import hierps.integrations.torchrec\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "needs torchrec" in out and "pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0" in out
