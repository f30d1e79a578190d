"""Models built on the meta device: tables past RAM go into the store unallocated, the dense layers
get torch's initial values; and a materialised table is copied in with every row as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle import TORCH_OPTIMIZERS
from test_deepspeed import LOSS, TOL, ds_config, process_group  # noqa: F401 (an autouse fixture)
from torch import nn

import hierps
from hierps.errors import ConfigError
from hierps.integrations import deepspeed as hds
from hierps.integrations.swap import materialize
from hierps.rows._initializers import initial_rows

PAST_RAM = 2 * 10**9  # rows: x 16 float32 = 128 GB, more than this machine has
DIM, BATCH, BAG, KEYS = 16, 16, 4, 64


def initializer_rows(store: hierps.Store, table: str, keys: np.ndarray) -> torch.Tensor:
    """keys (n,) int64 -> (n, dim) float32: the rows the table's initializer gives them."""
    info = store.tables[table]
    return torch.from_numpy(initial_rows(keys, info.dim, info.salt, info.initializer))


def peak_rss_reset() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS; returns that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(s for s in f if s.startswith(field + ":"))
    return int(line.split()[1]) * 1024


@pytest.mark.parametrize("cls", [nn.Embedding, nn.EmbeddingBag])
def test_from_module_of_a_meta_table_allocates_nothing_and_reads_the_initializer(make_store, cls):
    with torch.device("meta"):
        module = cls(PAST_RAM, DIM, padding_idx=7)
    store = make_store()
    start = peak_rss_reset()
    twin = (hierps.Embedding if cls is nn.Embedding else hierps.EmbeddingBag).from_module(
        module, store=store, name="t"
    )
    keys = np.array([0, 1, 6, 8, 123_456_789, PAST_RAM - 1], np.int64)
    assert torch.equal(twin.lookup(torch.from_numpy(keys)), initializer_rows(store, "t", keys))
    assert torch.equal(twin.lookup(torch.tensor([7])), torch.zeros(1, DIM))  # torch's padding row
    assert store.num_rows("t") == {"device": 0, "memory": 1, "ssd": 0}  # the padding row alone
    assert _status_bytes("VmHWM") - start < 2**28


def test_a_meta_table_takes_the_initializer_it_is_given(make_store):
    with torch.device("meta"):
        module = nn.EmbeddingBag(PAST_RAM, DIM)
    store = make_store()
    init = {"type": "uniform", "params": {"low": -0.01, "high": 0.01}}
    twin = hierps.EmbeddingBag.from_module(module, store=store, name="t", initializer=init)
    keys = np.arange(PAST_RAM - 100, PAST_RAM, dtype=np.int64)
    rows = twin.lookup(torch.from_numpy(keys))
    assert torch.equal(rows, initializer_rows(store, "t", keys))
    assert float(rows.abs().max()) <= 0.01


def test_overwriting_a_table_with_a_meta_module_is_refused(make_store):
    with torch.device("meta"):
        module = nn.Embedding(10, DIM)
    store = make_store()
    with pytest.raises(ConfigError) as err:
        hierps.Embedding.from_module(module, store=store, name="t", overwrite=True)
    assert str(err.value) == (
        "table 't': overwrite=True, but the weight given is on the meta device (shape (10, 16)) and "
        "holds no rows to write. Build the module on a real device to copy its rows in, or leave "
        "overwrite unset: a new table's rows then come from its initializer, and a table the store "
        "holds keeps its rows."
    )


