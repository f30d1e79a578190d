"""The parts of a store built one by one on a bare core, each tested through its own methods.

``Store.__init__`` wires a :class:`StoreCore` (with its :class:`PassPipeline`), then
:class:`Features`, :class:`PassRunner`, :class:`SparseTrainer` and :class:`FeatureLifeCycle` on
it; here each is built the same way and checked against a reference computed by hand: the
initializer's rows, one SGD step, the counters after ``observe``, the tiers a read walks through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from hierps._core import StoreCore
from hierps.config import InitializerConfig, OptimizerConfig, StoreSettings
from hierps.errors import StoreFullError
from hierps.lifecycle._features import Features
from hierps.lifecycle._lifecycle import FeatureLifeCycle
from hierps.rows._initializers import initial_rows, table_salt
from hierps.rows._table import TableInfo
from hierps.tiers._device import DrainedRows
from hierps.training._passes import PassRunner
from hierps.training._pipeline import PassPipeline
from hierps.training._trainer import SparseTrainer

DIM = 4
LR = 0.125
SGD = OptimizerConfig("sgd", {"lr": LR})
# An SGD row is its weights and 5 counters: 9 words of 4 bytes, plus 25 bytes of bookkeeping.
ROW_BYTES = (DIM + 5) * 4 + 25


@dataclass
class Parts:
    core: StoreCore
    pipe: PassPipeline
    features: Features
    passes: PassRunner
    trainer: SparseTrainer
    life: FeatureLifeCycle

    def table(self, name: str = "t") -> TableInfo:
        """A new SGD table, registered in every tier."""
        info = TableInfo(name, DIM, SGD, InitializerConfig("normal"), table_salt(self.core.seed, name))
        self.core.register(info)
        return info

    def close(self) -> None:
        try:
            self.pipe.close()
        finally:
            self.core.ssd.close()
            self.core.unlock()


def build(path: Path, **settings: Any) -> Parts:
    """The parts of a store at ``path``, wired as ``Store.__init__`` wires them."""
    settings.setdefault("device", "cpu")
    settings.setdefault("seed", 7)
    core = StoreCore(path, StoreSettings.parse(**settings), PassPipeline)
    pipe = cast(PassPipeline, core.pipe)
    features = Features(core)
    passes = PassRunner(core, pipe, features)
    return Parts(
        core,
        pipe,
        features,
        passes,
        SparseTrainer(core, passes, features),
        FeatureLifeCycle(core, features, passes),
    )


@pytest.fixture
def make_parts(tmp_path: Path) -> Iterator[Callable[..., Parts]]:
    built: list[Parts] = []

    def make(**settings: Any) -> Parts:
        parts = build(tmp_path / f"store{len(built)}", **settings)
        built.append(parts)
        return parts

    yield make
    for parts in built:
        parts.close()


def initial_weights(parts: Parts, table: str, keys: np.ndarray) -> np.ndarray:
    """The reference: N(0, 1) weights drawn from (seed, table, key) alone."""
    return initial_rows(keys, DIM, table_salt(7, table), InitializerConfig("normal"))


def resident(parts: Parts, table: str) -> np.ndarray:
    """Keys resident in the device tier, sorted (rows loaded on demand are appended)."""
    return np.sort(next(k for t, _, k, _ in parts.core.device_tier.resident_keys().tables if t == table))


def device_rows(parts: Parts, table: str, keys: np.ndarray) -> np.ndarray:
    """Stored rows of resident ``keys``, read from the device tier itself."""
    tier = parts.core.device_tier
    found, slots = tier.resolve(table, torch.from_numpy(keys))
    assert bool(found.all())
    return tier.rows(table)[slots].numpy()


# -- PassRunner -------------------------------------------------------------------------------
def test_a_pass_loads_the_initializer_rows_of_its_keys(make_parts):
    parts = make_parts(pipeline=False)
    info = parts.table()
    parts.passes.begin_pass([{"t": [5, 3, 5, 11]}, {"t": np.array([3, 40])}])
    keys = np.array([3, 5, 11, 40], np.int64)
    np.testing.assert_array_equal(resident(parts, "t"), keys)
    np.testing.assert_array_equal(device_rows(parts, "t", keys), info.fresh_rows(keys, 0))
    np.testing.assert_array_equal(device_rows(parts, "t", keys)[:, :DIM], initial_weights(parts, "t", keys))
    assert parts.passes.in_pass and len(parts.passes.plan.groups) == 1
    parts.passes.end_pass()
    assert parts.core.passes == 1 and parts.core.stats.history[-1].new_rows == 4
    assert parts.core.device_tier.num_rows("t") == 0
    assert parts.core.memory.num_rows("t") == 0  # nothing trained: no row is dirty, none written


def test_a_pass_over_the_device_budget_is_loaded_group_by_group(make_parts):
    parts = make_parts(pipeline=False, device_budget=10 * ROW_BYTES)
    parts.table()
    first, second, third = np.arange(6), np.arange(6, 12), np.arange(4)
    parts.passes.begin_pass([{"t": first}, {"t": second}, {"t": third}])
    # 16 ids do not fit 10 rows; mini-batches 2 and 3 together are 10 distinct keys, which do.
    groups = [g["t"].tolist() for g in parts.passes.plan.groups]
    assert groups == [list(range(6)), [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]]
    np.testing.assert_array_equal(resident(parts, "t"), first)
    parts.passes.resident_slots("t", torch.from_numpy(second))  # training reaches mini-batch 2
    assert parts.passes.plan.cursor == 1
    np.testing.assert_array_equal(resident(parts, "t"), groups[1])
    parts.passes.end_pass()


def test_parse_batches_takes_one_mapping_or_a_list(make_parts):
    parts = make_parts()
    parts.table()
    one = parts.passes.parse_batches({"t": torch.tensor([4, 2])})
    assert len(one) == 1 and one[0]["t"].dtype == np.int64 and one[0]["t"].tolist() == [4, 2]
    assert [b["t"].tolist() for b in parts.passes.parse_batches([{"t": [1]}, {"t": [2, 3]}])] == [[1], [2, 3]]


# -- SparseTrainer ----------------------------------------------------------------------------
def test_one_sgd_step_is_the_hand_computed_update(make_parts):
    parts = make_parts(pipeline=False)
    info = parts.table()
    keys = np.array([2, 9, 30], np.int64)
    parts.passes.begin_pass({"t": keys})
    weights = parts.trainer.gather("t", torch.from_numpy(keys), requires_grad=True)
    np.testing.assert_array_equal(weights.detach().numpy(), initial_weights(parts, "t", keys))
    coef = torch.arange(len(keys) * DIM, dtype=torch.float32).reshape(len(keys), DIM) / 8
    (weights * coef).sum().backward()  # the gradient of each weight is its coefficient
    parts.trainer.step()
    expected = initial_weights(parts, "t", keys) - np.float32(LR) * coef.numpy()
    np.testing.assert_allclose(device_rows(parts, "t", keys)[:, :DIM], expected, rtol=0, atol=1e-7)
    assert info.step == 1 and parts.trainer.pending == []
    parts.passes.end_pass()  # the trained rows go down to RAM
    assert parts.core.memory.num_rows("t") == 3 and parts.core.memory.num_dirty("t") == 3
    np.testing.assert_allclose(parts.core.fetch("t", keys, touch=False)[:, :DIM], expected, rtol=0, atol=1e-7)


def test_apply_gradients_sums_the_gradients_of_a_key_first(make_parts):
    parts = make_parts(pipeline=False)
    info = parts.table()
    keys = torch.tensor([7, 7, 2])
    grads = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5], [-1.0, 0.0, 1.0, 8.0]])
    parts.trainer.apply_gradients("t", keys, grads)  # no pass: the rows load on demand
    w0 = initial_weights(parts, "t", np.array([2, 7], np.int64))
    expected = w0 - np.float32(LR) * np.stack([grads[2].numpy(), (grads[0] + grads[1]).numpy()])
    got = parts.core.whole_rows("t", np.array([2, 7], np.int64))[:, :DIM]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7)
    assert info.step == 1


# -- FeatureLifeCycle -------------------------------------------------------------------------
def test_counters_after_gathers_and_observe(make_parts):
    parts = make_parts(pipeline=False)
    parts.table()
    keys = np.array([1, 2, 3], np.int64)
    parts.passes.begin_pass({"t": keys})
    parts.trainer.gather("t", torch.from_numpy(keys), requires_grad=True)
    parts.trainer.gather("t", torch.tensor([2]), requires_grad=True)
    parts.trainer.zero_grad()
    parts.life.observe("t", np.array([1, 1, 2, 3, 99]), np.array([1.0, 0.0, 1.0, 0.0, 1.0]))
    counters = parts.life.counters("t", np.array([1, 2, 3, 99]))
    np.testing.assert_array_equal(counters["count"], [1, 2, 1, 0])  # sightings in gathers
    np.testing.assert_array_equal(counters["show"], [2, 1, 1, 0])  # 99 has no row: not counted
    np.testing.assert_array_equal(counters["click"], [1, 1, 0, 0])
    np.testing.assert_array_equal(counters["last_pass"], [0, 0, 0, 0])
    np.testing.assert_array_equal(parts.life.has_rows("t", [1, 99]), [True, False])
    parts.passes.end_pass()
    assert parts.core.memory.num_rows("t") == 3  # counted rows are dirty: they went down to RAM
    np.testing.assert_array_equal(parts.life.counters("t", keys)["show"], [2, 1, 1])


# -- StoreCore: reads and writes through the hierarchy ----------------------------------------
def test_fetch_reads_ram_then_ssd_then_the_initializer(make_parts):
    parts = make_parts()
    info = parts.table()
    core = parts.core
    newer, only_on_disk = np.full((1, info.words), 1.5, np.float32), np.full((1, info.words), 2.5, np.float32)
    core.ssd.write("t", np.array([1, 2], np.int64), np.concatenate([newer - 1, only_on_disk]))
    core.memory.put("t", np.array([1], np.int64), newer, dirty=True)  # RAM holds a newer row of key 1
    keys = np.array([1, 2, 3], np.int64)
    rows = core.fetch_many({"t": keys}, touch=True)["t"]
    np.testing.assert_array_equal(rows[0], newer[0])
    np.testing.assert_array_equal(rows[1], only_on_disk[0])
    np.testing.assert_array_equal(rows[2], info.fresh_rows(keys[2:], 0)[0])
    assert (core.memory.hits, core.memory.misses) == (1, 2)
    assert core.ssd.rows_read == 1  # key 1 was never asked of the SSD tier
    np.testing.assert_array_equal(core.stored("t", keys), [True, True, False])


def _drained(keys: np.ndarray, value: float, words: int) -> DrainedRows:
    """Rows leaving the device tier, every other one dirty."""
    rows = np.full((len(keys), words), value, np.float32)
    rows[:, 0] += keys
    return DrainedRows(keys, rows, np.arange(len(keys)) % 2 == 0)


def test_put_dirty_sends_dirty_rows_down_and_the_ram_tier_spills_to_ssd(make_parts):
    parts = make_parts(memory_budget=40 * ROW_BYTES)
    words = parts.table("t").words
    parts.table("u")
    keys = np.arange(100, dtype=np.int64)[::-1].copy()  # any order: the core sorts them
    drained = {"t": _drained(keys, 1.0, words), "u": _drained(keys, 2.0, words)}
    parts.core.put_dirty(drained)
    for table, d in drained.items():
        dirty = np.sort(d.keys[d.dirty])
        np.testing.assert_array_equal(parts.core.stored(table, d.keys), d.dirty)  # clean rows: not written
        order = np.argsort(d.keys[d.dirty])
        np.testing.assert_array_equal(parts.core.fetch(table, dirty, touch=False), d.rows[d.dirty][order])
    assert parts.core.memory.bytes_used <= 40 * ROW_BYTES
    assert parts.core.ssd.num_rows("t") > 0  # evicted through the sink the core gave the RAM tier


def test_put_dirty_keeps_every_row_in_ram_when_the_disk_is_full(make_parts, monkeypatch):
    parts = make_parts(memory_budget=40 * ROW_BYTES)
    words = parts.table("t").words
    parts.table("u")
    calls = []

    def full(*args: Any, **kwargs: Any) -> None:
        calls.append(args[0])
        raise StoreFullError("no space left on the test disk")

    monkeypatch.setattr(parts.core.ssd, "write", full)
    keys = np.arange(100, dtype=np.int64)
    drained = {"t": _drained(keys, 1.0, words), "u": _drained(keys, 2.0, words)}
    with pytest.raises(StoreFullError):
        parts.core.put_dirty(drained)
    assert calls  # the RAM tier did try to spill
    for table, d in drained.items():
        assert parts.core.memory.num_rows(table) == 50  # every dirty row, over budget
        _, rows = parts.core.memory.get(table, keys[d.dirty], touch=False)
        np.testing.assert_array_equal(rows, d.rows[d.dirty])
    assert parts.core.ssd.num_rows("t") == parts.core.ssd.num_rows("u") == 0
