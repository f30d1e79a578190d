"""Click-model metrics: exact ROC AUC, log loss, normalised entropy and calibration.

Inputs may be numpy arrays, torch tensors (any device, grad or not) or sequences; they are
flattened to 1-D. ``labels`` are binary (0/1, any numeric dtype).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["auc", "calibration", "log_loss", "normalized_entropy"]


def _as_1d(x: Any, dtype: type) -> np.ndarray:
    """Array-like or torch tensor -> flat numpy array of ``dtype``."""
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype).reshape(-1)


def _check_labels(labels: np.ndarray, n: int) -> None:
    if len(labels) != n:
        raise ValueError(f"labels ({len(labels)}) and predictions ({n}) differ in length")
    if not np.all((labels == 0) | (labels == 1)):
        raise ValueError("labels must be 0 or 1")


def _average_ranks(scores: np.ndarray) -> np.ndarray:
    """1-based ranks of ``scores`` ``(n,)``, tied values sharing their mean rank -> float64 ``(n,)``."""
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Boundaries of runs of equal scores in sorted order.
    new_run = np.empty(len(scores), dtype=bool)
    new_run[:1] = True
    new_run[1:] = sorted_scores[1:] != sorted_scores[:-1]
    run_start = np.flatnonzero(new_run)
    run_end = np.append(run_start[1:], len(scores))  # exclusive
    # Positions start..end-1 (0-based) average to (start + end + 1) / 2 as 1-based ranks.
    run_rank = (run_start + run_end + 1) / 2.0
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = np.repeat(run_rank, run_end - run_start)
    return ranks


def auc(labels: Any, scores: Any) -> float:
    """Exact ROC AUC via the Mann-Whitney rank statistic, O(n log n).

    ``labels (n,)`` in {0, 1}; ``scores (n,)`` any monotone score (logits or probabilities).
    A tied positive/negative pair counts 1/2, matching the area under the ROC step curve.
    Raises ``ValueError`` when only one class is present, as AUC is then undefined.
    """
    y = _as_1d(labels, np.float64)
    s = _as_1d(scores, np.float64)
    _check_labels(y, len(s))
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    pos = y == 1
    n_pos = int(pos.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    rank_sum = _average_ranks(s)[pos].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(labels: Any, predictions: Any, *, logits: bool = False, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy in nats.

    ``predictions (n,)`` are probabilities, clipped to ``[eps, 1 - eps]`` so one confident miss
    cannot make the mean infinite; with ``logits=True`` they are logits and the loss is computed
    in the overflow-free form ``max(z, 0) - y z + log1p(exp(-|z|))`` with no clipping.
    """
    y = _as_1d(labels, np.float64)
    p = _as_1d(predictions, np.float64)
    _check_labels(y, len(p))
    if len(y) == 0:
        raise ValueError("log_loss of an empty set")
    if logits:
        return float(np.mean(np.maximum(p, 0.0) - y * p + np.log1p(np.exp(-np.abs(p)))))
    p = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def normalized_entropy(labels: Any, predictions: Any, *, logits: bool = False) -> float:
    """Log loss divided by the entropy of the empirical click rate (NE; below 1 beats the prior).

    Raises ``ValueError`` when only one class is present, as the reference entropy is then 0.
    """
    y = _as_1d(labels, np.float64)
    ctr = float(y.mean()) if len(y) else 0.0
    if not 0.0 < ctr < 1.0:
        raise ValueError("normalized entropy needs both positive and negative labels")
    baseline = -(ctr * np.log(ctr) + (1.0 - ctr) * np.log(1.0 - ctr))
    return log_loss(y, predictions, logits=logits) / baseline


def calibration(labels: Any, predictions: Any, *, logits: bool = False) -> float:
    """Mean predicted click rate over the observed click rate (1.0 is calibrated; AUC ignores it).

    ``predictions (n,)`` are probabilities, or logits with ``logits=True``.
    """
    y = _as_1d(labels, np.float64)
    p = _as_1d(predictions, np.float64)
    _check_labels(y, len(p))
    if not y.any():
        raise ValueError("calibration needs at least one positive label")
    if logits:
        p = 1.0 / (1.0 + np.exp(-p))
    return float(p.mean() / y.mean())
