"""examples/deepctr_movielens: deepctr-torch's DeepFM on MovieLens-100k trains through the store like plain PyTorch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_deepspeed import engines, process_group

from hierps.errors import StaleWeightError

__all__ = ["engines", "process_group"]  # fixtures shared with test_deepspeed

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "deepctr_movielens" / "train.py"


def load_example():
    spec = importlib.util.spec_from_file_location("deepctr_movielens_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deepfm_on_movielens_trains_in_passes_like_plain_pytorch(tmp_path, monkeypatch):
    ex = load_example()
    codes, labels = ex.movielens_100k(limit=3000)
    assert len(labels) == 3000 and 0.3 < labels.mean() < 0.7  # ratings of 4-5 are clicks
    cut = 2400
    train = ex.as_tensors({k: v[:cut] for k, v in codes.items()}, labels[:cut])
    test = ex.as_tensors({k: v[cut:] for k, v in codes.items()}, labels[cut:])
    config = {
        "train_micro_batch_size_per_gpu": 200,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "hierarchical_ps": {
            "path": str(tmp_path / "store"),
            "memory_budget": "1MiB",
            "device_budget": "48KiB",  # less than the tables' rows: passes are split, evaluation streams
            "modules": "auto",
            "auto_min_rows": 1,
            "pass_batches": 4,
            "optimizer": {"type": "sgd", "params": {"lr": 0.5}},
        },
    }
    ref = ex.build_model(codes)
    engine, losses = ex.train_hierps(ex.build_model(codes), train, config, epochs=1, lr_dense=1e-2)
    try:
        assert (
            len(engine.hierps_modules) == 12 and not engine.hierps_swap.dense
        )  # DeepFM's and its linear part's
        assert engine.hierps_store.passes >= 2
        # DeepSpeed's loader drew the batches with a seeded DistributedSampler: plain PyTorch takes the same.
        sampler = torch.utils.data.DistributedSampler(train, num_replicas=1, rank=0)
        batches = list(torch.utils.data.DataLoader(train, batch_size=200, sampler=sampler))
        expected = ex.train_plain(ref, batches, lr_sparse=0.5, lr_dense=1e-2)
        assert losses == pytest.approx(expected, rel=1e-4, abs=1e-5)
        assert ex.evaluate(engine.module, test) == pytest.approx(ex.evaluate(ref, test), abs=1e-6)
        kept = engine.module.regularization_weight[0][0]  # deepctr keeps the old embedding weights for L2
        with pytest.raises(StaleWeightError, match="L2 regularisation"):
            sum((w**2).sum() for w in kept)
    finally:
        engine.destroy()


def test_the_loader_found_the_columns_of_deepctrs_input(tmp_path):
    ex = load_example()
    codes, labels = ex.movielens_100k(limit=600)
    config = {
        "train_micro_batch_size_per_gpu": 100,
        "zero_optimization": {"stage": 0},
        "hierarchical_ps": {"path": str(tmp_path / "s"), "auto_min_rows": 1, "pass_batches": 2},
    }
    engine, _ = ex.train_hierps(ex.build_model(codes), ex.as_tensors(codes, labels), config, 1, 1e-3)
    try:
        # 6 batches: the first on demand while the loader finds each table's column, then 2 + 2 + 1.
        assert engine.hierps_store.passes == 3
    finally:
        engine.destroy()
