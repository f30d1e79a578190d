"""The trainers ``hierps bench`` compares: one function per variant, each run in its own process.

Every variant trains the same model (:mod:`hierps.demo.models`: the DLRM, or with ``--model wide`` a
logistic regression over the embeddings) on the same synthetic Criteo-like
workload (:mod:`hierps.demo.data`: 26 power-law features) and returns a JSON-ready dict whose
``seconds`` is the wall time of one measured epoch (or of ``examples`` measured examples for the
dense variants), taken after a warm-up of the same shape.

==================  ==========================================================================
variant             embeddings
==================  ==========================================================================
torch-sparse        ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.Adagrad``, ids folded
torch-dense         ``nn.EmbeddingBag(sparse=False)``, one ``torch.optim.Adam`` for everything
deepspeed-dense     the same model as torch-dense, trained by a DeepSpeed engine (ZeRO 0, Adam)
mmap                rows ``[w | g2sum]`` in a numpy memmap per table, Adagrad applied with numpy
hierps-ramN-pipe    ``hierps.EmbeddingBag`` over a store with a RAM budget of N% of the table
hierps-ramN-sync    the same without the pass pipeline
hierps-ramN-pipe-   hierps-ramN-pipe with compact rows: bf16 weights and Adagrad state (84 bytes a
compact             row at dim 16 instead of 148), the same RAM budget in bytes (N% of the fp32 table)
mlp-only            no embedding work at all (fixed embedding outputs): the ceiling of any store
==================  ==========================================================================
"""

from __future__ import annotations

import cProfile
import math
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hierps
from hierps.demo.app import DemoConfig, build_model, table_names
from hierps.demo.data import CriteoData, CriteoSpec, generate
from hierps.demo.models import ClickModel, make_model, remap_ids
from hierps.integrations.rendezvous import free_port
from hierps.rows import row_layout
from hierps.tiers import ram_row_bytes

__all__ = ["PROFILER", "VARIANTS", "NoLookup", "Workload", "make_workload", "peak_rss_bytes", "run_variant"]

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_ADAGRAD_EPS = 1e-10  # torch.optim.Adagrad's default, also the store's
T = TypeVar("T")


@dataclass
class Workload:
    """The examples of one run: ``batches`` of ``(dense (B, 13), sparse (B, 26) raw ids, labels (B,))``."""

    spec: CriteoSpec
    data: CriteoData
    batches: list[Batch]
    passes: list[list[Batch]]
    distinct_ids: int


def make_workload(cfg: dict[str, Any]) -> Workload:
    """Draw ``cfg["examples"]`` examples over an id population of ``cfg["rows"]`` ids (deterministic)."""
    spec = CriteoSpec(total_vocab=cfg["rows"], seed=cfg["seed"])
    data = generate(spec, cfg["examples"], seed=cfg["seed"])
    batches = list(data.batches(cfg["batch_size"]))
    k = cfg["pass_batches"]
    passes = [batches[i : i + k] for i in range(0, len(batches), k)]
    distinct = sum(len(np.unique(data.sparse[:, i])) for i in range(data.sparse.shape[1]))
    return Workload(spec, data, batches, passes, distinct)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# Set by the bench worker to profile the measured part of a run (the training thread only).
PROFILER: cProfile.Profile | None = None


def _timed(fn: Callable[[], T]) -> T:
    """Run the measured part of a variant, under PROFILER when one is set."""
    if PROFILER is None:
        return fn()
    PROFILER.enable()
    try:
        return fn()
    finally:
        PROFILER.disable()


