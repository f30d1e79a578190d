"""Trains a table through two checkpoints; run as a subprocess by test_checkpoint.py.

usage: python crash_worker.py STORE OUT
Writes OUT/ref1.npy after the first checkpoint and OUT/ref2.npy after the second: every row
(weights and optimizer state) of keys KEYS, as the process sees them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

import hierps

VOCAB, DIM = 300, 4
KEYS = np.arange(-VOCAB // 2, VOCAB // 2, dtype=np.int64) * 7919


def train_steps(store: hierps.Store, bag: hierps.EmbeddingBag, seed: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    batches = [torch.from_numpy(KEYS[(rng.zipf(1.2, size=24) - 1) % VOCAB]) for _ in range(steps)]
    for start in range(0, steps, 4):
        group = batches[start : start + 4]
        with store.run_pass([{"t": ids} for ids in group]):
            for ids in group:
                out = bag(ids, torch.arange(0, 24, 3))
                (out**2).sum().backward()
                store.step()


def main(store_path: str, out: str) -> None:
    out_dir = Path(out)
    store = hierps.Store(
        store_path,
        memory_budget="1KiB",
        device="cpu",
        max_segments=4,
        optimizer={"type": "adam", "params": {"lr": 0.01}},
    )
    bag = hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name="t")
    train_steps(store, bag, seed=1, steps=12)
    store.checkpoint("first")
    np.save(out_dir / "ref1.npy", store.read_rows("t", KEYS), allow_pickle=False)
    train_steps(store, bag, seed=2, steps=12)
    store.checkpoint("second")
    np.save(out_dir / "ref2.npy", store.read_rows("t", KEYS), allow_pickle=False)
    store.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
