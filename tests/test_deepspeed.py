"""hierps.deepspeed: a DeepSpeed engine trains dense layers and store-backed tables like plain torch."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import deepspeed
import deepspeed.ops
import numpy as np
import pytest
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from oracle import TORCH_OPTIMIZERS, TinyModel, zipf_batches
from procs import finished
from torch import nn

import hierps
from hierps._store import store_parts
from hierps.errors import ConfigError
from hierps.integrations import deepspeed as hds
from hierps.integrations.config import HierarchicalPSConfig, select_modules
from hierps.integrations.rendezvous import free_port

VOCAB, DIM, BATCH, BAG = 400, 8, 16, 5
TOL = {"rtol": 1e-5, "atol": 1e-6}
LOSS = nn.BCEWithLogitsLoss()


def launcher_group() -> Iterator[None]:
    """A single-rank gloo group, as the deepspeed launcher would set it up (once: it outlives its
    user); the launcher's variables are restored after."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    skip_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield from launcher_group()


def skip_shm_build() -> None:
    # DeepSpeed compiles a shared-memory all-reduce for CPU ranks on first use (about a minute
    # on a fresh machine); gloo alone serves these few small collectives.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def ds_config(path, *, gas=1, stage=0, bf16=False, opt="adagrad", **section):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # DeepSpeed clips dense gradients at 1.0 by default; torch does not
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "hierarchical_ps": {
            "path": str(path),
            "memory_budget": "2KiB",
            "device_budget": "1MiB",
            "modules": ["emb"],
            "optimizer": {"type": opt, "params": TORCH_OPTIMIZERS[opt][1]},
            **section,
        },
    }


def twins(seed=1):
    """(reference model with a sparse torch table, an identical copy to hand to DeepSpeed)."""
    torch.manual_seed(seed)
    ref = TinyModel(nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True), DIM)
    return ref, copy.deepcopy(ref)


def train_torch(ref, opt, batches, gas):
    cls, params = TORCH_OPTIMIZERS[opt]
    sparse, dense = cls(ref.emb.parameters(), **params), torch.optim.Adam(ref.head.parameters(), lr=0.01)
    losses = []
    for i, b in enumerate(batches):
        loss = LOSS(ref(b.ids, b.offsets), b.labels)
        (loss / gas).backward()
        losses.append(loss.item())
        if (i + 1) % gas == 0:
            for o in (sparse, dense):
                o.step()
                o.zero_grad()
    return losses


