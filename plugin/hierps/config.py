"""Parsing of settings, done once at the edge: the store's settings, sizes, optimizer, initializer,
admission and eviction.

:class:`StoreSettings` is the one place where the settings of a store have their defaults and
bounds: ``hierps.Store(path, **settings)`` and the DeepSpeed ``"hierarchical_ps"`` section
(:mod:`hierps.integrations.config`) both check them through :func:`parse_setting`.
:class:`TableSpec` holds the six settings of one table (optimizer, initializer, admission,
eviction, weights_dtype, state_dtype) as one value, from the modules down to the store.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict, Unpack

from hierps.errors import ConfigError

__all__ = [
    "DEFAULT_KEEP_CHECKPOINTS",
    "EVICTION_POLICIES",
    "STATE_DTYPES",
    "UNADMITTED_VALUES",
    "WEIGHTS_DTYPES",
    "AdmissionConfig",
    "EvictionConfig",
    "InitializerConfig",
    "OptimizerConfig",
    "StoreSettings",
    "TableSettings",
    "TableSpec",
    "parse_dtype",
    "parse_int",
    "parse_number",
    "parse_setting",
    "parse_size",
]

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*$")

EVICTION_POLICIES = ("lru", "lfu")
# Three checkpoints let a job resume from one before a bad save.
DEFAULT_KEEP_CHECKPOINTS = 3


def parse_size(value: Any, name: str = "size") -> int:
    """Bytes from an int or a string like ``"512MiB"``, ``"8GiB"``, ``"1.5GB"``, ``"4096"``.

    >>> parse_size("2KiB")
    2048
    """
    if isinstance(value, bool):
        raise ConfigError(
            f"{name}: expected a size in bytes or a string like '512MiB'. Got {value!r} instead."
        )
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).upper() if m else ""
        if not m or unit not in _UNITS:
            raise ConfigError(
                f"{name}: cannot read {value!r} as a size; write an int of bytes or a number with "
                "a unit among B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '512MiB')."
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(
            f"{name}: expected a size in bytes or a string like '512MiB'. Got {value!r} instead."
        )
    if n < 0:
        raise ConfigError(f"{name}: a size must not be negative. Got {value!r} instead.")
    return n


def parse_number(
    name: str, value: Any, *, low: float | None = None, high: float | None = None, low_open: bool = False
) -> float:
    """A finite int or float within the bounds (``low_open``: above ``low``) -> float; ``ConfigError``
    naming ``name`` and the value otherwise (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}: expected a finite number. Got {value!r} instead.")
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ConfigError(f"{name}: expected a number {bound}. Got {value!r} instead.")
    if high is not None and value > high:
        raise ConfigError(f"{name}: expected a number <= {high}. Got {value!r} instead.")
    return float(value)


WEIGHTS_DTYPES = ("fp32", "bf16", "fp16")
"""Precisions a table's weights may be stored in (``weights_dtype``)."""
STATE_DTYPES = ("fp32", "bf16")
"""Precisions of per-coordinate optimizer state (``state_dtype``); fp16's range (6e-8 .. 65504)
loses squared gradients, so it is not offered."""


def parse_dtype(value: Any, key: str) -> str:
    """A row precision: ``key`` is ``"weights_dtype"`` or ``"state_dtype"`` (or ends with one, as in
    ``"hierarchical_ps.tables.user.weights_dtype"``)."""
    allowed = STATE_DTYPES if key.endswith("state_dtype") else WEIGHTS_DTYPES
    if value not in allowed:
        hint = " (fp16 cannot hold small squared gradients)" if value == "fp16" else ""
        raise ConfigError(f"{key}: expected one of {', '.join(allowed)}. Got {value!r} instead{hint}.")
    return str(value)


# Hyper-parameters each sparse optimizer takes, with torch's defaults (sgd has no default lr
# in torch either). Names and meaning follow torch.optim.SGD / Adagrad / SparseAdam.
_OPTIMIZER_PARAMS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": None},
    "adagrad": {"lr": 0.01, "lr_decay": 0.0, "eps": 1e-10, "initial_accumulator_value": 0.0},
    "rowwise_adagrad": {"lr": 0.01, "eps": 1e-10, "initial_accumulator_value": 0.0},
    "adam": {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08},
    "partial_rowwise_adam": {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08},
    # FTRL-Proximal (McMahan et al. 2013): per-coordinate rate alpha / (beta + sqrt(n)), L1 and L2.
    "ftrl": {"alpha": 0.05, "beta": 1.0, "lambda1": 0.0, "lambda2": 0.0},
}


