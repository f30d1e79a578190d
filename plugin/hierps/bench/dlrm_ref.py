"""``hierps bench --model dlrm-ref``: the reference DLRM in plain PyTorch, TorchRec and hierps, on the same batches.

The model is :class:`hierps.demo.models.ReferenceDLRM` (dlrm's Criteo Kaggle setup: 26 sparse
``nn.EmbeddingBag`` tables of dim 16, each called with its own offsets, bottom MLP 13-512-256-64-16,
dot interaction, top MLP 367-512-256-1, sigmoid, BCE), its tables capped at ``max_ind_range``
rows (7.9M rows in all by default). The data are :func:`hierps.demo.data.generate_bags`: bags of
1-10 Zipf-distributed ids per table and labels from a hidden teacher.

=================  ==============================================================================
variant            training
=================  ==============================================================================
torch              the model as written, eager: ``torch.optim.SGD`` (or ``Adagrad``) on the
                   tables' sparse gradients and on the dense layers
torchrec           the 26 tables in a ``torchrec.EmbeddingBagCollection`` fed a ``KeyedJaggedTensor``,
                   sharded by ``DistributedModelParallel`` (one gloo rank, table-wise, ``fused``
                   kernel: FBGEMM's table-batched embedding on the CPU, ``exact_sgd`` or
                   ``exact_adagrad`` applied in the backward); the MLPs and interaction of the model,
                   under DMP's ``DistributedDataParallel``, with torch's optimizer. Skipped (a line in
                   the report) where torchrec cannot be imported
hierps-ram         built on the meta device and handed to ``hierps.deepspeed.initialize``; a
                   ``PassLoader`` loads each pass's rows; the RAM tier holds every row it creates
hierps-ssd         the same with a 64 MiB RAM tier: most rows live on SSD
hierps-no-loader   as hierps-ram, the loop over the batches as they are: rows fetched on demand
mlp-only           (asked for by ``--variants``) the model with each table a stand-in that returns the
                   same (B, 16) leaf every batch: the MLPs and interaction alone, with the dense
                   optimizer. No embedding work at all: the most any table implementation can reach
torch-tables       (asked for by ``--variants``) the 26 tables alone, without the MLPs: the mean
                   square of their pooled outputs as the loss, torch's sparse SGD
hierps-tables      the same tables in a store (RAM), announced as ``hierps.Bags`` by a PassLoader
=================  ==============================================================================

After training, hierps-ram and hierps-ssd also time an evaluation epoch over the same batches
(``torch.no_grad()``), its forwards reading their own rows, then with ``PassLoader(...,
evaluate=True)`` reading each group's rows ahead; the report sets that against a training step.

Every hierps variant has a 512 MiB device tier. Each variant runs in its own process (the bench
worker, so peak RSS, ``VmHWM``, is its own): a warm-up epoch, then a timed one over the same
batches (examples/s), every step's loss recorded. The tables of torch and torchrec start from the
rows the store's initializer gives the ids they meet (other rows are never read), so all variants
train the same model from the same values: their losses agree step by step, which the report
checks (torchrec's within FBGEMM's rounding: its kernels sum the same floats in another order).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from hierps.bench._worker import median_record, one_rank_ds_config, single_rank_env, spawn
from hierps.bench.variants import NoLookup
from hierps.demo.models import ReferenceDLRM

__all__ = [
    "REF_VARIANTS",
    "config_from_args",
    "format_report",
    "run_from_args",
    "run_phase",
    "run_ref_bench",
    "shard_fused",
    "torchrec_missing",
]

REF_VARIANTS = ("torch", "torchrec", "hierps-ram", "hierps-no-loader", "hierps-ssd")
# The model's 26 tables alone (the mean square of their pooled outputs as the loss, SGD), on the same batches: the
# part of a step hierps replaces, apart from the MLPs both run alike. Run when asked (--variants).
TABLE_VARIANTS = ("torch-tables", "hierps-tables")
# The model without any embedding work (its tables return a fixed leaf): the ceiling of every
# variant above. Run when asked (--variants).
CEILING = "mlp-only"
_ALL = (*REF_VARIANTS, *TABLE_VARIANTS, CEILING)
# dlrm's Kaggle rate for SGD. (The example trains at 1.0, where its AUC rises faster, but there
# rounding differences grow step by step: by 1e-5 in about 100 steps.)
_LR = {"sgd": 0.1, "adagrad": 0.01}
_ADAGRAD_EPS = 1e-10  # torch.optim.Adagrad's default and the store's, given to FBGEMM's exact_adagrad too
_INIT_BOUND = 0.01  # the store's initializer: uniform in +-0.01 for every table
_LOSS = nn.BCELoss()
_MiB = float(1 << 20)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    optimizer = getattr(args, "optimizer", None) or "sgd"
    return {
        "max_ind_range": getattr(args, "max_ind_range", None) or 1_466_000,
        "examples": args.examples or (49_152 if quick else 98_304),
        "batch_size": args.batch_size or 1024,
        "pass_batches": args.pass_batches or 8,
        "dim": args.dim or 16,
        "repeats": args.repeats or (1 if quick else 2),
        "threads": args.threads or 1,
        "optimizer": optimizer,
        "lr": _LR[optimizer],
        "ssd_memory_budget": args.memory_budget or "64MiB",
        "device_budget": getattr(args, "device_budget", None) or "512MiB",
        # Flatter than the demo's 1.1: an epoch of this bench touches about 1M rows (111 MiB of SGD
        # rows at the default size, 69 MiB with --quick), more than hierps-ssd's RAM tier holds.
        "zipf_exponent": 1.0,
        "seed": 0,
        "variants": [v for v in args.variants.split(",") if v] if args.variants else list(REF_VARIANTS),
    }


config_from_args = _config


# -- the workload ----------------------------------------------------------------------------------
def _batches(cfg: dict[str, Any]) -> tuple[list[Any], tuple[int, ...]]:
    """The epoch's :class:`~hierps.demo.data.BagBatch` es (deterministic) and the tables' sizes."""
    from hierps.demo.data import BagSpec, generate_bags, kaggle_table_sizes

    sizes = kaggle_table_sizes(cfg["max_ind_range"])
    spec = BagSpec(sizes, zipf_exponent=cfg["zipf_exponent"], seed=cfg["seed"])
    data = generate_bags(spec, cfg["examples"], seed=cfg["seed"])
    return list(data.batches(cfg["batch_size"], drop_last=True)), sizes


def _names(n_tables: int) -> list[str]:
    return [f"tables.{k}" for k in range(n_tables)]


def _optimizer(cfg: dict[str, Any], params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if cfg["optimizer"] == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg["lr"], eps=_ADAGRAD_EPS)
    return torch.optim.SGD(params, lr=cfg["lr"])


def _initializer() -> dict[str, Any]:
    return {"type": "uniform", "params": {"low": -_INIT_BOUND, "high": _INIT_BOUND}}


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM`` of ``/proc/self/status``), in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(s for s in f if s.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


class _Run:
    """Times a stream of two epochs from the first step of the second; profiles that epoch if asked."""

    def __init__(self, epoch: int, profile: str | None) -> None:
        self.epoch, self.profile = epoch, profile
        self.profiler = cProfile.Profile() if profile else None
        self.losses: list[float] = []
        self.t0 = self.cpu0 = self.process0 = 0.0

    def steps(self, batches: Iterable[Any]) -> Iterator[Any]:
        """The batches of ``batches``, with the clock (and the profiler) started at the second epoch."""
        for i, batch in enumerate(batches):
            if i == self.epoch:
                self.t0, self.cpu0, self.process0 = (
                    time.perf_counter(),
                    time.thread_time(),
                    time.process_time(),
                )
                if self.profiler is not None:
                    self.profiler.enable()
            yield batch

    def record(self, **extra: Any) -> dict[str, Any]:
        seconds = time.perf_counter() - self.t0
        train_cpu = time.thread_time() - self.cpu0
        process_cpu = time.process_time() - self.process0
        if self.profiler is not None:
            self.profiler.disable()
        examples = self.epoch * extra.pop("batch_size")
        record = {
            "seconds": seconds,
            "examples": examples,
            "examples_per_s": examples / seconds,
            # CPU seconds of the training thread alone (a loaded machine stretches wall time)
            "train_thread_cpu_s": train_cpu,
            "examples_per_train_cpu_s": examples / train_cpu,
            # and of every thread (the training thread's and the background work's: pipeline, reads)
            "process_cpu_s": process_cpu,
            "examples_per_process_cpu_s": examples / process_cpu,
            "losses": self.losses,
            "final_loss": self.losses[-1],
            **extra,
        }
        if self.profiler is not None and self.profile is not None:
            record["breakdown"] = _write_profile(self.profiler, self.profile, self.epoch)
        return record


# -- the tables alone ---------------------------------------------------------------------------------
def _tables_only(cfg: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    """The reference DLRM's tables without its MLPs: plain ``nn.EmbeddingBag(sparse=True)`` with
    torch's SGD, or hierps modules in a store (tables in RAM) announced by a ``PassLoader``."""
    import hierps
    import hierps.deepspeed

    batches, sizes = _batches(cfg)
    names = _names(len(sizes))
    torch.manual_seed(cfg["seed"])
    stream: Iterable[Any] = batches + batches
    step: Callable[[], None]
    tables: list[nn.Module]
    if name == "torch-tables":
        plain = [nn.EmbeddingBag(n, cfg["dim"], mode="sum", sparse=True) for n in sizes]
        _start_from_initializer([t.weight for t in plain], batches, cfg)
        opt = torch.optim.SGD([t.weight for t in plain], lr=cfg["lr"])
        tables = list(plain)

        def step() -> None:
            opt.step()
            opt.zero_grad()

    else:
        store = hierps.Store(
            tmp / "store",
            memory_budget="4GiB",
            device_budget=cfg["device_budget"],
            optimizer={"type": "sgd", "params": {"lr": cfg["lr"]}},
            initializer=_initializer(),
            seed=cfg["seed"],
        )
        tables = [hierps.EmbeddingBag(None, cfg["dim"], mode="sum", store=store, name=t) for t in names]
        step = store.step
        target = SimpleNamespace(hierps_store=store, hierps_modules=dict(zip(names, tables)))
        stream = hierps.deepspeed.PassLoader(
            stream,
            lambda b: {t: hierps.Bags(i, o) for t, i, o in zip(names, b.ids, b.offsets)},
            target,
            cfg["pass_batches"],
        )
    run = _Run(len(batches), None)
    for b in run.steps(stream):
        loss = torch.cat([t(i, o) for t, i, o in zip(tables, b.ids, b.offsets)], 1).square().mean()
        loss.backward()
        step()
        run.losses.append(loss.item())
    return run.record(batch_size=cfg["batch_size"], rows=sum(sizes))