def _clock(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    _timed(fn)
    return time.perf_counter() - t0


def _measure(step: Callable[[Batch], None], warm_up: list[Batch], measured: list[Batch]) -> dict[str, Any]:
    """Run ``step`` over ``warm_up``, then time it over ``measured``."""
    for b in warm_up:
        step(b)

    def run() -> None:
        for b in measured:
            step(b)

    return {"seconds": _clock(run), "examples": sum(len(b[2]) for b in measured)}


def _measure_epoch(step: Callable[[Batch], None], batches: list[Batch]) -> dict[str, Any]:
    """A warm-up epoch, then a timed one."""
    return _measure(step, batches, batches)


def _measure_dense(
    step: Callable[[Batch], None], batches: list[Batch], cfg: dict[str, Any]
) -> dict[str, Any]:
    """Warm-up steps, then ``dense_steps`` timed ones: dense Adam over every row makes epochs too slow."""
    warm, steps = cfg["dense_warmup_steps"], cfg["dense_steps"]
    order = [batches[i % len(batches)] for i in range(warm + steps)]
    return {**_measure(step, order[:warm], order[warm:]), "steps": steps}


def _folded_batches(work: Workload) -> list[Batch]:
    """The workload's batches with raw ids folded into each torch table's range (``remap_ids``)."""
    folded = torch.from_numpy(remap_ids(work.data.sparse, work.spec.resolved_vocab_sizes))
    return [(d, folded[i * len(d) : (i + 1) * len(d)], y) for i, (d, _, y) in enumerate(work.batches)]


_LOSS = nn.BCEWithLogitsLoss()


# -- torch-sparse ---------------------------------------------------------------------------------
def _torch_sparse(work: Workload, cfg: dict[str, Any], tmp: Path, params: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(cfg["seed"])
    model = make_model(cfg["model"], work.spec.resolved_vocab_sizes, cfg["dim"])
    sparse_opt = torch.optim.Adagrad(list(model.sparse_parameters()), lr=cfg["lr_sparse"])
    dense_opt = torch.optim.Adam(list(model.dense_parameters()), lr=cfg["lr_dense"])

    def step(b: Batch) -> None:
        dense, sparse, labels = b
        _LOSS(model(dense, sparse), labels).backward()
        sparse_opt.step()
        dense_opt.step()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()

    return _measure_epoch(step, _folded_batches(work))


# -- dense: torch Adam and DeepSpeed ----------------------------------------------------------------
def _dense_model(work: Workload, cfg: dict[str, Any]) -> ClickModel:
    torch.manual_seed(cfg["seed"])
    model = make_model(cfg["model"], work.spec.resolved_vocab_sizes, cfg["dim"])
    for table in model.tables:
        table = cast(nn.EmbeddingBag, table)  # make_model's own tables
        table.sparse = False  # dense (rows, dim) gradients: what a model without sparse support trains
    return model


def _torch_dense(work: Workload, cfg: dict[str, Any], tmp: Path, params: dict[str, Any]) -> dict[str, Any]:
    return _measure_dense(_adam_step(_dense_model(work, cfg), cfg["lr_dense"]), _folded_batches(work), cfg)


def _adam_step(
    model: nn.Module, lr: float, then: Sequence[_MmapBag | NoLookup] = ()
) -> Callable[[Batch], None]:
    """One training step of ``model`` on a batch: the loss's backward, a dense Adam step, then a
    step of each of ``then`` (tables that apply their own gradients)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step(b: Batch) -> None:
        dense, sparse, labels = b
        _LOSS(model(dense, sparse), labels).backward()
        opt.step()
        opt.zero_grad()
        for table in then:
            table.step()

    return step


def _deepspeed_dense(
    work: Workload, cfg: dict[str, Any], tmp: Path, params: dict[str, Any]
) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_SIZE": "1",
    }.items():
        os.environ.setdefault(key, value)
    import deepspeed
    import torch.distributed as dist

    model = _dense_model(work, cfg)
    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {
        "train_batch_size": cfg["batch_size"],
        "train_micro_batch_size_per_gpu": cfg["batch_size"],
        "gradient_accumulation_steps": 1,
        # torch_adam: DeepSpeed's own Adam kernels need a CUDA or compiled CPU op; this is the
        # engine around torch.optim.Adam, as on any machine without those ops.
        "optimizer": {
            "type": "Adam",
            "params": {"lr": cfg["lr_dense"], "torch_adam": True, "adam_w_mode": False},
        },
        "zero_optimization": {"stage": 0},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step(b: Batch) -> None:
        dense, sparse, labels = b
        engine.backward(_LOSS(engine(dense, sparse), labels))
        engine.step()

    try:
        return _measure_dense(step, _folded_batches(work), cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- mmap ---------------------------------------------------------------------------------------
class _MmapBag(nn.Module):
    """One table as a ``(n, 2 * dim)`` float32 memmap ``[weights | Adagrad g2sum]``.

    forward gathers the distinct rows of a mini-batch into a leaf; :meth:`step` applies the
    same dedup-then-Adagrad update as torch's sparse Adagrad and writes the rows back.
    """

    def __init__(self, path: Path, n: int, dim: int, lr: float, rng: np.random.Generator) -> None:
        super().__init__()
        self.dim, self.lr = dim, lr
        self.rows = np.memmap(path, dtype=np.float32, mode="w+", shape=(n, 2 * dim))
        bound = 1.0 / math.sqrt(n)  # the DLRM reference init of torch-sparse
        for start in range(0, n, 1 << 20):
            stop = min(n, start + (1 << 20))
            self.rows[start:stop, :dim] = rng.uniform(-bound, bound, (stop - start, dim)).astype(np.float32)
            self.rows[start:stop, dim:] = 0.0
        self._pending: list[tuple[np.ndarray, torch.Tensor]] = []

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        uniq, local = np.unique(ids.numpy(), return_inverse=True)
        leaf = torch.from_numpy(self.rows[uniq, : self.dim]).requires_grad_(True)
        if self.training and torch.is_grad_enabled():
            self._pending.append((uniq, leaf))
        return F.embedding_bag(torch.from_numpy(local.reshape(-1)), leaf, offsets, mode="sum")

    def step(self) -> None:
        for uniq, leaf in self._pending:
            if leaf.grad is None:
                continue
            g = leaf.grad.numpy()
            rows = self.rows[uniq]
            rows[:, self.dim :] += g * g
            rows[:, : self.dim] -= self.lr * g / (np.sqrt(rows[:, self.dim :]) + _ADAGRAD_EPS)
            self.rows[uniq] = rows
        self._pending = []


def _with_tables(work: Workload, cfg: dict[str, Any], tables: Sequence[nn.Module]) -> ClickModel:
    """The model with ``tables`` in place of its torch embedding tables."""
    torch.manual_seed(cfg["seed"])
    model = make_model(cfg["model"], [1] * len(work.spec.resolved_vocab_sizes), cfg["dim"])
    for i, table in enumerate(tables):
        model.tables[i] = table
    return model


def _measure_with_tables(
    work: Workload, cfg: dict[str, Any], tables: Sequence[_MmapBag | NoLookup], batches: list[Batch]
) -> dict[str, Any]:
    """An epoch of the model with ``tables`` (each stepped after the dense Adam step) over ``batches``."""
    return _measure_epoch(_adam_step(_with_tables(work, cfg, tables), cfg["lr_dense"], tables), batches)


def _mmap(work: Workload, cfg: dict[str, Any], tmp: Path, params: dict[str, Any]) -> dict[str, Any]:
    rng = np.random.default_rng(cfg["seed"])
    tmp.mkdir(parents=True, exist_ok=True)
    bags = [
        _MmapBag(tmp / f"table-{i}.f32", n, cfg["dim"], cfg["lr_sparse"], rng)
        for i, n in enumerate(work.spec.resolved_vocab_sizes)
    ]
    return {
        **_measure_with_tables(work, cfg, bags, _folded_batches(work)),
        "file_bytes": int(sum(b.rows.nbytes for b in bags)),
    }


# -- mlp-only -----------------------------------------------------------------------------------
class NoLookup(nn.Module):
    """Returns the same (B, dim) leaf for every batch: the model runs, no embedding work is done."""

    def __init__(self, batch: int, dim: int, gen: torch.Generator) -> None:
        super().__init__()
        self.out = (0.01 * torch.randn(batch, dim, generator=gen)).requires_grad_(True)  # not a Parameter

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.out[: offsets.numel()]

    def step(self) -> None:
        self.out.grad = None


def _mlp_only(work: Workload, cfg: dict[str, Any], tmp: Path, params: dict[str, Any]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(cfg["seed"])
    bags = [NoLookup(cfg["batch_size"], cfg["dim"], gen) for _ in work.spec.resolved_vocab_sizes]
    return _measure_with_tables(work, cfg, bags, work.batches)


# -- hierps -------------------------------------------------------------------------------------
def _hierps_run(
    store: hierps.Store,
    model: nn.Module,
    dense_opt: torch.optim.Optimizer,
    passes: list[list[Batch]],
    names: list[str],
    pipeline: bool,
) -> dict[str, Any]:
    """A warm-up epoch then a measured one, pass by pass, as one stream of passes.

    Pipelined, each pass reads the next one ahead, across the epoch boundary too, so the measured
    epoch sees the steady state of a long run: its first pass was read ahead during the warm-up,
    and the write-back of its last pass overlaps what would come next (the write-back of the
    warm-up's last pass falls in the measured epoch instead).
    """
    stream = passes + passes
    ids = [[{n: sparse[:, i] for i, n in enumerate(names)} for _, sparse, _ in group] for group in stream]

    def counters() -> tuple[float, ...]:
        u = store.usage()
        return (
            u.prepare_seconds,
            u.writeback_seconds,
            u.wait_seconds,
            u.ssd_bytes_read,
            u.ssd_bytes_written,
            u.ssd_read_seconds,
            u.ssd_write_seconds,
        )

    begin = train = end = 0.0
    before: tuple[float, ...] = ()
    t0 = 0.0
    for p, group in enumerate(stream):
        if p == len(passes):
            before, t0 = counters(), time.perf_counter()
            if PROFILER is not None:
                PROFILER.enable()
        t1 = time.perf_counter()
        store.begin_pass(ids[p])
        if pipeline and p + 1 < len(stream):
            store.prefetch(ids[p + 1])
        t2 = time.perf_counter()
        for dense, sparse, labels in group:
            _LOSS(model(dense, sparse), labels).backward()
            dense_opt.step()
            dense_opt.zero_grad()
            store.step()
        t3 = time.perf_counter()
        store.end_pass()
        t4 = time.perf_counter()
        if p >= len(passes):
            begin, train, end = begin + t2 - t1, train + t3 - t2, end + t4 - t3
    seconds = time.perf_counter() - t0
    if PROFILER is not None:
        PROFILER.disable()
    d = [a - b for a, b in zip(counters(), before)]
    store.flush()
    return {
        "seconds": seconds,
        "begin_seconds": begin,
        "train_seconds": train,
        "end_seconds": end,
        "prepare_seconds": d[0],
        "writeback_seconds": d[1],
        "wait_seconds": d[2],
        "ssd_bytes_read": int(d[3]),
        "ssd_bytes_written": int(d[4]),
        "ssd_read_seconds": d[5],
        "ssd_write_seconds": d[6],
    }


def _hierps(work: Workload, cfg: dict[str, Any], tmp: Path, params: dict[str, Any]) -> dict[str, Any]:
    pipeline = bool(params["pipeline"])
    # The table: every row the workload creates, at what the RAM tier charges per fp32 row (floats
    # of weights, optimizer state and counters, plus its bookkeeping), whatever the rows' precision:
    # compact rows get the same bytes of RAM. (The demo model's tables train with Adagrad.)
    table_bytes = work.distinct_ids * ram_row_bytes(row_layout("adagrad", cfg["dim"]).words)
    budget = int(params["budget"] * table_bytes)
    store = hierps.Store(
        tmp / "store",
        memory_budget=budget,
        device_budget=cfg["device_budget"],
        pipeline=pipeline,
        seed=cfg["seed"],
    )
    try:
        dtype = params.get("dtype", "fp32")
        model = build_model(
            store,
            DemoConfig(embedding_dim=cfg["dim"], seed=cfg["seed"], lr_sparse=cfg["lr_sparse"]),
            kind=cfg["model"],
            weights_dtype=dtype,
            state_dtype=dtype,
        )
        names = table_names(len(work.spec.resolved_vocab_sizes))
        info = store.info(names[0])
        if info.optimizer.type != "adagrad":
            raise RuntimeError("the bench's RAM budget assumes the demo model's Adagrad rows")
        dense_opt = torch.optim.Adam(model.parameters(), lr=cfg["lr_dense"])
        record = _hierps_run(store, model, dense_opt, work.passes, names, pipeline)
        n = len(work.passes)
        stages = {"prepare": record["prepare_seconds"], "writeback": record["writeback_seconds"]}
        if not pipeline:  # without the pipeline both stages run on the training thread
            stages = {"prepare": record["begin_seconds"], "writeback": record["end_seconds"]}
        background = record["prepare_seconds"] + record["writeback_seconds"]
        usage = store.usage()
        record.update(
            examples=len(work.data),
            passes=n,
            memory_budget=budget,
            table_bytes=table_bytes,
            pipeline=pipeline,
            budget_fraction=params["budget"],
            ssd_bytes_read_per_pass=record["ssd_bytes_read"] / n,
            ssd_bytes_written_per_pass=record["ssd_bytes_written"] / n,
            prepare_per_pass=stages["prepare"] / n,
            writeback_per_pass=stages["writeback"] / n,
            train_per_pass=record["train_seconds"] / n,
            wait_per_pass=record["wait_seconds"] / n,
            hidden_fraction=(1.0 - record["wait_seconds"] / background)
            if pipeline and background > 0
            else 0.0,
            rows_memory=usage.memory_rows,
            rows_ssd=usage.ssd_rows,
            row_bytes=info.layout.row_bytes,
        )
        return record
    finally:
        store.close()


VARIANTS: dict[str, tuple[Callable[..., dict[str, Any]], dict[str, Any]]] = {
    "torch-sparse": (_torch_sparse, {}),
    "torch-dense": (_torch_dense, {}),
    "deepspeed-dense": (_deepspeed_dense, {}),
    "mmap": (_mmap, {}),
    "mlp-only": (_mlp_only, {}),
    **{
        f"hierps-ram{pct}-{mode}": (_hierps, {"budget": pct / 100, "pipeline": mode == "pipe"})
        for pct in (100, 25, 5)
        for mode in ("pipe", "sync")
    },
    **{
        f"hierps-ram{pct}-pipe-compact": (_hierps, {"budget": pct / 100, "pipeline": True, "dtype": "bf16"})
        for pct in (25, 5)
    },
}


def run_variant(name: str, cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Build the workload and run variant ``name`` once: a JSON-ready record."""
    fn, params = VARIANTS[name]
    work = make_workload(cfg)
    record = fn(work, cfg, tmp, params)
    record["examples_per_s"] = record["examples"] / record["seconds"]
    record["distinct_ids"] = work.distinct_ids
    return record