def train_engine(engine, batches, pass_batches=None):
    loader = (
        batches
        if pass_batches is None
        else hds.PassLoader(batches, lambda b: {"emb": b.ids}, engine, pass_batches=pass_batches)
    )
    losses = []
    for b in loader:
        loss = LOSS(engine(b.ids, b.offsets).float(), b.labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def state(engine):
    """(rows of every id, dense parameters) of an engine's model."""
    return engine.module.emb.lookup(torch.arange(VOCAB)), [
        p.detach().clone() for p in engine.module.head.parameters()
    ]


@pytest.fixture
def engines():
    """Engines built by a test, destroyed (and their stores closed) at teardown."""
    made = []

    def build(**kwargs):
        engine, *rest = hds.initialize(**kwargs)
        made.append(engine)
        return (engine, *rest)

    yield build
    for e in made:
        e.destroy()


@pytest.mark.parametrize(
    ("stage", "gas", "opt", "pass_batches", "section"),
    [
        (0, 1, "adagrad", 4, {}),
        (0, 3, "adagrad", 4, {}),
        (0, 3, "adam", None, {}),
        (1, 1, "sgd", 4, {}),
        (1, 3, "adagrad", 5, {}),
        (2, 1, "adam", 4, {}),
        (2, 3, "adagrad", None, {}),
        (3, 3, "adagrad", 4, {}),
        (0, 1, "adam", 4, {"pipeline": False, "max_segments": 2}),
    ],
)
def test_training_matches_torch_with_rows_on_ssd(engines, tmp_path, stage, gas, opt, pass_batches, section):
    ref, model = twins()
    batches = zipf_batches(12, batch=BATCH, bag=BAG, vocab=VOCAB)
    ref_losses = train_torch(ref, opt, batches, gas)
    # model.parameters() holds the embedding weight: initialize drops it from what DeepSpeed gets.
    engine, optimizer, _, _ = engines(
        model=model,
        model_parameters=model.parameters(),
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        config=ds_config(tmp_path, gas=gas, stage=stage, opt=opt, **section),
    )
    assert engine.hierps_store.pipeline is section.get("pipeline", True)
    assert engine.hierps_store.max_segments == section.get("max_segments", 16)
    assert isinstance(engine, DeepSpeedEngine) and isinstance(engine, hds.HierpsEngine)
    assert isinstance(engine.module.emb, hierps.EmbeddingBag) and not list(engine.module.emb.parameters())
    assert engine.hierps_store.path == tmp_path / "rank-00000"
    losses = train_engine(engine, batches, pass_batches)
    store = engine.hierps_store
    assert (
        store_parts(store).core.ssd.num_rows("emb") > 10 * store_parts(store).core.memory.num_rows("emb")
        and store_parts(store).core.ssd.bytes_read > 0
    )
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    rows, dense = state(engine)
    torch.testing.assert_close(rows, ref.emb.weight.detach(), **TOL)
    for a, b in zip(ref.head.parameters(), dense):
        torch.testing.assert_close(b, a.detach(), **TOL)
    assert store.tables["emb"].step == len(batches) // gas


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_dense_layers_train(engines, tmp_path, stage):
    _, model = twins()
    engine, _, _, _ = engines(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        config=ds_config(tmp_path, gas=2, stage=stage, bf16=True),
    )
    assert next(engine.module.head.parameters()).dtype == torch.bfloat16
    before = engine.module.emb.lookup(torch.arange(VOCAB))
    batches = zipf_batches(8, batch=BATCH, bag=BAG, vocab=VOCAB, seed=4)
    first = [LOSS(engine(b.ids, b.offsets).float(), b.labels).item() for b in batches]
    assert engine(batches[0].ids, batches[0].offsets).dtype == torch.bfloat16
    for _ in range(6):
        train_engine(engine, batches)
    with torch.no_grad():
        last = [LOSS(engine(b.ids, b.offsets).float(), b.labels).item() for b in batches]
    assert sum(last) < 0.8 * sum(first)
    assert not torch.equal(engine.module.emb.lookup(torch.arange(VOCAB)), before)
    assert engine.hierps_store.tables["emb"].step == 6 * len(batches) // 2


def test_loss_scaling_is_undone_for_the_rows(engines, tmp_path):
    class Scaled:  # an engine under fp16 autocast: a GradScaler multiplies the loss by 1024
        optimizer = None
        torch_autocast_z0_gradscaler = type("Scaler", (), {"get_scale": lambda self: 1024.0})()

    rows = torch.randn(3, 4, requires_grad=True)
    out = hds._OutputHook(Scaled(), torch.half)(None, (), rows * 1.0)
    assert out.dtype == torch.half
    (out.float().sum() * 1024.0).backward()
    torch.testing.assert_close(rows.grad, torch.ones(3, 4))
    _, model = twins()  # a ZeRO optimizer without loss scaling (fp32) scales by exactly 1
    engine, _, _, _ = engines(
        model=model, optimizer=torch.optim.Adam(model.parameters()), config=ds_config(tmp_path, stage=2)
    )
    assert hds._loss_scale(engine) == 1.0


def test_load_checkpoint_resumes_identically_also_in_a_fresh_engine(engines, tmp_path):
    batches = zipf_batches(12, batch=BATCH, bag=BAG, vocab=VOCAB, seed=2)
    first, then = batches[:4], batches[4:]
    cfg = ds_config(tmp_path / "store", gas=2, stage=1, opt="adam", keep_checkpoints=2)
    _, model = twins()
    engine, _, _, _ = engines(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), config=cfg
    )
    train_engine(engine, first, pass_batches=2)
    engine.save_checkpoint(tmp_path / "ckpt", tag="A")
    losses = train_engine(engine, then, pass_batches=4)
    after = state(engine)
    engine.save_checkpoint(tmp_path / "ckpt")  # default tag global_step<N>, now the "latest" one
    assert (tmp_path / "ckpt" / f"global_step{engine.global_steps}" / "hierps-rank-00000.json").exists()

    engine.load_checkpoint(tmp_path / "ckpt", tag="A")
    assert train_engine(engine, then, pass_batches=4) == losses
    for a, b in zip(state(engine), after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    train_engine(engine, batches)  # more training that no checkpoint covers; then the process "dies"
    engine.destroy()
    _, fresh_model = twins(seed=9)  # other initial weights: everything must come from the checkpoint
    fresh, _, _, _ = engines(
        model=fresh_model, optimizer=torch.optim.Adam(fresh_model.parameters(), lr=0.01), config=cfg
    )
    fresh.load_checkpoint(tmp_path / "ckpt", tag="A")
    assert train_engine(fresh, then, pass_batches=4) == losses
    for a, b in zip(state(fresh), after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    fresh.load_checkpoint(tmp_path / "ckpt")  # the latest tag
    for a, b in zip(state(fresh), after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fresh.save_checkpoint(tmp_path / "ckpt", tag="C")  # keep_checkpoints=2: A is retired
    with pytest.raises(ConfigError, match="'A'.*keep_checkpoints=2"):
        fresh.load_checkpoint(tmp_path / "ckpt", tag="A")


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"memry_budget": "1GiB"}, ["hierarchical_ps.memry_budget", "unknown key", "'1GiB'"]),
        ({"memory_budget": -5}, ["hierarchical_ps.memory_budget", "-5"]),
        ({"device_budget": "-1MiB"}, ["hierarchical_ps.device_budget", "'-1MiB'"]),
        ({"optimizer": {"type": "adamw"}}, ["hierarchical_ps.optimizer.type", "'adamw'"]),
        ({"modules": ["emb", "towers.2"]}, ["hierarchical_ps.modules", "'towers.2'", "['emb']"]),
        ({"modules": ["head"]}, ["hierarchical_ps.modules", "'head'", "Sequential"]),
        ({"pass_batches": 0}, ["hierarchical_ps.pass_batches", "0"]),
        ({"path": None}, ["hierarchical_ps.path", "None"]),
        ({"dense_allreduce": "mpi"}, ["hierarchical_ps.dense_allreduce", "'mpi'"]),
        ({"dense_allreduce": "horovod"}, ["hierarchical_ps.dense_allreduce", "horovod"]),
        ({"pipeline": "no"}, ["hierarchical_ps.pipeline", "'no'"]),
        ({"max_segments": 1}, ["hierarchical_ps.max_segments", "1"]),
    ],
)
def test_bad_section_fails_before_anything_is_built(tmp_path, monkeypatch, section, named):
    monkeypatch.setattr("hierps.integrations.config._importable", lambda module: False)  # as without Horovod
    _, model = twins()
    cfg = ds_config(tmp_path / "store")
    cfg["hierarchical_ps"].update(section)
    snapshot = copy.deepcopy(cfg)
    with pytest.raises(ConfigError) as err:
        hds.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg)
    for text in named:
        assert text in str(err.value)
    assert isinstance(model.emb, nn.EmbeddingBag) and not (tmp_path / "store").exists()
    assert cfg == snapshot


