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
   ``hierps.EmbeddingBag`` over a store in ``<path>/rank-00000`` (rows 0..N-1 from their
   weights, table named by the qualified module name, e.g. ``tables.3``). These have no
   parameters, so DeepSpeed, ZeRO and their broadcasts never see the tables; the embedding
   weights are also dropped from ``model_parameters`` and from a client optimizer;
3. builds the engine with ``deepspeed.initialize`` and extends its class with
   :class:`HierpsEngine`: ``step()`` runs DeepSpeed's step and then, when that step was an
   accumulation boundary, the store's sparse step; ``save_checkpoint`` / ``load_checkpoint``
   also checkpoint / restore the store.

Why the sparse step sits on ``engine.step``: the engine calls the dense optimizer (a client
optimizer as-is under ZeRO 0, DeepSpeed's ZeRO optimizer wrapping it under ZeRO 1 / 2) only at
the accumulation boundary. ``engine.step`` is the one public call every training loop makes
once per micro-batch, whatever wraps the optimizer, and ``is_gradient_accumulation_boundary()``
read just before it says whether this call updates the parameters. Sparse gradients add up in
the store across the micro-batches in between (``engine.backward`` has already divided the loss
by ``gradient_accumulation_steps``, for them as for the dense ones), so both parts take one step
on the same summed gradients.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.pipe import PipelineModule
from torch import nn

from hierps._files import read_json_checked, write_json_atomic
from hierps.errors import ConfigError
from hierps.ids import same_device
from hierps.integrations.config import (
    SECTION,
    DenseAllreduce,
    HierarchicalPSConfig,
    rank_store_path,
    resolve_dense_allreduce,
    select_modules,
    split_config,
)
from hierps.integrations.loader import PassLoader
from hierps.modules import Embedding, EmbeddingBag
from hierps.store import Store

__all__ = ["HierarchicalPSConfig", "HierpsEngine", "PassLoader", "initialize", "swap_embeddings"]

_RECORD_FORMAT = "hierps-deepspeed-checkpoint"


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
    anything is built.
    """
    kwargs = {
        "args": args, "model": model, "optimizer": optimizer, "model_parameters": model_parameters,
        "training_data": training_data, "lr_scheduler": lr_scheduler, "distributed_port": distributed_port,
        "mpu": mpu, "dist_init_required": dist_init_required, "collate_fn": collate_fn, "config": config,
        "mesh_param": mesh_param, "config_params": config_params,
    }
    from_args = config is None and config_params is None
    source = config if config is not None else config_params
    if from_args:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    ds_config, section = split_config(source)
    if section is None:
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


def _initialize_with_store(section: HierarchicalPSConfig, kwargs: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    model = kwargs["model"]
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: deepspeed.initialize needs an nn.Module. Got {type(model).__name__}.")
    if isinstance(model, PipelineModule):
        raise ConfigError(f"{SECTION}: pipeline-parallel models (PipelineModule) are not supported; pass the "
                          "model as a plain nn.Module.")
    dense_allreduce = resolve_dense_allreduce(section.dense_allreduce)
    chosen = select_modules(model, section)
    # What deepspeed.initialize does first; done here so that rank and world size are known.
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=kwargs["distributed_port"],
                               dist_init_required=kwargs["dist_init_required"])
    rank, world = _rank_and_world_size()
    if world > 1:
        raise ConfigError(
            f"{SECTION}: this run has {world} ranks, and the store keeps every table on one rank: each rank "
            "would train its own diverging copy of the tables. Launch one process (deepspeed --num_gpus 1, "
            "torchrun --nproc_per_node 1)."
        )
    store = Store(rank_store_path(section, rank), memory_budget=section.memory_budget,
                  device_budget=section.device_budget, device=_training_device(kwargs["args"]),
                  eviction=section.eviction.value, seed=section.seed, optimizer=section.optimizer,
                  initializer=section.initializer, keep_checkpoints=section.keep_checkpoints)
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        twins = swap_embeddings(model, chosen, store, optimizer=section.optimizer, undo=swaps)
        dropped = {id(p) for m in chosen.values() for p in m.parameters()}
        kwargs["model_parameters"] = _dense_parameters(kwargs["model_parameters"], dropped)
        _drop_from_optimizer(kwargs["optimizer"], dropped)
        engine, optimizer, loader, scheduler = deepspeed.initialize(**kwargs)
        _attach(engine, store, section, twins, rank, dense_allreduce)
    except BaseException:
        for parent, attr, original in reversed(swaps):
            setattr(parent, attr, original)
        store.close()
        raise
    return engine, optimizer, loader, scheduler


def swap_embeddings(model: nn.Module, modules: Mapping[str, nn.Module], store: Store, *, optimizer: Any = None,
                    undo: list[tuple[nn.Module, str, nn.Module]] | None = None) -> dict[str, nn.Module]:
    """Replace each named ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model`` by its hierps twin.

    ``modules``: qualified name -> module (as :func:`select_modules` gives). Every reference to
    a module is replaced (a module shared by two parents stays shared), and the twin holds rows
    0..N-1 of its weight in table ``name`` (unless the store already holds that table: resume).
    ``undo`` receives ``(parent, attribute, original)`` for each replacement. Returns name -> twin.
    """
    refs: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for attr, child in parent.named_children():
            refs.setdefault(id(child), []).append((parent, attr))
    twins: dict[str, nn.Module] = {}
    made: dict[int, nn.Module] = {}
    for name, module in modules.items():
        if id(module) not in made:
            cls = EmbeddingBag if isinstance(module, nn.EmbeddingBag) else Embedding
            made[id(module)] = cls.from_module(module, store=store, name=name, optimizer=optimizer)
            for parent, attr in refs.get(id(module), []):
                if undo is not None:
                    undo.append((parent, attr, module))
                setattr(parent, attr, made[id(module)])
        twins[name] = made[id(module)]
    return twins


def _dense_parameters(params: Any, dropped: set[int]) -> list[Any] | None:
    """``model_parameters`` (tensors or param-group dicts) without the swapped embedding weights."""
    if params is None:
        return None
    out: list[Any] = []
    for p in params:
        if isinstance(p, Mapping):
            group = dict(p)
            members = [group["params"]] if isinstance(group["params"], torch.Tensor) else group["params"]
            group["params"] = [q for q in members if id(q) not in dropped]
            out.append(group)
        elif id(p) not in dropped:
            out.append(p)
    return out


def _drop_from_optimizer(optimizer: Any, dropped: set[int]) -> None:
    """Take the swapped embedding weights (and their state) out of a client torch optimizer, in place."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return  # None, or a callable DeepSpeed calls with the dense model_parameters
    for group in optimizer.param_groups:
        group["params"] = [q for q in group["params"] if id(q) not in dropped]
    for p in [p for p in optimizer.state if id(p) in dropped]:
        del optimizer.state[p]


def _rank_and_world_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _training_device(args: Any) -> torch.device:
    """The device the engine will train on (DeepSpeed picks it the same way, after init_distributed)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(get_accelerator().device_name(getattr(args, "device_rank", local_rank)))


def _attach(engine: Any, store: Store, section: HierarchicalPSConfig, twins: dict[str, nn.Module], rank: int,
            dense_allreduce: DenseAllreduce) -> None:
    if not same_device(store.device, engine.device):
        raise ConfigError(f"{SECTION}: the store was opened on {store.device} but the engine trains on "
                          f"{engine.device}; set LOCAL_RANK (or args.device_rank) consistently.")
    base = type(engine)
    engine.__class__ = type(f"Hierps{base.__name__}", (HierpsEngine, base), {})
    engine.hierps_store = store
    engine.hierps_config = section
    engine.hierps_modules = twins
    engine.hierps_rank = rank
    engine.hierps_dense_allreduce = dense_allreduce
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.half if engine.fp16_enabled() else None
    if dtype is not None:
        for twin in {id(t): t for t in twins.values()}.values():
            twin.register_forward_hook(_OutputCast(engine, dtype))


class _OutputCast:
    """Forward hook: a hierps module's float32 output in the engine's dtype; its gradient unscaled.

    Under fp16 the engine multiplies the loss by its loss scale, and divides the dense gradients
    by it in its optimizer; the gradient reaching the embedding output is divided here, so the
    store steps on true gradients.
    """

    def __init__(self, engine: Any, dtype: torch.dtype) -> None:
        self.engine = engine
        self.dtype = dtype

    def __call__(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if output.requires_grad and self.dtype == torch.half:
            output.register_hook(self._unscale)
        return output.to(self.dtype)

    def _unscale(self, grad: torch.Tensor) -> torch.Tensor:
        scale = _loss_scale(self.engine)
        return grad if scale == 1.0 else grad / scale


def _loss_scale(engine: Any) -> float:
    """The loss scale of the engine's current backward (1.0 when it does not scale the loss)."""
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    if scaler is not None:
        return float(scaler.get_scale())
    if not engine.fp16_enabled():
        return 1.0
    opt = engine.optimizer
    cfg = getattr(opt, "loss_scale_config", None)
    return float(cfg.cur_scale if cfg is not None else getattr(opt, "cur_scale", 1.0))


class HierpsEngine:
    """What :func:`initialize` adds to the DeepSpeed engine's own class (which stays a base).

    Attributes: ``hierps_store`` (the :class:`hierps.Store`), ``hierps_config`` (the section),
    ``hierps_modules`` (qualified name -> hierps module), ``hierps_rank``, ``hierps_dense_allreduce``.
    """

    hierps_store: Store
    hierps_config: HierarchicalPSConfig
    hierps_modules: dict[str, nn.Module]
    hierps_rank: int
    hierps_dense_allreduce: DenseAllreduce

    def step(self, lr_kwargs: Any = None) -> None:
        """DeepSpeed's step; at an accumulation boundary, then one sparse step for every touched row.

        When DeepSpeed skipped the dense update (fp16 overflow), the sparse gradients are
        dropped as well, so both parts stay on the same steps.
        """
        managed = self.managed_gradient_accumulation()
        boundary = not managed or self.is_gradient_accumulation_boundary()
        super().step(lr_kwargs)  # type: ignore[misc]
        if boundary:
            if self.was_step_applied():
                self.hierps_store.step()
            else:
                self.hierps_store.zero_grad()

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Any:
        """DeepSpeed's checkpoint of ``tag`` (default ``global_step<N>``), and a store checkpoint of it.

        The store checkpoint is made durable first, then ``<save_dir>/<tag>/hierps-rank-NNNNN.json``
        names it, then DeepSpeed writes its files and its ``latest`` pointer: a crash at any
        point leaves every earlier tag loadable.
        """
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        ckpt = self.hierps_store.checkpoint(tag=tag)
        record = _record_path(save_dir, tag, self.hierps_rank)
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(record, {
            "format": _RECORD_FORMAT, "tag": tag, "rank": self.hierps_rank, "checkpoint": ckpt,
            "store": str(self.hierps_store.path.resolve()), "tables": sorted(self.hierps_modules),
            "global_steps": int(self.global_steps),
        })
        return super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {},  # type: ignore[misc]
                                       save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
        """DeepSpeed's load of ``tag`` (default: the ``latest`` one), and the store back at that tag.

        The store returns to exactly the rows and optimizer state saved with the tag, whatever
        ran since. Raises ``ConfigError`` before loading anything when the tag has no store
        checkpoint (saved without hierps, or retired by ``keep_checkpoints``).
        """
        resolved = str(tag) if tag is not None else _latest_tag(load_dir, self.load_universal_checkpoint())
        ckpt = self._hierps_checkpoint_of(load_dir, resolved) if resolved is not None else None
        out = super().load_checkpoint(  # type: ignore[misc]
            load_dir, tag, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            custom_load_fn=custom_load_fn)
        if out[0] is not None and ckpt is not None:
            self.hierps_store.restore(ckpt)
        return out

    def destroy(self) -> None:
        """DeepSpeed's destroy, then close the store (rows after the last checkpoint are not kept)."""
        super().destroy()  # type: ignore[misc]
        self.hierps_store.close()

    def _hierps_checkpoint_of(self, load_dir: str, tag: str) -> int:
        """The store checkpoint saved with ``tag``, checked against this store."""
        path = _record_path(load_dir, tag, self.hierps_rank)
        if not path.exists():
            raise ConfigError(
                f"load_checkpoint: tag {tag!r} in {load_dir} has no {path.name}: it was saved without the "
                f"{SECTION} section, or its save did not finish. Load a tag saved by a hierps engine."
            )
        record = read_json_checked(path)
        ckpt = int(record["checkpoint"])
        kept = {c["id"]: c["tag"] for c in self.hierps_store.list_checkpoints()}
        if ckpt not in kept:
            raise ConfigError(
                f"load_checkpoint: tag {tag!r} maps to checkpoint {ckpt} of the store {record['store']}, which "
                f"{self.hierps_store.path} does not hold (it keeps {sorted(kept)}; older ones are retired past "
                f"keep_checkpoints={self.hierps_store.keep_checkpoints}). Raise keep_checkpoints to keep more "
                "tags loadable, or point path at the store this tag was saved with."
            )
        if kept[ckpt] != tag:
            raise ConfigError(
                f"load_checkpoint: tag {tag!r} maps to checkpoint {ckpt} of the store {record['store']}, but "
                f"checkpoint {ckpt} of {self.hierps_store.path} is tagged {kept[ckpt]!r}: another store. Point "
                "path at the store this tag was saved with."
            )
        return ckpt


def _record_path(directory: str | os.PathLike[str], tag: str, rank: int) -> Path:
    return Path(directory) / tag / f"hierps-rank-{rank:05d}.json"


def _latest_tag(load_dir: str, universal: bool) -> str | None:
    """The tag DeepSpeed's ``latest`` (or ``latest_universal``) file names, or None without one."""
    latest = Path(load_dir) / ("latest_universal" if universal else "latest")
    return latest.read_text().strip() if latest.is_file() else None
