"""The online trainer: follow a directory of Parquet logs, train in passes of event time, publish deltas.

The demo DLRM (26 ``nn.EmbeddingBag`` tables, two MLPs) trains through ``hierps.deepspeed.initialize``,
its tables moved into the store. Its input is a
:class:`hierps.online.ParquetStream` over the log directory, cut into passes of ``--pass-seconds``
of event time, inside a ``PassLoader`` that announces each pass to the store ahead. Every
``--publish-every`` passes it saves a checkpoint (DeepSpeed's dense state, the store's rows and
the stream position, atomically) and publishes the rows changed since the last one as a delta into
the serving directory (:class:`hierps.online.Publisher`), which ``serve.py`` follows.

Killed at any point and started again with the same arguments, it loads the latest checkpoint
and goes on from the stream position saved with it: no example is trained twice or skipped, and
the losses of the steps after it are those the uninterrupted run had (``--steps-log`` writes
them). ``--wait`` seconds without a new file end the run (the stream waits that long)::

    python examples/online/train.py --stream /tmp/logs --work /tmp/online --serve /tmp/serve
    torchrun --nproc_per_node 2 examples/online/train.py ...   # two ranks: each its share of each batch
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
import hierps.online
from hierps.demo.data import CriteoSpec
from hierps.demo.models import DLRM

N_DENSE, N_SPARSE = 13, 26


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stream", required=True, help="the directory the Parquet log files arrive in")
    p.add_argument("--work", required=True, help="the store and the checkpoints live here")
    p.add_argument("--serve", required=True, help="the serving directory deltas are published into")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--pass-seconds", type=float, default=60.0, help="event time per pass")
    p.add_argument("--publish-every", type=int, default=1, help="passes between checkpoint + delta")
    p.add_argument("--compact-every", type=int, default=8, help="deltas before a new base is written")
    p.add_argument("--wait", type=float, default=10.0, help="seconds without a new file before ending")
    p.add_argument("--steps-log", default=None, help="append each step's loss here (JSON lines)")
    p.add_argument("--dump", default=None, help="at the end, save the dense parameters here (.npy)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def config(work: Path) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,  # batches come from the stream, whole
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "hierarchical_ps": {
            "path": str(work / "store"),
            "modules": "auto",
            "auto_min_rows": 1,
            "memory_budget": "8MiB",
            "device_budget": "256MiB",
            "optimizer": {"type": "adagrad", "params": {"lr": 0.05}},
            "initializer": {"type": "uniform", "params": {"low": -0.01, "high": 0.01}},
            "keep_checkpoints": 3,
        },
    }


def main() -> None:
    args = parse_args()
    work, ckpt = Path(args.work), Path(args.work) / "ckpt"
    torch.manual_seed(args.seed)
    model = DLRM(CriteoSpec(seed=args.seed).vocab_sizes, embedding_dim=16, n_dense=N_DENSE, n_sparse=N_SPARSE)
    engine, _, _, _ = hierps.deepspeed.initialize(
        model=model, config=config(work), optimizer=torch.optim.Adam(model.parameters(), lr=1e-3)
    )
    rank, world = engine.global_rank, engine.world_size
    stream = hierps.online.ParquetStream(  # at several ranks, each takes its share of every batch
        args.stream,
        batch_size=args.batch_size,
        pass_seconds=args.pass_seconds,
        time_column="ts",
        wait=args.wait,
        rank=rank,
        world_size=world,
    )
    names = [f"tables.{i}" for i in range(N_SPARSE)]
    loader = hierps.deepspeed.PassLoader(
        stream, lambda b: {n: b[f"c{i}"] for i, n in enumerate(names)}, engine
    )
    if (ckpt / "latest").exists():  # a restart: the rows, the dense state and the stream position
        engine.load_checkpoint(str(ckpt))
    publisher = hierps.online.Publisher(engine, args.serve, compact_every=args.compact_every)
    steps_log = f"{args.steps_log}.rank{rank}" if args.steps_log and world > 1 else args.steps_log
    log = open(steps_log, "a") if steps_log else None  # noqa: SIM115
    shard = getattr(engine.hierps_store, "local", engine.hierps_store)  # this rank's Store
    loss_fn = nn.BCEWithLogitsLoss()
    losses, start = [], time.perf_counter()
    for batch in loader:
        dense = torch.stack([batch[f"d{j}"] for j in range(N_DENSE)], dim=1).float()
        sparse = torch.stack([batch[f"c{j}"] for j in range(N_SPARSE)], dim=1)
        loss = loss_fn(engine(dense, sparse), batch["label"].float())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if log is not None:
            log.write(json.dumps({"step": int(engine.global_steps), "loss": losses[-1]}) + "\n")
            log.flush()
        if not loader.at_pass_end:
            continue
        passes = shard.passes + 1  # the pass this batch ends (closed at the next batch)
        line = f"pass {passes:3d}  {len(losses)} steps  loss {sum(losses) / len(losses):.4f}"
        if passes % args.publish_every == 0:
            engine.save_checkpoint(str(ckpt), tag=f"pass{passes}")
            done = publisher.publish()
            if done is not None:
                line += f"  published {done}"
        if rank == 0:
            print(f"{line}  {time.perf_counter() - start:.1f}s", flush=True)
        losses = []
    if args.dump and rank == 0:
        np.save(args.dump, torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]).numpy())
    engine.destroy()


if __name__ == "__main__":
    main()