# -- torch -------------------------------------------------------------------------------------------
def _torch(cfg: dict[str, Any], profile: str | None, ceiling: bool = False) -> dict[str, Any]:
    """The model in plain PyTorch; with ``ceiling`` (``mlp-only``) each table a :class:`NoLookup`,
    the dense optimizer alone."""
    batches, sizes = _batches(cfg)
    torch.manual_seed(cfg["seed"])
    stand_ins: list[NoLookup] = []
    if ceiling:
        model = ReferenceDLRM([1] * len(sizes), cfg["dim"])  # its tables replaced: never allocated whole
        gen = torch.Generator().manual_seed(cfg["seed"])
        stand_ins = [NoLookup(cfg["batch_size"], cfg["dim"], gen) for _ in sizes]
        model.tables = nn.ModuleList(stand_ins)
        opts = [_optimizer(cfg, model.dense_parameters())]
    else:
        model = ReferenceDLRM(sizes, cfg["dim"])
        _start_from_initializer([cast(nn.EmbeddingBag, t).weight for t in model.tables], batches, cfg)
        opts = [_optimizer(cfg, model.sparse_parameters()), _optimizer(cfg, model.dense_parameters())]
    run = _Run(len(batches), profile)
    for b in run.steps(batches + batches):
        loss = _LOSS(model(b.dense, b.ids, b.offsets), b.labels)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for t in stand_ins:
            t.step()
        run.losses.append(loss.item())
    return run.record(batch_size=cfg["batch_size"], rows=0 if ceiling else sum(sizes))


