"""``python -m hierps.bench_dist`` / ``hierps bench --dist``: the sharded store against one store, and its scaling inputs.

Every run is launched by ``torchrun`` (gloo, one torch thread per rank) and trains the demo DLRM
on synthetic Criteo-like data, pass by pass, each pass announced (``begin_pass``, and
``prefetch`` of the next one), a warm-up epoch then a measured one:

1. **One rank**: ``hierps.Store`` and ``hierps.ShardedStore`` at world size 1 on the same
   workload, interleaved ``repeats`` times in the same run; the ratio of their median examples/s.
2. **Bytes**: what the sharded store's all-to-alls send per example, against the minimum: every
   distinct key a rank's mini-batch needs from another rank costs its row out and its gradient
   back (``2 x dim x 4`` bytes); keys and counts travel once per pass.
3. **Scaling inputs** at 1, 2 and 4 ranks: per-rank CPU seconds per example (a rank's process
   time over the examples it trained), all-to-all bytes per example, and the dense all-reduce
   bytes per step; ``docs/performance.md`` turns them into a model of throughput against ranks
   and link bandwidth. On a machine with fewer cores than ranks, wall-clock examples/s of the
   larger worlds measures the machine, not the store; the CPU seconds and bytes are what count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["main", "run_distributed_bench"]


def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn

    import hierps
    from hierps.demo.app import DemoConfig, build_model, table_names
    from hierps.demo.data import CriteoSpec, generate
    from hierps.integrations.transport import TorchDistributedTransport
    from hierps.sharding import owner_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    transport = TorchDistributedTransport()
    rank, world = transport.rank, transport.world_size
    data = generate(CriteoSpec(total_vocab=args.rows, seed=0), args.examples, seed=0)
    options = {"memory_budget": args.memory_budget, "device": "cpu"}
    store: Any = (
        hierps.Store(Path(args.store), **options)
        if args.kind == "store"
        else hierps.ShardedStore(Path(args.store), transport, **options)
    )
    model = build_model(store, DemoConfig(embedding_dim=args.dim))
    dense_params = list(model.dense_parameters())  # the DLRM's bottom then top MLP parameters
    opt = torch.optim.Adam(dense_params, lr=1e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    names = table_names()
    share = args.batch_size // world
    mine = [
        (
            d[rank * share : (rank + 1) * share],
            s[rank * share : (rank + 1) * share],
            y[rank * share : (rank + 1) * share],
        )
        for d, s, y in data.batches(args.batch_size)
    ]
    passes = [mine[i : i + args.pass_batches] for i in range(0, len(mine), args.pass_batches)]
    stream = passes + passes  # a warm-up epoch, then the measured one (read ahead across the boundary)
    ids = [[{n: s[:, i] for i, n in enumerate(names)} for _, s, _ in group] for group in stream]
    minimum = 0  # bytes: rows out and gradients back of the distinct keys owned elsewhere
    for _, s, _ in mine:
        for i in range(s.shape[1]):
            keys = np.unique(s[:, i].numpy())
            minimum += 2 * int((owner_of(keys, world) != rank).sum()) * args.dim * 4
    sent = (lambda: store.bytes_sent) if args.kind == "sharded" else (lambda: 0)
    wall = cpu = 0.0
    sent0 = 0
    for p, group in enumerate(stream):
        if p == len(passes):
            transport.barrier()
            wall, cpu, sent0 = time.perf_counter(), time.process_time(), sent()
        store.begin_pass(ids[p])
        if p + 1 < len(stream):
            store.prefetch(ids[p + 1])
        for d, s, y in group:
            loss_fn(model(d, s), y).backward()
            if world > 1:
                for q in dense_params:
                    grad = q.grad
                    if grad is None:
                        raise RuntimeError("a dense parameter of the model got no gradient")
                    dist.all_reduce(grad)
                    grad /= world  # in place: q.grad is this tensor
            opt.step()
            opt.zero_grad()
            store.step()
        store.end_pass()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    totals = transport.all_reduce_sum(
        torch.tensor([float(sent() - sent0), float(minimum), cpu, 0.0], dtype=torch.float64)
    )
    slowest = transport.all_reduce_sum(torch.tensor([wall], dtype=torch.float64))  # mean of ranks
    if rank == 0:
        examples = len(mine) * share * world
        dense_bytes = sum(q.numel() for q in dense_params) * 4
        Path(args.out).write_text(
            json.dumps(
                {
                    "kind": args.kind,
                    "world_size": world,
                    "seconds": float(slowest[0]) / world,
                    "examples": examples,
                    "examples_per_s": examples * world / float(slowest[0]),
                    "cpu_seconds_per_rank": float(totals[2]) / world,
                    "cpu_us_per_example_per_rank": 1e6 * float(totals[2]) / examples,
                    "bytes_sent_per_example": float(totals[0]) / examples,
                    "minimum_bytes_per_example": float(totals[1]) / examples,
                    "dense_bytes_per_step": dense_bytes,
                    "steps": len(mine),
                }
            )
        )
    store.close()
    transport.barrier()  # no rank tears its process groups down while another still uses them
    dist.destroy_process_group()


def _launch(kind: str, world: int, tmp: Path, cfg: dict[str, Any], label: str) -> dict[str, Any]:
    """One torchrun of ``world`` ranks -> rank 0's record."""
    from hierps.integrations.rendezvous import free_port

    result = tmp / f"result-{label}.json"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [
        torchrun,
        f"--nproc_per_node={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "hierps.bench.dist",
        "--worker",
        "--kind",
        kind,
        "--store",
        str(tmp / f"store-{label}"),
        "--out",
        str(result),
        *[f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()],
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} at {world} rank(s) failed:\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def run_distributed_bench(
    examples: int = 65_536,
    rows: int = 200_000,
    dim: int = 16,
    batch_size: int = 4096,
    pass_batches: int = 8,
    memory_budget: str = "64MiB",
    repeats: int = 3,
    worlds: tuple[int, ...] = (1, 2, 4),
    out: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run the three measurements of the module docstring; print them; return them JSON-ready."""
    cfg = {
        "examples": examples,
        "rows": rows,
        "dim": dim,
        "batch_size": batch_size,
        "pass_batches": pass_batches,
        "memory_budget": memory_budget,
    }
    started = time.perf_counter()
    results: dict[str, Any] = {"config": {**cfg, "repeats": repeats}, "load_average_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="hierps-bench-dist-") as tmp_dir:
        tmp = Path(tmp_dir)
        runs: dict[str, list[dict[str, Any]]] = {"store": [], "sharded": []}
        for r in range(repeats):  # interleaved: load from other jobs spreads over both
            for kind in runs:
                runs[kind].append(_launch(kind, 1, tmp, cfg, f"{kind}-1-{r}"))
                out(
                    f"  [{time.perf_counter() - started:5.0f} s] {kind} x1 #{r + 1}: {runs[kind][-1]['examples_per_s']:.0f} examples/s"
                )
        median = {kind: statistics.median(x["examples_per_s"] for x in rs) for kind, rs in runs.items()}
        cpu = {
            kind: statistics.median(x["cpu_us_per_example_per_rank"] for x in rs) for kind, rs in runs.items()
        }
        results["one_rank"] = {
            "store_examples_per_s": median["store"],
            "sharded_examples_per_s": median["sharded"],
            "ratio": median["sharded"] / median["store"],
            "store_cpu_us_per_example": cpu["store"],
            "sharded_cpu_us_per_example": cpu["sharded"],
            "cpu_ratio": cpu["store"] / cpu["sharded"],  # > 1: the sharded store costs less CPU
            "runs": runs,
        }
        scaling = []
        for world in worlds:
            record = (
                min(runs["sharded"], key=lambda x: x["cpu_us_per_example_per_rank"])
                if world == 1
                else _launch("sharded", world, tmp, cfg, f"sharded-{world}")
            )
            scaling.append(record)
            out(f"  [{time.perf_counter() - started:5.0f} s] sharded x{world}: done")
        results["scaling"] = scaling
    results["seconds"] = time.perf_counter() - started
    results["load_average_end"] = os.getloadavg()
    _report(results, out)
    return results


def _report(results: dict[str, Any], out: Callable[[str], Any]) -> None:
    one = results["one_rank"]
    out(
        f"one rank: ShardedStore {one['sharded_examples_per_s']:.0f} examples/s, Store "
        f"{one['store_examples_per_s']:.0f} examples/s: {one['ratio']:.2f}x (goal >= 0.9x); CPU per example "
        f"{one['sharded_cpu_us_per_example']:.2f} us against {one['store_cpu_us_per_example']:.2f} us: "
        f"{one['cpu_ratio']:.2f}x"
    )
    for r in results["scaling"]:
        if r["world_size"] > 1:
            ratio = r["bytes_sent_per_example"] / r["minimum_bytes_per_example"]
            out(
                f"{r['world_size']} ranks: all-to-all {r['bytes_sent_per_example']:.1f} B/example, minimum "
                f"(rows out, gradients back) {r['minimum_bytes_per_example']:.1f} B/example: {ratio:.2f}x "
                "(goal <= 1.3x)"
            )
    out(
        "ranks | CPU us/example/rank | all-to-all B/example | minimum B/example | dense B/step | examples/s here"
    )
    for r in results["scaling"]:
        out(
            f"{r['world_size']:5d} | {r['cpu_us_per_example_per_rank']:19.1f} | {r['bytes_sent_per_example']:20.1f} | "
            f"{r['minimum_bytes_per_example']:17.1f} | {r['dense_bytes_per_step']:12d} | {r['examples_per_s']:15.0f}"
        )
    out(
        f"bench took {results['seconds']:.0f} s (load average {results['load_average_start'][0]:.1f} at start)"
    )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m hierps.bench_dist`` (also ``hierps bench --dist``)."""
    ap.add_argument("--examples", type=int, default=65_536, help="examples per epoch (default 65536)")
    ap.add_argument("--rows", type=int, default=200_000, help="id population (default 200000)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4096, help="global batch (default 4096)")
    ap.add_argument("--pass-batches", type=int, default=8, help="mini-batches per pass (default 8)")
    ap.add_argument("--memory-budget", default="64MiB")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved one-rank runs of each store")
    ap.add_argument("--worlds", default="1,2,4", help="world sizes of the scaling table (default 1,2,4)")
    ap.add_argument("--json", help="write the results as JSON here")


def run_from_args(args: argparse.Namespace) -> int:
    results = run_distributed_bench(
        args.examples,
        args.rows,
        args.dim,
        args.batch_size,
        args.pass_batches,
        args.memory_budget,
        args.repeats,
        tuple(int(w) for w in str(args.worlds).split(",") if w.strip()),
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierps.bench_dist", description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=("store", "sharded"), default="sharded", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
