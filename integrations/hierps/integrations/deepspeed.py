"""hierps under DeepSpeed: dense layers to the engine, embedding tables to the store.

::

    engine, optimizer, _, _ = hierps.deepspeed.initialize(model=model, optimizer=dense_opt,
                                                          config="ds_config.json")
    for batch in hierps.deepspeed.PassLoader(loader, ids_of, engine):
        loss = loss_fn(engine(*batch.inputs), batch.labels)
        engine.backward(loss)
        engine.step()                     # dense step, then one sparse step per touched row
    engine.save_checkpoint("ckpt/")       # DeepSpeed's files + a store checkpoint of the same tag

:func:`initialize` takes the arguments of ``deepspeed.initialize`` and returns what it returns.
When the config has an enabled ``"hierarchical_ps"`` section it:

1. validates the section and removes it from (a copy of) the config;
2. replaces the chosen ``nn.Embedding`` / ``nn.EmbeddingBag`` modules by ``hierps.Embedding`` /
   ``hierps.EmbeddingBag`` (rows 0..N-1 from their weights, table named by the qualified module
   name, e.g. ``tables.3``). These have no parameters, so DeepSpeed, ZeRO and their broadcasts
   never see the tables; the embedding weights are also dropped from ``model_parameters`` and
   from a client optimizer. A model built on the ``meta`` device (tables too large to allocate)
   allocates no table: their rows come from the section's initializer; its other layers are
   then materialised on the CPU and initialised by their ``reset_parameters()``
   (:func:`~hierps.integrations.swap.materialize` says which values that reproduces), and the
   optimizer and ``model_parameters`` given are pointed at them. One rank keeps its rows in a
   :class:`hierps.Store` under ``<path>/rank-00000``; several ranks in a
   :class:`hierps.ShardedStore` (one shard per rank, ``<path>/rank-NNNNN``; rows and gradients
   travel by all-to-all, over torch.distributed, or over Horovod when ``dense_allreduce``
   resolves to ``horovod``). Either way it opens at the
   latest checkpoint of the directory committed for all ranks, resharded when another number of
   ranks wrote it (one process can take over what many trained);
3. logs one line saying which embedding modules went into the store and which stayed dense, and
   why (``engine.hierps_swap``; rank 0, INFO on the ``hierps.deepspeed`` logger, on stderr while
   the application has not configured logging), warning when ``"auto"`` left one dense; the old modules' weights
   become :class:`~hierps.integrations.swap.StaleWeight`, which raise ``StaleWeightError`` when used;
4. builds the engine with ``deepspeed.initialize`` and extends its class with
   :class:`HierpsEngine`: ``step()`` runs DeepSpeed's step and then, when that step was an
   accumulation boundary, the store's sparse step; ``save_checkpoint`` / ``load_checkpoint``
   also checkpoint / restore the store. The loader of ``training_data`` comes back as a
   :class:`PassLoader`: it loads each pass's rows before its batches run (ids found through
   ``batch_ids``, or from the first batches).

Why the sparse step sits on ``engine.step``: the engine calls the dense optimizer (a client
optimizer as-is under ZeRO 0, DeepSpeed's ZeRO optimizer wrapping it under ZeRO 1 / 2) only at
the accumulation boundary. ``engine.step`` is the one public call every training loop makes
once per micro-batch, whatever wraps the optimizer, and ``is_gradient_accumulation_boundary()``
read just before it says whether this call updates the parameters. Sparse gradients add up in
the store across the micro-batches in between (``engine.backward`` has already divided the loss
by ``gradient_accumulation_steps``, for them as for the dense ones), so both parts take one step
on the same summed gradients. Over W ranks the sharded store sums a row's gradients from every
rank and divides by W, as DeepSpeed averages dense gradients: W ranks on W slices of a batch
train like one process on the whole batch.

Dense gradients only: DeepSpeed's ``gradient_clipping`` (1.0 unless set) and its loss scaling
see the dense parameters; the sparse rows get their true, unclipped gradients.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
from torch import nn

from hierps._faults import fault_point
from hierps._store import Store, store_parts
from hierps.config import TableSettings, TableSpec
from hierps.errors import ConfigError
from hierps.integrations.config import (
    SECTION,
    STORE_SETTINGS,
    DenseAllreduce,
    HierarchicalPSConfig,
    resolve_dense_allreduce,
    select_modules,
    split_config,
)
from hierps.integrations.dataloader import resumable
from hierps.integrations.horovod import map_horovod_env
from hierps.integrations.loader import PassLoader
from hierps.integrations.rendezvous import free_port
from hierps.integrations.schedule import TablesFollowLr, configured_lr
from hierps.integrations.swap import (
    DenseEmbeddingWarning,
    SwapReport,
    check_not_shared,
    materialize,
    report_swap,
    retire_weights,
)
from hierps.integrations.transport import HorovodTransport, TorchDistributedTransport
from hierps.metrics import MetricsServer, monitor_events, serve
from hierps.modules import Embedding, EmbeddingBag, without_tables
from hierps.rows._ids import same_device
from hierps.sharding._commits import ALONE, ShardCheckpoints, rank_dir
from hierps.sharding._sharded import ShardedStore, owner_of
from hierps.storage._files import fsync_dir, read_json_checked, write_json_atomic
from hierps.tiers._stats import PassRecord

__all__ = ["HierarchicalPSConfig", "HierpsEngine", "PassLoader", "initialize", "swap_embeddings"]

_RECORD_FORMAT = "hierps-deepspeed-checkpoint"
_CLIENT_KEY = "hierps"  # in DeepSpeed's client state: which store checkpoint its files go with

# Jobs DeepSpeed sets up itself when RANK, WORLD_SIZE, ... are missing: MPI launchers (OpenMPI,
# MPICH / Intel MPI, PMIx, MVAPICH; read through mpi4py), AzureML and SageMaker.
_SELF_DISCOVERED = (
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_RANK",
    "MV2_COMM_WORLD_SIZE",
    "AZUREML_EXPERIMENT_ID",
    "SM_TRAINING_ENV",
)


class _UnconfiguredLogging(logging.Handler):
    """Writes a record to stderr when no handler of the application's would: logging not set up.

    Why not the usual ``NullHandler``: the swap line says what ``initialize`` did to the user's
    model (which tables left its parameters), and a library default that hides it is how nobody
    saw it. Why not WARNING: nothing is wrong, and a warning on every healthy start trains people
    to ignore warnings. So the line is INFO on the ``hierps.deepspeed`` logger: once the
    application configures logging (a handler on the root logger, ``logging.basicConfig``), it
    goes there like any record and this handler stays silent; until then it reaches stderr, as
    Python's own last-resort handler does for warnings. ``logging.getLogger("hierps.deepspeed")
    .setLevel(logging.WARNING)`` silences it.
    """

    def emit(self, record: logging.LogRecord) -> None:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return  # the application's handlers have it
            logger = logger.parent if logger.propagate else None
        try:
            sys.stderr.write(self.format(record) + "\n")  # sys.stderr now: a redirected one too
        except Exception:
            self.handleError(record)


_log = logging.getLogger("hierps.deepspeed")
if _log.level == logging.NOTSET:  # a level set before this import is the application's
    _log.setLevel(logging.INFO)
_log.addHandler(_UnconfiguredLogging())
# Steps between the records of a loop that announces no passes, when the config sets no steps_per_print.
_ON_DEMAND_RECORD_STEPS = 100


def _single_process_env(dist_init_required: bool | None) -> dict[str, str]:
    """Set what ``torchrun --nproc_per_node 1`` would for a process no launcher started.

    ``python train.py`` has no RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR or MASTER_PORT, and
    ``deepspeed.init_distributed`` then looks for an MPI job (``No module named 'mpi4py'``). When
    neither RANK nor WORLD_SIZE is set (a launcher always sets both), no MPI / AzureML / SageMaker
    job is found, and no process group exists or is refused (``dist_init_required=False``), this sets
    RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR=127.0.0.1 and MASTER_PORT
    (a free port), each unless already set (a chosen port, a LOCAL_RANK picking the device). Returns
    what it set.
    """
    env = os.environ
    if (
        dist_init_required is False
        or torch.distributed.is_initialized()
        or any(name in env for name in ("RANK", "WORLD_SIZE", *_SELF_DISCOVERED))
    ):
        return {}
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    defaults["MASTER_ADDR"] = "127.0.0.1"
    if "MASTER_PORT" not in env:
        defaults["MASTER_PORT"] = str(free_port())
    added = {k: v for k, v in defaults.items() if k not in env}
    env.update(added)
    return added


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with the model's large embeddings kept in a hierps store.

    Same arguments and return value ``(engine, optimizer, training_dataloader, lr_scheduler)``.
    The config (``config``, ``config_params`` or ``args.deepspeed_config``; a dict or a JSON
    file) may hold a ``"hierarchical_ps"`` section; without one, or with ``"enabled": false``,
    this is exactly ``deepspeed.initialize``. With one, the returned engine is a
    :class:`HierpsEngine`: ``engine.module.<name>`` is the hierps module (``lookup(ids)`` reads
    its rows), ``engine.hierps_store`` the store. A bad section raises ``ConfigError`` before
    anything is built. In a process no launcher started (``python train.py``: no RANK or
    WORLD_SIZE), it sets world-size-1 defaults first, as ``torchrun`` would.
    """
    kwargs = {
        "args": args,
        "model": model,
        "optimizer": optimizer,
        "model_parameters": model_parameters,
        "training_data": training_data,
        "lr_scheduler": lr_scheduler,
        "distributed_port": distributed_port,
        "mpu": mpu,
        "dist_init_required": dist_init_required,
        "collate_fn": collate_fn,
        "config": config,
        "mesh_param": mesh_param,
        "config_params": config_params,
    }
    from_args = config is None and config_params is None
    source = config if config is not None else config_params
    if from_args:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    ds_config, section = split_config(_read_config(source))
    if section is None:  # the arguments go to DeepSpeed untouched
        return deepspeed.initialize(**kwargs)
    # DeepSpeed gets the config without the section, as a dict, through one argument only.
    kwargs.update(config=ds_config, config_params=None)
    if from_args:
        kwargs["args"] = copy.copy(args)
        for name in ("deepspeed_config", "deepscale_config"):
            if hasattr(args, name):
                setattr(kwargs["args"], name, None)
    if not section.enabled:
        return deepspeed.initialize(**kwargs)
    return _initialize_with_store(section, kwargs)


