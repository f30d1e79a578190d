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

__all__ = ["Counted", "main", "run_distributed_bench", "run_hosts_bench"]


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
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or dist.get_world_size()  # ranks per host
    transport = Counted(TorchDistributedTransport(), local)
    rank, world = transport.rank, transport.world_size
    if args.kind == "reshard":
        _reshard_worker(args, transport)
        dist.destroy_process_group()
        return
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
    # bytes: rows out and gradients back of the distinct keys owned elsewhere (on this host, on others)
    minimum = np.zeros(2)
    for _, s, _ in mine:
        for i in range(s.shape[1]):
            owners = owner_of(np.unique(s[:, i].numpy()), world)
            elsewhere = owners[owners != rank]
            across = int((elsewhere // local != rank // local).sum())
            minimum += 2 * args.dim * 4 * np.array([len(elsewhere) - across, across])
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
    # Within and across hosts: half of both epochs (alike), since a pass is routed while the one
    # before it trains, so the measured epoch's first pass was routed inside the warm-up.
    split = transport.split() / 2
    totals = transport.all_reduce_sum(
        torch.tensor(
            [float(sent() - sent0), float(minimum.sum()), cpu, 0.0, *split, *minimum], dtype=torch.float64
        )
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
                    "ranks_per_host": local,
                    "within_host_bytes_per_example": float(totals[4]) / examples,
                    "across_hosts_bytes_per_example": float(totals[5]) / examples,
                    "minimum_within_host_bytes_per_example": float(totals[6]) / examples,
                    "minimum_across_hosts_bytes_per_example": float(totals[7]) / examples,
                }
            )
        )
    for start in range(0, args.extra_rows, 1 << 18):  # rows for the reshard to move, beyond the trained ones
        keys = 10**12 + 7919 * np.arange(start, min(start + (1 << 18), args.extra_rows), dtype=np.int64)
        store.write(
            names[0], keys, np.random.default_rng(start).standard_normal((len(keys), args.dim), np.float32)
        )
    if args.checkpoint:
        store.checkpoint("bench")
    store.close()
    transport.barrier()  # no rank tears its process groups down while another still uses them
    dist.destroy_process_group()


