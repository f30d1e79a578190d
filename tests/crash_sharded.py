"""Two ranks train a sharded store through two checkpoints; one rank is killed inside the second.

Ranks are processes forked from a server that imported torch and hierps once (as in
``crash_scenario``), joined by gloo on localhost. ``run_ranks`` starts ``world`` of them and returns
their exit codes; the rank killed at its fault point returns ``-SIGKILL``, and the others stop with
``PeerLostError`` (or finish, when nothing collective was left).

The run (:func:`scenario`): each rank trains its slice of the same global batches, checkpoint
``c1``; more training, checkpoint ``c2``. ``keep_checkpoints=1``, so ``c2`` retires ``c1`` (commit
record and parts). The fault ``<after>/<point>:<n>`` is armed on one rank once checkpoint number
``after`` returned (0: from the start), so ``n`` counts hits from there. Every rank writes ``OUT/<tag>-<rank>.npz`` after each checkpoint it saw return: its
owned keys and their full rows (weights and optimizer state); :func:`reopen` writes ``OUT/reopen-<rank>.npz``
the same way, as the store stands once opened.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

import hierps
from hierps import _faults
from hierps.integrations.rendezvous import free_port
from hierps.sharding._sharded import owner_of

KEYS = (np.arange(240, dtype=np.int64) - 120) * 104_729
DIM, BATCH, BAG, STEPS = 4, 16, 3, 4
TAGS = ("c1", "c2")
SETTINGS = {"memory_budget": "1KiB", "device": "cpu", "keep_checkpoints": 1, "max_segments": 3}

Target = Callable[[str, str, int, int, str, int], None]


def _open(store_path: str, transport: object) -> tuple[hierps.ShardedStore, hierps.EmbeddingBag]:
    store = hierps.ShardedStore(store_path, transport, **SETTINGS)  # type: ignore[arg-type]
    bag = hierps.EmbeddingBag(
        None, DIM, mode="sum", store=store, name="t", optimizer={"type": "adam", "params": {"lr": 0.05}}
    )
    return store, bag


def _train(store: hierps.ShardedStore, bag: hierps.EmbeddingBag, seed: int) -> None:
    rng = np.random.default_rng(seed)
    share = BATCH // store.world_size
    mine = slice(store.rank * share, (store.rank + 1) * share)
    batches = [
        torch.from_numpy(KEYS[(rng.zipf(1.3, size=(BATCH, BAG)) - 1) % len(KEYS)]) for _ in range(STEPS)
    ]
    local = [ids[mine].reshape(-1) for ids in batches]
    with store.run_pass([{"t": ids} for ids in local]):
        for ids in local:
            (bag(ids, torch.arange(0, ids.numel(), BAG)) ** 2).sum().backward()
            store.step()


def _save_rows(store: hierps.ShardedStore, path: Path) -> None:
    owned = KEYS[owner_of(KEYS, store.world_size) == store.rank]
    tags = [c["tag"] for c in store.list_checkpoints()]
    np.savez(path, keys=owned, rows=store.local.read_rows("t", owned), tags=np.array(tags, dtype=str))


def scenario(store_path: str, out: str, rank: int, world: int, fault: str, fault_rank: int) -> None:
    """Train, checkpoint c1; train, checkpoint c2, with ``fault`` (``<after>/<point>:<n>``) armed on
    ``fault_rank`` once checkpoint number ``after`` returned."""
    after, _, point = fault.rpartition("/")
    store, bag = _open(store_path, _transport())
    for i, tag in enumerate(TAGS, start=1):
        if rank == fault_rank and i - 1 == int(after or 0):
            _faults.arm(point)
        _train(store, bag, seed=i)
        store.checkpoint(tag)
        _faults.arm("")
        _save_rows(store, Path(out) / f"{tag}-{rank}.npz")
    store.close()


def reopen(store_path: str, out: str, rank: int, world: int, fault: str, fault_rank: int) -> None:
    """Open the store (a restarted job; ``fault``, ``<point>:<n>``, armed on ``fault_rank`` from the
    start, e.g. inside a reshard) and write what this rank holds."""
    if rank == fault_rank and fault:
        _faults.arm(fault)
    store, _ = _open(store_path, _transport())
    _faults.arm("")
    _save_rows(store, Path(out) / f"reopen-{rank}.npz")
    store.close()


def _transport() -> object:
    from hierps.integrations.transport import TorchDistributedTransport

    return TorchDistributedTransport()


def _rank(
    target: Target, store: str, out: str, rank: int, world: int, port: int, fault: str, fault_rank: int
):
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=30),
        )
        target(store, out, rank, world, fault, fault_rank)
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(
    target: Target, store: Path, out: Path, world: int, fault: str = "", fault_rank: int = -1
) -> list[int]:
    """Run ``target`` on ``world`` ranks forked from the server; their exit codes, rank 0 first."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["hierps", "hierps.integrations.transport", "torch.distributed"])
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(target, str(store), str(out), r, world, port, fault, fault_rank))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for r, p in enumerate(procs):
        if p.exitcode is None:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {r} of {target.__name__} ({fault!r} on rank {fault_rank}) hung")
    codes = [int(p.exitcode or 0) for p in procs]
    errors = [(out / f"error-{r}.txt") for r in range(world)]
    if fault_rank < 0 and any(codes):
        raise AssertionError("\n".join(e.read_text() for e in errors if e.exists()))
    for r, e in enumerate(errors):  # a survivor stops on the lost peer, on nothing else
        if r != fault_rank and e.exists() and "PeerLostError" not in e.read_text():
            raise AssertionError(e.read_text())
    return codes


def rows_of(out: Path, prefix: str, world: int) -> tuple[dict[int, np.ndarray], list[list[str]]]:
    """Every key's full row from the ranks' files ``<prefix>-<rank>.npz``, and each rank's checkpoint tags."""
    rows: dict[int, np.ndarray] = {}
    tags = []
    for r in range(world):
        with np.load(out / f"{prefix}-{r}.npz") as f:
            rows.update({int(k): v for k, v in zip(f["keys"], f["rows"])})
            tags.append([str(t) for t in f["tags"]])
    return rows, tags