def _read_config(source: Any) -> Mapping[str, Any] | None:
    """A config as DeepSpeed reads it (a dict; a path of a JSON / hjson file; base64 JSON), or None.

    None also when DeepSpeed could not read it either: ``deepspeed.initialize`` reports that.
    """
    if source is None or isinstance(source, Mapping):
        return source
    try:
        return load_ds_config(str(source))
    except (OSError, ValueError):
        return None


def _initialize_with_store(
    section: HierarchicalPSConfig, kwargs: dict[str, Any]
) -> tuple[Any, Any, Any, Any]:
    model = kwargs["model"]
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: deepspeed.initialize needs an nn.Module. Got {type(model).__name__}.")
    if isinstance(model, PipelineModule):
        raise ConfigError(
            f"{SECTION}: pipeline-parallel models (PipelineModule) are not supported; pass the "
            "model as a plain nn.Module."
        )
    zero = (kwargs["config"] or {}).get("zero_optimization") or {}
    dense_allreduce = resolve_dense_allreduce(
        section.dense_allreduce, zero_stage=int(zero.get("stage", 0) or 0)
    )
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    _adapt_torchrec(model, swaps)  # a TorchRec model: its collections' tables become modules to swap
    chosen = select_modules(model, section)
    check_not_shared(model, chosen)
    map_horovod_env()  # under horovodrun: RANK, MASTER_ADDR, ... from HOROVOD_*; else nothing
    _single_process_env(kwargs["dist_init_required"])  # plain `python train.py`: one rank, as torchrun
    dense_lr = configured_lr(kwargs["optimizer"], kwargs["config"])  # before a scheduler moves it
    # What deepspeed.initialize does first; done here so that rank and world size are known.
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=kwargs["distributed_port"],
        dist_init_required=kwargs["dist_init_required"],
    )
    first_rank = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    with warnings.catch_warnings():
        if not first_rank:  # one rank says it
            warnings.simplefilter("ignore", DenseEmbeddingWarning)
        report = report_swap(model, chosen, section)
    store, transport, checkpoints = _open_store(section, dense_allreduce, _training_device(kwargs["args"]))
    try:
        twins = swap_embeddings(
            model,
            chosen,
            store,
            TableSpec.of(
                optimizer=section.optimizer,
                weights_dtype=section.weights_dtype,
                state_dtype=section.state_dtype,
            ),
            undo=swaps,
        )
        dropped = {id(p) for m in chosen.values() for p in m.parameters()}
        # A meta-device model: the dense layers, on the CPU as an eager build holds them.
        made = materialize(model, torch.device("cpu"))
        kwargs["model_parameters"] = _dense_parameters(kwargs["model_parameters"], dropped, made)
        _rebind_optimizer(kwargs["optimizer"], dropped, made)
        engine, optimizer, loader, scheduler = deepspeed.initialize(**kwargs)
        _attach(engine, store, section, twins, transport, dense_allreduce, dense_lr)
        engine.hierps_checkpoints = checkpoints
        engine.hierps_swap = report
    except BaseException:
        for parent, attr, original in reversed(swaps):
            setattr(parent, attr, original)
        store.close()
        raise
    retire_weights(chosen, {name: getattr(t, "table", name) for name, t in twins.items()})
    if first_rank:
        _log.info("%s", report.line())
    if loader is not None and twins:  # DeepSpeed's loader of training_data, resumable and pass-aware
        loader = PassLoader(resumable(loader), None, engine)
    return engine, optimizer, loader, scheduler