@dataclass(frozen=True)
class OptimizerConfig:
    """A sparse optimizer and its hyper-parameters, e.g. ``OptimizerConfig("adagrad", {"lr": 0.05})``."""

    type: str = "adagrad"
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.type not in _OPTIMIZER_PARAMS:
            raise ConfigError(
                f"optimizer.type: unknown sparse optimizer {self.type!r}; "
                f"choose one of {', '.join(_OPTIMIZER_PARAMS)}."
            )
        allowed = _OPTIMIZER_PARAMS[self.type]
        unknown = sorted(set(self.params) - set(allowed))
        if unknown:
            raise ConfigError(
                f"optimizer.params: {self.type} takes no parameter {unknown[0]!r}; "
                f"it takes {', '.join(allowed)}."
            )
        merged = {**allowed, **self.params}
        if "lr" in merged and merged["lr"] is None:
            raise ConfigError("optimizer.params.lr: sgd needs a learning rate (like torch.optim.SGD).")
        if "lr" in merged:
            parse_number("optimizer.params.lr", merged["lr"], low=0.0)
        if "alpha" in merged:
            parse_number("optimizer.params.alpha", merged["alpha"], low=0.0, low_open=True)
        for name in ("beta", "lambda1", "lambda2"):
            if name in merged:
                parse_number(f"optimizer.params.{name}", merged[name], low=0.0)
        if "eps" in merged:
            parse_number("optimizer.params.eps", merged["eps"], low=0.0)
        if "lr_decay" in merged:
            parse_number("optimizer.params.lr_decay", merged["lr_decay"], low=0.0)
        if "initial_accumulator_value" in merged:
            parse_number(
                "optimizer.params.initial_accumulator_value", merged["initial_accumulator_value"], low=0.0
            )
        if merged.get("eps") == 0 and not merged.get("initial_accumulator_value"):
            # The step divides by sqrt(second moment) + eps, and a row's second moment is 0 until a
            # gradient reaches it: a coordinate (a row, for the row-wise ones) whose gradient is 0
            # would get 0 / 0 = NaN. torch.optim.SparseAdam refuses eps=0 for the same reason.
            start = " or initial_accumulator_value > 0" if "initial_accumulator_value" in merged else ""
            raise ConfigError(
                f"optimizer.params.eps: {self.type} needs eps > 0{start}: with 0, a zero gradient on a "
                f"row whose second moment is still 0 gives NaN weights. Got {merged['eps']!r} instead; use "
                f"the default ({allowed['eps']!r})."
            )
        if "betas" in merged:
            betas = merged["betas"]
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise ConfigError(f"optimizer.params.betas: expected two numbers. Got {betas!r} instead.")
            for b in betas:
                parse_number("optimizer.params.betas", b, low=0.0, high=1.0)
            if betas[0] >= 1.0 or betas[1] >= 1.0:
                raise ConfigError(f"optimizer.params.betas: each beta must be < 1. Got {betas!r} instead.")
            merged["betas"] = (float(betas[0]), float(betas[1]))
        object.__setattr__(self, "params", merged)

    @classmethod
    def parse(cls, value: Any) -> OptimizerConfig:
        """From an ``OptimizerConfig``, a type name, or ``{"type": ..., "params": {...}}``."""
        if isinstance(value, OptimizerConfig):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"type", "params"})
            if unknown:
                raise ConfigError(f"optimizer: unknown key {unknown[0]!r}; expected 'type' and 'params'.")
            params = value.get("params", {}) or {}
            if not isinstance(params, dict):
                raise ConfigError(f"optimizer.params: expected a mapping. Got {params!r} instead.")
            return cls(value.get("type", "adagrad"), dict(params))
        raise ConfigError(
            f"optimizer: expected a type name or {{'type': ..., 'params': ...}}. Got {value!r}."
        )

    def to_json(self) -> dict[str, Any]:
        params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.params.items()}
        return {"type": self.type, "params": params}


_INITIALIZERS = {"normal": {"mean": 0.0, "std": 1.0}, "uniform": {"low": -0.05, "high": 0.05}, "zeros": {}}


