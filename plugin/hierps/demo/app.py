"""``hierps demo``: a DLRM-style click model trained through the store, rows spilling to SSD.

Data is Criteo-format: 13 dense and 26 categorical features, generated here (power-law id
frequencies, labels from a hidden teacher) or read from real Criteo TSV files (``--data``).
The RAM budget defaults to a fraction of the table so that rows spill to the SSD tier.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import hierps
from hierps.config import parse_int, parse_number, parse_size
from hierps.demo.data import CriteoData, CriteoSpec, generate, read_criteo_tsv
from hierps.demo.metrics import auc
from hierps.demo.models import ClickModel, make_model
from hierps.errors import ConfigError

__all__ = ["DemoConfig", "build_model", "load_data", "run_demo", "table_names"]


@dataclass
class DemoConfig:
    """Settings of the demo job; defaults finish in well under two minutes on two CPU cores."""

    examples: int = 300_000  # synthetic examples (train + test)
    test_fraction: float = 0.1
    data: str | None = None  # path of Criteo TSV file(s); None: synthetic
    max_rows: int | None = None  # cap on rows read from --data
    batch_size: int = 2048
    pass_batches: int = 16  # mini-batches per pass (the working set loaded at once)
    embedding_dim: int = 16
    memory_budget: str = "4MiB"  # about 1/8 of the synthetic table: most rows live on SSD
    device_budget: str = "512MiB"
    store: str | None = None  # store directory; None: a temporary one
    lr_sparse: float = 0.05
    lr_dense: float = 1e-3
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        """Every setting checked here, before any data is made or read (``ConfigError`` naming it)."""
        for name in ("examples", "batch_size", "pass_batches", "embedding_dim"):
            parse_int(name, getattr(self, name), 1)
        parse_int("max_rows", self.max_rows, 1, optional=True)
        parse_int("seed", self.seed, 0)
        parse_number("test_fraction", self.test_fraction, low=0.0, high=1.0, low_open=True)
        if self.test_fraction == 1.0:
            raise ConfigError(
                "test_fraction: expected a number < 1 (some examples must train). Got 1.0 instead."
            )
        for name in ("lr_sparse", "lr_dense"):
            parse_number(name, getattr(self, name), low=0.0)
        for name in ("memory_budget", "device_budget"):
            parse_size(getattr(self, name), name)
        if self.data is not None and not Path(self.data).exists():
            raise ConfigError(
                f"data: no file or directory {self.data!r}; give Criteo TSV file(s), or no data."
            )


def table_names(n_sparse: int = 26) -> list[str]:
    return [f"tables.{i}" for i in range(n_sparse)]


def load_data(cfg: DemoConfig) -> tuple[CriteoData, CriteoData]:
    """(train, test) examples; ``ConfigError`` for a TSV file that does not parse."""
    if cfg.data:
        try:
            data = read_criteo_tsv(cfg.data, max_rows=cfg.max_rows)
        except ValueError as exc:  # a line that is not Criteo TSV: the message names the file
            raise ConfigError(f"data: {exc}") from exc
    else:
        data = generate(CriteoSpec(seed=cfg.seed), cfg.examples, seed=cfg.seed)
    return data.split(1.0 - cfg.test_fraction)


def _check_split(train: CriteoData, probe: CriteoData) -> None:
    """Enough examples to train on and to measure an AUC (clicks and non-clicks among the probe's)."""
    labels = set(np.unique(probe.labels).tolist())
    if len(train) == 0 or labels != {0.0, 1.0}:
        raise ConfigError(
            f"examples: {len(train)} to train on and {len(probe)} to test, with labels {sorted(labels)}: an "
            "AUC needs both clicks and non-clicks among the test examples. Use more examples (e.g. 10000)."
        )


def build_model(
    store: hierps.Store,
    cfg: DemoConfig,
    n_dense: int = 13,
    n_sparse: int = 26,
    kind: str = "dlrm",
    optimizer: Any = None,
    weights_dtype: str = "fp32",
    state_dtype: str = "fp32",
) -> ClickModel:
    """The model (``"dlrm"`` or ``"wide"``, see :mod:`hierps.demo.models`) with each ``tables.i`` a
    ``hierps.EmbeddingBag`` keyed by raw feature ids, its rows stored in ``weights_dtype`` /
    ``state_dtype`` and trained by ``optimizer`` (default: Adagrad at ``cfg.lr_sparse``)."""
    torch.manual_seed(cfg.seed)
    model = make_model(kind, [1] * n_sparse, cfg.embedding_dim, n_dense=n_dense)
    init = {"type": "uniform", "params": {"low": -0.01, "high": 0.01}}
    opt = optimizer if optimizer is not None else {"type": "adagrad", "params": {"lr": cfg.lr_sparse}}
    spec = hierps.TableSpec.of(
        optimizer=opt, initializer=init, weights_dtype=weights_dtype, state_dtype=state_dtype
    )
    for i, name in enumerate(table_names(n_sparse)):
        model.tables[i] = hierps.EmbeddingBag(
            None, cfg.embedding_dim, mode="sum", store=store, name=name, spec=spec
        )
    return model.to(store.device)


def evaluate(
    model: nn.Module, data: CriteoData, device: torch.device, batch_size: int = 8192
) -> tuple[float, float]:
    """(AUC, log loss) of the model on ``data``."""
    model.eval()
    scores = []
    with torch.no_grad():
        for dense, sparse, _ in data.batches(batch_size):
            scores.append(torch.sigmoid(model(dense.to(device), sparse.to(device))).cpu().numpy())
    model.train()
    p = np.clip(np.concatenate(scores), 1e-7, 1 - 1e-7)
    y = data.labels
    return auc(y, p), float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


def run_demo(cfg: DemoConfig, out: Callable[[str], Any] = print) -> dict[str, Any]:
    """Train one epoch pass by pass; print per-pass stats and ``final AUC x.xxxx``."""
    t_start = time.perf_counter()
    train, test = load_data(cfg)
    probe = test.subset(slice(0, min(len(test), 20_000)))  # the probe of each pass: part of the test set
    _check_split(train, probe)
    n_sparse = train.sparse.shape[1]
    names = table_names(n_sparse)
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if cfg.store is None:
        tmp = tempfile.TemporaryDirectory(prefix="hierps-demo-")
        path = Path(tmp.name) / "store"
    else:
        path = Path(cfg.store)
    store = hierps.Store(
        path, memory_budget=cfg.memory_budget, device_budget=cfg.device_budget, seed=cfg.seed
    )
    try:
        model = build_model(store, cfg, n_dense=train.dense.shape[1], n_sparse=n_sparse)
        dense_opt = torch.optim.Adam(model.parameters(), lr=cfg.lr_dense)
        loss_fn = nn.BCEWithLogitsLoss()
        batches = list(train.batches(cfg.batch_size, shuffle=True, seed=cfg.seed))
        n_passes = (len(batches) + cfg.pass_batches - 1) // cfg.pass_batches
        out(
            f"hierps demo: {len(train)} train / {len(test)} test examples, {n_sparse} tables of dim "
            f"{cfg.embedding_dim}, {n_passes} passes of {cfg.pass_batches} batches of {cfg.batch_size}; "
            f"RAM budget {cfg.memory_budget}, store {path}, device {store.device}"
        )
        bar = _progress(len(batches), cfg.progress)
        history = []

        def pass_ids(p: int) -> list[dict[str, torch.Tensor]]:
            group = batches[p * cfg.pass_batches : (p + 1) * cfg.pass_batches]
            return [{n: sparse[:, i] for i, n in enumerate(names)} for _, sparse, _ in group]

        for p in range(n_passes):
            group = batches[p * cfg.pass_batches : (p + 1) * cfg.pass_batches]
            losses = []
            store.begin_pass(pass_ids(p))
            if p + 1 < n_passes:
                store.prefetch(pass_ids(p + 1))  # read in the background while this pass trains
            for dense, sparse, labels in group:
                loss = loss_fn(
                    model(dense.to(store.device), sparse.to(store.device)), labels.to(store.device)
                )
                loss.backward()
                dense_opt.step()
                dense_opt.zero_grad()
                store.step()
                losses.append(loss.item())
                if bar is not None:
                    bar.update(1)
            store.end_pass()
            stats = store.stats.history[-1].to_json()
            probe_auc, _ = evaluate(model, probe, store.device)
            record = {**stats, "train_loss": float(np.mean(losses)), "probe_auc": probe_auc}
            history.append(record)
            line = (
                f"pass {p + 1:3d}/{n_passes}  loss {record['train_loss']:.4f}  auc {probe_auc:.4f}  "
                f"rows ram/ssd {stats['rows_memory']}/{stats['rows_ssd']}  "
                f"hit ram {stats['ram_hit_rate']:.0%} ssd {stats['ssd_hit_rate']:.0%} "
                f"new {stats['new_rows']}  ssd read {_fmt_bytes(stats['ssd_bytes_read'])} "
                f"written {_fmt_bytes(stats['ssd_bytes_written'])}  {stats['seconds']:.1f}s"
            )
            (bar.write if bar is not None else out)(line)
        if bar is not None:
            bar.close()
        ckpt = store.checkpoint("demo-final")
        final_auc, final_loss = evaluate(model, test, store.device)
        elapsed = time.perf_counter() - t_start
        usage = store.usage()
        out(
            f"checkpoint {ckpt}: {usage.ssd_rows} rows on SSD, "
            f"{_fmt_bytes(usage.disk_bytes)} on disk; test log loss {final_loss:.4f}; {elapsed:.1f}s"
        )
        out(f"final AUC {final_auc:.4f}")
        return {"final_auc": final_auc, "final_log_loss": final_loss, "passes": history, "seconds": elapsed}
    finally:
        store.close()
        if tmp is not None:
            tmp.cleanup()


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="batch", leave=False, dynamic_ncols=True)