def _adapt_torchrec(model: nn.Module, undo: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """TorchRec collections of ``model`` hold their tables as the torch modules swapped here, under
    TorchRec's qualified names (:func:`hierps.integrations.torchrec.adapt_collections`: the same
    weights, nothing copied). Only when the model's code imported torchrec: hierps never needs it."""
    if "torchrec" in sys.modules:
        from hierps.integrations.torchrec import adapt_collections

        adapt_collections(model, undo=undo)


def _open_store(
    section: HierarchicalPSConfig, dense_allreduce: DenseAllreduce, device: torch.device
) -> tuple[Store | ShardedStore, Any, ShardCheckpoints]:
    """One rank: a :class:`Store` in ``<path>/rank-00000``. Several: a :class:`ShardedStore` over them.

    Either way the store opens at the latest checkpoint of the directory, whatever number of ranks
    wrote it (resharded into this one when need be). The sharded store's collectives go over
    Horovod when it all-reduces the dense gradients, else over torch.distributed (DeepSpeed's
    process group). Returns ``(store, transport or None, its checkpoints)``.
    """
    options = {name: getattr(section, name) for name in STORE_SETTINGS}
    options["device"] = device
    path = Path(section.path or "")
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        checkpoints = ShardCheckpoints.open(
            path, ALONE, owner_of, lambda: Store(rank_dir(path, 0), **options)
        )
        return checkpoints.local, None, checkpoints
    if dense_allreduce is DenseAllreduce.HOROVOD:
        transport: Any = HorovodTransport()
    else:
        transport = TorchDistributedTransport()
    sharded = ShardedStore(path, transport, **options)
    return sharded, transport, sharded.checkpoints


def swap_embeddings(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    store: Store | ShardedStore,
    spec: TableSpec | None = None,
    *,
    undo: list[tuple[nn.Module, str, nn.Module]] | None = None,
    **settings: Unpack[TableSettings],
) -> dict[str, nn.Module]:
    """Replace each named ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model`` by its hierps twin.

    ``modules``: qualified name -> module (as :func:`select_modules` gives). Every reference to
    a module is replaced (a module shared by two parents stays shared), and the twin holds rows
    0..N-1 of its weight in table ``name`` (unless the store already holds that table: resume; a
    module on the meta device has none: the table's initializer gives them).
    ``undo`` receives ``(parent, attribute, original)`` for each replacement. ``spec`` and the
    keywords (``optimizer=``, ``weights_dtype=``, ...) are the tables' settings (see
    :meth:`hierps.Store.table`). Returns name -> twin.
    """
    spec = TableSpec.of(spec, **settings)
    refs: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for attr, child in parent._modules.items():  # named_children() would hide a second reference
            refs.setdefault(id(child), []).append((parent, attr))
    twins: dict[str, nn.Module] = {}
    made: dict[int, nn.Module] = {}
    for name, module in modules.items():
        if id(module) not in made:
            twin: nn.Module
            if isinstance(module, nn.EmbeddingBag):
                twin = EmbeddingBag.from_module(module, store=store, name=name, spec=spec)
            elif isinstance(module, nn.Embedding):
                twin = Embedding.from_module(module, store=store, name=name, spec=spec)
            else:
                raise ConfigError(
                    f"swap_embeddings: {name!r} is a {type(module).__name__}, not an nn.Embedding "
                    "or nn.EmbeddingBag."
                )
            made[id(module)] = twin
            for parent, attr in refs.get(id(module), []):
                if undo is not None:
                    undo.append((parent, attr, module))
                setattr(parent, attr, made[id(module)])
        twins[name] = made[id(module)]
    return twins


_Materialised = Mapping[int, tuple[torch.Tensor, torch.Tensor]]  # id(meta tensor) -> (it, its twin)


def _rebound(p: Any, dropped: set[int], made: _Materialised) -> list[Any]:
    """What a parameter the user handed over becomes: [] for a swapped embedding weight, [its
    materialised twin] for a meta one, [itself] otherwise."""
    if id(p) in dropped:
        return []
    return [made[id(p)][1]] if id(p) in made else [p]


def _dense_parameters(params: Any, dropped: set[int], made: _Materialised) -> list[Any] | None:
    """``model_parameters`` (tensors or param-group dicts) without the swapped embedding weights,
    the materialised tensors in place of meta ones."""
    if params is None:
        return None
    out: list[Any] = []
    for p in params:
        if isinstance(p, Mapping):
            group = dict(p)
            members = [group["params"]] if isinstance(group["params"], torch.Tensor) else group["params"]
            group["params"] = [r for q in members for r in _rebound(q, dropped, made)]
            out.append(group)
        else:
            out.extend(_rebound(p, dropped, made))
    return out


def _rebind_optimizer(optimizer: Any, dropped: set[int], made: _Materialised) -> None:
    """A client torch optimizer, in place: without the swapped embedding weights (and their state),
    the materialised tensors in place of meta ones (whose state, if any, held no values)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return  # None, or a callable DeepSpeed calls with the dense model_parameters
    for group in optimizer.param_groups:
        group["params"] = [r for q in group["params"] for r in _rebound(q, dropped, made)]
    for p in [p for p in optimizer.state if id(p) in dropped or id(p) in made]:
        del optimizer.state[p]


def _training_device(args: Any) -> torch.device:
    """The device the engine will train on (DeepSpeed picks it the same way, after init_distributed)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(get_accelerator().device_name(getattr(args, "device_rank", local_rank)))


def _attach(
    engine: Any,
    store: Store | ShardedStore,
    section: HierarchicalPSConfig,
    twins: dict[str, nn.Module],
    transport: Any,
    dense_allreduce: DenseAllreduce,
    dense_lr: float | None = None,
) -> None:
    if not same_device(store.device, engine.device):
        raise ConfigError(
            f"{SECTION}: the store was opened on {store.device} but the engine trains on "
            f"{engine.device}; set LOCAL_RANK (or args.device_rank) consistently."
        )
    average = None
    if transport is not None and dense_allreduce is DenseAllreduce.HOROVOD:
        if engine.zero_optimization_stage() > 0:
            raise ConfigError(
                f"{SECTION}.dense_allreduce: 'horovod' all-reduces whole dense gradients, which ZeRO stage "
                f"{engine.zero_optimization_stage()} partitions itself. Use ZeRO stage 0, or "
                '"dense_allreduce": "deepspeed".'
            )
        engine.enable_backward_allreduce = False  # Horovod averages them in step() instead
        average = transport.average_gradients
    elif engine.zero_optimization_stage() == 0 and int(getattr(engine, "dp_world_size", 0)) == 1:
        # One data-parallel replica: DeepSpeed's all-reduce would flatten every dense gradient, reduce
        # it with itself and copy it back (a few ms a step, no change to a bit).
        engine.enable_backward_allreduce = False
    base = type(engine)
    engine.__class__ = type(f"Hierps{base.__name__}", (HierpsEngine, base), {})
    engine.hierps_store = store
    engine.hierps_config = section
    engine.hierps_modules = twins
    engine.hierps_dense_allreduce = dense_allreduce
    engine._hierps_average = average
    engine._hierps_lr = TablesFollowLr(store, [getattr(t, "table", n) for n, t in twins.items()], dense_lr)
    if isinstance(store, Store):  # steps at accumulation boundaries: gathers between them are expected
        trainer = store_parts(store).trainer
        # 4x: a micro-batch may gather a table more than once (a module the model calls twice).
        trainer.gathers_before_warning = max(
            trainer.gathers_before_warning, 4 * int(engine.gradient_accumulation_steps())
        )
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.half if engine.fp16_enabled() else None
    if dtype is not None or _may_scale_loss(engine):  # else the hook would return its output as it is
        for twin in {id(t): t for t in twins.values()}.values():
            twin.register_forward_hook(_OutputHook(engine, dtype))
    engine._hierps_unmonitor = _monitor_passes(engine)


class _OutputHook:
    """Forward hook on a hierps module: its float32 output in the engine's dtype, its gradient unscaled.

    Under bf16 / fp16 the dense layers expect their dtype (the cast lets gradients through). When
    the engine scales the loss (fp16 loss scaling, a GradScaler), it unscales the dense gradients
    in its optimizer; the gradient reaching the embedding output is unscaled here, so the store
    steps on true gradients.
    """

    def __init__(self, engine: Any, dtype: torch.dtype | None) -> None:
        self.engine = engine
        self.dtype = dtype

    def __call__(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if output.requires_grad:
            # The loss scale of this micro-batch's backward: it changes only in step(), after it.
            scale = _loss_scale(self.engine)
            if scale != 1.0:
                output.register_hook(lambda grad: grad / scale)
        return output if self.dtype is None else output.to(self.dtype)


def _may_scale_loss(engine: Any) -> bool:
    """Whether ``engine.backward`` may ever scale the loss: fp16, a ZeRO optimizer or a GradScaler.

    Decided once, at :func:`initialize`: the engine's precision and optimizer are fixed by then."""
    return (
        engine.fp16_enabled()
        or isinstance(engine.optimizer, ZeROOptimizer)
        or getattr(engine, "torch_autocast_z0_gradscaler", None) is not None
    )


def _loss_scale(engine: Any) -> float:
    """The factor ``engine.backward`` multiplies the loss by (as ``DeepSpeedEngine.scale`` does)."""
    if isinstance(engine.optimizer, ZeROOptimizer):
        with torch.enable_grad():  # scale_if_loss only scales what looks like a loss: a graph output
            probe = torch.ones((), device=engine.device, requires_grad=True) * 1.0
            return float(engine.optimizer.scale_if_loss(probe).detach())
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    return float(scaler.get_scale()) if scaler is not None else 1.0


class HierpsEngine:
    """What :func:`initialize` adds to the DeepSpeed engine's own class (which stays a base).

    Attributes: ``hierps_store`` (a :class:`hierps.Store`, or a :class:`hierps.ShardedStore`
    over several ranks), ``hierps_config`` (the section), ``hierps_modules`` (qualified name ->
    hierps module), ``hierps_dense_allreduce`` (``deepspeed`` or ``horovod``), ``hierps_swap`` (which
    embedding modules went into the store and which stayed dense, and why), ``hierps_metrics`` (the
    Prometheus endpoint of the section's ``metrics_port``, or None).
    """

    hierps_store: Store | ShardedStore
    hierps_checkpoints: ShardCheckpoints
    hierps_config: HierarchicalPSConfig
    hierps_modules: dict[str, nn.Module]
    hierps_dense_allreduce: DenseAllreduce
    hierps_swap: SwapReport
    hierps_metrics: MetricsServer | None
    _hierps_unmonitor: Callable[[], None]
    _hierps_average: Callable[[list[nn.Parameter]], None] | None
    _hierps_lr: TablesFollowLr

    if TYPE_CHECKING:  # provided by the DeepSpeed engine class this one is mixed into
        module: nn.Module
        optimizer: Any
        global_steps: int
        global_rank: int
        world_size: int

        def managed_gradient_accumulation(self) -> bool: ...
        def is_gradient_accumulation_boundary(self) -> bool: ...
        def was_step_applied(self) -> bool: ...
        def load_universal_checkpoint(self) -> bool: ...
        def use_node_local_storage(self) -> bool: ...
        def steps_per_print(self) -> int | None: ...

        local_rank: int

    def step(self, lr_kwargs: Any = None) -> None:
        """DeepSpeed's step; at an accumulation boundary, then one sparse step for every touched row.

        When DeepSpeed skipped the dense update (fp16 overflow), the sparse gradients are
        dropped as well, so both parts stay on the same steps. The sparse step runs at the
        learning rate of the dense one, scaled to the tables' (see
        :mod:`hierps.integrations.schedule`): a scheduler moves both.
        """
        boundary = not self.managed_gradient_accumulation() or self.is_gradient_accumulation_boundary()
        if boundary and self._hierps_average is not None:
            self._hierps_average([p for p in self.module.parameters() if p.requires_grad])
        # The rate this step's dense update uses: a scheduler DeepSpeed steps moves it after it.
        factor = self._hierps_lr.factor(self.optimizer) if boundary else 1.0
        super().step(lr_kwargs)  # type: ignore[misc]
        if boundary:
            if self.was_step_applied():
                self._hierps_lr.apply(factor)
                self.hierps_store.step()
            else:
                self.hierps_store.zero_grad()
            # A loop that announces no passes still reports: a record of its on-demand loads every
            # steps_per_print steps (one per pass otherwise, at end_pass).
            local = _rank_store(self.hierps_store)
            every = self.steps_per_print() or _ON_DEMAND_RECORD_STEPS
            if local.stats.steps_unrecorded >= max(1, int(every)):
                local.record_stats()

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> Any:
        """DeepSpeed's checkpoint of ``tag`` (default ``global_step<N>``), and a store checkpoint of it.

        In this order, so that a crash at any point leaves every earlier tag loadable, and the tag
        being saved either whole or refused when loaded:

        1. the store checkpoint is made durable; older store checkpoints are not retired yet;
        2. DeepSpeed writes its files (the dense state, no table), the store checkpoint's id in
           their client state;
        3. ``<save_dir>/<tag>/hierps-rank-NNNNN.json`` names the store checkpoint: the tag is whole;
        4. ``latest`` names the tag (written atomically, once every rank finished 3);
        5. store checkpoints beyond ``keep_checkpoints`` are retired.

        A tag saved again (``"best"``) keeps its previous record until step 3: DeepSpeed's files
        that do not match it are refused by :meth:`load_checkpoint`.
        """
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        ckpt = self.hierps_checkpoints.checkpoint(tag, retire=False)
        fault_point("deepspeed.store_saved")
        state = {**(client_state or {}), _CLIENT_KEY: {"checkpoint": ckpt, "tag": tag}}
        with without_tables():  # the store checkpoint holds the rows: none in DeepSpeed's files
            out = super().save_checkpoint(  # type: ignore[misc]
                save_dir,
                tag=tag,
                client_state=state,
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        fault_point("deepspeed.files_saved")
        record = _record_path(save_dir, tag, self.global_rank)
        record.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "format": _RECORD_FORMAT,
            "tag": tag,
            "rank": self.global_rank,
            "world_size": self.world_size,
            "checkpoint": ckpt,
            "store": str(self.hierps_checkpoints.root.resolve()),
            "tables": sorted(self.hierps_modules),
            "global_steps": int(self.global_steps),
        }
        write_json_atomic(record, body)
        fault_point("deepspeed.recorded")
        _barrier()
        # Where each host saves on its own disk, each host's first rank names the tag there.
        writer = self.local_rank if self.use_node_local_storage() else self.global_rank
        if save_latest and writer == 0:
            _write_latest(Path(save_dir), tag)
        _barrier()
        fault_point("deepspeed.latest_written")
        self.hierps_checkpoints.retire()
        return out

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[Any, Any]:
        """DeepSpeed's load of ``tag`` (default: the ``latest`` one), and the store back at that tag.

        The store returns to exactly the rows and optimizer state saved with the tag, whatever
        ran since (a tag saved by another number of ranks, one included, is resharded). Raises
        ``ConfigError`` before loading anything when the tag has no store checkpoint (saved
        without hierps, its save did not finish, or retired by ``keep_checkpoints``); and, after
        DeepSpeed loaded its files, when they belong to another save of the tag than its store
        checkpoint (a save of a reused tag was interrupted): then load another tag.
        """
        resolved = str(tag) if tag is not None else _latest_tag(load_dir, self.load_universal_checkpoint())
        ref = self._hierps_checkpoint_of(load_dir, resolved) if resolved is not None else None
        out = super().load_checkpoint(  # type: ignore[misc]
            load_dir,
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )
        if out[0] is not None and ref is not None:
            written = out[1].pop(_CLIENT_KEY, None) if isinstance(out[1], dict) else None
            if isinstance(written, dict) and written.get("checkpoint") != ref:
                raise ConfigError(
                    f"load_checkpoint: tag {resolved!r} in {load_dir}: DeepSpeed's files were written with store "
                    f"checkpoint {written.get('checkpoint')!r}, its record names {ref}: the tag was saved again "
                    "and that save did not finish, so its dense and sparse parts are of different saves. "
                    "The engine's dense state is now that of the files; load another tag (e.g. the latest)."
                )
            self.hierps_checkpoints.restore(ref)
            if isinstance(self.hierps_store, ShardedStore):
                self.hierps_store.zero_grad()
        return out

    def destroy(self) -> None:
        """DeepSpeed's destroy, then close the store (rows after the last checkpoint are not kept)."""
        self._hierps_unmonitor()
        super().destroy()  # type: ignore[misc]
        self.hierps_store.close()

    def _hierps_checkpoint_of(self, load_dir: str, tag: str) -> int:
        """The store checkpoint saved with ``tag``, at whatever world size it was saved (collective).

        Each rank reads the record it finds under ``<load_dir>/<tag>``: its own, else rank 0's, else
        any rank's (saved on each host's own disk, a host holds its ranks' records only; saved by
        another number of ranks, a rank may have none), and the ranks agree on the checkpoint.
        """
        path = _find_record(load_dir, tag, self.global_rank)
        record = read_json_checked(path) if path is not None else {}
        saved = record.get("checkpoint")
        found = {row[0] for row in self.hierps_checkpoints.gather([saved if isinstance(saved, int) else 0])}
        if found == {0}:
            raise ConfigError(
                f"load_checkpoint: tag {tag!r} in {load_dir} has no {_record_path(load_dir, tag, 0).name} "
                f"on any rank: it was saved without the {SECTION} section, or its save did not finish. Load "
                "a tag saved by a hierps engine."
            )
        if len(found - {0}) > 1:
            raise ConfigError(
                f"load_checkpoint: tag {tag!r}: the ranks' records under {load_dir} name different store "
                f"checkpoints ({sorted(found - {0})}): the directory holds files of several saves. Load another tag."
            )
        ckpt = max(found)
        snap = self.hierps_checkpoints.find(ckpt)
        if snap is None or snap.tag != tag:
            raise ConfigError(
                f"load_checkpoint: tag {tag!r} has no checkpoint in the store {self.hierps_checkpoints.root} "
                f"(it was retired past keep_checkpoints={self.hierps_store.keep_checkpoints}, or the store "
                f"is another one than {record.get('store', 'the one it was saved with')}). Raise "
                "keep_checkpoints to keep more tags loadable, or point path at the store this tag was saved with."
            )
        return ckpt


def _rank_store(store: Store | ShardedStore) -> Store:
    """This rank's store: the store, or of a sharded one its part here."""
    return store.local if isinstance(store, ShardedStore) else store


def _monitor_passes(engine: Any) -> Callable[[], None]:
    """Hand each pass record of this rank's store (of a sharded store: its part here) to DeepSpeed's
    monitor (the config's ``tensorboard`` / ``csv_monitor`` / ``wandb`` sections, written at rank 0)
    as ``hierps/<field>`` events at the global step the pass closed at
    (:func:`hierps.metrics.monitor_events`); with the section's ``metrics_port``, serve the store's
    figures at ``engine.hierps_metrics``. Returns what stops both (at ``destroy``)."""
    local = _rank_store(engine.hierps_store)
    monitor = getattr(engine, "monitor", None)
    stop: list[Callable[[], None]] = []
    if monitor is not None and getattr(monitor, "enabled", False):

        def write(record: PassRecord) -> None:
            try:
                monitor.write_events(monitor_events(record, int(engine.global_steps)))
            except Exception as exc:  # a monitor that fails to write does not stop training
                _log.warning(
                    "hierps: DeepSpeed's monitor could not write pass %d: %s", record.pass_index, exc
                )

        local.stats.listeners.append(write)
        stop.append(lambda: local.stats.listeners.remove(write))
    engine.hierps_metrics = None
    if engine.hierps_config.metrics_port is not None:
        host, port = engine.hierps_config.metrics_port
        engine.hierps_metrics = serve(port + int(engine.local_rank) if port else 0, store=local, host=host)
        stop.append(engine.hierps_metrics.close)

    def unmonitor() -> None:
        while stop:
            stop.pop()()

    return unmonitor


def _find_record(directory: str | os.PathLike[str], tag: str, rank: int) -> Path | None:
    """This rank's record of ``tag``, else rank 0's, else any rank's; None when there is none here."""
    for path in (_record_path(directory, tag, rank), _record_path(directory, tag, 0)):
        if path.exists():
            return path
    return next(iter(sorted((Path(directory) / tag).glob("hierps-rank-*.json"))), None)


def _record_path(directory: str | os.PathLike[str], tag: str, rank: int) -> Path:
    return Path(directory) / tag / f"hierps-rank-{rank:05d}.json"


def _write_latest(save_dir: Path, tag: str) -> None:
    """DeepSpeed's ``latest`` file naming ``tag``, replaced atomically (never empty, never half a tag)."""
    tmp = save_dir / f".latest.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / "latest")
    fsync_dir(save_dir)


def _barrier() -> None:
    """Wait for every rank (torch.distributed, as DeepSpeed's own checkpoint does), if there are several."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _latest_tag(load_dir: str, universal: bool) -> str | None:
    """The tag DeepSpeed's ``latest`` (or ``latest_universal``) file names, or None without one."""
    latest = Path(load_dir) / ("latest_universal" if universal else "latest")
    return latest.read_text().strip() if latest.is_file() else None