@torch.no_grad()
def _start_from_initializer(weights: Sequence[torch.Tensor], batches: list[Any], cfg: dict[str, Any]) -> None:
    """Give the rows ``batches`` read (of each table's ``(rows, dim)`` weight) the values the store's
    initializer gives them in the hierps runs."""
    from hierps.config import InitializerConfig
    from hierps.rows import initial_rows, table_salt

    init = InitializerConfig.parse(_initializer())
    for k, name in enumerate(_names(len(batches[0].ids))):
        keys = np.unique(np.concatenate([b.ids[k].numpy() for b in batches]))
        rows = initial_rows(keys, cfg["dim"], table_salt(cfg["seed"], name), init)
        weights[k][torch.from_numpy(keys)] = torch.from_numpy(rows)


# -- torchrec ----------------------------------------------------------------------------------------
def torchrec_missing() -> str | None:
    """Why the torchrec variant cannot run here, or None where torchrec and FBGEMM's CPU kernels are installed."""
    import importlib.util

    missing = [m for m in ("torchrec", "fbgemm_gpu") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not installed (an optional extra: `make setup` installs "
        "torchrec==1.8.0 and fbgemm-gpu-cpu==1.8.0 with --no-deps)"
    )


def shard_fused(
    model: nn.Module, collection: nn.Module, optimizer: type[torch.optim.Optimizer], params: dict[str, Any]
) -> Any:
    """``model`` in TorchRec's ``DistributedModelParallel`` over the default process group, as TorchRec
    trains sparse tables on CPU ranks: ``collection``'s (an ``EmbeddingBagCollection``) tables sharded
    table-wise on the ``fused`` kernel, i.e. FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` with
    ``optimizer`` (``torch.optim.SGD``: exact_sgd, ``Adagrad``: exact_adagrad, torchrec's
    ``RowWiseAdagrad``: exact_row_wise_adagrad) of ``params`` applied in the backward. (DMP's own plan
    for one CPU rank is data-parallel tables on the dense kernel, stepped by a dense optimizer.) The
    other parameters are left to the caller's optimizer (``in_backward_optimizer_filter``)."""
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    apply_optimizer_in_backward(optimizer, collection.parameters(), dict(params))  # it renames keys in place
    constraints = {
        cfg.name: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
        )
        for cfg in collection.embedding_bag_configs()  # type: ignore[operator]
    }
    sharders: list[Any] = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


