"""The counters every row carries after its optimizer state: how often, and when, its key was seen.

A row is ``[weights (dim) | optimizer state | counters (NUM_COUNTERS)]``, float32 throughout, and
the counters move with it through every tier and into checkpoints. The optimizer never reads
them, so training arithmetic is the same with or without them.

===========  ==================================================================================
column       meaning
===========  ==================================================================================
count        sightings of the key in training forward passes (exact up to 2**24, then rounded)
decayed      the same with each sighting weighed ``decay ** (passes since it)``, as of last_pass
show         impressions fed by :meth:`hierps.Store.observe`
click        clicks (labels) fed by :meth:`hierps.Store.observe`
last_pass    index of the pass in which the key was last seen (or its row written)
===========  ==================================================================================

``decayed`` is kept lazily: it is brought up to date only when the key is seen again, so rows
that are not seen are never rewritten; :func:`decayed_now` gives its value later. Ages count
finished passes: after ``passes`` passes, a row last seen in pass ``passes - 1`` is unseen for 0
passes and keeps its whole decayed count.
"""

from __future__ import annotations

import numpy as np
import torch

from hierps.config import EvictionConfig

__all__ = [
    "CLICK",
    "COUNT",
    "COUNTERS",
    "DECAYED",
    "LAST_PASS",
    "NUM_COUNTERS",
    "SHOW",
    "condemned",
    "count_histogram",
    "decayed_now",
    "initial_counters",
    "passes_unseen",
    "record_seen",
    "record_seen_rows",
]

COUNTERS = ("count", "decayed", "show", "click", "last_pass")
NUM_COUNTERS = len(COUNTERS)
COUNT, DECAYED, SHOW, CLICK, LAST_PASS = range(NUM_COUNTERS)


def initial_counters(n: int, now: int) -> np.ndarray:
    """(n, NUM_COUNTERS) float32 counters of fresh rows: nothing seen, last seen in pass ``now``."""
    out = np.zeros((n, NUM_COUNTERS), dtype=np.float32)
    out[:, LAST_PASS] = now
    return out


def record_seen(
    rows: torch.Tensor, slots: torch.Tensor, start: int, counts: torch.Tensor, now: int, decay: float
) -> None:
    """Count sightings into the counters of some rows, in place.

    rows: (n, width) float32 whose counters start at column ``start``; slots: (U,) unique int64
    rows seen; counts: (U,) float32 sightings of each in this mini-batch; now: the index of the
    current pass; decay: factor per pass of ``decayed``. Column-wise ``index_add_`` /
    ``index_copy_``: an order of magnitude cheaper than gathering and scattering row blocks.
    """
    rows[:, start + COUNT].index_add_(0, slots, counts)
    decayed = rows[:, start + DECAYED]
    if decay == 1.0:
        decayed.index_add_(0, slots, counts)
    else:
        age = (now - rows[:, start + LAST_PASS].index_select(0, slots)).clamp_(min=0)
        factor = torch.pow(torch.tensor(decay, dtype=torch.float32, device=rows.device), age)
        decayed.index_copy_(0, slots, decayed.index_select(0, slots) * factor + counts)
    rows[:, start + LAST_PASS].index_fill_(0, slots, float(now))


def record_seen_rows(block: torch.Tensor, start: int, counts: torch.Tensor, now: int, decay: float) -> None:
    """:func:`record_seen` of rows gathered already: block (U, width) float32 in place, one row per
    sighting count of ``counts`` (U,). The same floats as counting them in the table's rows."""
    block[:, start + COUNT] += counts
    if decay == 1.0:
        block[:, start + DECAYED] += counts
    else:
        age = (now - block[:, start + LAST_PASS]).clamp_(min=0)
        factor = torch.pow(torch.tensor(decay, dtype=torch.float32, device=block.device), age)
        block[:, start + DECAYED] = block[:, start + DECAYED] * factor + counts
    block[:, start + LAST_PASS] = float(now)


def passes_unseen(counters: np.ndarray, passes: int) -> np.ndarray:
    """counters: (n, NUM_COUNTERS) -> (n,) float64 finished passes since each row was last seen,
    when ``passes`` passes have finished (0 for rows seen in the last or the current pass)."""
    return np.maximum(passes - 1 - counters[:, LAST_PASS].astype(np.float64), 0.0)


def decayed_now(counters: np.ndarray, passes: int, decay: float) -> np.ndarray:
    """counters: (n, NUM_COUNTERS) -> (n,) float64 decayed counts when ``passes`` passes have finished."""
    decayed = counters[:, DECAYED].astype(np.float64)
    if decay == 1.0:
        return decayed
    return decayed * np.power(decay, passes_unseen(counters, passes))


def condemned(counters: np.ndarray, passes: int, rule: EvictionConfig) -> np.ndarray:
    """counters: (n, NUM_COUNTERS) -> (n,) bool, the rows ``rule`` deletes after ``passes`` passes."""
    out = np.zeros(len(counters), bool)
    if rule.ttl_passes is not None:
        out |= passes_unseen(counters, passes) >= rule.ttl_passes
    if rule.min_decayed_count > 0:
        out |= decayed_now(counters, passes, rule.decay) < rule.min_decayed_count
    return out


def count_histogram(counts: np.ndarray, buckets: np.ndarray | None = None) -> np.ndarray:
    """Rows per power-of-two bucket of ``count``: bucket 0 holds count 0, bucket b holds [2**(b-1), 2**b).

    counts: (n,) float; buckets: a histogram to add to (returned, grown as needed), or None.
    """
    c = np.maximum(np.asarray(counts, dtype=np.float64), 0.0)
    # floor(log2(c)) + 1 for c >= 1; 0 for c < 1.
    which = np.where(c >= 1.0, np.floor(np.log2(np.maximum(c, 1.0))).astype(np.int64) + 1, 0)
    found = np.bincount(which, minlength=1) if len(which) else np.zeros(1, np.int64)
    if buckets is None:
        return found
    size = max(len(buckets), len(found))
    out = np.zeros(size, np.int64)
    out[: len(buckets)] += buckets
    out[: len(found)] += found
    return out