def test_without_section_or_disabled_it_is_plain_deepspeed(engines, tmp_path):
    for cfg in (ds_config(tmp_path), ds_config(tmp_path, enabled=False)):
        if cfg["hierarchical_ps"].get("enabled", True):
            del cfg["hierarchical_ps"]
        snapshot = copy.deepcopy(cfg)
        _, model = twins()
        model.emb.sparse = False  # plain DeepSpeed all-reduces dense gradients
        engine, _, _, _ = engines(model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg)
        assert type(engine) is DeepSpeedEngine and not hasattr(engine, "hierps_store")
        assert isinstance(engine.module.emb, nn.EmbeddingBag) and engine.module.emb.weight.requires_grad
        assert cfg == snapshot
        train_engine(engine, zipf_batches(2, batch=BATCH, bag=BAG, vocab=VOCAB))
    assert not any(tmp_path.iterdir())


def test_config_from_args_json_file(engines, tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config(tmp_path / "store", modules="auto", auto_min_rows=VOCAB)))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    _, model = twins()
    engine, _, _, _ = engines(args=args, model=model, optimizer=torch.optim.Adam(model.parameters()))
    assert isinstance(engine.module.emb, hierps.EmbeddingBag) and args.deepspeed_config == str(path)
    assert "hierarchical_ps" not in engine.config and engine.hierps_config.auto_min_rows == VOCAB
    train_engine(engine, zipf_batches(2, batch=BATCH, bag=BAG, vocab=VOCAB))


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Embedding(500, 4)
        self.user, self.item = shared, shared
        self.tables = nn.ModuleList([nn.EmbeddingBag(300, 4), nn.EmbeddingBag(20, 4)])
        self.head = nn.Linear(4, 1)


