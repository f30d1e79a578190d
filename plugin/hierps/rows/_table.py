"""What a table is: its dim, optimizer, initializer, life-cycle settings and the width of its rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hierps.config import AdmissionConfig, EvictionConfig, InitializerConfig, OptimizerConfig
from hierps.rows._counters import NUM_COUNTERS
from hierps.rows._optim import state_width

__all__ = ["TableInfo"]


@dataclass
class TableInfo:
    """One table: its dim, optimizer, initializer, life-cycle settings and optimizer step count."""

    name: str
    dim: int
    optimizer: OptimizerConfig
    initializer: InitializerConfig
    salt: np.uint64
    step: int = 0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)

    @property
    def state_end(self) -> int:
        """Columns of weights and optimizer state; the counters follow."""
        return self.dim + state_width(self.optimizer, self.dim)

    @property
    def width(self) -> int:
        """Floats per row: weights, optimizer state, counters."""
        return self.state_end + NUM_COUNTERS

    def to_json(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "width": self.width,
            "optimizer": self.optimizer.to_json(),
            "initializer": self.initializer.to_json(),
            "step": self.step,
            "admission": self.admission.to_json(),
            "eviction": self.eviction.to_json(),
        }
