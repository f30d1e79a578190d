"""Sparse optimizers applied to the rows a step touched; their state lives in the row.

A row, decoded (see :mod:`hierps.rows._layout`), is one float32 vector ``[weights (dim) |
optimizer state (state_width(dim))]`` and travels whole through every tier. Gradients of a row are
summed before the step (one step per row), and each update follows the arithmetic of the matching
torch optimizer on a sparse gradient, so ``sgd`` / ``adagrad`` / ``adam`` agree with
``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam`` up to summation order.

=====================  ======================  ==============================================
type                   state per row           reference
=====================  ======================  ==============================================
sgd                    none                    torch.optim.SGD (no momentum / decay)
adagrad                sum of g² (dim)         torch.optim.Adagrad, sparse branch
rowwise_adagrad        mean of g² (1)          FBGEMM's row-wise Adagrad
adam                   m, v (2 * dim)          torch.optim.SparseAdam (step count per table)
partial_rowwise_adam   m (dim), v (1)          SparseAdam with v the mean of g² over the row
                                               (FBGEMM's partial row-wise Adam)
ftrl                   z, n (2 * dim)          FTRL-Proximal, McMahan et al. 2013, Algorithm 1
=====================  ======================  ==============================================

Each state part is either per coordinate (``dim`` values, stored in the table's ``state_dtype``)
or per row (one value, always float32): :func:`state_parts` lists them.

FTRL-Proximal keeps per coordinate ``z`` and ``n`` and the weight they give in closed form,

    w = 0 if |z| <= lambda1, else -(z - sign(z) * lambda1) / ((beta + sqrt(n)) / alpha + lambda2);

a step with gradient ``g`` makes ``sigma = (sqrt(n + g²) - sqrt(n)) / alpha``, ``z += g - sigma *
w``, ``n += g²`` and stores the new ``w``. A fresh row starts at its initializer's weights ``w0``
with ``n = 0`` and the ``z`` that gives back ``w0`` in closed form, ``z = -(beta / alpha +
lambda2) * w0 - sign(w0) * lambda1``, so an embedding starts where its initializer put it (the
paper's ``z = 0`` is the case ``w0 = 0``). FTRL's square roots are correctly rounded, so its
arithmetic is IEEE float32's on every device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from hierps.config import OptimizerConfig

__all__ = ["apply_step", "coalesces", "ftrl_weights", "initial_state", "state_parts", "state_width"]

# (name, per coordinate?) of each optimizer's state parts, in row order.
_PARTS: dict[str, tuple[tuple[str, bool], ...]] = {
    "sgd": (),
    "adagrad": (("sum", True),),
    "rowwise_adagrad": (("sum", False),),
    "adam": (("exp_avg", True), ("exp_avg_sq", True)),
    "partial_rowwise_adam": (("exp_avg", True), ("exp_avg_sq", False)),
    "ftrl": (("z", True), ("n", True)),
}


def state_parts(opt_type: str, dim: int) -> list[tuple[str, int, bool]]:
    """``[(name, values, per_coordinate)]`` of the optimizer state a row of ``dim`` weights carries."""
    return [(name, dim if per_coord else 1, per_coord) for name, per_coord in _PARTS[opt_type]]


def state_width(opt: OptimizerConfig, dim: int) -> int:
    """Floats of optimizer state a row of ``dim`` weights carries (decoded)."""
    return sum(n for _, n, _ in state_parts(opt.type, dim))


def initial_state(opt: OptimizerConfig, weights: np.ndarray) -> np.ndarray:
    """weights (n, dim) float32 of fresh rows -> their (n, state_width) float32 optimizer state."""
    n, dim = weights.shape
    if opt.type == "ftrl":
        p = opt.params
        z = -(p["beta"] / p["alpha"] + p["lambda2"]) * weights.astype(np.float64)
        z -= np.sign(weights) * p["lambda1"]
        return np.concatenate([z.astype(np.float32), np.zeros((n, dim), np.float32)], axis=1)
    fill = float(opt.params.get("initial_accumulator_value", 0.0))
    return np.full((n, state_width(opt, dim)), fill, dtype=np.float32)


def ftrl_weights(opt: OptimizerConfig, z: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """FTRL-Proximal's closed-form weights of per-coordinate ``z`` and ``n`` (same shape, float32)."""
    p = opt.params
    lambda1 = _const(p["lambda1"], z)
    denom = _sqrt(n).add_(p["beta"]).div_(_const(p["alpha"], z)).add_(p["lambda2"])
    w = (z - z.sign() * lambda1).neg_().div_(denom)
    return w.masked_fill_(z.abs() <= lambda1, 0.0)


