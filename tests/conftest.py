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


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(False)
    yield
