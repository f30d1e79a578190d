"""The tables' learning rate follows the dense optimizer's: one schedule for the whole model.

A learning-rate scheduler (``torch.optim.lr_scheduler.*``, DeepSpeed's ``"scheduler"`` section, a
model's own such as dlrm's ``LRPolicyScheduler``) sets the ``lr`` of the dense optimizer's param
groups; the tables are not parameters of that optimizer. :class:`TablesFollowLr` carries the
schedule over: before each sparse step every table's ``lr`` becomes its configured ``lr`` times
``dense lr now / dense lr as configured`` (of the first param group). So a warm-up from 0 and a
decay to a tenth reach the rows as they reach the dense layers, and where the dense and sparse
rates differ (Adam at 1e-3, Adagrad at 0.05) their ratio stays as configured. With a constant
dense rate the factor is exactly 1 and the rows train as without a schedule.

The dense rate lives in DeepSpeed's checkpoint (its optimizer's and scheduler's state), so a
loaded checkpoint resumes the tables' rate with it; the rate of the last step is also in the
store's checkpoint, with each table's settings.

FTRL tables (their rate is ``alpha``, a per-coordinate rule of its own) keep their settings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hierps.config import OptimizerConfig
from hierps.interface import StoreInterface

__all__ = ["TablesFollowLr", "configured_lr"]


def configured_lr(optimizer: Any, config: Mapping[str, Any] | None) -> float | None:
    """The dense learning rate as configured, before any scheduler moved it, or None if unknown.

    From a client torch optimizer (its first group's ``initial_lr``, which torch schedulers
    record, else its ``lr``), else from the config's ``"optimizer": {"params": {"lr": ...}}``.
    """
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer.param_groups:
        group = optimizer.param_groups[0]
        return float(group.get("initial_lr", group["lr"]))
    lr = ((config or {}).get("optimizer") or {}).get("params", {}).get("lr")
    return float(lr) if isinstance(lr, (int, float)) else None


class TablesFollowLr:
    """Sets each table's ``lr`` to its configured one times the dense optimizer's factor."""

    def __init__(self, store: StoreInterface, tables: Iterable[str], dense_lr: float | None) -> None:
        self.store = store
        # The tables' settings as configured (the store may hold a scaled rate from a checkpoint).
        self.configured = {
            t: store.tables[t].optimizer for t in tables if "lr" in store.tables[t].optimizer.params
        }
        self.dense_lr = dense_lr

    def factor(self, optimizer: Any) -> float:
        """``dense lr now / dense lr as configured`` (1 without an optimizer or a configured rate)."""
        groups = getattr(optimizer, "param_groups", None)
        if not groups or not self.dense_lr:
            return 1.0
        return float(groups[0]["lr"]) / self.dense_lr

    def apply(self, factor: float) -> None:
        """Each table's rate: its configured one times ``factor`` (the configured settings at 1)."""
        scaled: list[tuple[OptimizerConfig, OptimizerConfig]] = []  # tables of one setting share one
        for table, base in self.configured.items():
            opt = base if factor == 1.0 else next((s for b, s in scaled if b == base), None)
            if opt is None:
                opt = OptimizerConfig(base.type, {**base.params, "lr": base.params["lr"] * factor})
                scaled.append((base, opt))
            self.store.tables[table].optimizer = opt