@dataclass(frozen=True)
class InitializerConfig:
    """How a never-seen key's row starts. ``normal`` (N(0, 1)) is ``nn.Embedding``'s default."""

    type: str = "normal"
    params: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.type not in _INITIALIZERS:
            raise ConfigError(
                f"initializer.type: unknown initializer {self.type!r}; choose one of {', '.join(_INITIALIZERS)}."
            )
        allowed = _INITIALIZERS[self.type]
        unknown = sorted(set(self.params) - set(allowed))
        if unknown:
            raise ConfigError(f"initializer.params: {self.type} takes no parameter {unknown[0]!r}.")
        merged = {
            k: parse_number(f"initializer.params.{k}", v) for k, v in {**allowed, **self.params}.items()
        }
        if self.type == "normal" and merged["std"] < 0:
            raise ConfigError(f"initializer.params.std: must be >= 0. Got {merged['std']!r} instead.")
        if self.type == "uniform" and merged["low"] > merged["high"]:
            raise ConfigError(f"initializer.params: low must be <= high. Got {merged!r} instead.")
        object.__setattr__(self, "params", merged)

    @classmethod
    def parse(cls, value: Any) -> InitializerConfig:
        if isinstance(value, InitializerConfig):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            return cls(value.get("type", "normal"), dict(value.get("params", {}) or {}))
        raise ConfigError(
            f"initializer: expected a type name or {{'type': ..., 'params': ...}}. Got {value!r}."
        )

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "params": dict(self.params)}


UNADMITTED_VALUES = ("initializer", "zeros")


