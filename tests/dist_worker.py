"""One rank of a sharded training job; launched by torchrun / horovodrun / the tests.

usage: python dist_worker.py MODE STORE OUT [--transport torch|horovod] [--die-after N] [--every-pass]
                            [--keep N (keep_checkpoints)]
MODE train: train STEPS global batches (this rank takes its slice of each), checkpoint "final",
            write OUT/result-<rank>.npz (rows of all keys, dense params, losses, owned full rows).
            With --every-pass, also checkpoint "pass<k>" after pass k and write OUT/pass<k>-<rank>.npz
            (owned keys and full rows) once it returned.
MODE load:  restore checkpoint "final" (resharding if needed), write OUT/loaded-<rank>.npz.
MODE reopen: open the store, nothing else (no write, no restore), write OUT/reopened-<rank>.npz
            (rows of all keys, this rank's full rows, its checkpoints' ids, world sizes and tags).
            With --export-rank R, then export checkpoint "pass3" and the delta since it to the
            latest into <STORE>/../exports/{pass3,delta}, written on rank R's host.

HIERPS_HOLD=<point>:<n>[/<point>:<m>] makes the rank stop (sleep, as a process the test is about to
kill) at the n-th time it reaches a fault point (the m-th hit of the second point after the n-th of
the first), once it wrote OUT/held-<rank>: the test then SIGKILLs every process of its host.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import hierps
from hierps import _faults
from hierps._store import store_parts
from hierps.integrations.transport import HorovodTransport, TorchDistributedTransport

VOCAB, DIM, GLOBAL_BATCH, BAG, STEPS, PASS = 300, 8, 16, 4, 16, 4
ALL_KEYS = (np.arange(VOCAB, dtype=np.int64) - 100) * 1_000_003
OPTIMIZER = {"type": "adagrad", "params": {"lr": 0.2}}


def global_batches():
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        ids = ALL_KEYS[(rng.zipf(1.3, size=(GLOBAL_BATCH, BAG)) - 1) % VOCAB]
        yield torch.from_numpy(ids), torch.from_numpy(rng.integers(0, 2, GLOBAL_BATCH).astype(np.float32))


class _Hold(list):
    """A trace of fault points (:func:`hierps._faults.trace`) that stops this process at HIERPS_HOLD."""

    def __init__(self, spec: str, marker: Path) -> None:
        super().__init__()
        self.steps = [(p, int(n)) for p, _, n in (part.partition(":") for part in spec.split("/"))]
        self.marker = marker

    def append(self, name: str) -> None:
        point, n = self.steps[0]
        if name != point:
            return
        n -= 1
        self.steps[0] = (point, n)
        if n > 0:
            return
        self.steps.pop(0)
        if not self.steps:
            self.marker.write_text(name)
            time.sleep(600)  # killed by the test long before this returns


def setup(kind: str):
    if kind == "horovod":
        transport = HorovodTransport()
        return transport, transport.average_gradients
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    transport = TorchDistributedTransport()

    def average(params):
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= transport.world_size

    return transport, average


def build(store):
    torch.manual_seed(0)
    ref = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
    bag = hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name="t", optimizer=OPTIMIZER)
    store.write("t", ALL_KEYS, ref.weight.detach())
    head = nn.Sequential(nn.Linear(DIM, 8), nn.ReLU(), nn.Linear(8, 1))
    return bag, head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("store")
    ap.add_argument("out")
    ap.add_argument("--transport", default="torch")
    ap.add_argument("--die-after", type=int, default=-1)
    ap.add_argument("--every-pass", action="store_true")
    ap.add_argument("--export-rank", type=int, default=None)
    ap.add_argument("--keep", type=int, default=None, help="the store's keep_checkpoints")
    args = ap.parse_args()
    transport, average = setup(args.transport)
    rank, world = transport.rank, transport.world_size
    if os.environ.get("HIERPS_HOLD"):
        _faults.trace(_Hold(os.environ["HIERPS_HOLD"], Path(args.out) / f"held-{rank}"))
    kept = {} if args.keep is None else {"keep_checkpoints": args.keep}
    store = hierps.ShardedStore(args.store, transport, memory_budget="1KiB", device="cpu", **kept)
    out = Path(args.out)
    if args.mode == "reopen":
        hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name="t", optimizer=OPTIMIZER)
        owned = ALL_KEYS[hierps.sharding._sharded.owner_of(ALL_KEYS, world) == rank]
        np.savez(
            out / f"reopened-{rank}.npz",
            rows=store.lookup("t", torch.from_numpy(ALL_KEYS)).numpy(),
            keys=owned,
            full=store.local.read_rows("t", owned),
            worlds=np.array([c["world_size"] for c in store.list_checkpoints()]),
            tags=np.array([str(c["tag"]) for c in store.list_checkpoints()]),
        )
        if args.export_rank is not None:
            exports = Path(args.store).parent / "exports"
            store.export(exports / "pass3", checkpoint="pass3", rank=args.export_rank)
            store.export(exports / "delta", since="pass3", rank=args.export_rank)
        store.close()
        return
    bag, head = build(store)
    if args.mode == "load":
        store.restore("final")
        owned = ALL_KEYS[hierps.sharding._sharded.owner_of(ALL_KEYS, world) == rank]
        np.savez(
            out / f"loaded-{rank}.npz",
            keys=owned,
            rows=store.local.read_rows("t", owned),
            step=store.local.tables["t"].step,
            worlds=np.array([c["world_size"] for c in store.list_checkpoints()]),
            tags=np.array([str(c["tag"]) for c in store.list_checkpoints()]),
        )
        store.close()
        return
    opt = torch.optim.Adam(head.parameters(), lr=0.01)
    losses = []
    batches = list(global_batches())
    share = GLOBAL_BATCH // world
    for start in range(0, STEPS, PASS):
        group = batches[start : start + PASS]
        local = [
            (ids[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]) for ids, y in group
        ]
        store.begin_pass([{"t": ids} for ids, _ in local])
        if start + PASS < STEPS:  # read the next pass ahead (collective, like begin_pass)
            nxt = batches[start + PASS : start + 2 * PASS]
            store.prefetch([{"t": ids[rank * share : (rank + 1) * share]} for ids, _ in nxt])
        for i, (ids, y) in enumerate(local):
            if start + i == args.die_after and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            logits = head(bag(ids.reshape(-1), torch.arange(0, ids.numel(), BAG))).squeeze(-1)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, y)
            loss.backward()
            average(list(head.parameters()))
            opt.step()
            opt.zero_grad()
            store.step()
            losses.append(float(transport.all_reduce_sum(loss.detach().reshape(1))[0]) / world)
        store.end_pass()
        if args.every_pass:
            tag = f"pass{start // PASS + 1}"
            store.checkpoint(tag)
            owned = ALL_KEYS[hierps.sharding._sharded.owner_of(ALL_KEYS, world) == rank]
            np.savez(out / f"{tag}-{rank}.npz", keys=owned, rows=store.local.read_rows("t", owned))
    store.checkpoint("final")
    rows = store.lookup("t", torch.from_numpy(ALL_KEYS)).numpy()
    owned = ALL_KEYS[hierps.sharding._sharded.owner_of(ALL_KEYS, world) == rank]
    np.savez(
        out / f"result-{rank}.npz",
        rows=rows,
        losses=np.array(losses),
        dense=np.concatenate([p.detach().reshape(-1).numpy() for p in head.parameters()]),
        owned_keys=owned,
        owned_rows=store.local.read_rows("t", owned),
        ssd_read=store_parts(store.local).core.ssd.bytes_read,
        rows_fetched=store.rows_fetched,  # rows fetched key by key (0: every mini-batch on the fast path)
        bytes_sent=store.bytes_sent,
    )
    store.close()


if __name__ == "__main__":
    try:
        main()
    finally:
        import torch.distributed as dist

        # Leave the process group before the interpreter exits: gloo's threads, still running at exit,
        # can abort the process ("terminate called without an active exception") after its work is done.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
