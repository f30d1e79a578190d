"""What a table is: its dim, optimizer, initializer, precisions, life-cycle settings and row layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hierps.config import (
    STATE_DTYPES,
    WEIGHTS_DTYPES,
    AdmissionConfig,
    EvictionConfig,
    InitializerConfig,
    OptimizerConfig,
    TableSpec,
)
from hierps.errors import StoreFormatError
from hierps.rows._counters import initial_counters
from hierps.rows._initializers import initial_rows, table_salt
from hierps.rows._layout import RowLayout, row_layout
from hierps.rows._optim import coalesces, initial_state

__all__ = ["TableInfo"]


@dataclass
class TableInfo:
    """One table: its dim, optimizer, initializer, precisions, life-cycle settings and step count.

    A row is handled in two forms: *decoded*, ``width`` float32 ``[weights (dim) | optimizer
    state | counters]`` (what the optimizer, :meth:`hierps.Store.read_rows` and ``write_rows``
    see), and *stored*, ``layout.words`` 4-byte words in the table's precisions (what every tier
    holds): see :mod:`hierps.rows._layout`.
    """

    name: str
    dim: int
    optimizer: OptimizerConfig
    initializer: InitializerConfig
    salt: np.uint64
    step: int = 0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    weights_dtype: str = "fp32"
    state_dtype: str = "fp32"

    @property
    def layout(self) -> RowLayout:
        return row_layout(self.optimizer.type, self.dim, self.weights_dtype, self.state_dtype)

    @property
    def spec(self) -> TableSpec:
        """The table's six settings, as :meth:`hierps.Store.table` takes them (e.g. to create the
        same table in another store)."""
        return TableSpec(
            self.optimizer,
            self.initializer,
            self.admission,
            self.eviction,
            self.weights_dtype,
            self.state_dtype,
        )

    @property
    def coalesced(self) -> bool:
        """Whether a key's gradients are summed in torch's ``coalesce`` order (see
        :func:`hierps.rows._optim.coalesces`), else in the order of the ids."""
        return coalesces(self.optimizer)

    @property
    def state_end(self) -> int:
        """Decoded columns of weights and optimizer state; the counters follow."""
        return self.layout.counters.column

    @property
    def width(self) -> int:
        """Floats per decoded row: weights, optimizer state, counters."""
        return self.layout.width

    @property
    def words(self) -> int:
        """4-byte words per stored row (every tier's row width)."""
        return self.layout.words

    @property
    def counter_word(self) -> int:
        """First stored word of the counters (float32 in every layout)."""
        return self.layout.counters.word

    def fresh_rows(self, keys: np.ndarray, now: int, weights: np.ndarray | None = None) -> np.ndarray:
        """Stored rows (n, words) of keys (n,) int64 starting afresh in pass ``now``: their
        initializer's weights (or ``weights`` (n, dim) float32), initial optimizer state, no sightings."""
        if weights is None:
            weights = initial_rows(keys, self.dim, self.salt, self.initializer)
        rows = np.concatenate(
            [
                np.asarray(weights, np.float32),
                initial_state(self.optimizer, weights),
                initial_counters(len(keys), now),
            ],
            axis=1,
        )
        return self.layout.encode_np(rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "width": self.width,
            "weights_dtype": self.weights_dtype,
            "state_dtype": self.state_dtype,
            "layout": self.layout.to_json(),
            "optimizer": self.optimizer.to_json(),
            "initializer": self.initializer.to_json(),
            "step": self.step,
            "admission": self.admission.to_json(),
            "eviction": self.eviction.to_json(),
        }

    @classmethod
    def from_json(cls, name: str, meta: dict[str, Any], seed: int) -> TableInfo:
        """The table a checkpoint manifest entry describes, its recorded layout checked against the one
        its optimizer and precisions give (``StoreFormatError`` naming the table otherwise)."""
        dtypes = (meta.get("weights_dtype"), meta.get("state_dtype"))
        if dtypes[0] not in WEIGHTS_DTYPES or dtypes[1] not in STATE_DTYPES:
            raise StoreFormatError(
                f"table {name!r}: the manifest gives weights_dtype {dtypes[0]!r} and state_dtype "
                f"{dtypes[1]!r}; expected one of {WEIGHTS_DTYPES} and one of {STATE_DTYPES}. It was not "
                "written by this hierps, or is damaged."
            )
        info = cls(
            name,
            int(meta["dim"]),
            OptimizerConfig.parse(meta["optimizer"]),
            InitializerConfig.parse(meta["initializer"]),
            table_salt(seed, name),
            int(meta["step"]),
            AdmissionConfig.parse(meta.get("admission")),
            EvictionConfig.parse(meta.get("eviction")),
            weights_dtype=str(dtypes[0]),
            state_dtype=str(dtypes[1]),
        )
        if meta.get("layout") != info.layout.to_json() or int(meta["width"]) != info.width:
            raise StoreFormatError(
                f"table {name!r}: the manifest records the row layout {meta.get('layout')} (width "
                f"{meta.get('width')}), but its optimizer and precisions give {info.layout.to_json()} "
                f"(width {info.width}); the rows cannot be read safely. It was written by another "
                "hierps, or is damaged."
            )
        return info
