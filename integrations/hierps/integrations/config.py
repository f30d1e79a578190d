"""The ``"hierarchical_ps"`` section of a DeepSpeed config: one strict model, checked at the edge.

::

    "hierarchical_ps": {"enabled": true, "path": "/local/ssd/hierps", "memory_budget": "8GiB",
                        "device_budget": "2GiB", "modules": "auto", "pass_batches": 16,
                        "optimizer": {"type": "adagrad", "params": {"lr": 0.05}},
                        "dense_allreduce": "auto"}

:func:`split_config` takes the section out of a config (as a dict) and validates it;
every bad key or value becomes one :class:`hierps.errors.ConfigError` naming the key and the
value, raised before any model is touched. :func:`select_modules` resolves ``modules`` against a
model, and :func:`resolve_dense_allreduce` resolves ``dense_allreduce`` against the process it
runs in. Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from hierps.config import InitializerConfig, OptimizerConfig, StoreSettings, parse_dtype, parse_setting
from hierps.errors import ConfigError
from hierps.integrations.horovod import launched_by_horovodrun
from hierps.integrations.loader import parse_batch_ids

__all__ = [
    "SECTION",
    "DenseAllreduce",
    "STORE_SETTINGS",
    "HierarchicalPSConfig",
    "embedding_modules",
    "parse_section",
    "resolve_dense_allreduce",
    "select_modules",
    "split_config",
]

SECTION = "hierarchical_ps"
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
# Keys of the section that are store settings, handed to hierps.Store as they are.
STORE_SETTINGS = tuple(f.name for f in dataclasses.fields(StoreSettings) if f.name != "device")


class DenseAllreduce(str, Enum):  # noqa: UP042 (StrEnum needs Python 3.11; setup.cfg allows 3.10)
    """Who all-reduces the dense gradients between ranks."""

    AUTO = "auto"  # horovod when launched by horovodrun, else deepspeed
    DEEPSPEED = "deepspeed"
    HOROVOD = "horovod"


_DEFAULTS = StoreSettings()


def _setting(value: Any, info: Any) -> Any:
    """A store setting, checked where ``hierps.Store`` checks it (:func:`hierps.config.parse_setting`)."""
    return parse_setting(info.field_name, value)


def _modules(value: Any) -> Any:
    if value == "auto":
        return value
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(
            f'modules: expected "auto" or a list of qualified module names like ["user", '
            f'"tables.3"]. Got {value!r} instead.'
        )
    dupes = sorted({v for v in value if list(value).count(v) > 1})
    if dupes:
        raise ConfigError(f"modules: {dupes[0]!r} is listed more than once. Got {value!r}.")
    return tuple(value)


def _batch_ids(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f'batch_ids: expected a mapping of module name to batch key, like {{"user": '
            f'"user_ids"}}. Got {value!r} instead.'
        )
    parse_batch_ids(value)  # each place checked here, used by PassLoader
    return dict(value)


def _metrics_port(value: Any) -> tuple[str, int] | None:
    """``metrics_port``: None, a port (an int or its digits) on loopback, or ``"HOST:PORT"`` -> (host, port)."""
    if value is None:
        return None
    host, port = "127.0.0.1", value
    if isinstance(value, str):
        host, _, port = value.rpartition(":") if ":" in value else ("127.0.0.1", "", value)
        port = int(port) if port.isdigit() and host else None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(
            'metrics_port: expected a port from 0 to 65535 (0: any free one), or "HOST:PORT" like '
            f'"0.0.0.0:9108". Got {value!r} instead.'
        )
    return host, port


def _dtype(value: Any, info: Any) -> str:
    """A row precision, checked where ``hierps.Store.table`` checks it (:func:`hierps.config.parse_dtype`)."""
    return parse_dtype(value, info.field_name)


Setting = BeforeValidator(_setting)
Dtype = BeforeValidator(_dtype)
StrictInt = Annotated[int, Field(strict=True)]


class HierarchicalPSConfig(BaseModel):
    """The ``"hierarchical_ps"`` section: which embeddings go to the store, and the store's settings."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, arbitrary_types_allowed=True
    )

    enabled: bool = Field(True, strict=True)
    """Swap embeddings into the store; false leaves the model and DeepSpeed exactly as without the section."""
    path: str | None = None
    """Store directory, on a local SSD; rank r keeps its rows in ``<path>/rank-{r:05d}``."""
    memory_budget: Annotated[int, Setting] = _DEFAULTS.memory_budget
    """Bytes (or a string like "8GiB") of rows the RAM tier may cache."""
    device_budget: Annotated[int, Setting] = _DEFAULTS.device_budget
    """Bytes of rows the device tier may hold: the working set of one pass."""
    modules: Annotated[Literal["auto"] | tuple[str, ...], BeforeValidator(_modules)] = "auto"
    """ "auto" (every nn.Embedding / nn.EmbeddingBag of at least auto_min_rows rows) or qualified names."""
    auto_min_rows: StrictInt = Field(10_000, ge=1)
    """Smallest table "auto" swaps; smaller tables stay dense, trained by DeepSpeed."""
    pass_batches: StrictInt = Field(16, ge=1)
    """Mini-batches per pass: how far PassLoader reads ahead to load their rows at once."""
    optimizer: Annotated[OptimizerConfig, Setting] = _DEFAULTS.optimizer
    """Sparse optimizer of the swapped tables: {"type": sgd | adagrad | rowwise_adagrad | adam |
    partial_rowwise_adam | ftrl, "params": {...}}."""
    weights_dtype: Annotated[str, Dtype] = "fp32"
    """Precision the swapped tables' weights are stored in: "fp32" (exact), "bf16" or "fp16" (half the
    bytes; computed in float32, rounded stochastically on write)."""
    state_dtype: Annotated[str, Dtype] = "fp32"
    """Precision of their per-coordinate optimizer state: "fp32" or "bf16"."""
    initializer: Annotated[InitializerConfig, Setting] = _DEFAULTS.initializer
    """Initial rows of ids beyond the module's rows 0..N-1 (raw feature ids): normal | uniform | zeros."""
    dense_allreduce: DenseAllreduce = DenseAllreduce.AUTO
    """Who all-reduces dense gradients: "auto", "deepspeed" or "horovod"."""
    eviction: Annotated[str, Setting] = _DEFAULTS.eviction
    """RAM tier eviction policy: "lru" or "lfu"."""
    seed: Annotated[int, Setting] = _DEFAULTS.seed
    """Seed of the initializer of new rows."""
    keep_checkpoints: Annotated[int | None, Setting] = _DEFAULTS.keep_checkpoints
    """Store checkpoints kept restorable; older ones (and the tags that map to them) are retired.
    null: as many as the store kept at its latest checkpoint (3 for a new store)."""
    pipeline: Annotated[bool, Setting] = _DEFAULTS.pipeline
    """Read the next pass ahead and write the last one back in the background (same parameters as false)."""
    max_segments: Annotated[int, Setting] = _DEFAULTS.max_segments
    """SSD segments per table before background compaction merges them (bounds the files a read opens)."""
    metrics_port: Annotated[tuple[str, int] | None, BeforeValidator(_metrics_port)] = None
    """Serve each rank's store figures for Prometheus (:func:`hierps.metrics.serve`) from initialize to
    ``engine.destroy()``: rank r at ``http://127.0.0.1:<port + local rank>/metrics`` (0: any free port,
    see ``engine.hierps_metrics.url``); "HOST:PORT" binds HOST instead. null: no endpoint."""
    batch_ids: Annotated[dict[str, Any] | None, BeforeValidator(_batch_ids)] = None
    """Module name -> where its ids are in a batch: a key ("user_ids", 0), a path ([0, "user"]), or
    {"path": [0], "columns": [3, 4]}. For PassLoader and the loader of training_data; without it they
    find the places from the first batches."""

    @model_validator(mode="after")
    def _path_when_enabled(self) -> HierarchicalPSConfig:
        if self.enabled and not self.path:
            raise ConfigError(
                "path: required when the section is enabled; set it to a directory on a local "
                f'SSD, e.g. "/local/ssd/hierps". Got {self.path!r} instead.'
            )
        return self