class PastRam(nn.Module):
    """Dense layers (one with buffers) constructed first, the table last."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, DIM), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(2 * DIM, 8), nn.ReLU(), nn.Linear(8, 1))
        self.emb = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.bottom(dense), self.emb(ids, offsets)], dim=1)
        return self.head(x).squeeze(-1)


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters and buffers of ``model`` but its table's."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {k: v.detach().clone() for k, v in tensors if not k.startswith("emb.")}


def test_a_meta_model_past_ram_trains_through_initialize_like_torch(tmp_path):
    rng = np.random.default_rng(3)
    keys = np.unique(np.concatenate([[0, PAST_RAM - 1], rng.integers(1, PAST_RAM - 1, KEYS - 2)]))
    assert len(keys) == KEYS
    batches = []
    for _ in range(6):
        local = torch.from_numpy(rng.integers(0, KEYS, BATCH * BAG))
        dense = torch.from_numpy(rng.standard_normal((BATCH, 4)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32))
        batches.append(
            (dense, torch.from_numpy(keys)[local], local, torch.arange(0, BATCH * BAG, BAG), labels)
        )

    torch.manual_seed(11)
    with torch.device("meta"):
        model = PastRam(PAST_RAM)
    start = peak_rss_reset()
    engine, _, _, _ = hds.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),  # holds meta tensors: pointed anew
        config=ds_config(tmp_path / "store", opt="sgd"),  # 2 KiB of RAM tier: rows on SSD
    )
    try:
        store = engine.hierps_store
        # The reference: built eagerly under the same seed (its table of the KEYS rows in use,
        # holding what the store's initializer gives them).
        torch.manual_seed(11)
        ref = PastRam(KEYS)
        assert dense_state(engine.module).keys() == dense_state(ref).keys()
        for name, value in dense_state(ref).items():  # torch's own initial values, bit for bit
            assert torch.equal(dense_state(engine.module)[name], value), name
        with torch.no_grad():
            ref.emb.weight.copy_(initializer_rows(store, "emb", keys))
        sgd, params = TORCH_OPTIMIZERS["sgd"]
        sparse = sgd(ref.emb.parameters(), **params)
        dense_opt = torch.optim.Adam(
            [p for n, p in ref.named_parameters() if not n.startswith("emb.")], lr=0.01
        )
        # Passes of 2 batches: rows come in from, and go back to, the RAM and SSD tiers.
        for dense, ids, local, offsets, labels in hds.PassLoader(batches, lambda b: {"emb": b[1]}, engine, 2):
            loss = LOSS(engine(dense, ids, offsets).float(), labels)
            engine.backward(loss)
            engine.step()
            ref_loss = LOSS(ref(dense, local, offsets), labels)
            ref_loss.backward()
            for opt in (sparse, dense_opt):
                opt.step()
                opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, **TOL)
        torch.testing.assert_close(engine.module.emb.lookup(torch.from_numpy(keys)), ref.emb.weight, **TOL)
        for name, value in dense_state(ref).items():
            torch.testing.assert_close(dense_state(engine.module)[name], value, **TOL, msg=name)
        engine.save_checkpoint(str(tmp_path / "ckpt"))  # the dense state, and the rows onto SSD
        assert store.num_rows("emb")["ssd"] == KEYS
        # Keys never trained (neighbours of trained ones, and others) read as the initializer gives them.
        untrained = np.setdiff1d(
            np.concatenate([keys[:-1] + 1, keys[1:] - 1, rng.integers(0, PAST_RAM, 1000)]), keys
        )
        assert torch.equal(
            store.lookup("emb", torch.from_numpy(untrained)), initializer_rows(store, "emb", untrained)
        )
        # 128 GB of table never allocated, nor anything of a byte a row (2 GB).
        assert _status_bytes("VmHWM") - start < 2**28
    finally:
        engine.destroy()


def test_materialize_keeps_ties_and_says_what_it_cannot_initialise():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight

    with torch.device("meta"):
        tied = Tied()
    old = tied.a.weight
    made = materialize(tied, torch.device("cpu"))
    assert tied.a.weight is tied.b.weight and made[id(old)] == (old, tied.a.weight)
    assert not tied.a.weight.is_meta and not torch.isnan(tied.a.weight).any()

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        orphan = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(
        ConfigError, match=r"module\(s\) \['1'\] hold parameters or buffers there but have no "
    ):
        materialize(orphan, torch.device("cpu"))

    class Half(Scale):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("t", torch.zeros(2))

        def reset_parameters(self) -> None:
            self.s.fill_(1.0)

    with torch.device("meta"):
        half = nn.Sequential(Half())
    with pytest.raises(ConfigError, match=r"reset_parameters\(\) left \['0.t'\] unset"):
        materialize(half, torch.device("cpu"))


@pytest.mark.parametrize("weights_dtype", ["fp32", "bf16"])
def test_copy_in_keeps_every_row_as_given_over_the_ram_budget(make_store, weights_dtype):
    # Across several slices of rows made at once, and past the RAM budget (rows on SSD).
    rows = 40_000
    module = nn.EmbeddingBag(rows, DIM)
    store = make_store(memory_budget="1MiB")
    hierps.EmbeddingBag.from_module(module, store=store, name="t", weights_dtype=weights_dtype)
    shuffled = np.random.default_rng(0).permutation(rows)
    store.table("u", DIM, weights_dtype=weights_dtype)
    store.write("u", shuffled, module.weight.detach()[shuffled])
    info, keys = store.tables["t"], np.arange(rows, dtype=np.int64)
    # What the rows were before they were made a slice at a time: all at once.
    fresh = info.layout.decode_np(info.fresh_rows(keys, 0, module.weight.detach().numpy()))
    assert store.num_rows("t")["ssd"] > 0
    for table in ("t", "u"):
        assert np.array_equal(store.read_rows(table, keys), fresh[:, : info.state_end])


def test_layers_built_after_a_table_are_not_an_eager_builds(make_store):
    # What materialize says it reproduces: the generator's stream up to the first table's N(0, 1).
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), nn.EmbeddingBag(100, 4), nn.Linear(4, 4))

    torch.manual_seed(5)
    eager = build()
    torch.manual_seed(5)
    with torch.device("meta"):
        model = build()
    hds.swap_embeddings(model, {"1": model[1]}, make_store())
    materialize(model, torch.device("cpu"))
    assert torch.equal(model[0].weight, eager[0].weight) and torch.equal(model[0].bias, eager[0].bias)
    assert not torch.equal(model[2].weight, eager[2].weight)
