"""examples/dlrm_reference: the reference DLRM (a bag and its own offsets per table) trains through the
store exactly as plain PyTorch trains it, built eagerly or on the meta device."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_deepspeed import process_group

from hierps.config import InitializerConfig
from hierps.demo.data import BagSpec, generate_bags, kaggle_table_sizes
from hierps.rows import initial_rows, table_salt

__all__ = ["process_group"]  # the fixture shared with test_deepspeed

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dlrm_reference"
SIZES = kaggle_table_sizes(500)  # 11,219 rows: the Kaggle tables, capped small
STEPS, PASS = 6, 2
TOL = {"rtol": 0, "atol": 1e-5}
LR = json.loads((EXAMPLE / "ds_config.json").read_text())["hierarchical_ps"]["optimizer"]["params"]["lr"]


def load_example():
    spec = importlib.util.spec_from_file_location("dlrm_reference_train", EXAMPLE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config(tmp_path: Path, memory_budget: str = "64KiB") -> dict:
    """The example's config with a store under ``tmp_path``, a small RAM tier and passes of 2 batches."""
    cfg = json.loads((EXAMPLE / "ds_config.json").read_text())
    cfg["hierarchical_ps"].update(
        path=str(tmp_path / "store"), memory_budget=memory_budget, pass_batches=PASS
    )
    return cfg


def batches(n_examples: int = STEPS * 1024) -> list:
    return list(generate_bags(BagSpec(SIZES), n_examples).batches(1024, drop_last=True))


def test_the_reference_dlrm_trains_through_the_store_like_plain_pytorch(tmp_path):
    ex = load_example()
    data = batches()
    ref = ex.build_model(SIZES, seed=0)
    expected = ex.train_plain(ref, data, lr=LR)
    # 64 KiB of RAM tier: rows go back and forth between RAM and SSD between the passes.
    engine, losses = ex.train_hierps(ex.build_model(SIZES, seed=0), data, config(tmp_path), lr=LR)
    try:
        store = engine.hierps_store
        assert len(engine.hierps_modules) == 26 and store.passes == STEPS // PASS
        assert store.usage().ssd_rows > 0
        np.testing.assert_allclose(losses, expected, **TOL)
        assert expected[-1] < expected[0] - 0.02  # it learns
        for k in (2, 8, 20):  # a big table, the 3-row one, another big one
            keys = torch.arange(SIZES[k])
            torch.testing.assert_close(engine.module.tables[k].lookup(keys), ref.tables[k].weight, **TOL)
        # Evaluation reads the rows where they are: the same click probabilities as torch's.
        test = list(generate_bags(BagSpec(SIZES), 2048, seed=1).batches(1024))
        with torch.no_grad():
            for b in test:
                torch.testing.assert_close(engine.module(*b[:3]), ref(*b[:3]), rtol=0, atol=1e-4)
        assert ex.evaluate(engine.module, test) == pytest.approx(ex.evaluate(ref, test), abs=1e-4)
    finally:
        engine.destroy()


def test_a_meta_build_trains_like_plain_pytorch_from_the_initializer_rows(tmp_path):
    ex = load_example()
    data = batches(4 * 1024)
    cfg = config(tmp_path)
    engine, losses = ex.train_hierps(ex.build_model(SIZES, seed=0, meta=True), data, cfg, lr=LR)
    engine.destroy()
    # Plain PyTorch from the same dense values (torch's init under the seed) and, for each row the
    # batches read, the row the store's initializer gave it.
    ref = ex.build_model(SIZES, seed=0)
    init = InitializerConfig.parse(cfg["hierarchical_ps"]["initializer"])
    with torch.no_grad():
        for k, table in enumerate(ref.tables):
            keys = np.unique(np.concatenate([b.ids[k].numpy() for b in data]))
            rows = initial_rows(keys, 16, table_salt(0, f"tables.{k}"), init)
            table.weight[torch.from_numpy(keys)] = torch.from_numpy(rows)
    np.testing.assert_allclose(losses, ex.train_plain(ref, data, lr=LR), **TOL)


def test_the_script_runs_past_ram_on_the_meta_device(tmp_path, capsys):
    ex = load_example()
    # 33.8M x 100 = 3.4e9 rows of dim 16 (216 GB of float32): never allocated.
    result = ex.main(
        [
            "--meta",
            "--max-ind-range=-1",
            "--table-scale=100",
            "--steps=2",
            "--examples=2048",
            "--test-examples=1024",
            f"--store={tmp_path / 'store'}",
            "--memory-budget=4MiB",
            f"--json={tmp_path / 'out.json'}",
        ]
    )
    assert result["rows"] == 100 * sum(kaggle_table_sizes(None)) and len(result["losses"]) == 2
    assert json.loads((tmp_path / "out.json").read_text())["losses"] == result["losses"]
    assert "test AUC" in capsys.readouterr().out