def parse_section(raw: Any) -> HierarchicalPSConfig:
    """Validate a raw section (a mapping) -> the config, or one ``ConfigError`` naming every bad key."""
    if isinstance(raw, HierarchicalPSConfig):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{SECTION}: expected a JSON object of settings. Got {raw!r} instead.")
    try:
        return HierarchicalPSConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise ConfigError("\n".join(_describe(exc))) from None


def _describe(exc: ValidationError) -> list[str]:
    """One line per bad key: ``hierarchical_ps.<key>: <what is wrong>. Got <value> instead.``"""
    lines, seen = [], set()
    valid = ", ".join(HierarchicalPSConfig.model_fields)
    for err in exc.errors():
        loc = [
            str(p) for p in err["loc"] if not isinstance(p, str) or not p.startswith(("literal[", "tuple["))
        ]
        key = loc[0] if loc else ""
        if key in seen:
            continue
        seen.add(key)
        where = ".".join([SECTION, *loc])
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            lines.append(f"{SECTION}.{cause}")
        elif err["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key (value {err['input']!r}); the keys are {valid}.")
        else:
            lines.append(f"{where}: {err['msg']}. Got {err['input']!r} instead.")
    return lines


def split_config(
    config: Mapping[str, Any] | None,
) -> tuple[dict[str, Any] | None, HierarchicalPSConfig | None]:
    """A DeepSpeed config as a mapping -> ``(a copy without the section, the section or None)``.

    The caller's mapping is never modified.
    """
    if config is None:
        return None, None
    rest = {k: v for k, v in config.items() if k != SECTION}
    return rest, parse_section(config[SECTION]) if SECTION in config else None


