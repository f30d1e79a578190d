"""Throughput of the sharded store with 1 and 2 ranks on this machine, and its all-to-all traffic.

``python -m hierps.bench.dist`` launches ``torchrun`` with 1 then 2 processes (gloo). Each rank
trains the demo DLRM on its slice of every global batch through a :class:`hierps.ShardedStore`;
rank 0 reports global examples/s over a measured epoch (after a warm-up epoch) and the bytes the
all-to-alls sent per example, against the minimum: the distinct rows a rank needs from other
ranks times the row size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run_distributed_bench"]


def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn

    import hierps
    from hierps.demo.app import DemoConfig, build_model, table_names
    from hierps.demo.data import CriteoSpec, generate
    from hierps.integrations.transport import TorchDistributedTransport
    from hierps.sharding._sharded import owner_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    transport = TorchDistributedTransport()
    rank, world = transport.rank, transport.world_size
    data = generate(CriteoSpec(total_vocab=args.rows), args.examples, seed=0)
    store = hierps.ShardedStore(Path(args.store), transport, memory_budget=args.memory_budget, device="cpu")
    model = build_model(store, DemoConfig(embedding_dim=args.dim))  # type: ignore[arg-type]
    dense_params = list(model.dense_parameters())  # the DLRM's bottom then top MLP parameters
    opt = torch.optim.Adam(dense_params, lr=1e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    names = table_names()
    share = args.batch_size // world
    batches = list(data.batches(args.batch_size))
    minimum = 0

    def epoch(count: bool) -> float:
        nonlocal minimum
        t0 = time.perf_counter()
        for p in range(0, len(batches), args.pass_batches):
            group = [
                (
                    d[rank * share : (rank + 1) * share],
                    s[rank * share : (rank + 1) * share],
                    y[rank * share : (rank + 1) * share],
                )
                for d, s, y in batches[p : p + args.pass_batches]
            ]
            with store.run_pass([{n: s[:, i] for i, n in enumerate(names)} for _, s, _ in group]):
                for d, s, y in group:
                    loss_fn(model(d, s), y).backward()
                    for q in dense_params:
                        grad = q.grad
                        if grad is None:
                            raise RuntimeError("a dense parameter of the model got no gradient")
                        dist.all_reduce(grad)
                        grad /= world  # in place: q.grad is this tensor
                    opt.step()
                    opt.zero_grad()
                    store.step()
                    if count:
                        for i in range(s.shape[1]):
                            keys = np.unique(s[:, i].numpy())
                            minimum += int((owner_of(keys, world) != rank).sum()) * args.dim * 4
        return time.perf_counter() - t0

    epoch(False)
    sent0 = store.bytes_sent
    seconds = epoch(True)
    totals = transport.all_reduce_sum(
        torch.tensor([float(store.bytes_sent - sent0), float(minimum)], dtype=torch.float64)
    )
    slowest = transport.all_reduce_sum(torch.tensor([seconds], dtype=torch.float64)) / world
    if rank == 0:
        examples = len(batches) * share * world
        Path(args.out).write_text(
            json.dumps(
                {
                    "world_size": world,
                    "seconds": float(slowest[0]),
                    "examples_per_s": examples / float(slowest[0]),
                    "bytes_sent_per_example": float(totals[0]) / examples,
                    "minimum_bytes_per_example": float(totals[1]) / examples,
                }
            )
        )
    store.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_distributed_bench(
    examples: int = 65_536,
    rows: int = 200_000,
    dim: int = 16,
    batch_size: int = 4096,
    pass_batches: int = 8,
    memory_budget: str = "64MiB",
    out=print,
) -> dict[str, Any]:
    """Run 1 and 2 ranks with torchrun; returns ``{"1": {...}, "2": {...}}`` and prints a summary."""
    results: dict[str, Any] = {}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with tempfile.TemporaryDirectory(prefix="hierps-bench-dist-") as tmp:
        for world in (1, 2):
            result = Path(tmp) / f"result-{world}.json"
            cmd = [
                torchrun,
                f"--nproc_per_node={world}",
                "--master_addr=127.0.0.1",
                f"--master_port={_free_port()}",
                "-m",
                "hierps.bench.dist",
                "--worker",
                "--store",
                str(Path(tmp) / f"store-{world}"),
                "--out",
                str(result),
                "--examples",
                str(examples),
                "--rows",
                str(rows),
                "--dim",
                str(dim),
                "--batch-size",
                str(batch_size),
                "--pass-batches",
                str(pass_batches),
                "--memory-budget",
                memory_budget,
            ]
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
            subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
            results[str(world)] = json.loads(result.read_text())
    base = results["1"]["examples_per_s"]
    for ranks, r in results.items():
        ratio = (
            r["bytes_sent_per_example"] / r["minimum_bytes_per_example"]
            if r["minimum_bytes_per_example"]
            else 0
        )
        out(
            f"{ranks} rank(s): {r['examples_per_s']:9.0f} examples/s ({r['examples_per_s'] / base:.2f}x 1 rank); "
            f"all-to-all {r['bytes_sent_per_example']:.0f} B/example, minimum {r['minimum_bytes_per_example']:.0f} "
            f"B/example" + (f" ({ratio:.2f}x)" if ratio else "")
        )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierps.bench.dist")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store")
    ap.add_argument("--out")
    ap.add_argument("--examples", type=int, default=65_536)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--pass-batches", type=int, default=8)
    ap.add_argument("--memory-budget", default="64MiB")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    results = run_distributed_bench(
        args.examples, args.rows, args.dim, args.batch_size, args.pass_batches, args.memory_budget
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
