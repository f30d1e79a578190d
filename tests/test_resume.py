"""Resume to the example: a checkpoint holds where the data was, and a resumed run is the uninterrupted one.

The oracle is the run that was never stopped: it checkpoints at the same step, goes on, and its
batches, losses and rows are what the resumed run must give, bit for bit. The resumed run starts in
a fresh store object with another global RNG state (so the position cannot come from anywhere but
the checkpoint), through the PassLoader's read-ahead, with shuffling and with worker processes.
Through DeepSpeed (``training_data``), the stopped run is SIGKILLed in a process of its own, at one
and at two ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import launcher, outcome
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import hierps
from hierps._position import DataPositionWarning, decode_state, encode_state
from hierps.errors import ConfigError
from hierps.integrations.loader import PassLoader

VOCAB, DIM, BAG, BATCH = 300, 4, 3, 8
EPOCH = 10  # batches per epoch
TOTAL = 26  # steps: two epochs and a half
PASS = 4


def dataset(seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand((BATCH * EPOCH, BAG), generator=g, dtype=torch.float64)
    ids = ((1 - u) ** (-1 / 0.7)).long().sub(1) % VOCAB  # power-law ids, the same whatever the global RNG
    return torch.utils.data.TensorDataset(ids, torch.randint(0, 2, (BATCH * EPOCH,), generator=g).float())


def train(
    path: Path, checkpoint_at: int, *, stop: bool = False, resume: bool = False, workers: int = 0
) -> dict:
    """Train up to TOTAL steps of Adagrad rows (a fixed head) in passes of PASS batches, checkpointing at
    step ``checkpoint_at`` (and returning there with ``stop``); ``resume``: from the store's latest
    checkpoint. Returns each step's (loss, ids), the final rows and the passes run."""
    torch.manual_seed(99 if resume else 1)  # the loader's own shuffling must not decide where it resumes
    store = hierps.Store(path, device_budget="64KiB", memory_budget="4KiB", seed=3)
    emb = hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name="t", optimizer="adagrad")
    head = torch.linspace(-1, 1, DIM)
    data = StatefulDataLoader(dataset(), batch_size=BATCH, shuffle=True, num_workers=workers)
    loader = PassLoader(data, {"t": 0}, store, pass_batches=PASS)
    step = int(store.list_checkpoints()[-1]["tag"]) if resume else 0
    steps: dict[int, tuple[float, list[int]]] = {}
    while step < TOTAL and not (stop and step == checkpoint_at):
        for ids, labels in loader:
            loss = nn.functional.binary_cross_entropy_with_logits(emb(ids) @ head, labels)
            loss.backward()
            store.step()
            step += 1
            steps[step] = (loss.item(), ids.reshape(-1).tolist())
            if step == checkpoint_at:
                store.checkpoint(str(step))
            if step == TOTAL or (stop and step == checkpoint_at):
                break
    keys = np.arange(VOCAB, dtype=np.int64)
    out = {
        "steps": steps,
        "rows": emb.lookup(torch.arange(VOCAB)),
        "state": store.read_rows("t", keys),  # weights and Adagrad's accumulators
        "counters": store.counters("t", keys),
        "passes": store.passes,
    }
    store.close()
    return out


# Mid-pass, a pass's last batch and the next one, an epoch's last batch and the next one, with the
# read-ahead of the next pass under way, and late in the last epoch.
@pytest.mark.parametrize("stop_at", [1, 3, 4, 5, 9, 10, 11, 16, 22, 25])
def test_a_resumed_store_run_is_the_uninterrupted_one_to_the_example(tmp_path, stop_at):
    whole = train(tmp_path / "whole", stop_at)
    stopped = train(tmp_path / "run", stop_at, stop=True)
    assert stopped["steps"] == {s: whole["steps"][s] for s in range(1, stop_at + 1)}
    resumed = train(tmp_path / "run", stop_at, resume=True)
    assert sorted(resumed["steps"]) == list(range(stop_at + 1, TOTAL + 1))
    for s in resumed["steps"]:  # every later batch the same examples, every loss bit-equal
        assert resumed["steps"][s] == whole["steps"][s], s
    assert torch.equal(resumed["rows"], whole["rows"])
    np.testing.assert_array_equal(resumed["state"], whole["state"])
    for name, values in whole["counters"].items():  # counts, decayed counts, last pass seen
        np.testing.assert_array_equal(resumed["counters"][name], values, err_msg=name)
    assert resumed["passes"] == whole["passes"]  # the same pass boundaries


@pytest.mark.parametrize("stop_at", [6, 13])
def test_with_worker_processes_the_resumed_run_is_the_uninterrupted_one(tmp_path, stop_at):
    whole = train(tmp_path / "whole", stop_at, workers=2)
    train(tmp_path / "run", stop_at, stop=True, workers=2)
    resumed = train(tmp_path / "run", stop_at, resume=True, workers=2)
    assert resumed["steps"] == {s: whole["steps"][s] for s in range(stop_at + 1, TOTAL + 1)}
    assert torch.equal(resumed["rows"], whole["rows"])


# -- through DeepSpeed: the loader of training_data, a SIGKILL, load_checkpoint in a fresh process --
WORKER = Path(__file__).with_name("resume_worker.py")


