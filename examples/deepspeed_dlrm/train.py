"""Train the demo DLRM with DeepSpeed, its 26 embedding tables kept in a hierps store.

The model is a plain torch DLRM (``nn.EmbeddingBag`` tables, MLPs); the ``"hierarchical_ps"``
section of ``ds_config.json`` moves the tables into the store, where they are keyed by raw 64-bit
Criteo feature ids (no hashing into a fixed range, no collisions) and spill from RAM to SSD.
DeepSpeed trains the MLPs. Launch with any of::

    python examples/deepspeed_dlrm/train.py   # one rank: initialize sets RANK=0, WORLD_SIZE=1, ...
    deepspeed --num_gpus 1 examples/deepspeed_dlrm/train.py
    torchrun --nproc_per_node 1 examples/deepspeed_dlrm/train.py
    torchrun --nproc_per_node 2 examples/deepspeed_dlrm/train.py   # tables sharded over 2 ranks

Data: synthetic Criteo-format clicks from ``hierps.demo.data.generate`` (default), or Criteo TSV
files with ``--data``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import hierps
from hierps.demo.data import CriteoData, CriteoSpec, generate, read_criteo_tsv
from hierps.demo.metrics import auc
from hierps.demo.models import DLRM

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(HERE / "ds_config.json"), help="DeepSpeed config with the section")
    p.add_argument("--examples", type=int, default=200_000, help="synthetic examples (train + test)")
    p.add_argument("--data", default=None, help="Criteo TSV file or directory instead of synthetic data")
    p.add_argument("--max-rows", type=int, default=None, help="rows read from --data")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr-dense", type=float, default=1e-3, help="Adam learning rate of the MLPs")
    p.add_argument("--store", default=None, help="store directory (default: the config's path)")
    p.add_argument("--save-dir", default=None, help="save a DeepSpeed + store checkpoint here at the end")
    p.add_argument("--resume", action="store_true", help="load the latest checkpoint of --save-dir first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args()


def load_data(args: argparse.Namespace) -> tuple[CriteoData, CriteoData]:
    if args.data:
        data = read_criteo_tsv(args.data, max_rows=args.max_rows)
    else:
        data = generate(CriteoSpec(seed=args.seed), args.examples, seed=args.seed)
    return data.split(0.9)


def evaluate(engine, data: CriteoData, dtype: torch.dtype, batch_size: int = 8192) -> float:
    engine.eval()
    scores = []
    with torch.no_grad():
        for dense, sparse, _ in data.batches(batch_size):
            scores.append(
                engine(dense.to(engine.device, dtype), sparse.to(engine.device)).float().cpu().numpy()
            )
    engine.train()
    return auc(data.labels, np.concatenate(scores))


def main() -> None:
    args = parse_args()
    config = json.loads(Path(args.config).read_text())
    if args.store:
        config["hierarchical_ps"]["path"] = args.store
    train, test = load_data(args)

    torch.manual_seed(args.seed)
    model = DLRM(
        CriteoSpec(seed=args.seed).vocab_sizes,
        embedding_dim=16,
        n_dense=train.dense.shape[1],
        n_sparse=train.sparse.shape[1],
    )
    # The optimizer may list every parameter: the tables' weights are dropped from it when they move.
    engine, _, _, _ = hierps.deepspeed.initialize(
        model=model, config=config, optimizer=torch.optim.Adam(model.parameters(), lr=args.lr_dense)
    )
    if args.resume and args.save_dir:
        engine.load_checkpoint(args.save_dir)
    rank, world = engine.global_rank, engine.world_size
    # Each rank trains on its slice; equal slices, because every rank's lookups meet in all-to-alls.
    train, test = (d.subset(slice(rank, len(d) // world * world, world)) for d in (train, test))
    store = engine.hierps_store
    shard = getattr(store, "local", store)  # this rank's Store (a ShardedStore keeps it in .local)
    names = [f"tables.{i}" for i in range(train.sparse.shape[1])]
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    micro = engine.train_micro_batch_size_per_gpu()
    loss_fn = nn.BCEWithLogitsLoss()
    say = print if rank == 0 else (lambda *a: None)
    say(
        f"{len(train)} train / {len(test)} test examples per rank, {world} rank(s); "
        f"{len(engine.hierps_modules)} tables in the store {store.path} on {store.device}; RAM budget "
        f"{config['hierarchical_ps']['memory_budget']}, ZeRO stage {engine.zero_optimization_stage()}, "
        f"bf16 {engine.bfloat16_enabled()}"
    )

    start, losses, reported = time.perf_counter(), [], 0
    for epoch in range(args.epochs):
        batches = train.batches(micro, shuffle=True, seed=args.seed + epoch, drop_last=True)
        # Reads pass_batches batches ahead and loads all their rows before the first one runs.
        loader = hierps.deepspeed.PassLoader(
            batches, lambda b: {n: b[1][:, i] for i, n in enumerate(names)}, engine
        )
        for dense, sparse, labels in loader:
            logits = engine(dense.to(engine.device, dtype), sparse.to(engine.device))
            loss = loss_fn(logits.float(), labels.to(engine.device))
            engine.backward(loss)
            engine.step()  # dense step by DeepSpeed, then the sparse step of the touched rows
            losses.append(loss.item())
            if len(shard.stats.history) > reported:  # a pass ended: report it
                reported, s = len(shard.stats.history), shard.stats.history[-1]
                say(
                    f"pass {s.pass_index:3d}  loss {np.mean(losses[-loader.pass_batches :]):.4f}  rows in RAM "
                    f"{s.rows_memory} / on SSD {s.rows_ssd}  new {s.new_rows}  read from SSD "
                    f"{s.ssd_bytes_read / 2**20:.1f}MiB  {time.perf_counter() - start:.1f}s"
                )

    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
        say(f"saved {args.save_dir}/global_step{engine.global_steps} with its store checkpoint")
    test_auc = evaluate(engine, test, dtype)
    say(f"test AUC {test_auc:.4f} after {engine.global_steps} steps, {time.perf_counter() - start:.1f}s")
    engine.destroy()


if __name__ == "__main__":
    main()
