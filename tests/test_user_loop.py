"""The user's own loop keeps working: a plain ``python train.py``, the swap line, state dicts, a forgotten step.

- ``hierps.deepspeed.initialize`` in a process no launcher started forms a one-rank group, as
  ``torchrun --nproc_per_node 1`` would (DeepSpeed alone looks for MPI);
- the line saying which tables went into the store shows without any logging set-up, goes to the
  application's handlers once it has some, and is silenced by the logger's level;
- ``state_dict()`` holds a table as the torch module's ``weight`` where one can hold it, else says
  how to save it; ``load_state_dict`` of a plain torch checkpoint warm-starts the store;
- a ``Store`` loop that never calls ``step()`` is warned about, gradient accumulation is not;
- a learning-rate schedule of the dense optimizer moves the tables' rate too, and resumes with the
  checkpoint.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from oracle import TinyModel, zipf_batches
from test_deepspeed import launcher_group
from torch import nn

import hierps
from hierps._store import store_parts
from hierps.errors import NotSupportedError
from hierps.integrations import deepspeed as hds
from hierps.modules import without_tables
from hierps.storage._commit_log import opening_part
from hierps.storage._files import read_json_checked
from hierps.training._trainer import MissingStepWarning

VOCAB, DIM, BATCH, BAG = 60, 4, 8, 3
LOSS = nn.BCEWithLogitsLoss()
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# A user's train.py: a plain model, one call changed, no launcher. It skips DeepSpeed's one-off
# build of its CPU shared-memory all-reduce (minutes on a fresh machine), as test_deepspeed does.
SCRIPT = """
import json, sys
import deepspeed.ops
import torch
from oracle import TinyModel, zipf_batches
from torch import nn
import hierps

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
root, vocab, dim, batch, bag = sys.argv[1], *map(int, sys.argv[2:])
torch.manual_seed(0)
model = TinyModel(nn.EmbeddingBag(vocab, dim, mode="sum", sparse=True), dim)
config = json.loads(open(root + "/config.json").read())
engine, *_ = hierps.deepspeed.initialize(
    model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
)
for b in zipf_batches(4, batch=batch, bag=bag, vocab=vocab):
    engine.backward(nn.BCEWithLogitsLoss()(engine(b.ids, b.offsets), b.labels))
    engine.step()
engine.save_checkpoint(root + "/ckpt", tag="end")
engine.destroy()
"""


def ds_config(path: Path, **section) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.0,  # DeepSpeed clips dense gradients at 1.0 by default; torch does not
        "steps_per_print": 10**9,
        "hierarchical_ps": {
            "path": str(path),
            "modules": ["emb"],
            "optimizer": {"type": "sgd", "params": {"lr": 0.1}},
            **section,
        },
    }


def plain_model(seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel(nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True), DIM)


def train_plain(model: TinyModel, n: int, seed: int = 0) -> None:
    """SGD (lr 0.1) on every parameter: the reference for the store's sparse SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for b in zipf_batches(n, batch=BATCH, bag=BAG, vocab=VOCAB, seed=seed):
        opt.zero_grad()
        LOSS(model(b.ids, b.offsets), b.labels).backward()
        opt.step()


# -- one process without launcher variables ----------------------------------------------------------


