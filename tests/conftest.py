from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

import hierps  # noqa: E402


@pytest.fixture
def make_store(tmp_path):
    """Stores under the test's tmp dir, closed at teardown."""
    opened: list[hierps.Store] = []

    def make(name: str = "store", **kwargs) -> hierps.Store:
        kwargs.setdefault("device", "cpu")
        store = hierps.Store(tmp_path / name, **kwargs)
        opened.append(store)
        return store

    yield make
    for s in opened:
        s.close()


@pytest.fixture
def trained(make_store):
    """A store with one table ``t`` (dim 4) trained three steps over keys 0..31, checkpointed; its bag."""
    store = make_store(memory_budget="1KiB", device_budget="64KiB")
    bag = hierps.EmbeddingBag(None, 4, mode="sum", store=store, name="t")
    for i in range(3):
        ids = torch.arange(i, i + 30)
        bag(ids, torch.tensor([0, 10, 20])).sum().backward()
        store.step()
    store.checkpoint()
    return store, bag


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(False)
    yield