def embedding_modules(model: nn.Module) -> dict[str, nn.Embedding | nn.EmbeddingBag]:
    """Qualified name -> every ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model`` (a shared one once)."""
    return {name: m for name, m in model.named_modules() if name and isinstance(m, _EMBEDDINGS)}


def select_modules(model: nn.Module, cfg: HierarchicalPSConfig) -> dict[str, nn.Module]:
    """Qualified name -> the ``nn.Embedding`` / ``nn.EmbeddingBag`` the section swaps, in model order."""
    if cfg.modules == "auto":
        return {
            name: m for name, m in embedding_modules(model).items() if m.num_embeddings >= cfg.auto_min_rows
        }
    named = dict(model.named_modules())
    found = sorted(embedding_modules(model))
    out: dict[str, nn.Module] = {}
    for name in cfg.modules:
        module = named.get(name) if name else None
        if module is None:
            raise ConfigError(
                f"{SECTION}.modules: the model has no module {name!r}; its embedding modules are {found}."
            )
        if not isinstance(module, _EMBEDDINGS):
            raise ConfigError(
                f"{SECTION}.modules: {name!r} is a {type(module).__name__}, not an nn.Embedding "
                f"or nn.EmbeddingBag; its embedding modules are {found}."
            )
        out[name] = module
    return out


def resolve_dense_allreduce(
    choice: DenseAllreduce, under_horovodrun: bool | None = None, zero_stage: int = 0
) -> DenseAllreduce:
    """``auto`` -> ``horovod`` when launched by horovodrun and ZeRO does not partition the dense
    gradients (stage 0), else ``deepspeed`` (whose all-reduce runs under horovodrun as well).

    Raises ``ConfigError`` when Horovod is chosen but ``horovod.torch`` cannot be imported.
    """
    if under_horovodrun is None:
        under_horovodrun = launched_by_horovodrun()
    if choice is DenseAllreduce.AUTO:
        horovod = under_horovodrun and zero_stage == 0
        choice = DenseAllreduce.HOROVOD if horovod else DenseAllreduce.DEEPSPEED
    if choice is DenseAllreduce.HOROVOD and not _importable("horovod.torch"):
        raise ConfigError(
            f"{SECTION}.dense_allreduce: 'horovod' (launched by horovodrun, or asked for) needs horovod.torch, "
            'which cannot be imported here. Run `make horovod`, or set "dense_allreduce": "deepspeed".'
        )
    return choice


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
