"""``hierps bench --dropin``: a model written for plain PyTorch, trained through ``hierps.deepspeed.initialize``.

The model is written the way third-party CTR libraries write theirs: one ``nn.Embedding`` per
field, fed ``X[:, j:j+1].long()`` from one float tensor ``X`` that holds the dense features and
every field's id, a factorisation machine and an MLP on top (:class:`FieldModel`). The data are
the bench's synthetic Criteo-like examples (26 power-law fields, ids folded into each table's
range so that plain PyTorch can index them), batched by one ``torch.utils.data.DataLoader`` over
the same ``TensorDataset`` in every variant:

=====================  =====================================================================
variant                training
=====================  =====================================================================
torch                  the model as written (dense ``nn.Embedding``), one ``torch.optim.Adam``
torch-sparse           the tables ``sparse=True`` with ``torch.optim.Adagrad``, Adam for the rest
hierps-on-demand       ``hierps.deepspeed.initialize`` (tables into the store), the user's own
                       loop over the DataLoader: no pass announced, rows fetched on demand
hierps-training-data   ``hierps.deepspeed.initialize(training_data=dataset)`` and a loop over the
                       loader it returns (pass-aware; ``batch_ids`` found from the first batches)
=====================  =====================================================================

In both hierps variants the device tier holds ``device_fraction`` of the rows the epoch uses, so
the tables exceed it; the RAM tier holds them all. Each variant runs in its own process: a
warm-up epoch, then a timed one (examples/s); the ratios to the torch variants of the same run
are the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hierps.bench._worker import one_rank_ds_config, single_rank_env, spawn

__all__ = ["DROPIN_VARIANTS", "FieldModel", "run_from_args", "run_phase"]

DROPIN_VARIANTS = ("torch", "torch-sparse", "hierps-on-demand", "hierps-training-data")
_ROW_BYTES = (16 + 16 + 5) * 4 + 25  # dim 16, Adagrad state, counters, device-tier bookkeeping


class FieldModel(nn.Module):
    """DeepFM-style: per-field ``nn.Embedding``, second-order FM term, MLP. forward: X (B, 13 + F) -> (B,)."""

    def __init__(self, vocab_sizes: list[int], dim: int, n_dense: int = 13, sparse: bool = False) -> None:
        super().__init__()
        self.n_dense = n_dense
        self.embedding_dict = nn.ModuleDict(
            {f"C{j}": nn.Embedding(n, dim, sparse=sparse) for j, n in enumerate(vocab_sizes)}
        )
        for table in self.embedding_dict.parameters():
            nn.init.normal_(table, std=1e-2)
        self.dnn = nn.Sequential(
            nn.Linear(n_dense + len(vocab_sizes) * dim, 64),
            nn.ReLU(),
            nn.Linear(64, 32),
            nn.ReLU(),
            nn.Linear(32, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fields = [
            table(x[:, self.n_dense + j : self.n_dense + j + 1].long())
            for j, table in enumerate(self.embedding_dict.values())
        ]
        emb = torch.cat(fields, dim=1)  # (B, F, D)
        fm = 0.5 * (emb.sum(1).pow(2) - emb.pow(2).sum(1)).sum(1)
        deep = self.dnn(torch.cat([x[:, : self.n_dense], emb.flatten(1)], dim=1)).squeeze(1)
        return fm + deep


def _dataset(cfg: dict[str, Any]) -> tuple[torch.utils.data.TensorDataset, list[int], int]:
    """(examples as (X float32 (N, 13 + 26), labels), each table's rows, distinct ids of an epoch)."""
    from hierps.demo.data import CriteoSpec, generate
    from hierps.demo.models import remap_ids

    spec = CriteoSpec(total_vocab=cfg["rows"], seed=cfg["seed"])
    data = generate(spec, cfg["examples"], seed=cfg["seed"])
    sizes = list(spec.resolved_vocab_sizes)
    ids = remap_ids(data.sparse, sizes)
    x = np.concatenate([data.dense, ids.astype(np.float32)], axis=1)  # ids < 2**24: exact in float32
    distinct = sum(len(np.unique(ids[:, j])) for j in range(ids.shape[1]))
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(data.labels)), sizes, distinct


def _loader(data: torch.utils.data.TensorDataset, cfg: dict[str, Any]) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data, batch_size=cfg["batch_size"], shuffle=False, drop_last=True)


_LOSS = nn.BCEWithLogitsLoss()


def _epochs(step: Any, batches: Any) -> dict[str, Any]:
    """A warm-up epoch over ``batches``, then a timed one."""
    for batch in batches:
        step(batch)
    examples, t0 = 0, time.perf_counter()
    for batch in batches:
        step(batch)
        examples += len(batch[1])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "examples": examples, "examples_per_s": examples / seconds}