class _TorchRecDLRM(nn.Module):
    """The reference DLRM with its tables in a ``torchrec.EmbeddingBagCollection`` (``ebc``: tables
    ``t0``, ``t1``, ... read by features ``f0``, ``f1``, ...; built on the meta device, sharding
    allocates them): ``forward(dense, features KJT) -> (B,)`` click probabilities."""

    def __init__(self, table_sizes: Sequence[int], embedding_dim: int) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        super().__init__()
        # The MLPs first, as an eager ReferenceDLRM under the same seed builds them; its tables (one
        # row each here) dropped: the collection holds them.
        self.dlrm = ReferenceDLRM([1] * len(table_sizes), embedding_dim)
        self.dlrm.tables = nn.ModuleList()
        self.features = [f"f{k}" for k in range(len(table_sizes))]
        configs = [
            EmbeddingBagConfig(
                name=f"t{k}", embedding_dim=embedding_dim, num_embeddings=int(n), feature_names=[f]
            )
            for k, (n, f) in enumerate(zip(table_sizes, self.features))
        ]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))

    def forward(self, dense: torch.Tensor, features: Any) -> torch.Tensor:
        pooled = self.ebc(features).to_dict()
        interaction = self.dlrm.interact(self.dlrm.bottom(dense), [pooled[f] for f in self.features])
        return torch.sigmoid(self.dlrm.top(interaction).squeeze(1))

    def features_of(self, batch: Any) -> Any:
        """A :class:`~hierps.demo.data.BagBatch`'s ids and offsets per table as a ``KeyedJaggedTensor``."""
        from torchrec import KeyedJaggedTensor

        lengths = [torch.diff(o, append=o.new_tensor([len(i)])) for i, o in zip(batch.ids, batch.offsets)]
        return KeyedJaggedTensor(keys=self.features, values=torch.cat(batch.ids), lengths=torch.cat(lengths))