def _mapping(value: Any, key: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """A settings mapping with only known keys (None: all defaults)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key}: expected a mapping with keys among {', '.join(fields)}. Got {value!r} instead."
        )
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(
            f"{key}.{unknown[0]}: unknown key (value {value[unknown[0]]!r}); the keys are "
            f"{', '.join(fields)}."
        )
    return dict(value)


def _rekey(exc: ConfigError, default: str, key: str) -> ConfigError:
    """The same error with its leading key ``default`` (every message here starts with it) renamed ``key``."""
    text = str(exc)
    return ConfigError(key + text[len(default) :] if text.startswith(default) else text)


def parse_int(name: str, value: Any, low: int, *, optional: bool = False) -> int | None:
    """An int >= ``low`` (or None when ``optional``); ``ConfigError`` naming ``name`` and the value
    otherwise (a bool is not an int here)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        hint = f"an int >= {low}" + (" or null" if optional else "")
        raise ConfigError(f"{name}: expected {hint}. Got {value!r} instead.")
    return int(value)


@dataclass(frozen=True)
class AdmissionConfig:
    """When a new key of a table gets a trained row (per table; the default admits every key at once).

    A key without a row is *pending*: lookups and forward passes read it as the initializer's row
    (or zeros), its gradient is dropped, and only its sighting count is kept. It is admitted, and
    trains from that mini-batch on, at its ``min_count``-th sighting, or earlier by chance: each
    sighting admits it with probability ``admit_probability``, drawn from (seed, table, key,
    sighting number) so that reruns admit the same keys.
    """

    min_count: int | None = 1
    """Sightings that admit a key; 1 admits at first sight (no filter), None: only chance admits."""
    admit_probability: float = 0.0
    """Chance that one sighting of a pending key admits it (0: never by chance)."""
    unadmitted: str = "initializer"
    """What pending keys read as: "initializer" (the row they would start from) or "zeros"."""
    max_pending: int = 1 << 20
    """Pending keys counted per table (16 bytes each); past it, the least recently seen are forgotten."""

    def __post_init__(self) -> None:
        self._validate("admission")

    def _validate(self, key: str) -> None:
        parse_int(f"{key}.min_count", self.min_count, 1, optional=True)
        parse_number(f"{key}.admit_probability", self.admit_probability, low=0.0, high=1.0)
        if self.unadmitted not in UNADMITTED_VALUES:
            raise ConfigError(
                f"{key}.unadmitted: expected one of {UNADMITTED_VALUES}. Got {self.unadmitted!r} instead."
            )
        parse_int(f"{key}.max_pending", self.max_pending, 1)
        if self.min_count is None and self.admit_probability == 0.0:
            raise ConfigError(
                f"{key}: min_count is null and admit_probability is 0, so no key would ever be "
                "admitted. Set min_count (e.g. 3) or a probability (e.g. 0.1)."
            )

    @property
    def filters(self) -> bool:
        """False when every key is admitted at its first sighting (no pending keys at all)."""
        return self.min_count != 1 and self.admit_probability < 1.0

    @property
    def unknown_rows(self) -> str:
        """What a key without a row reads as: ``"initializer"`` or ``"zeros"``."""
        return self.unadmitted if self.filters else "initializer"

    @classmethod
    def parse(cls, value: Any, key: str = "admission") -> AdmissionConfig:
        """From an ``AdmissionConfig``, None (defaults) or a mapping like ``{"min_count": 3}``.

        ``key`` prefixes error messages (e.g. ``"hierarchical_ps.tables.user.admission"``).
        """
        if isinstance(value, AdmissionConfig):
            return value
        raw = _mapping(value, key, tuple(cls.__dataclass_fields__))
        try:
            return cls(**raw)
        except ConfigError as exc:
            raise _rekey(exc, "admission", key) from None

    def to_json(self) -> dict[str, Any]:
        return {
            "min_count": self.min_count,
            "admit_probability": self.admit_probability,
            "unadmitted": self.unadmitted,
            "max_pending": self.max_pending,
        }


@dataclass(frozen=True)
class EvictionConfig:
    """When rows of a table are deleted for good ("shrink"), per table; the default never deletes.

    A row goes when it was not seen in the last ``ttl_passes`` passes, or when its decayed count
    (each sighting weighed ``decay ** passes since``) is under ``min_decayed_count``. Shrinking
    runs every ``every_passes`` passes at the end of a pass, and on :meth:`hierps.Store.shrink`.
    This is not the RAM tier's cache policy (``Store(eviction="lru")``), which never deletes rows.
    """

    ttl_passes: int | None = None
    """Delete rows unseen for this many passes (null: no age limit)."""
    min_decayed_count: float = 0.0
    """Delete rows whose decayed count is below this (0: no count limit)."""
    decay: float = 1.0
    """Factor per pass applied to the decayed count, in (0, 1] (1: a plain count)."""
    every_passes: int | None = None
    """Shrink at the end of every this many passes (null: only when asked)."""
    reclaim_disk: bool = True
    """Kept for configs written for hierps 0.1, where false left deleted rows to later compaction.
    The SSD tier keeps no index of deletions, so the segments that held deleted rows are always
    rewritten at once; false is accepted with a warning and has no effect."""

    def __post_init__(self) -> None:
        self._validate("eviction")

    def _validate(self, key: str) -> None:
        parse_int(f"{key}.ttl_passes", self.ttl_passes, 1, optional=True)
        parse_number(f"{key}.min_decayed_count", self.min_decayed_count, low=0.0)
        parse_number(f"{key}.decay", self.decay, low=0.0, high=1.0, low_open=True)
        parse_int(f"{key}.every_passes", self.every_passes, 1, optional=True)
        if not isinstance(self.reclaim_disk, bool):
            raise ConfigError(
                f"{key}.reclaim_disk: expected true or false. Got {self.reclaim_disk!r} instead."
            )
        if self.reclaim_disk is False:
            warnings.warn(
                f"{key}.reclaim_disk: false has no effect: the segments that held deleted rows are "
                "always rewritten at once (the SSD tier keeps no index of deletions). Drop the setting.",
                UserWarning,
                stacklevel=3,
            )
        if self.every_passes is not None and not self.active:
            raise ConfigError(
                f"{key}.every_passes: set to {self.every_passes}, but neither ttl_passes nor "
                "min_decayed_count is set, so shrinking would delete nothing. Set one of them."
            )

    @property
    def active(self) -> bool:
        """True when a shrink deletes anything."""
        return self.ttl_passes is not None or self.min_decayed_count > 0

    @classmethod
    def parse(cls, value: Any, key: str = "eviction") -> EvictionConfig:
        """From an ``EvictionConfig``, None (defaults) or a mapping like ``{"ttl_passes": 30}``.

        ``key`` prefixes error messages (e.g. ``"hierarchical_ps.tables.user.eviction"``).
        """
        if isinstance(value, EvictionConfig):
            return value
        raw = _mapping(value, key, tuple(cls.__dataclass_fields__))
        try:
            return cls(**raw)
        except ConfigError as exc:
            raise _rekey(exc, "eviction", key) from None

    def to_json(self) -> dict[str, Any]:
        return {
            "ttl_passes": self.ttl_passes,
            "min_decayed_count": self.min_decayed_count,
            "decay": self.decay,
            "every_passes": self.every_passes,
            "reclaim_disk": self.reclaim_disk,
        }


def _parse_bool(name: str) -> Any:
    def parse(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false. Got {value!r} instead.")
        return value

    return parse


def _parse_eviction(value: Any) -> str:
    if value not in EVICTION_POLICIES:
        raise ConfigError(f"eviction: expected one of {EVICTION_POLICIES}. Got {value!r} instead.")
    return str(value)


def _parse_device(value: Any) -> str | None:
    """None, or a ``cpu`` / ``cuda[:i]`` device that exists here, as a string."""
    import torch  # here, not at the top: the settings import without torch

    if value is None:
        return None
    hint = "expected a device like 'cuda:0' or 'cpu' (or None for cuda when available, else cpu)"
    if not isinstance(value, (str, torch.device)):
        raise ConfigError(f"device: {hint}. Got {value!r} instead.")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"device: {hint}. Got {value!r} instead.") from exc
    if device.type == "cpu" and device.index not in (None, 0):
        raise ConfigError(f"device: {hint}; a cpu device has no index. Got {value!r} instead.")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device: {value!r} asked for, but no CUDA GPU is available here. Use 'cpu'.")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device: {value!r} asked for, but this machine has {count} CUDA GPU(s).")
    elif device.type != "cpu":
        raise ConfigError(f"device: {hint}; hierps trains on cpu or cuda. Got {value!r} instead.")
    return str(device)