def coalesces(opt: OptimizerConfig) -> bool:
    """Whether a key's gradients are summed in the order torch's sparse optimizers sum them.

    ``torch.optim.Adagrad`` and ``SparseAdam`` coalesce a sparse gradient before their step, and
    ``coalesce`` sums each row's duplicates in the order of a non-stable ``torch.sort`` of the ids.
    Summing in that order (:func:`hierps.training._batchplan.sum_order`) keeps such a table's rows
    bit-equal to torch's. ``torch.optim.SGD`` adds an uncoalesced gradient as it comes, so an SGD
    table sums in the order of the ids. Optimizers torch has no sparse form of (FTRL, the
    row-wise ones) sum as Adagrad's.
    """
    return opt.type != "sgd"


def apply_step(opt: OptimizerConfig, rows: torch.Tensor, grads: torch.Tensor, step: int) -> None:
    """Update ``rows`` in place.

    rows: (U, dim + state_width) float32 decoded rows, one per distinct key; grads: (U, dim)
    float32, already summed per key; step: this table's optimizer step count, 1 for the first step
    (torch keeps it per parameter tensor, hence per table here).
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
    elif opt.type in ("adam", "partial_rowwise_adam"):
        _adam(p, rows, grads, step, rowwise=opt.type == "partial_rowwise_adam")
    elif opt.type == "ftrl":
        z, n = rows[:, dim : 2 * dim], rows[:, 2 * dim : 3 * dim]
        g2 = grads.pow(2)
        new_n = n + g2
        sigma = _sqrt(new_n).sub_(_sqrt(n)).div_(_const(p["alpha"], w))
        z.add_(grads - sigma * w)
        n.copy_(new_n)
        w.copy_(ftrl_weights(opt, z, n))
    else:  # parse-time validation makes this unreachable; keep the failure loud regardless
        raise ValueError(f"unknown sparse optimizer {opt.type!r}")


def _adam(p: dict[str, Any], rows: torch.Tensor, grads: torch.Tensor, step: int, rowwise: bool) -> None:
    """SparseAdam's update; with ``rowwise`` the second moment is one value per row (mean of g²)."""
    dim = grads.shape[1]
    beta1, beta2 = p["betas"]
    exp_avg = rows[:, dim : 2 * dim]
    exp_avg_sq = rows[:, 2 * dim : 2 * dim + 1] if rowwise else rows[:, 2 * dim : 3 * dim]
    # The same sequence of operations as torch.optim.SparseAdam, for equal rounding.
    old_exp_avg = exp_avg.clone()
    exp_avg_update = grads.sub(old_exp_avg).mul_(1 - beta1)
    exp_avg.add_(exp_avg_update)
    old_exp_avg_sq = exp_avg_sq.clone()
    g2 = grads.pow(2).mean(dim=1, keepdim=True) if rowwise else grads.pow(2)
    exp_avg_sq_update = g2.sub_(old_exp_avg_sq).mul_(1 - beta2)
    exp_avg_sq.add_(exp_avg_sq_update)
    numer = exp_avg_update.add_(old_exp_avg)
    denom = exp_avg_sq_update.add_(old_exp_avg_sq).sqrt_().add_(p["eps"])
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = p["lr"] * math.sqrt(bias_correction2) / bias_correction1
    w = rows[:, :dim]
    w.add_(-step_size * numer.div_(denom))


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square roots on every device (torch's vectorised float32 ``sqrt`` on
    CPU may be off by an ulp; the float64 root rounded to float32 is the correctly rounded one)."""
    return x.double().sqrt_().float()


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a (1,) float32 tensor on ``like``'s device: a division by it is a true division
    everywhere (CUDA turns a division by a Python scalar into a product with its reciprocal)."""
    return torch.tensor([value], dtype=torch.float32, device=like.device)