def _torchrec(cfg: dict[str, Any], profile: str | None) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    batches, sizes = _batches(cfg)
    single_rank_env()
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(cfg["seed"])
        model = _TorchRecDLRM(sizes, cfg["dim"])
        fused, params = (
            (torch.optim.Adagrad, {"lr": cfg["lr"], "eps": _ADAGRAD_EPS})
            if cfg["optimizer"] == "adagrad"
            else (torch.optim.SGD, {"lr": cfg["lr"]})
        )
        dmp = shard_fused(model, model.ebc, fused, params)
        state = dmp.state_dict()
        weights = [
            state[f"ebc.embedding_bags.t{k}.weight"].local_shards()[0].tensor for k in range(len(sizes))
        ]
        _start_from_initializer(weights, batches, cfg)
        dense = _optimizer(cfg, [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())])
        feeds = [(b.dense, model.features_of(b), b.labels) for b in batches]
        del batches, state, weights
        run = _Run(len(feeds), profile)
        for x, features, labels in run.steps(feeds + feeds):
            loss = _LOSS(dmp(x, features), labels)
            loss.backward()
            dense.step()
            dense.zero_grad()
            run.losses.append(loss.item())
        return run.record(batch_size=cfg["batch_size"], rows=sum(sizes))
    finally:
        dist.destroy_process_group()


# -- hierps ------------------------------------------------------------------------------------------
def _hierps(cfg: dict[str, Any], tmp: Path, name: str, profile: str | None) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    single_rank_env()
    import deepspeed.ops

    import hierps
    import hierps.deepspeed
    from hierps.rows import row_layout
    from hierps.tiers import ram_row_bytes

    # DeepSpeed compiles a shared-memory all-reduce for CPU ranks on first use; one rank needs none.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    batches, sizes = _batches(cfg)
    distinct = sum(
        len(np.unique(np.concatenate([b.ids[k].numpy() for b in batches]))) for k in range(len(sizes))
    )
    row_bytes = ram_row_bytes(row_layout(cfg["optimizer"], cfg["dim"]).words)
    memory_budget: int | str = (
        cfg["ssd_memory_budget"] if name == "hierps-ssd" else max(64 << 20, 2 * distinct * row_bytes)
    )
    torch.manual_seed(cfg["seed"])
    with torch.device("meta"):
        model = ReferenceDLRM(sizes, cfg["dim"])
    section = {
        "path": str(tmp / "store"),
        "memory_budget": memory_budget,
        "device_budget": cfg["device_budget"],
        "modules": "auto",
        "auto_min_rows": 1,
        "pass_batches": cfg["pass_batches"],
        "optimizer": {"type": cfg["optimizer"], "params": {"lr": cfg["lr"]}},
        "initializer": _initializer(),
        "seed": cfg["seed"],
    }
    config = one_rank_ds_config(cfg["batch_size"], section)
    engine, _, _, _ = hierps.deepspeed.initialize(
        model=model, optimizer=_optimizer(cfg, model.parameters()), config=config
    )
    names = _names(len(sizes))
    stream = batches + batches
    loader: Iterable[Any] = stream
    if name != "hierps-no-loader":
        loader = hierps.deepspeed.PassLoader(
            stream, lambda b: {t: hierps.Bags(i, o) for t, i, o in zip(names, b.ids, b.offsets)}, engine
        )
    run = _Run(len(batches), profile)
    try:
        for b in run.steps(loader):
            loss = _LOSS(engine(b.dense, b.ids, b.offsets), b.labels)
            engine.backward(loss)
            engine.step()
            run.losses.append(loss.item())
        usage = engine.hierps_store.usage()
        record = run.record(  # the clock stops here: the evaluation after it is timed on its own
            batch_size=cfg["batch_size"],
            rows=sum(sizes),
            distinct_rows=distinct,
            memory_budget=memory_budget,
            rows_memory=usage.memory_rows,
            rows_ssd=usage.ssd_rows,
            evicted_rows=usage.evicted_rows,
            device_bytes=usage.device_bytes,
            ssd_bytes_read=usage.ssd_bytes_read,
            ssd_bytes_written=usage.ssd_bytes_written,
            passes=engine.hierps_store.passes,
        )
        if name != "hierps-no-loader":
            record.update(_evaluate(engine, batches, names))
        return record
    finally:
        engine.destroy()


