"""``hierps bench``: training throughput of hierps against plain PyTorch, measured in one run.

Variants (same DLRM, same data, one warm-up epoch then one measured epoch, median of repeats):

- ``torch-sparse``: ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.Adagrad``, everything in RAM
  (ids folded into each table's size, as a plain-torch user must);
- ``hierps-ram``: hierps with a RAM budget larger than the table;
- ``hierps-ram25``: hierps with a RAM budget of 1/4 of the table (rows spill to SSD).

Reported: examples/s, the ratio of each to ``torch-sparse``, SSD bytes read / written, peak RSS.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import hierps
from hierps.counters import NUM_COUNTERS
from hierps.data import CriteoData, CriteoSpec, generate
from hierps.demo import DemoConfig, build_model, table_names
from hierps.models import DLRM, remap_ids
from hierps.optim import state_width

__all__ = ["BenchConfig", "run_bench"]


@dataclass
class BenchConfig:
    examples: int = 262_144
    total_vocab: int = 1_000_000
    embedding_dim: int = 16
    batch_size: int = 4096
    pass_batches: int = 16
    repeats: int = 3
    seed: int = 0


def _torch_sparse(data: CriteoData, cfg: BenchConfig, spec: CriteoSpec, _: Path) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    model = DLRM(spec.vocab_sizes, embedding_dim=cfg.embedding_dim)
    sparse_opt = torch.optim.Adagrad(list(model.sparse_parameters()), lr=0.05)
    dense_opt = torch.optim.Adam(list(model.dense_parameters()), lr=1e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    folded = CriteoData(data.dense, remap_ids(data.sparse, spec.vocab_sizes), data.labels)

    def epoch() -> float:
        t0 = time.perf_counter()
        for dense, sparse, labels in folded.batches(cfg.batch_size):
            loss_fn(model(dense, sparse), labels).backward()
            sparse_opt.step()
            dense_opt.step()
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
        return time.perf_counter() - t0

    epoch()
    return {"seconds": epoch()}


def _hierps(budget_fraction: float) -> Callable[[CriteoData, BenchConfig, CriteoSpec, Path], dict[str, Any]]:
    def run(data: CriteoData, cfg: BenchConfig, spec: CriteoSpec, tmp: Path) -> dict[str, Any]:
        floats = cfg.embedding_dim + state_width(hierps.OptimizerConfig("adagrad"), cfg.embedding_dim) + NUM_COUNTERS
        row_bytes = floats * 4 + 25
        budget = int(budget_fraction * spec.total_vocab * row_bytes)
        store = hierps.Store(tmp / f"store-{budget_fraction}", memory_budget=budget, device_budget="4GiB")
        try:
            model = build_model(store, DemoConfig(embedding_dim=cfg.embedding_dim, seed=cfg.seed))
            dense_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            loss_fn = nn.BCEWithLogitsLoss()
            names = table_names()
            batches = list(data.batches(cfg.batch_size))

            def epoch() -> float:
                t0 = time.perf_counter()
                for p in range(0, len(batches), cfg.pass_batches):
                    group = batches[p : p + cfg.pass_batches]
                    with store.run_pass([{n: s[:, i] for i, n in enumerate(names)} for _, s, _ in group]):
                        for dense, sparse, labels in group:
                            loss_fn(model(dense, sparse), labels).backward()
                            dense_opt.step()
                            dense_opt.zero_grad()
                            store.step()
                return time.perf_counter() - t0

            epoch()
            r0, w0 = store.ssd.bytes_read, store.ssd.bytes_written
            seconds = epoch()
            return {"seconds": seconds, "ssd_bytes_read": store.ssd.bytes_read - r0,
                    "ssd_bytes_written": store.ssd.bytes_written - w0, "memory_budget": budget}
        finally:
            store.close()

    return run


VARIANTS: dict[str, Callable[..., dict[str, Any]]] = {
    "torch-sparse": _torch_sparse,
    "hierps-ram": _hierps(1.5),
    "hierps-ram25": _hierps(0.25),
}


def run_bench(cfg: BenchConfig, out: Callable[[str], Any] = print) -> dict[str, Any]:
    spec = CriteoSpec(total_vocab=cfg.total_vocab, seed=cfg.seed)
    data = generate(spec, cfg.examples, seed=cfg.seed)
    distinct = sum(len(np.unique(data.sparse[:, i])) for i in range(data.sparse.shape[1]))
    out(f"hierps bench: {cfg.examples} examples, batch {cfg.batch_size}, dim {cfg.embedding_dim}, "
        f"{distinct} distinct ids of {cfg.total_vocab}, torch threads {torch.get_num_threads()}")
    results: dict[str, Any] = {"config": asdict(cfg), "distinct_ids": distinct, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="hierps-bench-") as tmp:
        for name, fn in VARIANTS.items():
            runs = [fn(data, cfg, spec, Path(tmp) / f"{name}-{r}") for r in range(cfg.repeats)]
            seconds = statistics.median(r["seconds"] for r in runs)
            record = {**runs[0], "seconds": seconds, "examples_per_s": cfg.examples / seconds,
                      "all_seconds": [r["seconds"] for r in runs]}
            results["variants"][name] = record
    base = results["variants"]["torch-sparse"]["examples_per_s"]
    for name, record in results["variants"].items():
        record["ratio_to_torch_sparse"] = record["examples_per_s"] / base
        extra = ""
        if "ssd_bytes_read" in record:
            extra = (f"  ssd read {record['ssd_bytes_read'] / 2**20:.1f}MiB "
                     f"written {record['ssd_bytes_written'] / 2**20:.1f}MiB")
        out(f"{name:14s} {record['examples_per_s']:10.0f} examples/s  {record['ratio_to_torch_sparse']:.2f}x "
            f"torch-sparse{extra}")
    results["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return results