def _torch(cfg: dict[str, Any], sparse: bool) -> dict[str, Any]:
    data, sizes, _ = _dataset(cfg)
    torch.manual_seed(cfg["seed"])
    model = FieldModel(sizes, cfg["dim"], sparse=sparse)
    tables = list(model.embedding_dict.parameters())
    if sparse:
        dense = list(model.dnn.parameters())
        opts: list[torch.optim.Optimizer] = [
            torch.optim.Adagrad(tables, lr=cfg["lr_sparse"]),
            torch.optim.Adam(dense, lr=cfg["lr_dense"]),
        ]
    else:
        opts = [torch.optim.Adam(model.parameters(), lr=cfg["lr_dense"])]

    def step(batch: Any) -> None:
        x, y = batch
        _LOSS(model(x), y).backward()
        for o in opts:
            o.step()
            o.zero_grad()

    return _epochs(step, _loader(data, cfg))


def _hierps(cfg: dict[str, Any], tmp: Path, training_data: bool) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    single_rank_env()
    import deepspeed
    import deepspeed.ops

    import hierps.deepspeed

    # DeepSpeed compiles a shared-memory all-reduce for CPU ranks on first use; one rank needs none.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    data, sizes, distinct = _dataset(cfg)
    budget = int(cfg["device_fraction"] * distinct * _ROW_BYTES)
    torch.manual_seed(cfg["seed"])
    model = FieldModel(sizes, cfg["dim"])
    section = {
        "path": str(tmp / "store"),
        "memory_budget": "1GiB",
        "device_budget": budget,
        "modules": "auto",
        "auto_min_rows": 1,
        "pass_batches": cfg["pass_batches"],
        "optimizer": {"type": "adagrad", "params": {"lr": cfg["lr_sparse"]}},
    }
    config = one_rank_ds_config(cfg["batch_size"], section, dataloader_drop_last=True)
    engine, _, loader, _ = hierps.deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=cfg["lr_dense"]),
        config=config,
        training_data=data if training_data else None,
    )
    store = engine.hierps_store

    def step(batch: Any) -> None:
        x, y = batch
        engine.backward(_LOSS(engine(x), y))
        engine.step()

    try:
        record = _epochs(step, loader if training_data else _loader(data, cfg))
        record.update(
            device_budget=budget,
            distinct_rows=distinct,
            passes=store.passes,
            on_demand_rebuilds=store.stats.on_demand_rebuilds,
            on_demand_evictions=store.stats.on_demand_evictions,
        )
        return record
    finally:
        engine.destroy()


def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant of ``hierps bench --dropin`` in this process (the bench worker's entry point)."""
    cfg, name, tmp = spec["config"], spec["name"], Path(spec["tmp"])
    if name in ("torch", "torch-sparse"):
        return _torch(cfg, sparse=name == "torch-sparse")
    return _hierps(cfg, tmp, training_data=name == "hierps-training-data")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    return {
        "rows": args.rows or 1_000_000,
        "examples": args.examples or (32_768 if quick else 65_536),
        "batch_size": args.batch_size or 4096,
        "pass_batches": args.pass_batches or 4,
        "dim": args.dim or 16,
        "repeats": args.repeats or (1 if quick else 3),
        "threads": args.threads or 1,
        "device_fraction": getattr(args, "device_fraction", None) or 0.5,
        "seed": 0,
        "lr_sparse": 0.05,
        "lr_dense": 1e-3,
    }


def run_from_args(args: argparse.Namespace) -> int:
    """``hierps bench --dropin``: every variant ``repeats`` times, interleaved; medians and ratios."""
    import json

    cfg = _config(args)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in DROPIN_VARIANTS}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hierps-dropin-", dir=args.tmp) as tmp:
        for r in range(cfg["repeats"]):
            for name in DROPIN_VARIANTS:
                spec = {"task": "dropin", "name": name, "config": cfg, "tmp": str(Path(tmp) / f"{name}-{r}")}
                record = spawn(spec, timeout=1800.0)
                runs[name].append(record)
                rate = record.get("examples_per_s")
                print(
                    f"  [{time.perf_counter() - started:5.0f} s] {name}#{r + 1}: "
                    + (f"{rate:,.0f} examples/s" if rate else record.get("error", "?")[-300:])
                )
    medians = {
        name: statistics.median(r["examples_per_s"] for r in rs if "examples_per_s" in r)
        for name, rs in runs.items()
        if any("examples_per_s" in r for r in rs)
    }
    print(
        f"\nhierps bench --dropin: {cfg['examples']} examples per epoch, batches of {cfg['batch_size']}, {cfg['rows']:,}-id population"
    )
    print(f"{'variant':22} {'examples/s':>11} {'x torch':>8} {'x torch-sparse':>15}")
    for name, rate in medians.items():
        ratios = [f"{rate / medians[b]:.2f}" if b in medians else "-" for b in ("torch", "torch-sparse")]
        print(f"{name:22} {rate:11,.0f} {ratios[0]:>8} {ratios[1]:>15}")
    results = {
        "config": cfg,
        "runs": runs,
        "examples_per_s": medians,
        "seconds": time.perf_counter() - started,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0