@torch.no_grad()
def _evaluate(engine: Any, batches: list[Any], names: list[str]) -> dict[str, float]:
    """Seconds per evaluation batch over the epoch's batches after training: each forward reading
    its rows itself, then through ``PassLoader(..., evaluate=True)`` (rows read a group ahead)."""
    import hierps
    import hierps.deepspeed

    engine.eval()
    out = {}
    try:
        for label, loader in (
            ("eval_s_per_batch", batches),
            (
                "eval_ahead_s_per_batch",
                hierps.deepspeed.PassLoader(
                    batches,
                    lambda b: {t: hierps.Bags(i, o) for t, i, o in zip(names, b.ids, b.offsets)},
                    engine,
                    evaluate=True,
                ),
            ),
        ):
            t0 = time.perf_counter()
            for b in loader:
                engine(b.dense, b.ids, b.offsets)
            out[label] = (time.perf_counter() - t0) / len(batches)
    finally:
        engine.train()
    return out


def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant of ``hierps bench --model dlrm-ref`` in this process (the bench worker's entry point)."""
    cfg, name, profile = spec["config"], spec["name"], spec.get("profile")
    t0 = time.perf_counter()
    if name == "torch":
        record = _torch(cfg, profile)
    elif name == "torchrec":
        record = _torchrec(cfg, profile)
    elif name in TABLE_VARIANTS:
        record = _tables_only(cfg, Path(spec["tmp"]), name)
    elif name == CEILING:
        record = _torch(cfg, profile, ceiling=True)
    elif name in REF_VARIANTS:
        record = _hierps(cfg, Path(spec["tmp"]), name, profile)
    else:
        raise ValueError(f"dlrm-ref variant: expected one of {', '.join(_ALL)}. Got {name!r} instead.")
    record["peak_rss_bytes"] = peak_rss_bytes()
    record["process_seconds"] = time.perf_counter() - t0
    return record


# -- profile ---------------------------------------------------------------------------------------------
# (label, file the function is in, its name): the parts of a step the breakdown reports.
_PARTS = (
    ("model forward", "demo/models.py", "forward"),
    ("  hierps table forwards", "hierps/modules.py", "forward"),
    ("  interaction", "demo/models.py", "interact"),
    ("backward", "torch/autograd/__init__.py", "backward"),
    ("engine.step", "integrations/deepspeed.py", "step"),
    ("  store.step", "hierps/_store.py", "step"),
    ("loader (between batches)", "integrations/loader.py", "__iter__"),
    ("  begin_pass", "hierps/_store.py", "begin_pass"),
    ("  prefetch", "hierps/_store.py", "prefetch"),
    ("  end_pass", "hierps/_store.py", "end_pass"),
    ("torch sparse optimizer step", "torch/optim/optimizer.py", "wrapper"),
)


def _write_profile(profiler: cProfile.Profile, path: str, steps: int) -> dict[str, dict[str, float]]:
    """Write the profile's top functions to ``path``; return the parts of ``_PARTS`` it saw:
    ``{label: {"ms_per_step", "calls_per_step", "ms_per_call"}}`` (cumulative times)."""
    text = io.StringIO()
    profiler.dump_stats(Path(path).with_suffix(".prof"))  # for pstats / snakeviz
    stats = pstats.Stats(profiler, stream=text)
    breakdown: dict[str, dict[str, float]] = {}
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for label, file, func in _PARTS:
        hits = [v for (f, _, fn), v in table.items() if fn == func and f.replace("\\", "/").endswith(file)]
        if not hits:
            continue
        calls = sum(v[1] for v in hits)
        cum = sum(v[3] for v in hits)
        breakdown[label] = {
            "ms_per_step": 1e3 * cum / steps,
            "calls_per_step": calls / steps,
            "ms_per_call": 1e3 * cum / max(calls, 1),
        }
    text.write(f"{steps} measured steps; cumulative ms per step of the parts:\n")
    for label, part in breakdown.items():
        text.write(
            f"  {label:30} {part['ms_per_step']:9.2f} ms/step  {part['calls_per_step']:6.1f} calls/step  "
            f"{part['ms_per_call']:8.3f} ms/call\n"
        )
    stats.strip_dirs()
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    Path(path).write_text(text.getvalue(), encoding="utf-8")
    return breakdown


# -- the run ---------------------------------------------------------------------------------------------
def run_ref_bench(cfg: dict[str, Any], tmp: str | None = None, profile: str | None = None) -> dict[str, Any]:
    """Every variant of ``cfg`` ``repeats`` times, interleaved, each in its own process; medians."""
    unknown = sorted(set(cfg["variants"]) - set(_ALL))
    if unknown or "torch" not in cfg["variants"]:
        raise ValueError(
            f"dlrm-ref variants: expected a subset of {','.join(_ALL)} with torch (the baseline). "
            f"Got {','.join(cfg['variants'])} instead."
        )
    skipped = {"torchrec": why} if "torchrec" in cfg["variants"] and (why := torchrec_missing()) else {}
    for name, why in skipped.items():
        print(f"  {name}: skipped, {why}", flush=True)
    measured = [name for name in cfg["variants"] if name not in skipped]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in measured}
    started = time.perf_counter()
    results: dict[str, Any] = {
        "config": cfg,
        "load_average_start": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="hierps-dlrm-ref-", dir=tmp) as tmp_dir:

        def one(name: str, label: str, **extra: Any) -> dict[str, Any]:
            spec = {
                "task": "dlrm-ref",
                "name": name,
                "config": cfg,
                "tmp": str(Path(tmp_dir) / label),
                **extra,
            }
            record = spawn(spec, timeout=1800.0)
            rate = record.get("examples_per_s")
            print(
                f"  [{time.perf_counter() - started:5.0f} s] {label}: "
                + (f"{rate:,.0f} examples/s" if rate else str(record.get("error", "?"))[-600:]),
                flush=True,
            )
            return record

        for r in range(cfg["repeats"]):
            for name in measured:
                runs[name].append(one(name, f"{name}-{r + 1}"))
        if profile:
            Path(profile).mkdir(parents=True, exist_ok=True)
            results["profile"] = {}
            for name in measured:
                record = one(name, f"{name}-profiled", profile=str(Path(profile).resolve() / f"{name}.txt"))
                results["profile"][name] = record.get("breakdown", {})
    results["variants"] = {
        name: {"skipped": skipped[name]}
        if name in skipped
        else median_record(runs[name], by="examples_per_s")
        for name in cfg["variants"]
    }
    results["seconds"] = time.perf_counter() - started
    results["load_average_end"] = os.getloadavg()
    _compare(results)
    return results


