"""hierps: a hierarchical (device / RAM / SSD) parameter store for huge sparse embedding tables.

The whole public API at a glance::

    store = hierps.Store(path, memory_budget="8GiB", device_budget="2GiB", optimizer="adagrad")
    bag = hierps.EmbeddingBag.from_module(model.user, store=store, name="user")
    with store.run_pass([{"user": ids} for ids in pass_batches]):
        ...  # forward, backward, dense optimizer step, store.step()
    store.checkpoint()

Per table, ``admission`` / ``eviction`` settings give new ids a row only once seen often enough and
delete rows unseen for long; ``store.export(path, since=ckpt)`` writes weights (or a delta) for
serving, read back by ``hierps.serving.open(path)``.
``hierps.deepspeed.initialize`` swaps a model's embeddings in from a DeepSpeed config section.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

# hierps.integrations lives in the sibling source root integrations/ (integrations/hierps/integrations):
# both roots hold a hierps/ directory, and this package spans them.
__path__ = pkgutil.extend_path(__path__, __name__)

from hierps._store import Store
from hierps.config import (
    AdmissionConfig,
    EvictionConfig,
    InitializerConfig,
    OptimizerConfig,
    StoreSettings,
    TableSpec,
    parse_size,
)
from hierps.errors import (
    CheckpointRetiredError,
    ConfigError,
    CorruptStoreError,
    DeviceBudgetError,
    HierpsError,
    InvalidIdsError,
    LogFileError,
    MissingPartsError,
    NonFiniteGradientError,
    NotSupportedError,
    OffsetsError,
    PeerLostError,
    StaleWeightError,
    StoreClosedError,
    StoreFormatError,
    StoreFullError,
    StoreLockedError,
    TableMismatchError,
)
from hierps.interface import Bags, StoreInterface
from hierps.modules import Embedding, EmbeddingBag, get_default_store, set_default_store
from hierps.sharding._sharded import ShardedStore
from hierps.tiers import CheckpointReader
from hierps.tiers._stats import PassRecord, PassStats
from hierps.tiers._usage import StoreUsage

__version__ = "0.1.0"

__all__ = [
    "AdmissionConfig",
    "Bags",
    "CheckpointReader",
    "CheckpointRetiredError",
    "ConfigError",
    "CorruptStoreError",
    "DeviceBudgetError",
    "Embedding",
    "EmbeddingBag",
    "EvictionConfig",
    "HierpsError",
    "InitializerConfig",
    "InvalidIdsError",
    "LogFileError",
    "MissingPartsError",
    "NonFiniteGradientError",
    "NotSupportedError",
    "OffsetsError",
    "OptimizerConfig",
    "PassRecord",
    "PassStats",
    "PeerLostError",
    "ShardedStore",
    "StaleWeightError",
    "Store",
    "StoreClosedError",
    "StoreFormatError",
    "StoreFullError",
    "StoreInterface",
    "StoreLockedError",
    "StoreSettings",
    "StoreUsage",
    "TableMismatchError",
    "TableSpec",
    "get_default_store",
    "parse_size",
    "set_default_store",
]

_LAZY = {
    "deepspeed": "hierps.deepspeed",
    "serving": "hierps.serving",
    "metrics": "hierps.metrics",
    "planning": "hierps.planning",
}


def __getattr__(name: str) -> Any:
    # Integrations import heavy frameworks; load them only when asked for.
    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    raise AttributeError(f"module 'hierps' has no attribute {name!r}")
