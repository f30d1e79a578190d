"""New rows depend only on (seed, table, key): not on order, batch, tier or process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hierps
from hierps.config import InitializerConfig
from hierps.rows._initializers import initial_rows, table_salt


def test_rows_do_not_depend_on_order_or_batching():
    keys = np.array([5, -9, 2**62, -(2**63), 0, 17], dtype=np.int64)
    salt = table_salt(3, "user")
    init = InitializerConfig("normal")
    whole = initial_rows(keys, 16, salt, init)
    perm = np.array([3, 0, 5, 1, 4, 2])
    np.testing.assert_array_equal(initial_rows(keys[perm], 16, salt, init), whole[perm])
    np.testing.assert_array_equal(initial_rows(keys[2:3], 16, salt, init), whole[2:3])


def test_rows_differ_by_table_seed_and_key():
    keys = np.arange(100, dtype=np.int64)
    init = InitializerConfig("normal")
    a = initial_rows(keys, 8, table_salt(0, "a"), init)
    assert not np.allclose(a, initial_rows(keys, 8, table_salt(0, "b"), init))
    assert not np.allclose(a, initial_rows(keys, 8, table_salt(1, "a"), init))
    assert len({row.tobytes() for row in a}) == 100


@pytest.mark.parametrize(("kind", "mean", "std"), [("normal", 0.0, 1.0), ("uniform", 0.0, 0.1 / np.sqrt(3))])
def test_distribution(kind, mean, std):
    init = InitializerConfig(kind, {"low": -0.1, "high": 0.1} if kind == "uniform" else {})
    rows = initial_rows(np.arange(20000, dtype=np.int64), 8, table_salt(0, "t"), init)
    assert rows.dtype == np.float32
    assert abs(rows.mean() - mean) < 0.02 * max(std, 0.1)
    assert abs(rows.std() - std) / std < 0.02


def test_same_rows_whatever_tier_or_pass_first_sees_the_key(make_store):
    a = make_store("a", memory_budget="1KiB", seed=7)
    b = make_store("b", memory_budget="64MiB", seed=7)
    ta = hierps.Embedding(None, 4, store=a, name="t")
    tb = hierps.Embedding(None, 4, store=b, name="t")
    probe = torch.tensor([3, -1, 99, 2**40])
    b.begin_pass({"t": torch.arange(-50, 50)})
    b.end_pass()
    torch.testing.assert_close(ta.lookup(probe), tb.lookup(probe), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ta(probe), tb(probe.flip(0)).flip(0), rtol=0, atol=0)