def _compare(results: dict[str, Any]) -> None:
    """Each variant's ratio to torch's examples/s and its largest step-loss difference from torch's
    (the tables-alone variants: to torch-tables')."""
    for name, record in results["variants"].items():
        # the tables alone against torch's tables alone
        base = results["variants"].get("torch-tables" if name in TABLE_VARIANTS else "torch", {})
        if "examples_per_s" not in record or "examples_per_s" not in base:
            continue
        record["vs_torch"] = record["examples_per_s"] / base["examples_per_s"]
        for rate, ratio in (
            ("examples_per_train_cpu_s", "vs_torch_cpu"),
            ("examples_per_process_cpu_s", "vs_torch_process_cpu"),  # the background threads' CPU too
        ):
            if rate in record and rate in base:
                record[ratio] = record[rate] / base[rate]
        if name == CEILING:  # a model without tables: its losses are not the others'
            continue
        a, b = np.asarray(record["losses"]), np.asarray(base["losses"])
        record["max_loss_diff"] = float(np.abs(a - b).max()) if a.shape == b.shape else float("inf")


def format_report(results: dict[str, Any], out: Callable[[str], Any] = print) -> None:
    """The table: examples/s, ratio to torch, peak RSS, final loss and its largest step difference."""
    cfg = results["config"]
    rows = results["variants"].get("torch", {}).get("rows", 0)
    out(
        f"\nhierps bench --model dlrm-ref: {cfg['examples']:,} examples per epoch in batches of {cfg['batch_size']:,}, "
        f"{rows:,} rows (max_ind_range {cfg['max_ind_range']:,}), {cfg['optimizer']} lr {cfg['lr']}, "
        f"{cfg['threads']} torch thread(s), median of {cfg['repeats']}"
    )
    out(
        f"{'variant':18} {'examples/s':>11} {'x torch':>8} {'x torch per train-thread CPU s':>31} "
        f"{'per process CPU s':>18} {'peak RSS':>10} {'final loss':>11} {'max |dloss|':>12}"
    )
    for name, r in results["variants"].items():
        if "skipped" in r:
            out(f"{name:18} skipped: {r['skipped']}")
            continue
        if "examples_per_s" not in r:
            out(f"{name:18} failed: {str(r.get('error', '?'))[-300:]}")
            continue
        out(
            f"{name:18} {r['examples_per_s']:11,.0f} {r.get('vs_torch', float('nan')):8.2f} "
            f"{r.get('vs_torch_cpu', float('nan')):31.2f} {r.get('vs_torch_process_cpu', float('nan')):18.2f} "
            f"{r['peak_rss_bytes'] / _MiB:7,.0f}MiB {r['final_loss']:11.6f} {r.get('max_loss_diff', float('nan')):12.2e}"
        )
    for name, r in results["variants"].items():
        if "eval_s_per_batch" in r:
            step = r["seconds"] / (r["examples"] / cfg["batch_size"])
            out(
                f"{name:18} evaluation: {1e3 * r['eval_s_per_batch']:.1f} ms a batch reading its own rows, "
                f"{1e3 * r['eval_ahead_s_per_batch']:.1f} ms read ahead (PassLoader evaluate=True); "
                f"{r['eval_ahead_s_per_batch'] / step:.2f}x a training step ({1e3 * step:.1f} ms)"
            )
    for name, parts in results.get("profile", {}).items():
        out(f"\n{name}: cumulative ms per measured step (cProfile, an extra run)")
        for label, part in parts.items():
            out(
                f"  {label:30} {part['ms_per_step']:9.2f} ms/step  {part['calls_per_step']:6.1f} calls/step  "
                f"{part['ms_per_call']:8.3f} ms/call"
            )


def run_from_args(args: argparse.Namespace) -> int:
    """``hierps bench --model dlrm-ref``: run, print the table, write ``--json``."""
    cfg = _config(args)
    print(
        f"hierps bench --model dlrm-ref: variants {','.join(cfg['variants'])}, each in its own process",
        flush=True,
    )
    results = run_ref_bench(cfg, tmp=args.tmp, profile=args.profile)
    format_report(results)
    print(f"bench took {results['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0