def test_plain_python_without_launcher_variables_trains_and_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ds_config(tmp_path / "store")))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("HOROVOD_")}
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), *map(str, (VOCAB, DIM, BATCH, BAG))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # The swap line reached stderr with no logging set up, once.
    line = f"hierarchical_ps: 1 of 1 embedding modules in the store: emb ({VOCAB} rows)"
    assert run.stderr.count(line) == 1, run.stderr[-3000:]
    record = read_json_checked(tmp_path / "ckpt" / "end" / "hierps-rank-00000.json")
    assert record["world_size"] == 1 and (tmp_path / "ckpt" / "latest").read_text() == "end"
    # The checkpointed rows are those plain torch trains on the same batches.
    ref = plain_model()  # the script's model: seed 0, built the same way
    train_plain(ref, 4)
    with opening_part(), hierps.Store(tmp_path / "store" / "rank-00000", device="cpu") as store:
        assert store.list_checkpoints()[-1]["tag"] == "end"
        torch.testing.assert_close(
            store.lookup("emb", torch.arange(VOCAB)), ref.emb.weight.detach(), rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize(
    ("env", "required", "added"),
    [
        ({}, None, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}),
        (
            {"MASTER_PORT": "29999"},
            None,
            {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"},
        ),
        ({"LOCAL_RANK": "1"}, None, {"RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}),
        ({"RANK": "0"}, None, set()),  # a launcher's: DeepSpeed's rules apply
        ({"WORLD_SIZE": "2"}, None, set()),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, None, set()),  # mpirun: DeepSpeed asks MPI
        ({}, False, set()),  # the caller said the group exists
    ],
)
def test_single_process_defaults_only_where_no_launcher_set_any(monkeypatch, env, required, added):
    for name in (*LAUNCHER_ENV, *hds._SELF_DISCOVERED):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    before = dict(os.environ)
    assert set(hds._single_process_env(required)) == added
    assert {k: v for k, v in os.environ.items() if k not in added} == before  # nothing else changes
    if added:
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == (
            "0",
            "1",
            "127.0.0.1",
        )
        assert os.environ["LOCAL_RANK"] == env.get("LOCAL_RANK", "0")
        assert os.environ["MASTER_PORT"] == env.get("MASTER_PORT", os.environ["MASTER_PORT"])
        assert 0 < int(os.environ["MASTER_PORT"]) < 65536


# -- in-process engines ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def process_group():
    yield from launcher_group()


@pytest.fixture
def engines(process_group):
    made = []

    def build(model: nn.Module, config: dict, **kwargs):
        kwargs.setdefault("optimizer", torch.optim.SGD(model.parameters(), lr=0.1))
        engine, *_ = hds.initialize(model=model, config=config, **kwargs)
        made.append(engine)
        return engine

    yield build
    for e in made:
        e.destroy()


SWAP_LINE = f"hierarchical_ps: 1 of 1 embedding modules in the store: emb ({VOCAB} rows)"


def test_swap_line_shows_without_logging_setup(engines, tmp_path, capsys):
    root = logging.getLogger()
    handlers = root.handlers[:]  # pytest's own capture handlers: as if nothing were configured
    for h in handlers:
        root.removeHandler(h)
    try:
        engines(plain_model(), ds_config(tmp_path / "a"))
    finally:
        for h in handlers:
            root.addHandler(h)
    assert capsys.readouterr().err.count(SWAP_LINE) == 1


def test_swap_line_goes_to_the_applications_handlers_and_is_silenceable(engines, tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)  # a handler on the root logger: logging is configured
    engines(plain_model(), ds_config(tmp_path / "a"))
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("hierps")] == [
        ("hierps.deepspeed", logging.INFO, SWAP_LINE)
    ]
    assert SWAP_LINE not in capsys.readouterr().err  # said once, by the application's handler
    caplog.clear()
    logger = logging.getLogger("hierps.deepspeed")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        engines(plain_model(), ds_config(tmp_path / "b"))
    finally:
        logger.setLevel(level)
    assert not [r for r in caplog.records if r.name.startswith("hierps")]
    assert SWAP_LINE not in capsys.readouterr().err


# -- state dicts ----------------------------------------------------------------------------------


def test_plain_torch_checkpoint_warm_starts_the_swapped_model(engines, tmp_path):
    plain = plain_model()
    train_plain(plain, 3)
    saved = io.BytesIO()
    torch.save(plain.state_dict(), saved)  # what the plain run wrote, e.g. dlrm's --save-model
    engine = engines(plain_model(seed=7), ds_config(tmp_path / "store"))  # other initial weights
    saved.seek(0)
    result = engine.module.load_state_dict(torch.load(saved, weights_only=True))
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(engine.module.emb.lookup(torch.arange(VOCAB)), plain.emb.weight.detach())
    for a, b in zip(engine.module.head.parameters(), plain.head.parameters()):
        assert torch.equal(a, b)
    b = zipf_batches(1, batch=BATCH, bag=BAG, vocab=VOCAB, seed=5)[0]
    with torch.no_grad():
        torch.testing.assert_close(engine(b.ids, b.offsets), plain(b.ids, b.offsets), rtol=0, atol=1e-7)
    # From there it trains like the plain model continuing (fresh optimizers on both sides).
    train_plain(plain, 2, seed=9)
    for b in zipf_batches(2, batch=BATCH, bag=BAG, vocab=VOCAB, seed=9):
        engine.backward(LOSS(engine(b.ids, b.offsets), b.labels))
        engine.step()
    torch.testing.assert_close(
        engine.module.emb.lookup(torch.arange(VOCAB)), plain.emb.weight.detach(), rtol=1e-6, atol=1e-7
    )


def test_load_state_dict_refuses_a_weight_of_another_shape(make_store):
    model = TinyModel(hierps.EmbeddingBag(VOCAB, DIM, mode="sum", store=make_store(), name="emb"), DIM)
    other = plain_model().state_dict()
    other["emb.weight"] = torch.zeros(VOCAB + 1, DIM)
    before = model.emb.lookup(torch.arange(VOCAB))
    with pytest.raises(
        RuntimeError, match=r"size mismatch for emb.weight: copying a param with shape \(61, 4\)"
    ):
        model.load_state_dict(other)
    assert torch.equal(model.emb.lookup(torch.arange(VOCAB)), before)


def trained_hierps_model(store: hierps.Store, num_embeddings: int | None = VOCAB) -> TinyModel:
    torch.manual_seed(0)
    model = TinyModel(hierps.EmbeddingBag(num_embeddings, DIM, mode="sum", store=store, name="emb"), DIM)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    for b in zipf_batches(3, batch=BATCH, bag=BAG, vocab=VOCAB):
        opt.zero_grad()
        LOSS(model(b.ids, b.offsets), b.labels).backward()
        opt.step()
        store.step()
    return model


def test_torch_save_of_the_state_dict_holds_a_small_table(make_store, tmp_path):
    model = trained_hierps_model(make_store(optimizer={"type": "sgd", "params": {"lr": 0.1}}))
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    plain = plain_model(seed=3)
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == list(plain.state_dict())  # the keys of the plain torch model, in its order
    plain.load_state_dict(loaded)
    assert torch.equal(plain.emb.weight, model.emb.lookup(torch.arange(VOCAB)))
    b = zipf_batches(1, batch=BATCH, bag=BAG, vocab=VOCAB, seed=5)[0]
    with torch.no_grad():
        torch.testing.assert_close(plain(b.ids, b.offsets), model(b.ids, b.offsets), rtol=0, atol=1e-7)
    with without_tables():
        assert list(model.state_dict()) == [k for k in plain.state_dict() if k != "emb.weight"]


@pytest.mark.parametrize("case", ["unbounded", "large", "raw ids"])
def test_state_dict_of_a_table_no_weight_holds_says_how_to_save_it(make_store, case):
    store = make_store(optimizer={"type": "sgd", "params": {"lr": 0.1}})
    model = trained_hierps_model(store, None if case == "unbounded" else VOCAB)
    if case == "large":
        model.emb.state_dict_max_bytes = VOCAB * DIM * 4 - 1
    if case == "raw ids":  # ids beyond num_embeddings: a weight of VOCAB rows would leave them out
        store.write("emb", torch.arange(10**12, 10**12 + 2 * VOCAB), torch.ones(2 * VOCAB, DIM))
    said = {
        "unbounded": "built with num_embeddings=None: any int64 id has a row",
        "large": f"{VOCAB} rows x {DIM} float32 = 0.0 MiB, more than state_dict_max_bytes = 0.0 MiB",
        "raw ids": f"rows of it, more than num_embeddings={VOCAB}: its ids are not 0..{VOCAB - 1}",
    }[case]
    with pytest.raises(NotSupportedError) as err:
        torch.save(model.state_dict(), io.BytesIO())
    text = str(err.value)
    assert text.startswith("state_dict: 'emb.weight' is table 'emb' of a hierps.EmbeddingBag")
    assert said in text and "engine.save_checkpoint(dir)" in text and "without_tables()" in text
    with without_tables():  # the dense state alone still saves
        torch.save(model.state_dict(), io.BytesIO())


def test_torch_save_of_the_whole_model_says_how_to_save_it(make_store):
    model = trained_hierps_model(make_store())
    with pytest.raises(
        NotSupportedError, match=r"cannot be pickled \(torch.save\(model\).*store.checkpoint\(\)"
    ):
        torch.save(model, io.BytesIO())


def test_engine_checkpoint_keeps_tables_out_of_deepspeeds_files(engines, tmp_path, monkeypatch):
    # Tables too large for a state dict: DeepSpeed's files hold the dense state, the store the rows.
    monkeypatch.setattr(hierps.EmbeddingBag, "state_dict_max_bytes", 0)
    engine = engines(plain_model(), ds_config(tmp_path / "store"))
    for b in zipf_batches(2, batch=BATCH, bag=BAG, vocab=VOCAB):
        engine.backward(LOSS(engine(b.ids, b.offsets), b.labels))
        engine.step()
    rows = engine.module.emb.lookup(torch.arange(VOCAB))
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    files = list((tmp_path / "ckpt" / "t").glob("*model_states.pt"))
    assert files and all("emb.weight" not in torch.load(f, weights_only=False)["module"] for f in files)
    with pytest.raises(NotSupportedError):
        engine.module.state_dict()  # outside the engine's save the size rule holds
    b = zipf_batches(1, batch=BATCH, bag=BAG, vocab=VOCAB, seed=3)[0]
    engine.backward(LOSS(engine(b.ids, b.offsets), b.labels))
    engine.step()
    engine.load_checkpoint(tmp_path / "ckpt", tag="t")  # strict: no weight expected
    assert torch.equal(engine.module.emb.lookup(torch.arange(VOCAB)), rows)


# -- a forgotten store.step() ---------------------------------------------------------------------


def forwards(model: TinyModel, n: int) -> list[str]:
    """``n`` training forwards and backwards, no step; the MissingStepWarnings they gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for b in zipf_batches(n, batch=BATCH, bag=BAG, vocab=VOCAB):
            LOSS(model(b.ids, b.offsets), b.labels).backward()
    return [str(w.message) for w in seen if issubclass(w.category, MissingStepWarning)]


def test_a_loop_without_step_is_warned_once(make_store):
    store = make_store()
    model = TinyModel(hierps.EmbeddingBag(VOCAB, DIM, mode="sum", store=store, name="emb"), DIM)
    assert forwards(model, 64) == []  # as many as gradient accumulation may take
    said = forwards(model, 1)
    assert len(said) == 1 and said[0].startswith(
        "hierps: table 'emb' was gathered for training 65 times without a store.step(): its rows are not trained"
    )
    assert forwards(model, 5) == []
    store.step()
    store_parts(store).trainer.gathers_before_warning = 2
    assert forwards(model, 5) == []  # once per store


@pytest.mark.parametrize("reset", ["step", "zero_grad"])
def test_accumulating_gradients_is_not_warned(make_store, reset):
    store = make_store()
    model = TinyModel(hierps.EmbeddingBag(VOCAB, DIM, mode="sum", store=store, name="emb"), DIM)
    assert forwards(model, 40) == []
    getattr(store, reset)()
    assert forwards(model, 40) == []  # 80 since the store began, 40 since the last step
    with torch.no_grad():  # evaluation forwards gather nothing for a step
        for b in zipf_batches(30, batch=BATCH, bag=BAG, vocab=VOCAB):
            model(b.ids, b.offsets)
    assert forwards(model, 1) == []


def test_engine_steps_at_its_accumulation_boundaries_unwarned(engines, tmp_path):
    config = ds_config(tmp_path / "store")
    config["gradient_accumulation_steps"] = 32
    engine = engines(plain_model(), config)
    trainer = store_parts(engine.hierps_store).trainer
    assert trainer.gathers_before_warning == 4 * 32
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for b in zipf_batches(96, batch=BATCH, bag=BAG, vocab=VOCAB):
            engine.backward(LOSS(engine(b.ids, b.offsets), b.labels))
            engine.step()
    assert not [w for w in seen if issubclass(w.category, MissingStepWarning)]
    assert engine.hierps_store.tables["emb"].step == 3


# -- learning-rate schedules ----------------------------------------------------------------------


def warm_up(s: int) -> float:
    """A warm-up over 3 steps, then a decay: the factor of the lr after ``s`` scheduler steps."""
    return min(s + 1, 3) / 3 * 0.7 ** max(0, s - 2)


def warmup_lr(s: int) -> float:
    """DeepSpeed's WarmupLR (linear, 4 steps, 0 to the optimizer's lr) after ``s`` scheduler steps:
    it sets the minimum when built and steps after each update, so the first two updates run at 0."""
    return min(1.0, max(0, s - 1) / 4)


SCHEDULES = {
    "torch scheduler stepped by the loop": warm_up,
    "torch scheduler stepped by DeepSpeed": warm_up,
    "DeepSpeed's WarmupLR": warmup_lr,
}


def scheduled_engine(engines, path: Path, how: str, seed: int = 0):
    """(engine, the loop's scheduler or None) with tables on Adagrad (lr 0.3), dense Adam (lr 0.01)."""
    model = plain_model(seed)
    config = ds_config(path, optimizer={"type": "adagrad", "params": {"lr": 0.3}})
    kwargs: dict = {"optimizer": torch.optim.Adam(model.parameters(), lr=0.01)}
    if how == "torch scheduler stepped by DeepSpeed":
        kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warm_up)
    if how == "DeepSpeed's WarmupLR":
        config["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_num_steps": 4, "warmup_type": "linear"},
        }
    engine = engines(model, config, **kwargs)
    loop = None
    if how == "torch scheduler stepped by the loop":
        loop = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, warm_up)
    return engine, loop


