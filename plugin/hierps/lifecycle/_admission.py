"""Admission of new keys: a pending key is counted, not stored, until it earns a row.

Ads tables see new ids every minute and most of them a few times only; giving each a trained row
(and optimizer state, and SSD space) wastes most of it. Under an :class:`AdmissionConfig` that
filters, a key without a row is *pending*: :class:`~hierps.rows._pending.PendingKeys` keeps its
sighting count (exact, bounded; why not a sketch is told there), and :func:`admitted` decides at
each sighting whether it now gets its row.
"""

from __future__ import annotations

import numpy as np

from hierps.config import AdmissionConfig
from hierps.rows._initializers import key_uniform

__all__ = ["admitted"]

# Separates admission draws from the initializer's draws of the same (seed, table, key).
_ADMISSION_STREAM = 7


def admitted(
    cfg: AdmissionConfig, salt: np.uint64, keys: np.ndarray, before: np.ndarray, after: np.ndarray
) -> np.ndarray:
    """Which pending keys a mini-batch admits: keys (n,) int64 seen ``after - before`` times in it
    (counts before and after, (n,) int64) -> (n,) bool.

    By count at the ``min_count``-th sighting; by chance with probability ``admit_probability``
    per sighting, drawn from (seed, table, key, sighting count), so the same run admits the same keys.
    """
    ok = np.zeros(len(keys), bool)
    if cfg.min_count is not None:
        ok |= after >= cfg.min_count
    p = cfg.admit_probability
    if p > 0.0:
        chance = 1.0 - np.power(1.0 - p, (after - before).astype(np.float64))
        ok |= key_uniform(keys, salt, after, _ADMISSION_STREAM) < chance
    return ok
