"""Small tensor helpers shared by the tiers and the store."""

from __future__ import annotations

import math

import torch

__all__ = ["joined"]


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, without a copy when the parts are consecutive slices of one tensor."""
    if len(parts) == 1:
        return parts[0]
    base = parts[0]._base
    if (
        base is not None
        and base.is_contiguous()
        and all(p._base is base and p.is_contiguous() for p in parts)
    ):
        row = math.prod(base.shape[1:]) if base.dim() > 1 else 1
        start = parts[0].storage_offset() - base.storage_offset()
        at = start
        for p in parts:
            if p.storage_offset() - base.storage_offset() != at:
                break
            at += p.numel()
        else:
            if start % row == 0:
                return base.narrow(0, start // row, sum(p.shape[0] for p in parts))
    return torch.cat(parts)