def train_scheduled(engine, loop, batches) -> None:
    for b in batches:
        engine.backward(LOSS(engine(b.ids, b.offsets), b.labels))
        engine.step()
        if loop is not None:
            loop.step()


@pytest.mark.parametrize("how", list(SCHEDULES))
def test_lr_schedulers_reach_the_tables_and_resume_with_the_checkpoint(engines, tmp_path, how):
    batches = zipf_batches(8, batch=BATCH, bag=BAG, vocab=VOCAB, seed=1)
    ref = plain_model()  # plain torch: one schedule on both optimizers
    sparse = torch.optim.Adagrad(ref.emb.parameters(), lr=0.3)
    dense = torch.optim.Adam(ref.head.parameters(), lr=0.01)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, SCHEDULES[how]) for o in (sparse, dense)]
    for b in batches:
        LOSS(ref(b.ids, b.offsets), b.labels).backward()
        for o in (sparse, dense):
            o.step()
            o.zero_grad()
        for s in schedules:
            s.step()

    engine, loop = scheduled_engine(engines, tmp_path / "store", how)
    train_scheduled(engine, loop, batches[:4])
    engine.save_checkpoint(tmp_path / "ckpt", tag="half")
    train_scheduled(engine, loop, batches[4:])
    rows = engine.module.emb.lookup(torch.arange(VOCAB))
    torch.testing.assert_close(rows, ref.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    assert engine.hierps_store.tables["emb"].optimizer.params["lr"] == pytest.approx(
        0.3 * SCHEDULES[how](7)
    )  # the rate of the last step
    if loop is not None:
        return  # the loop's own scheduler is the loop's to save
    engine.destroy()
    fresh, _ = scheduled_engine(engines, tmp_path / "store", how, seed=5)
    fresh.load_checkpoint(tmp_path / "ckpt", tag="half")  # DeepSpeed's scheduler state, the store's rows
    train_scheduled(fresh, None, batches[4:])
    torch.testing.assert_close(fresh.module.emb.lookup(torch.arange(VOCAB)), rows, rtol=0, atol=0)
