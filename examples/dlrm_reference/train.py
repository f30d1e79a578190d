"""Train the reference DLRM (dlrm's Criteo Kaggle setup) with DeepSpeed, its 26 tables in a hierps store.

The model is plain PyTorch (``hierps.demo.models.ReferenceDLRM``: 26 ``nn.EmbeddingBag(mode="sum",
sparse=True)`` tables of dim 16, each called with its own offsets; bottom MLP 13-512-256-64-16, dot
interaction, top MLP 367-512-256-1, sigmoid, BCE). The ``"hierarchical_ps"`` section of
``ds_config.json`` moves its tables into the store; a ``PassLoader`` loads each pass's rows before
it runs. ``--plain`` trains the same model on the same batches with plain PyTorch instead: what
hierps must reproduce, loss for loss. Launch with any of::

    python examples/dlrm_reference/train.py                 # one rank: initialize sets RANK=0, ...
    python examples/dlrm_reference/train.py --plain         # the same in plain PyTorch
    python examples/dlrm_reference/train.py --meta --max-ind-range -1 --table-scale 100  # 3.4e9 rows

Data: synthetic (``hierps.demo.data.generate_bags``): bags of 1-10 Zipf-distributed ids per table,
labels from a hidden teacher, so the test AUC says how much the model learnt.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import hierps
from hierps.demo.data import BagBatch, BagSpec, generate_bags, kaggle_table_sizes
from hierps.demo.metrics import auc
from hierps.demo.models import ReferenceDLRM

HERE = Path(__file__).resolve().parent
LOSS = nn.BCELoss()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(HERE / "ds_config.json"), help="DeepSpeed config with the section")
    p.add_argument("--examples", type=int, default=131_072, help="synthetic training examples")
    p.add_argument("--test-examples", type=int, default=16_384)
    p.add_argument(
        "--steps", type=int, default=None, help="train this many mini-batches (default: one epoch)"
    )
    p.add_argument(
        "--max-ind-range",
        type=int,
        default=1_466_000,
        help="rows per table at most (-1: uncapped, 33.8M rows)",
    )
    p.add_argument("--table-scale", type=int, default=1, help="multiply every table's rows (before the cap)")
    p.add_argument(
        "--meta", action="store_true", help="build the model on the meta device: no table allocated"
    )
    p.add_argument(
        "--plain", action="store_true", help="plain PyTorch, no DeepSpeed, no store (the reference)"
    )
    p.add_argument(
        "--lr", type=float, default=None, help="SGD learning rate of tables and MLPs (default: the config's)"
    )
    p.add_argument("--store", default=None, help="store directory (default: the config's path)")
    p.add_argument("--memory-budget", default=None, help="RAM tier budget (default: the config's)")
    p.add_argument(
        "--pass-batches", type=int, default=None, help="mini-batches per pass (default: the config's)"
    )
    p.add_argument("--json", default=None, help="write the losses and the test AUC here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def table_sizes(args: argparse.Namespace) -> tuple[int, ...]:
    """The Kaggle tables' rows times ``--table-scale``, each capped at ``--max-ind-range`` (-1: no cap)."""
    scaled = [n * args.table_scale for n in kaggle_table_sizes(None)]
    return tuple(scaled if args.max_ind_range < 0 else (min(n, args.max_ind_range) for n in scaled))


def build_model(sizes: Sequence[int], seed: int, meta: bool = False) -> ReferenceDLRM:
    """The model under ``torch.manual_seed(seed)``; on the meta device its tables take no memory."""
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return ReferenceDLRM(sizes)
    return ReferenceDLRM(sizes)


def train_plain(model: nn.Module, batches: Iterable[BagBatch], lr: float) -> list[float]:
    """Plain PyTorch: one SGD over the sparse tables and the dense layers. Returns each step's loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for dense, ids, offsets, labels in batches:
        loss = LOSS(model(dense, ids, offsets), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_hierps(
    model: nn.Module, batches: Iterable[BagBatch], config: dict[str, Any], lr: float
) -> tuple[Any, list[float]]:
    """The same loop through DeepSpeed with the tables in a hierps store: (engine, each step's loss)."""
    engine, _, _, _ = hierps.deepspeed.initialize(
        model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=lr)
    )
    names = [f"tables.{k}" for k in range(len(engine.hierps_modules))]
    losses = []
    # Reads pass_batches batches ahead and loads all their rows before the first one runs.
    for dense, ids, offsets, labels in hierps.deepspeed.PassLoader(
        batches, lambda b: {t: hierps.Bags(i, o) for t, i, o in zip(names, b.ids, b.offsets)}, engine
    ):
        loss = LOSS(engine(dense, ids, offsets), labels)
        engine.backward(loss)
        engine.step()  # the dense SGD step by DeepSpeed, then the sparse step of the touched rows
        losses.append(loss.item())
    return engine, losses


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[BagBatch]) -> float:
    """Test AUC; an evaluation forward reads rows without loading them into the device tier."""
    model.eval()
    scores, labels = [], []
    for dense, ids, offsets, y in batches:
        scores.append(model(dense, ids, offsets).numpy())
        labels.append(y.numpy())
    model.train()
    return auc(np.concatenate(labels), np.concatenate(scores))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sizes = table_sizes(args)
    config = json.loads(Path(args.config).read_text())
    section = config["hierarchical_ps"]
    section.update(
        {k: v for k, v in (("path", args.store), ("memory_budget", args.memory_budget)) if v is not None}
    )
    if args.pass_batches:
        section["pass_batches"] = args.pass_batches
    if args.lr is not None:  # one rate for the tables and the MLPs, as dlrm's single SGD has
        section["optimizer"] = {"type": "sgd", "params": {"lr": args.lr}}
    lr = section["optimizer"]["params"]["lr"]
    spec = BagSpec(sizes, seed=args.seed)
    batch = config["train_micro_batch_size_per_gpu"]
    train = generate_bags(spec, args.examples, seed=args.seed)
    test = generate_bags(spec, args.test_examples, seed=args.seed + 1)
    steps = args.steps if args.steps is not None else len(train) // batch
    batches = itertools.islice(train.batches(batch, drop_last=True), steps)
    print(f"{sum(sizes):,} rows in {len(sizes)} tables; {steps} steps of {batch}; meta {args.meta}")

    start = time.perf_counter()
    model = build_model(sizes, args.seed, meta=args.meta and not args.plain)
    if args.plain:
        losses = train_plain(model, batches, lr)
        module: nn.Module = model
    else:
        engine, losses = train_hierps(model, batches, config, lr)
        module = engine.module
        print(f"store {engine.hierps_store.path}: {engine.hierps_store.passes} passes")
    trained = time.perf_counter() - start
    for step in range(0, len(losses), max(1, len(losses) // 10)):
        print(f"step {step:5d}  loss {losses[step]:.5f}")
    test_auc = evaluate(module, test.batches(8192))
    print(f"final loss {losses[-1]:.5f}  test AUC {test_auc:.4f}  ({len(losses)} steps, {trained:.1f} s)")
    if not args.plain:
        engine.destroy()
    result = {"losses": losses, "test_auc": test_auc, "seconds": trained, "rows": sum(sizes)}
    if args.json:
        Path(args.json).write_text(json.dumps(result), encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
