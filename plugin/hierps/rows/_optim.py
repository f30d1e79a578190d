"""Sparse optimizers applied to the rows a step touched; their state lives in the row.

A row is one float32 vector ``[weights (dim) | optimizer state (state_width(dim))]`` and travels
whole through every tier. Gradients of a row are summed before the step (one step per row), and
each update follows the arithmetic of the matching torch optimizer on a sparse gradient, so
``sgd`` / ``adagrad`` / ``adam`` agree with ``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam`` up
to summation order.

=================  ==================  ==========================================
type               state per row       torch reference
=================  ==================  ==========================================
sgd                none                torch.optim.SGD (no momentum / decay)
adagrad            sum of g² (dim)     torch.optim.Adagrad, sparse branch
rowwise_adagrad    mean of g² (1)      FBGEMM's row-wise Adagrad
adam               m, v (2 * dim)      torch.optim.SparseAdam (step count per table)
=================  ==================  ==========================================
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hierps.config import OptimizerConfig

__all__ = ["apply_step", "initial_state", "state_width"]


def state_width(opt: OptimizerConfig, dim: int) -> int:
    """Floats of optimizer state a row of ``dim`` weights carries."""
    return {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim}[opt.type]


def initial_state(opt: OptimizerConfig, n: int, dim: int) -> np.ndarray:
    """(n, state_width) float32 state of fresh rows."""
    width = state_width(opt, dim)
    fill = float(opt.params.get("initial_accumulator_value", 0.0))
    return np.full((n, width), fill, dtype=np.float32)


def apply_step(opt: OptimizerConfig, rows: torch.Tensor, grads: torch.Tensor, step: int) -> None:
    """Update ``rows`` in place.

    rows: (U, dim + state_width) float32, one per distinct key; grads: (U, dim) float32, already
    summed per key; step: this table's optimizer step count, 1 for the first step (torch keeps it
    per parameter tensor, hence per table here).
    """
    dim = grads.shape[1]
    w = rows[:, :dim]
    p = opt.params
    if opt.type == "sgd":
        w.add_(grads, alpha=-p["lr"])
    elif opt.type == "adagrad":
        clr = p["lr"] / (1 + (step - 1) * p["lr_decay"])
        state_sum = rows[:, dim : 2 * dim]
        state_sum.add_(grads.pow(2))
        std = state_sum.sqrt().add_(p["eps"])
        w.add_(grads / std, alpha=-clr)
    elif opt.type == "rowwise_adagrad":
        state_sum = rows[:, dim : dim + 1]
        state_sum.add_(grads.pow(2).mean(dim=1, keepdim=True))
        std = state_sum.sqrt().add_(p["eps"])
        w.add_(grads / std, alpha=-p["lr"])
    elif opt.type == "adam":
        beta1, beta2 = p["betas"]
        exp_avg = rows[:, dim : 2 * dim]
        exp_avg_sq = rows[:, 2 * dim : 3 * dim]
        # The same sequence of operations as torch.optim.SparseAdam, for equal rounding.
        old_exp_avg = exp_avg.clone()
        exp_avg_update = grads.sub(old_exp_avg).mul_(1 - beta1)
        exp_avg.add_(exp_avg_update)
        old_exp_avg_sq = exp_avg_sq.clone()
        exp_avg_sq_update = grads.pow(2).sub_(old_exp_avg_sq).mul_(1 - beta2)
        exp_avg_sq.add_(exp_avg_sq_update)
        numer = exp_avg_update.add_(old_exp_avg)
        denom = exp_avg_sq_update.add_(old_exp_avg_sq).sqrt_().add_(p["eps"])
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = p["lr"] * math.sqrt(bias_correction2) / bias_correction1
        w.add_(-step_size * numer.div_(denom))
    else:  # parse-time validation makes this unreachable; keep the failure loud regardless
        raise ValueError(f"unknown sparse optimizer {opt.type!r}")