# Each setting's parser: the bounds of every store setting, in one place.
_SETTINGS: dict[str, Any] = {
    "memory_budget": lambda v: parse_size(v, "memory_budget"),
    "device_budget": lambda v: parse_size(v, "device_budget"),
    "device": _parse_device,
    "eviction": _parse_eviction,
    "seed": lambda v: parse_int("seed", v, 0),
    "optimizer": OptimizerConfig.parse,
    "initializer": InitializerConfig.parse,
    "keep_checkpoints": lambda v: parse_int("keep_checkpoints", v, 1, optional=True),
    "max_segments": lambda v: parse_int("max_segments", v, 2),
    "pipeline": _parse_bool("pipeline"),
}


def parse_setting(name: str, value: Any) -> Any:
    """One store setting, checked and normalised (sizes in bytes, configs parsed); ``ConfigError``
    naming the setting and the value when it is out of bounds."""
    return _SETTINGS[name](value)


@dataclass(frozen=True)
class StoreSettings:
    """The settings of a :class:`hierps.Store`, checked once (see :meth:`parse`).

    The defaults carry the reason: a GiB of RAM and of device memory fits a laptop and a GPU
    alike; three checkpoints let a job resume from one before a bad save; sixteen segments per
    table bound the files one read opens.
    """

    memory_budget: int = 1 << 30
    """Bytes of rows the RAM tier may cache."""
    device_budget: int = 1 << 30
    """Bytes of rows the device tier may hold (the working set of a pass)."""
    device: str | None = None
    """Training device; None: ``cuda`` when available, else ``cpu``."""
    eviction: str = "lru"
    """Which rows the RAM tier evicts first: ``"lru"`` or ``"lfu"``."""
    seed: int = 0
    """Seed of the initializer of new rows."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig("adagrad"))
    """Default sparse optimizer of new tables."""
    initializer: InitializerConfig = field(default_factory=lambda: InitializerConfig("normal"))
    """Default initializer of new tables (``normal``, like ``nn.Embedding``)."""
    keep_checkpoints: int | None = None
    """Checkpoints kept restorable; older ones are retired. None: as many as the store kept when it
    last checkpointed (:data:`DEFAULT_KEEP_CHECKPOINTS` for a new store), so that a tool opening
    the store with defaults never retires checkpoints its trainer kept."""
    max_segments: int = 16
    """SSD segments per table before compaction merges them."""
    pipeline: bool = True
    """Read the next pass ahead and write the last one back in the background."""

    @classmethod
    def parse(cls, **settings: Any) -> StoreSettings:
        """Settings by name (sizes as ints or strings like ``"512MiB"``, configs as dicts or
        names) -> checked settings; ``ConfigError`` for an unknown name or a value out of bounds."""
        unknown = sorted(set(settings) - set(_SETTINGS))
        if unknown:
            raise ConfigError(f"unknown store setting {unknown[0]!r}; the settings are {list(_SETTINGS)}.")
        return cls(**{name: parse_setting(name, value) for name, value in settings.items()})


# Each table setting's parser; a parser hands back a value it already parsed as it is, so a
# setting passed down from a module to the store is checked once.
_TABLE_SETTINGS: dict[str, Any] = {
    "optimizer": OptimizerConfig.parse,
    "initializer": InitializerConfig.parse,
    "admission": AdmissionConfig.parse,
    "eviction": EvictionConfig.parse,
    "weights_dtype": lambda v: parse_dtype(v, "weights_dtype"),
    "state_dtype": lambda v: parse_dtype(v, "state_dtype"),
}


class TableSettings(TypedDict, total=False):
    """The settings of a table by keyword, as ``store.table(name, dim, **settings)``, the modules and
    the DeepSpeed swap take them (each also given as a :class:`TableSpec`); None: not given."""

    optimizer: OptimizerConfig | str | dict[str, Any] | None
    initializer: InitializerConfig | str | dict[str, Any] | None
    admission: AdmissionConfig | dict[str, Any] | None
    eviction: EvictionConfig | dict[str, Any] | None
    weights_dtype: str | None
    state_dtype: str | None


@dataclass(frozen=True)
class TableSpec:
    """The settings of one table, checked once: ``TableSpec.of(optimizer="adagrad", weights_dtype="bf16")``.

    A setting left None is not given: a new table takes the store's default (its ``optimizer`` and
    ``initializer``, every key admitted, no row deleted, fp32 rows), a reopened one keeps what it
    has. ``store.table(name, dim, spec)``, ``hierps.EmbeddingBag(..., spec=spec)`` and their
    keyword forms (``optimizer=...``) take the same settings; :meth:`of` merges the two.
    """

    optimizer: OptimizerConfig | None = None
    """Sparse optimizer (``"adagrad"``, ``{"type": "sgd", "params": {"lr": 0.1}}``); its type is
    fixed when the table is created (the state layout), its hyper-parameters may change."""
    initializer: InitializerConfig | None = None
    """How a never-seen key's row starts (``"normal"``, ``"uniform"``, ``"zeros"``); fixed when the
    table is created (rows already drawn from it cannot follow another)."""
    admission: AdmissionConfig | None = None
    """When a new key gets a trained row (a mapping like ``{"min_count": 3}``)."""
    eviction: EvictionConfig | None = None
    """When a row is deleted (a mapping like ``{"ttl_passes": 30, "every_passes": 10}``)."""
    weights_dtype: str | None = None
    """Precision the weights are stored in: ``"fp32"``, ``"bf16"`` or ``"fp16"``; fixed at creation."""
    state_dtype: str | None = None
    """Precision of the per-coordinate optimizer state: ``"fp32"`` or ``"bf16"``; fixed at creation."""

    def __post_init__(self) -> None:
        for name, parse in _TABLE_SETTINGS.items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse(value))

    @classmethod
    def of(cls, spec: TableSpec | None = None, /, **settings: Unpack[TableSettings]) -> TableSpec:
        """``spec`` (None: nothing given) with the settings given by keyword in its place, each
        checked (``ConfigError`` for a bad value or an unknown name); a keyword None keeps ``spec``'s.

        >>> spec = TableSpec.of(optimizer="adagrad", weights_dtype="bf16")
        >>> TableSpec.of(spec, weights_dtype="fp16", state_dtype=None).weights_dtype
        'fp16'
        """
        if spec is not None and not isinstance(spec, TableSpec):
            raise ConfigError(
                f"spec: expected a hierps.TableSpec (or the settings by keyword, like optimizer='adagrad'). "
                f"Got {spec!r} instead."
            )
        given: dict[str, Any] = {name: value for name, value in settings.items() if value is not None}
        unknown = sorted(set(settings) - set(_TABLE_SETTINGS))
        if unknown:  # a keyword a type checker would flag, passed anyway
            raise ConfigError(
                f"unknown table setting {unknown[0]!r} (value {given.get(unknown[0])!r}); the settings "
                f"of a table are {', '.join(_TABLE_SETTINGS)}."
            )
        base = spec if spec is not None else cls()
        return replace(base, **given) if given else base