def test_auto_swaps_large_tables_and_keeps_shared_ones_shared(make_store):
    model = Towers()
    cfg = HierarchicalPSConfig(path="unused", modules="auto", auto_min_rows=100)
    chosen = select_modules(model, cfg)
    assert list(chosen) == ["user", "tables.0"]
    weight = model.user.weight.detach().clone()
    twins_ = hds.swap_embeddings(model, chosen, make_store())
    assert model.user is model.item is twins_["user"] and isinstance(model.user, hierps.Embedding)
    assert isinstance(model.tables[0], hierps.EmbeddingBag) and isinstance(model.tables[1], nn.EmbeddingBag)
    torch.testing.assert_close(model.user.lookup(torch.arange(500)), weight, rtol=0, atol=0)


def test_pass_loader_loads_each_pass_before_it_runs_and_reads_the_next_ahead(make_store):
    store = make_store()
    store.table("user", 4)
    calls = []
    for name in ("begin_pass", "prefetch", "end_pass"):
        method = getattr(store, name)
        setattr(store, name, lambda *a, _n=name, _m=method: (calls.append((_n, *map(len, a))), _m(*a))[1])
    batches = [{"user_ids": torch.tensor([i, i + 1])} for i in range(5)]
    seen = []
    for b in hds.PassLoader(batches, {"user": "user_ids"}, store, pass_batches=2):
        seen.append(int(b["user_ids"][0]))
        calls.append(("batch", seen[-1]))
    assert seen == [0, 1, 2, 3, 4]
    # fmt: off
    assert calls == [
        ("begin_pass", 2), ("prefetch", 2), ("batch", 0), ("batch", 1), ("end_pass",),
        ("begin_pass", 2), ("prefetch", 1), ("batch", 2), ("batch", 3), ("end_pass",),
        ("begin_pass", 1), ("batch", 4), ("end_pass",),
    ]
    # fmt: on
    calls.clear()
    for _ in hds.PassLoader(batches, {"user": "user_ids"}, store, pass_batches=3):
        break  # a consumer that stops mid-pass still gets its pass closed
    assert calls == [("begin_pass", 3), ("prefetch", 2), ("end_pass",)]
    with pytest.raises(ConfigError, match="batch\\['items'\\]"):
        next(iter(hds.PassLoader(batches, {"user": "items"}, store)))


