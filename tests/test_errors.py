"""Bad input gets a clear error naming the problem, and changes nothing in the store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hierps
from hierps import errors

KEYS = np.arange(0, 40, dtype=np.int64)


@pytest.fixture
def trained(make_store):
    store = make_store(memory_budget="1KiB", device_budget="64KiB")
    bag = hierps.EmbeddingBag(None, 4, mode="sum", store=store, name="t")
    for i in range(3):
        ids = torch.arange(i, i + 30)
        bag(ids, torch.tensor([0, 10, 20])).sum().backward()
        store.step()
    store.checkpoint()
    return store, bag


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
        with pytest.raises(errors.NonFiniteGradientError, match=r"NaN or inf gradient for table\(s\) \['t'\]"):
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
    from hierps._files import write_json_atomic

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
    store.close()
    with pytest.raises(errors.StoreClosedError):
        bag.lookup(torch.tensor([1]))
