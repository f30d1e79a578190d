"""Bad input gets a clear error naming the problem, and changes nothing in the store."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

import hierps
from hierps import errors

KEYS = np.arange(0, 40, dtype=np.int64)


def _snapshot(store):
    return store.read_rows("t", KEYS).copy(), store.tables["t"].step, store.num_rows("t")


def _unchanged(store, before):
    rows, step, counts = before
    np.testing.assert_array_equal(store.read_rows("t", KEYS), rows)
    assert store.tables["t"].step == step
    assert store.num_rows("t") == counts


def test_float_ids_are_refused(trained):
    store, bag = trained
    before = _snapshot(store)
    with pytest.raises(errors.InvalidIdsError, match="dtype torch.float32"):
        bag(torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(errors.InvalidIdsError, match="float"):
        store.lookup("t", np.array([1.5]))
    _unchanged(store, before)


def test_ids_on_the_wrong_device_are_refused(trained):
    store, bag = trained
    before = _snapshot(store)
    with pytest.raises(errors.InvalidIdsError, match="ids are on meta, the store trains on cpu"):
        bag(torch.tensor([1, 2], device="meta"), torch.tensor([0], device="meta"))
    _unchanged(store, before)


def test_ids_outside_int64_are_refused(trained):
    store, _ = trained
    with pytest.raises(errors.InvalidIdsError, match="outside int64"):
        store.lookup("t", np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(errors.InvalidIdsError, match="outside int64"):
        store.lookup("t", np.array([2**70], dtype=object))


def test_mini_batch_larger_than_device_budget(trained):
    store, bag = trained
    before = _snapshot(store)
    row = 4 * 8 + 25  # adagrad: 4 weights + 4 state floats, plus bookkeeping
    n = 64 * 1024 // row + 1
    with pytest.raises(errors.DeviceBudgetError, match="more than its budget of 65536 bytes"):
        bag(torch.arange(1000, 1000 + n), torch.tensor([0]))
    with pytest.raises(errors.DeviceBudgetError):
        store.begin_pass([{"t": torch.arange(1000, 1000 + n)}])
    _unchanged(store, before)


def test_nan_and_inf_gradients_are_rejected_before_any_update(trained):
    store, bag = trained
    before = _snapshot(store)
    for bad in (float("nan"), float("inf")):
        out = bag(torch.arange(0, 12), torch.tensor([0, 6]))
        (out.sum() * torch.tensor(bad)).backward()
        with pytest.raises(
            errors.NonFiniteGradientError, match=r"NaN or inf gradient for table\(s\) \['t'\]"
        ):
            store.step()
        _unchanged(store, before)
    # The store goes on training afterwards.
    bag(torch.arange(0, 12), torch.tensor([0, 6])).sum().backward()
    store.step()
    assert store.tables["t"].step == before[1] + 1


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        (torch.tensor([1, 3]), "offsets must start at 0"),
        (torch.tensor([0, 5, 2]), "non-decreasing"),
        (torch.tensor([0, 99]), "past the end of input"),
        (torch.tensor([0.0, 2.0]), "int64"),
        (None, "1D input needs offsets"),
    ],
)
def test_bad_offsets(trained, offsets, message):
    store, bag = trained
    before = _snapshot(store)
    with pytest.raises(errors.OffsetsError, match=message):
        bag(torch.arange(0, 8), offsets)
    _unchanged(store, before)


def test_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(errors.StoreFormatError, match="is not a hierps store"):
        hierps.Store(tmp_path, device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.csv"]


def test_store_of_another_format_version(make_store, tmp_path):
    store = make_store("s")
    store.close()
    from hierps.storage._files import write_json_atomic

    write_json_atomic(tmp_path / "s" / "hierps.json", {"format": "hierps-store", "format_version": 99})
    with pytest.raises(errors.StoreFormatError, match="format version 99"):
        hierps.Store(tmp_path / "s", device="cpu")


def test_table_reopened_with_another_dim(trained, tmp_path):
    store, _ = trained
    with pytest.raises(errors.TableMismatchError, match="dim 4, asked for dim 8"):
        hierps.EmbeddingBag(None, 8, store=store, name="t")
    path = store.path
    store.close()
    reopened = hierps.Store(path, device="cpu")
    try:
        with pytest.raises(errors.TableMismatchError, match="dim 4, asked for dim 8"):
            reopened.table("t", 8)
        with pytest.raises(errors.TableMismatchError, match="carry adagrad state, asked for sgd"):
            reopened.table("t", 4, optimizer={"type": "sgd", "params": {"lr": 0.1}})
    finally:
        reopened.close()


def test_second_writer_is_refused(trained):
    store, _ = trained
    with pytest.raises(errors.StoreLockedError, match="another process has this store open"):
        hierps.Store(store.path, device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_budget": -5}, "memory_budget: a size must not be negative"),
        ({"device_budget": "12 parsecs"}, "device_budget: cannot read '12 parsecs'"),
        ({"optimizer": "adadelta"}, "unknown sparse optimizer 'adadelta'"),
        ({"optimizer": {"type": "adam", "params": {"momentum": 0.9}}}, "adam takes no parameter 'momentum'"),
        ({"eviction": "random"}, "eviction: expected one of"),
    ],
)
def test_bad_settings(tmp_path, kwargs, message):
    with pytest.raises(errors.ConfigError, match=message):
        hierps.Store(tmp_path / "s", device="cpu", **kwargs)


def test_closed_store(trained):
    store, bag = trained
    ids, offsets = torch.arange(0, 30), torch.tensor([0, 10, 20])
    store.begin_pass([{"t": ids}])  # an announced mini-batch: its forward would take the planned path
    store.close()
    with pytest.raises(errors.StoreClosedError):
        bag.lookup(torch.tensor([1]))
    with pytest.raises(errors.StoreClosedError):
        bag(ids, offsets)


# -- more bad input, each refused before anything changes -------------------------------------


def test_ids_outside_int64_through_every_entry_point(trained):
    store, bag = trained
    before = _snapshot(store)
    with pytest.raises(errors.InvalidIdsError, match="dtype torch.uint64"):
        bag(torch.tensor([2**63], dtype=torch.uint64), torch.tensor([0]))
    for call in (
        lambda: store.read_rows("t", [2**64]),
        lambda: store.begin_pass({"t": [2**63]}),
        lambda: store.write("t", [-(2**63) - 1], np.zeros((1, 4), np.float32)),
    ):
        with pytest.raises(errors.InvalidIdsError, match="outside int64"):
            call()
    _unchanged(store, before)


@pytest.mark.parametrize("ids", [np.array([1.0, 2.0]), np.array([np.nan]), np.array([True]), ["1", "2"]])
def test_non_integer_ids_in_a_pass_or_a_write(trained, ids):
    store, _ = trained
    before = _snapshot(store)
    with pytest.raises(errors.InvalidIdsError, match="expected integer ids"):
        store.begin_pass([{"t": ids}])
    with pytest.raises(errors.InvalidIdsError, match="expected integer ids"):
        store.write("t", ids, np.zeros((len(ids), 4), np.float32))
    _unchanged(store, before)


def test_bad_pass_leaves_the_running_pass_alone(trained):
    store, bag = trained
    store.begin_pass({"t": torch.arange(0, 10)})
    resident = store.num_rows("t")["device"]
    with pytest.raises(errors.InvalidIdsError):
        store.begin_pass([{"t": np.array([0.5])}])
    with pytest.raises(errors.ConfigError, match="unknown table 'nope'"):
        store.begin_pass({"nope": [1]})
    assert store.num_rows("t")["device"] == resident and store.passes == 0
    bag(torch.arange(0, 10), torch.tensor([0, 5])).sum().backward()
    store.step()
    store.end_pass()


def test_bad_writes(trained):
    store, _ = trained
    before = _snapshot(store)
    with pytest.raises(errors.ConfigError, match="keys must be unique"):
        store.write("t", [1, 1], np.zeros((2, 4), np.float32))
    with pytest.raises(errors.ConfigError, match=r"weights of shape \(2, 5\) for 2 keys of dim 4"):
        store.write("t", [1, 2], np.zeros((2, 5), np.float32))
    _unchanged(store, before)


def test_mismatched_bags_and_weights(trained):
    store, bag = trained
    before = _snapshot(store)
    with pytest.raises(errors.OffsetsError, match="offsets must be None when input is 2D"):
        bag(torch.arange(0, 8).reshape(2, 4), torch.tensor([0]))
    with pytest.raises(errors.OffsetsError, match="per_sample_weights of shape"):
        bag(torch.arange(0, 8), torch.tensor([0, 4]), per_sample_weights=torch.ones(5))
    with pytest.raises(errors.OffsetsError, match="input must be 1D"):
        bag(torch.arange(0, 8).reshape(2, 2, 2), None)
    _unchanged(store, before)


def test_non_finite_gradient_in_one_table_updates_no_table(make_store):
    store = make_store(memory_budget="1KiB")
    good = hierps.EmbeddingBag(None, 4, mode="sum", store=store, name="good")
    bad = hierps.Embedding(None, 3, store=store, name="bad")
    ids = torch.arange(0, 12)
    rows = {t: store.read_rows(t, KEYS).copy() for t in ("good", "bad")}
    loss = good(ids, torch.tensor([0, 6])).sum() + bad(ids).sum() * torch.tensor(float("inf"))
    loss.backward()
    with pytest.raises(errors.NonFiniteGradientError, match=r"table\(s\) \['bad'\]"):
        store.step()
    for t in ("good", "bad"):
        np.testing.assert_array_equal(store.read_rows(t, KEYS), rows[t])
        assert store.tables[t].step == 0


def test_second_writer_in_another_process_is_refused(tmp_path):
    import crash_scenario as cs

    from hierps.tiers._reader import CheckpointReader

    path, out = tmp_path / "s", tmp_path / "holder"
    holder = cs.start_forked(cs.hold, path, out)
    try:
        for _ in range(3000):
            if (out / "ready").exists() or not holder.is_alive():
                break
            time.sleep(0.01)
        assert (out / "ready").exists(), "the holding process did not open the store"
        listing = sorted(p.relative_to(path) for p in path.rglob("*"))
        with pytest.raises(errors.StoreLockedError, match="another process has this store open for writing"):
            hierps.Store(path, device="cpu")
        assert sorted(p.relative_to(path) for p in path.rglob("*")) == listing
        assert CheckpointReader(path).manifest["tag"] == "held"  # readers take no lock
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a killed writer leaves no stale lock behind
        holder.join()
    with hierps.Store(path, device="cpu") as store:
        assert store.list_checkpoints()[-1]["tag"] == "held"


def test_offsets_changed_in_place_are_checked_again(trained):
    store, bag = trained
    offsets = torch.tensor([0, 4])
    bag(torch.arange(0, 8), offsets)  # checked once, then remembered
    offsets[0] = 3  # same object, changed: must be checked again
    with pytest.raises(errors.OffsetsError, match="offsets must start at 0"):
        bag(torch.arange(0, 8), offsets)
    with pytest.raises(errors.OffsetsError, match="past the end of input"):
        bag(torch.arange(0, 3), torch.tensor([0, 4]))


def test_write_rows_with_a_repeated_key_is_refused_and_checkpoints_go_on(make_store):
    """A key repeated across the slices write_rows sorts and encodes (2^18 rows each) is found too;
    nothing is written, and every later checkpoint works (repeated keys in the RAM tier made every
    checkpoint fail, for the rest of the process)."""
    store = make_store(memory_budget="1MiB")
    info = store.table("t", 4)
    n = (1 << 18) + 1
    keys = np.arange(n, dtype=np.int64)
    keys[-1] = (1 << 18) - 1  # sorted, the two copies meet where the first slice ends
    rows = np.zeros((n, info.width), np.float32)
    with pytest.raises(errors.ConfigError, match=f"key {(1 << 18) - 1} appears more than once"):
        store.write_rows("t", keys, rows)
    assert store.num_rows("t") == {"device": 0, "memory": 0, "ssd": 0}
    store.write_rows("t", keys[:-1][::-1], rows[:-1])  # unique, in reverse order: written
    ckpt = store.checkpoint()
    path = store.path
    store.close()
    with hierps.Store(path, device="cpu") as again:
        assert again.checkpoint_id == ckpt and again.num_rows("t")["ssd"] == n - 1


def test_end_pass_counts_each_pass_once(trained):
    store, bag = trained
    with pytest.raises(errors.ConfigError, match="no pass is open"):
        store.end_pass()
    assert store.passes == 0
    with store.run_pass({"t": torch.arange(0, 10)}):
        bag(torch.arange(0, 10), torch.tensor([0, 5])).sum().backward()
        store.step()
    assert store.passes == 1
    with pytest.raises(errors.ConfigError, match=r"no pass is open \(1 passes closed"):
        store.end_pass()  # a repeated end_pass does not count the pass again
    assert store.passes == 1


def test_retire_checkpoints_keeps_only_checkpoint_ids(make_store):
    store = make_store(keep_checkpoints=10)
    store.table("t", 4)
    for i in range(4):
        store.write("t", [i], np.full((1, 4), i, np.float32))
        store.checkpoint(tag=f"c{i}")
    ids = [c["id"] for c in store.list_checkpoints()]
    for keep, message in [("x", "keep is a str"), ([999], "no checkpoint 999"), ({1, "2"}, "keep holds '2'")]:
        with pytest.raises(errors.ConfigError, match=message):
            store.retire_checkpoints(keep)
        assert [c["id"] for c in store.list_checkpoints()] == ids  # nothing retired
    store.retire_checkpoints([np.int64(ids[1])])
    assert [c["id"] for c in store.list_checkpoints()] == [ids[1], ids[-1]]  # and the current one


def test_a_table_keeps_its_initializer(make_store, tmp_path):
    store = make_store(seed=3)
    info = store.table("t", 4, initializer="uniform", optimizer={"type": "adagrad", "params": {"lr": 0.1}})
    before = store.lookup("t", [5, 6]).clone()
    with pytest.raises(errors.TableMismatchError, match=r"initializer \{'type': 'uniform'"):
        store.table("t", 4, initializer={"type": "uniform", "params": {"low": -1.0, "high": 1.0}})
    assert store.table("t", 4, initializer="uniform") is info  # the same one: taken
    store.checkpoint()
    store.close()
    with hierps.Store(tmp_path / "store", device="cpu") as again:
        with pytest.raises(errors.TableMismatchError, match="cannot follow a new initializer"):
            again.table("t", 4, initializer="normal", optimizer={"type": "adagrad", "params": {"lr": 0.5}})
        assert again.tables["t"].optimizer.params["lr"] == 0.1  # refused whole: nothing else changed
        again.table("t", 4, optimizer={"type": "adagrad", "params": {"lr": 0.5}})  # new hyper-parameters
        assert again.tables["t"].optimizer.params["lr"] == 0.5
        torch.testing.assert_close(again.lookup("t", [5, 6]), before, rtol=0, atol=0)


def test_eps_zero_is_taken_only_where_no_step_divides_by_zero(make_store):
    store = make_store()
    opt = {"type": "adagrad", "params": {"eps": 0, "initial_accumulator_value": 0.1}}
    assert store.table("a", 4, optimizer=opt).optimizer.params["eps"] == 0
    with pytest.raises(errors.ConfigError, match="rowwise_adagrad needs eps > 0"):
        store.table("r", 4, optimizer={"type": "rowwise_adagrad", "params": {"eps": 0.0}})
    with pytest.raises(errors.ConfigError, match=r"eps: expected a number >= 0.0"):
        store.table("r", 4, optimizer={"type": "adam", "params": {"eps": -1e-8}})