def started(root: Path, world: int, save_at: str, kill_at: int, name: str) -> Callable[[], None]:
    """Start the worker's run; what it returns waits for the run's end and checks how it ended."""
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [*launcher(world), str(WORKER), str(root), save_at, str(kill_at), name]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def ended() -> None:
        out, err = outcome(proc)
        if kill_at:
            assert proc.returncode != 0, "the run was to be killed"
        else:
            assert proc.returncode == 0, out[-3000:] + err[-3000:]

    return ended


def launch(root: Path, world: int, save_at: str, kill_at: int, name: str) -> None:
    started(root, world, save_at, kill_at, name)()


def results(root: Path, name: str, rank: int) -> dict:
    body = json.loads((root / f"{name}-{rank}.json").read_text())
    body["steps"] = {int(k): v for k, v in body["steps"].items()}
    return body


SAVES = "3,6,9,12,15,18,21"  # every third of the 24 steps (passes of 4 batches, epochs of 10)


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "kills"), [(1, [2, 5, 10, 14, 20, 23]), (2, [5, 20])])
def test_a_deepspeed_run_killed_again_and_again_resumes_at_the_next_batch_bit_exactly(tmp_path, world, kills):
    """SIGKILLed before its first save, mid-pass with the next pass read ahead, at and after an epoch's
    end, and in the last epoch, each time started again from the latest tag; at two ranks each rank
    resumes its own share of the data (DeepSpeed's sampler) with the sharded store. Every step any
    run trained is the uninterrupted run's step (same examples, bit-equal loss), and so are the
    final rows and dense parameters."""
    whole_ended = started(tmp_path / "full", world, SAVES, 0, "whole")  # beside the killed runs
    root = tmp_path / "killed"
    try:
        for i, kill in enumerate(kills):
            launch(root, world, SAVES, kill, f"run{i}")
        launch(root, world, SAVES, 0, "last")
    finally:  # (no run outlives the test)
        whole_ended()
    saved = [int(s) for s in SAVES.split(",")]
    for rank in range(world):
        whole = results(tmp_path / "full", "whole", rank)
        assert sorted(whole["steps"]) == list(range(1, 25))
        start = 0  # each run begins after the latest save before the previous run's kill
        for i, kill in enumerate(kills):
            run = results(root, f"run{i}", rank)["steps"]
            assert sorted(run) == list(range(start + 1, kill + 1)), (rank, i)
            assert all(run[s] == whole["steps"][s] for s in run), (rank, i)
            start = max([s for s in saved if s <= kill], default=0)
        last = results(root, "last", rank)
        assert sorted(last["steps"]) == list(range(start + 1, 25))
        assert all(last["steps"][s] == whole["steps"][s] for s in last["steps"])
        assert last["rows"] == whole["rows"] and last["dense"] == whole["dense"]


# -- the state as checkpoints keep it -----------------------------------------------------------------
def test_a_loaders_state_goes_to_json_and_back_to_equal_values():
    g = torch.Generator().manual_seed(4)
    state = {
        "generator": g.get_state(),
        "ints": {0: 1, 2: (3, 4.5)},
        "big": 2**63 - 1,
        "odd": [float("inf"), float("-inf"), b"\x00\xff", np.arange(3, dtype=np.int32), None, True],
        "__hierps__": "a user key that looks like a tag",
    }
    back = decode_state(json.loads(json.dumps(encode_state(state), allow_nan=False)))
    assert torch.equal(back["generator"], state["generator"]) and back["generator"].dtype == torch.uint8
    assert back["ints"] == {0: 1, 2: (3, 4.5)} and back["big"] == 2**63 - 1
    assert back["odd"][:3] == [float("inf"), float("-inf"), b"\x00\xff"] and back["odd"][4:] == [None, True]
    np.testing.assert_array_equal(back["odd"][3], np.arange(3, dtype=np.int32))
    assert back["__hierps__"] == state["__hierps__"]
    with pytest.raises(ConfigError, match=r"state\['sampler'\] is a object.*never pickled"):
        encode_state({"sampler": object()})


def test_the_position_is_in_the_checkpoint_and_a_plain_dataloader_is_told_what_to_use(tmp_path):
    store = hierps.Store(tmp_path / "s")
    store.table("t", DIM)
    loader = PassLoader(StatefulDataLoader(dataset(), batch_size=BATCH), {"t": 0}, store, pass_batches=PASS)
    for i, _ in enumerate(loader):
        if i == 5:
            break
    json.dumps(loader.state_dict(), default=lambda t: "tensor")  # plain values but the tensors
    with pytest.raises(ConfigError, match="'data_position' is where the tracked loader's position is kept"):
        store.checkpoint(extra={"data_position": 1})
    store.checkpoint("a")
    store.track_data(None)
    store.checkpoint("b")  # no loader tracked: no position
    fresh = PassLoader(StatefulDataLoader(dataset(), batch_size=BATCH), {"t": 0}, store, pass_batches=PASS)
    with pytest.warns(DataPositionWarning, match="checkpoint 2 holds no data position"):
        store.restore("b")
    store.restore("a")  # back to the batch after the sixth
    assert torch.equal(next(iter(fresh))[0], dataset()[6 * BATCH : 7 * BATCH][0])
    with pytest.warns(DataPositionWarning, match="Use torchdata.stateful_dataloader.StatefulDataLoader"):
        PassLoader(torch.utils.data.DataLoader(dataset(), batch_size=BATCH), {"t": 0}, store)
    with pytest.raises(ConfigError, match="expected an object with state_dict"):
        store.track_data([1, 2])
    store.close()