class Counted:
    """A transport that counts the bytes this rank's all-to-alls send to ranks on its own host and
    on other hosts (ranks ``[h * local, (h + 1) * local)`` are host ``h``'s, as torchrun numbers them)."""

    def __init__(self, inner: Any, local: int, sent: Any = None) -> None:
        import numpy as np

        self._inner, self._local = inner, local
        self.rank, self.world_size = inner.rank, inner.world_size
        self._sent = sent if sent is not None else np.zeros(inner.world_size)  # bytes to each rank

    def _count(self, send: Any, counts: list[int]) -> None:
        row = send[0].numel() * send.element_size() if send.numel() else 0
        self._sent += [row * c for c in counts]

    def split(self) -> Any:
        """(bytes sent to other ranks of this host, bytes sent to other hosts), float64."""
        import numpy as np

        host = np.arange(self.world_size) // self._local
        mine = host == self.rank // self._local
        mine[self.rank] = False
        return np.array([self._sent[mine].sum(), self._sent[host != self.rank // self._local].sum()])

    def all_to_all(self, send: Any, send_counts: list[int]) -> Any:
        self._count(send, send_counts)
        return self._inner.all_to_all(send, send_counts)

    def all_to_all_known(self, send: Any, send_counts: list[int], recv_counts: list[int]) -> Any:
        self._count(send, send_counts)
        return self._inner.all_to_all_known(send, send_counts, recv_counts)

    def all_reduce_sum(self, t: Any) -> Any:
        return self._inner.all_reduce_sum(t)

    def barrier(self) -> None:
        self._inner.barrier()

    def companion(self) -> Counted:
        return Counted(self._inner.companion(), self._local, self._sent)


def _reshard_worker(args: argparse.Namespace, transport: Counted) -> None:
    """One rank per host: the link (an all-to-all of ``--link-mib`` MiB each way), the disk (writing
    as many bytes, fsynced), then opening the store of 4 ranks at 2, which reshards it."""
    import torch

    import hierps
    from hierps.bench.scale import peak_rss, reset_peak_rss
    from hierps.config import parse_size

    rank, world = transport.rank, transport.world_size
    n = args.link_mib * (1 << 20) // 4
    block = torch.ones(n, dtype=torch.float32)
    counts = [n // world] * world
    link = []
    for _ in range(3):
        transport.barrier()
        t0 = time.perf_counter()
        transport.all_to_all_known(block[: sum(counts)], counts, counts)
        link.append(time.perf_counter() - t0)
    across = (world - 1) * (n // world) * 4  # bytes each rank sent to the other host
    scratch = Path(args.store).parent / f"disk-probe-{rank}"
    data = b"\x01" * (1 << 20)
    t0 = time.perf_counter()
    with open(scratch, "wb") as f:
        for _ in range(args.link_mib):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    disk = time.perf_counter() - t0
    scratch.unlink()
    del block
    # The reshard's own peak RSS: the peak so far (the link probe's block) reset, from what the
    # process holds before it (the interpreter, torch, the transport).
    before = reset_peak_rss()
    transport.barrier()
    split0, t0, c0 = transport.split(), time.perf_counter(), time.process_time()
    store = hierps.ShardedStore(
        Path(args.store),
        transport,
        memory_budget=args.memory_budget,
        device_budget=args.memory_budget,
        device="cpu",
    )
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = peak_rss()
    split = transport.split() - split0
    with hierps.CheckpointReader(store.local.path) as reader:  # the part this rank now holds
        held = {t: e.rows for t, e in reader.meta.tables.items()}
    rows = sum(held.values())
    row_bytes = sum(n * (8 + 4 * store.tables[t].width) for t, n in held.items())  # key and decoded row
    budgets = 2 * parse_size(args.memory_budget)  # the RAM tier's and the device tier's
    totals = transport.all_reduce_sum(
        torch.tensor([rows, row_bytes, *split, cpu, 0.0, peak - before, before, peak], dtype=torch.float64)
    )
    rss = totals[-3:]
    # The bound of docs/scale.md the reshard is held to, per rank: budgets + 2 B per key it holds + a fixed overhead.
    over = (float(rss[0]) - world * budgets - 2 * float(totals[0])) / world
    slowest = transport.all_reduce_sum(torch.tensor([seconds if rank == 0 else 0.0], dtype=torch.float64))
    # An export of the 2 ranks onto rank 0's host: host B's part streamed over the link.
    transport.barrier()
    split1, t0 = transport.split(), time.perf_counter()
    manifest = store.export(Path(args.store).parent / "export")
    exported = (time.perf_counter() - t0, sum(t["rows"] for t in manifest["tables"].values()))
    export_across = float(transport.all_reduce_sum(torch.tensor((transport.split() - split1)[1:]))[0])
    if rank == 0:
        secs = float(slowest[0])
        Path(args.out).write_text(
            json.dumps(
                {
                    "kind": "reshard",
                    "from_world_size": 4,
                    "world_size": world,
                    "rows": int(totals[0]),
                    "row_bytes": float(totals[1]),
                    "seconds": secs,
                    "rows_per_s": float(totals[0]) / secs,
                    "gb_per_s": float(totals[1]) / secs / 1e9,
                    "across_hosts_bytes": float(totals[3]),
                    "cpu_seconds": float(totals[4]),
                    "link_gb_per_s": across / min(link) / 1e9,
                    "link_mib": args.link_mib,
                    "disk_write_gb_per_s": args.link_mib * (1 << 20) / disk / 1e9,
                    "export_seconds": exported[0],
                    "export_rows": exported[1],
                    "export_rows_per_s": exported[1] / exported[0],
                    "export_across_hosts_bytes": export_across,
                    "peak_rss_bytes_per_rank": float(rss[2]) / world,
                    "rss_before_bytes_per_rank": float(rss[1]) / world,
                    "reshard_rss_bytes_per_rank": float(rss[0]) / world,
                    "budget_bytes_per_rank": budgets,
                    "reshard_rss_over_budgets_and_2b_per_key": over,
                }
            )
        )
    store.close()
    transport.barrier()


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


def _workload(
    examples: int, rows: int, dim: int, batch_size: int, pass_batches: int, memory_budget: str
) -> dict[str, Any]:
    """The worker's options for the workload (the same for every run of a bench)."""
    return {
        "examples": examples,
        "rows": rows,
        "dim": dim,
        "batch_size": batch_size,
        "pass_batches": pass_batches,
        "memory_budget": memory_budget,
    }


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
    cfg = _workload(examples, rows, dim, batch_size, pass_batches, memory_budget)
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


def _on_hosts(
    hosts: Any,
    disks: list[Path],
    tmp: Path,
    kind: str,
    per_host: int,
    nodes: int,
    store: str,
    label: str,
    cfg: dict[str, Any],
    *extra: str,
) -> dict[str, Any]:
    """One torchrun of ``nodes`` test hosts x ``per_host`` ranks -> rank 0's record."""
    from hierps.bench.hosts import wait_all
    from hierps.integrations.rendezvous import free_port

    result = tmp / f"result-{label}.json"
    port = free_port()
    procs = []
    for host in range(nodes):
        argv = [
            str(Path(sys.executable).parent / "torchrun"),
            f"--nnodes={nodes}",
            f"--node_rank={host}",
            f"--nproc_per_node={per_host}",
            f"--master_addr={hosts.addrs[0] if nodes > 1 else '127.0.0.1'}",
            f"--master_port={port}",
            "-m",
            "hierps.bench.dist",
            "--worker",
            "--kind",
            kind,
            "--store",
            str(hosts.common / store),
            "--out",
            str(result),
            *[f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()],
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        env["OMP_NUM_THREADS"] = "1"
        procs.append(hosts.launch(host, disks[host], argv, env, tmp / f"{label}-host{host}.log"))
    codes = wait_all(procs, 3600)
    if codes != [0] * nodes:
        logs = "\n".join((tmp / f"{label}-host{h}.log").read_text()[-3000:] for h in range(nodes))
        raise RuntimeError(f"{label} ended with {codes}:\n{logs}")
    return dict(json.loads(result.read_text()))


def run_hosts_bench(
    examples: int = 32_768,
    rows: int = 200_000,
    dim: int = 16,
    batch_size: int = 4096,
    pass_batches: int = 8,
    memory_budget: str = "64MiB",
    link_mib: int = 256,
    extra_rows: int = 1_000_000,
    out: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """2 test hosts x 2 ranks against 1 host x 4 ranks on the same workload, then the 4-rank store
    of the two hosts (its trained rows and ``extra_rows`` more) opened at 2 ranks, one per host (a
    reshard across hosts), against the link and the disk, measured in the same run (root only;
    :mod:`hierps.bench.hosts`)."""
    from hierps.bench.hosts import TwoHosts, can_make_hosts

    why = can_make_hosts()
    if why is not None:
        raise RuntimeError(f"hierps bench --dist --hosts: {why}")
    cfg = _workload(examples, rows, dim, batch_size, pass_batches, memory_budget)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "config": {**cfg, "link_mib": link_mib, "extra_rows": extra_rows},
        "load_average_start": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="hierps-bench-hosts-") as tmp_dir:
        tmp = Path(tmp_dir)
        disks = [tmp / "disk-a", tmp / "disk-b"]
        with TwoHosts(tmp / "common") as hosts:
            one = _on_hosts(hosts, disks, tmp, "sharded", 4, 1, "one-host", "one-host", cfg)
            out(
                f"  [{time.perf_counter() - started:5.0f} s] 1 host x 4 ranks: {one['examples_per_s']:.0f} examples/s"
            )
            extra = f"--extra-rows={extra_rows}"
            two = _on_hosts(
                hosts, disks, tmp, "sharded", 2, 2, "store", "two-hosts", cfg, "--checkpoint", extra
            )
            out(
                f"  [{time.perf_counter() - started:5.0f} s] 2 hosts x 2 ranks: {two['examples_per_s']:.0f} examples/s"
            )
            reshard = _on_hosts(
                hosts, disks, tmp, "reshard", 1, 2, "store", "reshard", {**cfg, "link_mib": link_mib}
            )
            out(f"  [{time.perf_counter() - started:5.0f} s] reshard 4 -> 2 across hosts: done")
    results.update(one_host=one, two_hosts=two, reshard=reshard, seconds=time.perf_counter() - started)
    results["load_average_end"] = os.getloadavg()
    _report_hosts(results, out)
    return results


def _report_hosts(results: dict[str, Any], out: Callable[[str], Any]) -> None:
    one, two, r = results["one_host"], results["two_hosts"], results["reshard"]
    out(
        f"2 hosts x 2 ranks: {two['examples_per_s']:.0f} examples/s, 1 host x 4 ranks: "
        f"{one['examples_per_s']:.0f} examples/s: {two['examples_per_s'] / one['examples_per_s']:.2f}x"
    )
    out(
        "run               | within host B/example (minimum) | across hosts B/example (minimum) | store's count"
    )
    for name, rec in (("1 host x 4 ranks", one), ("2 hosts x 2 ranks", two)):
        out(
            f"{name:17s} | {rec['within_host_bytes_per_example']:12.1f} ({rec['minimum_within_host_bytes_per_example']:8.1f}) "
            f"        | {rec['across_hosts_bytes_per_example']:12.1f} ({rec['minimum_across_hosts_bytes_per_example']:8.1f})"
            f"          | {rec['bytes_sent_per_example']:.1f}"
        )
    out(
        f"reshard 4 -> 2 ranks across hosts: {r['rows']:,} rows in {r['seconds']:.2f} s: {r['rows_per_s']:,.0f} rows/s, "
        f"{r['gb_per_s']:.3f} GB/s of rows ({r['across_hosts_bytes'] / 1e6:.1f} MB across hosts); the link "
        f"{r['link_gb_per_s']:.2f} GB/s (gloo all-to-all of {r['link_mib']} MiB), the disk {r['disk_write_gb_per_s']:.2f} "
        "GB/s (write + fsync)"
    )
    out(
        f"  peak RSS of a rank over the reshard: {r['reshard_rss_bytes_per_rank'] / 2**20:.0f} MiB above the "
        f"{r['rss_before_bytes_per_rank'] / 2**20:.0f} MiB it held before (peak {r['peak_rss_bytes_per_rank'] / 2**20:.0f} MiB); "
        f"budgets {r['budget_bytes_per_rank'] / 2**20:.0f} MiB + 2 B per key held: "
        f"{r['reshard_rss_over_budgets_and_2b_per_key'] / 2**20:+.0f} MiB over that"
    )
    out(
        f"export of the 2 ranks onto host A: {r['export_rows']:,} rows in {r['export_seconds']:.2f} s: "
        f"{r['export_rows_per_s']:,.0f} rows/s ({r['export_across_hosts_bytes'] / 1e6:.1f} MB across hosts)"
    )
    out(
        f"bench took {results['seconds']:.0f} s (load average {results['load_average_start'][0]:.1f} at start)"
    )


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
    ap.add_argument(
        "--hosts",
        action="store_true",
        help="instead: 2 test hosts x 2 ranks against 1 host x 4 ranks, bytes within and across hosts, and a "
        "reshard 4 -> 2 across hosts against the link and the disk (network namespaces; root only)",
    )
    ap.add_argument("--link-mib", type=int, default=256, help="MiB each way for the link and disk probes")
    ap.add_argument(
        "--extra-rows",
        type=int,
        default=0,
        help="with --hosts: rows written before the 2-host checkpoint (default 1000000)",
    )
    ap.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results as JSON here")


def run_from_args(args: argparse.Namespace) -> int:
    if args.hosts:
        hosts = run_hosts_bench(
            args.examples,
            args.rows,
            args.dim,
            args.batch_size,
            args.pass_batches,
            args.memory_budget,
            args.link_mib,
            args.extra_rows or 1_000_000,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(hosts, indent=1), encoding="utf-8")
        return 0
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
    ap.add_argument(
        "--kind", choices=("store", "sharded", "reshard"), default="sharded", help=argparse.SUPPRESS
    )
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
