"""Mini-batches translated ahead: each table's ids of each mini-batch of a pass, as working-set slots.

When a pass is announced (:meth:`hierps.Store.prefetch`, or at :meth:`hierps.Store.begin_pass`),
every mini-batch's ids of every table are deduplicated and translated into the slots the device
tier will give their rows (:meth:`hierps.tiers.DeviceTier.layout`), on the pipeline's worker. A
training forward then only checks that its ids are the announced ones (one comparison) and
gathers its rows: no sort, no search, no host round trip on the training thread.

Example: a pass of two mini-batches of table ``"user"`` with ids ``[7, 3, 7]`` then ``[3]``,
resident as keys ``[3, 7]`` from slot 10 on, translates into ``keys [3, 7]``, ``local [1, 0, 1]``,
``counts [1, 2]``, ``slots [10, 11]``, then ``keys [3]``, ``local [0]``, ``counts [1]``, ``slots [10]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["BatchPlan", "PassBatches", "translate"]


@dataclass
class BatchPlan:
    """One table's ids of one mini-batch, translated (all tensors on the training device)."""

    ids: torch.Tensor  # (n,) int64 the ids as announced (a private copy)
    keys: torch.Tensor  # (U,) int64 sorted distinct ids
    local: torch.Tensor  # (n,) int64 position of each id in keys
    counts: torch.Tensor  # (U,) float32 occurrences of each key
    slots: torch.Tensor  # (U,) int64 device-tier slots of the keys' rows


@dataclass
class PassBatches:
    """The translated mini-batches of the current pass and, per table, the next one expected."""

    plans: list[dict[str, BatchPlan]]
    generation: int  # the device tier's generation the slots belong to
    cursor: dict[str, int] = field(default_factory=dict)

    def match(self, table: str, ids: torch.Tensor, generation: int) -> BatchPlan | None:
        """The plan of ``table``'s next announced mini-batch if ``ids`` are its ids, else None."""
        if generation != self.generation:
            return None
        k = self.cursor.get(table, 0)
        plan = self.plans[k].get(table) if k < len(self.plans) else None
        if plan is None or plan.ids.numel() != ids.numel() or not torch.equal(plan.ids, ids.reshape(-1)):
            return None
        self.cursor[table] = k + 1
        return plan


def translate(
    batches: Sequence[Mapping[str, np.ndarray]],
    keep: Mapping[str, np.ndarray],
    base: Mapping[str, int],
    device: torch.device,
) -> list[dict[str, BatchPlan]]:
    """Plans of each mini-batch's tables in ``keep``.

    batches: per mini-batch ``{table: (n,) int64 ids}``; keep: per table the sorted distinct
    keys the pass makes resident (every id of ``batches`` among them); base: the table's first
    slot (:meth:`~hierps.tiers.DeviceTier.layout` of ``keep``).
    """
    out: list[dict[str, BatchPlan]] = []
    for batch in batches:
        plans = {}
        for table, raw in batch.items():
            if table not in keep:
                continue
            ids = np.array(raw, dtype=np.int64, copy=True)  # later changes to the caller's ids don't leak in
            keys, local, counts = np.unique(ids, return_inverse=True, return_counts=True)
            slots = base[table] + np.searchsorted(keep[table], keys)
            plans[table] = BatchPlan(
                ids=torch.from_numpy(ids).to(device),
                keys=torch.from_numpy(keys).to(device),
                local=torch.from_numpy(local.reshape(-1).astype(np.int64)).to(device),
                counts=torch.from_numpy(counts.astype(np.float32)).to(device),
                slots=torch.from_numpy(slots.astype(np.int64)).to(device),
            )
        out.append(plans)
    return out