def run_ranks(launcher: list[str], tmp_path: Path, *args: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [*launcher, __file__, str(tmp_path / "store"), str(tmp_path), *args]
    proc = finished(cmd, env, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize("launch", ["torchrun", "horovodrun"])
def test_two_ranks_train_like_one_torch_process(tmp_path, launch):
    bin_dir = Path(sys.executable).parent
    if launch == "torchrun":  # ZeRO 1 over DeepSpeed's all-reduce, a sharded store over torch.distributed
        launcher = [
            str(bin_dir / "torchrun"),
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
        ]
        run_ranks(launcher, tmp_path, "deepspeed", "1")
    else:  # dense gradients and the sharded store's all-to-all both over Horovod
        pytest.importorskip("horovod.torch", reason="Horovod is installed by `make horovod`")
        launcher = [str(bin_dir / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable]
        run_ranks(launcher, tmp_path, "horovod", "0")
    ref, _ = twins()
    ref_losses = train_torch(ref, "adagrad", zipf_batches(12, batch=BATCH, bag=BAG, vocab=VOCAB), gas=2)
    results = [dict(np.load(tmp_path / f"result-{rank}.npz")) for rank in (0, 1)]
    np.testing.assert_allclose((results[0]["losses"] + results[1]["losses"]) / 2, ref_losses, **TOL)
    dense = np.concatenate([p.detach().reshape(-1).numpy() for p in ref.head.parameters()])
    every = zipf_batches(12, batch=BATCH, bag=BAG, vocab=VOCAB)
    ids = np.concatenate([b.ids.numpy() for b in every])
    clicks = np.concatenate([np.repeat(b.labels.numpy(), BAG) for b in every])
    for r in results:  # the same rows on both ranks (lookup asks their owners), equal to torch's
        np.testing.assert_allclose(r["rows"], ref.emb.weight.detach().numpy(), **TOL)
        np.testing.assert_allclose(r["dense"], dense, **TOL)
        # observe under two ranks counts what one process counts on the global batches
        np.testing.assert_array_equal(r["shows"], np.bincount(ids, minlength=VOCAB).astype(np.float32))
        np.testing.assert_array_equal(
            r["clicks"], np.bincount(ids, clicks, minlength=VOCAB).astype(np.float32)
        )
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["rank-00000", "rank-00001"]
    assert (tmp_path / "ckpt" / "end" / "hierps-rank-00001.json").exists()
    if launch == "torchrun":
        one_process_takes_over(tmp_path, results[0])


def one_process_takes_over(tmp_path: Path, saved: dict[str, np.ndarray]) -> None:
    """One process opens the store two ranks trained, and loads the tag they saved, exactly."""
    _, model = twins(seed=9)  # other initial weights: the rows must all come from the store
    engine, _, _, _ = hds.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters()), config=ds_config(tmp_path / "store")
    )
    try:
        assert isinstance(engine.hierps_store, hierps.Store)
        # It opens at the latest checkpoint of both ranks, resharded into one store: every row.
        np.testing.assert_array_equal(engine.module.emb.lookup(torch.arange(VOCAB)).numpy(), saved["rows"])
        assert [c["world_size"] for c in engine.hierps_checkpoints.list_checkpoints()] == [2, 1]
        train_engine(engine, zipf_batches(3, batch=BATCH, bag=BAG, vocab=VOCAB, seed=7))
        engine.save_checkpoint(tmp_path / "ckpt", tag="one")
        engine.load_checkpoint(tmp_path / "ckpt", tag="end", load_optimizer_states=False)
        rows, dense = state(engine)
        np.testing.assert_array_equal(rows.numpy(), saved["rows"])
        np.testing.assert_array_equal(np.concatenate([p.reshape(-1).numpy() for p in dense]), saved["dense"])
    finally:
        engine.destroy()


def _rank_worker(store: str, out: str, dense_allreduce: str, stage: str) -> None:
    """One of two ranks: half of each global batch, a sharded store, results to ``out``."""
    skip_shm_build()
    _, model = twins()
    cfg = ds_config(store, gas=2, stage=int(stage), dense_allreduce=dense_allreduce)
    share = cfg["train_micro_batch_size_per_gpu"] = BATCH // 2
    engine, _, _, _ = hds.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), config=cfg
    )
    rank, world = engine.global_rank, engine.world_size
    assert isinstance(engine.hierps_store, hierps.ShardedStore) and world == 2
    batches = []
    for b in zipf_batches(12, batch=BATCH, bag=BAG, vocab=VOCAB):
        mine = slice(rank * share, (rank + 1) * share)
        batches.append(
            type(b)(
                b.ids.reshape(BATCH, BAG)[mine].reshape(-1), torch.arange(0, share * BAG, BAG), b.labels[mine]
            )
        )
    losses = train_engine(engine, batches, pass_batches=4)
    emb = engine.module.emb
    for b in batches:  # show / click counters of this rank's examples, counted at the keys' owners
        emb.observe(b.ids, b.offsets, b.labels)
    counted = engine.hierps_store.counters(emb.table, np.arange(VOCAB))
    rows, dense = state(engine)
    engine.save_checkpoint(Path(out) / "ckpt", tag="end")
    np.savez(
        Path(out) / f"result-{rank}.npz",
        losses=np.array(losses),
        rows=rows.numpy(),
        dense=np.concatenate([p.float().reshape(-1).numpy() for p in dense]),
        shows=counted["show"],
        clicks=counted["click"],
    )
    train_engine(engine, batches[:4])
    engine.load_checkpoint(Path(out) / "ckpt", tag="end")  # every rank back to its shard of "end"
    for a, b in zip(state(engine), (rows, dense)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    engine.destroy()


if __name__ == "__main__":  # a rank of test_two_ranks_train_like_one_torch_process
    _rank_worker(*sys.argv[1:])


def test_auto_dense_allreduce_follows_the_launcher_and_zero_stage():
    from hierps.integrations.config import DenseAllreduce, resolve_dense_allreduce

    auto = DenseAllreduce.AUTO
    assert resolve_dense_allreduce(auto, under_horovodrun=False) is DenseAllreduce.DEEPSPEED
    # Under horovodrun, Horovod all-reduces whole gradients: only where ZeRO does not partition them.
    if importlib.util.find_spec("horovod.torch") is not None:
        assert resolve_dense_allreduce(auto, under_horovodrun=True, zero_stage=0) is DenseAllreduce.HOROVOD
    assert resolve_dense_allreduce(auto, under_horovodrun=True, zero_stage=1) is DenseAllreduce.DEEPSPEED


# -- a save killed half way ------------------------------------------------------------------------
SAVE_CASES = [
    # (tags saved, keep_checkpoints, killed at, what the tag asked for loads: "first" / "second" / error)
    (("best", "best"), 3, "deepspeed.store_saved", "best", "first"),
    (("best", "best"), 3, "deepspeed.files_saved", "best", ConfigError),
    (("best", "best"), 3, "deepspeed.recorded", "best", "second"),
    (("A", "B"), 1, "deepspeed.store_saved", None, "first"),
    (("A", "B"), 1, "deepspeed.recorded", None, "first"),
    (("A", "B"), 1, "deepspeed.recorded", "B", "second"),
    (("A", "B"), 1, "deepspeed.latest_written", None, "second"),
]


@pytest.mark.parametrize(("tags", "keep", "point", "load", "expected"), SAVE_CASES)
def test_a_save_killed_half_way_loads_one_save_entirely_or_fails_clearly(
    engines, tmp_path, tags, keep, point, load, expected
):
    """A process saving ``tags[1]`` (a reused tag, or a new one with keep_checkpoints 1) is SIGKILLed
    at ``point`` inside the save. A fresh engine then loads ``load`` (None: the latest tag): it gets
    the dense layers and the rows of one save, bit for bit, or a ConfigError naming the problem."""
    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "HIERPS_FAULT": f"{point}:2",
    }
    args = [str(tmp_path / "store"), str(tmp_path / "ckpt"), str(tmp_path), str(keep), *tags]
    proc = subprocess.run(
        [sys.executable, str(here / "ds_save_worker.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr  # killed inside the second save
    _, model = twins(seed=9)  # other weights: everything loaded must come from the checkpoint
    engine, _, _, _ = engines(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        config=ds_config(tmp_path / "store", gas=1, stage=1, opt="adam"),
    )
    if expected is ConfigError:
        with pytest.raises(ConfigError, match="saved again and that save did not finish"):
            engine.load_checkpoint(tmp_path / "ckpt", tag=load)
        return
    engine.load_checkpoint(tmp_path / "ckpt", tag=load)
    rows, dense = state(engine)
    want_rows, want_dense = torch.load(tmp_path / f"{expected}.pt", weights_only=True)
    torch.testing.assert_close(rows, want_rows, rtol=0, atol=0)
    for a, b in zip(dense, want_dense):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
