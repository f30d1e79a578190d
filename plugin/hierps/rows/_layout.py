"""How a table's row is laid out in bytes: the same raw words in every tier, float32 for compute.

Every tier stores a row as ``words`` 4-byte words (a float32 array of that width: the device
arena, the RAM slabs, the SSD segments and checkpoints), and only the device decodes them. A row
is a sequence of fields, each starting on a word:

===========  ==================  =========================================================
field        values              dtype
===========  ==================  =========================================================
weights      dim                 the table's ``weights_dtype``: fp32, bf16 or fp16
state parts  dim or 1 each       per-coordinate parts in ``state_dtype`` (fp32 or bf16);
                                 per-row parts (row-wise second moments) in fp32
counters     NUM_COUNTERS        fp32 (:mod:`hierps.rows._counters`), always the last words
===========  ==================  =========================================================

Two 16-bit values share a word; a field of an odd number of them ends with two zero bytes. With
every dtype fp32 the stored row *is* the decoded row (``[weights | state | counters]`` float32)
and :meth:`RowLayout.decode` / :meth:`RowLayout.encode` return their argument: fp32 tables run
exactly the arithmetic and the speed they would without layouts.

**Rounding.** A value written by an optimizer step is rounded stochastically: up with the
probability of its distance to the value below, so that small updates are kept on average instead
of always rounding back. The random bits are a hash of (table salt ^ key, the table's step count,
the column of the value in the decoded row) (:func:`rounding_bits`), so a step rounds the same
way whatever the pass, batch, rank or device: results are reproducible, and a test can hold a
reference that rounds with the same bits. With ``r`` a value's 32 random bits:

- bf16: away from zero when the 16 bits a bf16 drops from the float32 value, plus ``r >> 16``,
  reach 2**16 (probability: those bits / 2**16), else toward zero;
- fp16, ``|x| >= 2**-14`` (its normal range): the same with the 13 dropped bits and ``r & 0x1FFF``;
- fp16, ``|x| < 2**-14`` (a grid of 2**-24): up (toward +inf) when ``(r >> 8) / 2**24`` is below
  the distance from ``x`` to the grid value below, in units of 2**-24, else down;
- fp16 saturates at +-65504.

Values written otherwise (initial rows, :meth:`hierps.Store.write`,
``write_rows``) round to nearest, so they depend on the key alone; decoding then encoding a row
gives it back unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from hierps.rows._counters import NUM_COUNTERS
from hierps.rows._optim import state_parts

__all__ = ["Field", "RowLayout", "as_stored", "row_layout", "rounding_bits", "stochastic_round"]

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_M32 = 0xFFFFFFFF
_FP16_MAX = 65504.0
_FP16_MIN_NORMAL = 2.0**-14


@dataclass(frozen=True)
class Field:
    """One field of a row: ``count`` values of ``dtype`` from word ``word`` (stored) and column
    ``column`` (decoded); ``rounded`` when a step's writes round it stochastically."""

    name: str
    dtype: str
    count: int
    column: int
    word: int

    @property
    def words(self) -> int:
        return math.ceil(self.count * _BYTES[self.dtype] / 4)

    @property
    def rounded(self) -> bool:
        return self.dtype != "fp32"


@dataclass(frozen=True)
class RowLayout:
    """The fields of a table's rows; ``words`` 4-byte words stored, ``width`` float32 decoded."""

    fields: tuple[Field, ...]

    @property
    def words(self) -> int:
        last = self.fields[-1]
        return last.word + last.words

    @property
    def width(self) -> int:
        last = self.fields[-1]
        return last.column + last.count

    @property
    def weights(self) -> Field:
        return self.fields[0]

    @property
    def counters(self) -> Field:
        return self.fields[-1]

    @property
    def compact(self) -> bool:
        """Some field is stored in fewer than 4 bytes a value (the row needs decoding)."""
        return any(f.rounded for f in self.fields)

    @property
    def row_bytes(self) -> int:
        return 4 * self.words

    # -- decoding -------------------------------------------------------------------------------
    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """stored (n, words) float32 -> (n, width) float32 decoded rows (``stored`` itself if fp32)."""
        if not self.compact:
            return stored
        out = torch.empty((stored.shape[0], self.width), dtype=torch.float32, device=stored.device)
        for f in self.fields:
            out[:, f.column : f.column + f.count] = _unpack(stored, f)
        return out

    def gather_weights(self, stored: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """stored (N, words) float32, slots (U,) int64 -> (U, dim) float32 copy of those rows' weights."""
        w = self.weights
        picked = stored[:, w.word : w.word + w.words].index_select(0, slots)
        if w.dtype == "fp32":  # index_select's result is new and contiguous already
            return picked
        return _unpack(picked, Field(w.name, w.dtype, w.count, w.column, 0)).contiguous()

    def weights_of(self, stored: torch.Tensor) -> torch.Tensor:
        """stored (U, words) float32 rows gathered already -> (U, dim) float32 copy of their weights:
        :meth:`gather_weights` of those rows."""
        w = self.weights
        out = _unpack(stored[:, w.word : w.word + w.words], Field(w.name, w.dtype, w.count, w.column, 0))
        out = out.contiguous()
        return out.clone() if out.data_ptr() == stored.data_ptr() else out

    def decode_np(self, stored: np.ndarray) -> np.ndarray:
        """:meth:`decode` of a host array (returned as it is when fp32)."""
        if not self.compact:
            return stored
        return self.decode(torch.from_numpy(_writable(stored))).numpy()

    # -- encoding -------------------------------------------------------------------------------
    def encode(self, rows: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
        """rows (n, width) float32 decoded -> (n, words) float32 stored (``rows`` itself if fp32).

        bits: (n, >= last rounded column + 1) int64 random bits of :func:`rounding_bits` to round
        stochastically (an optimizer step), or None to round to nearest.
        """
        if not self.compact:
            return rows
        out = torch.zeros((rows.shape[0], self.words), dtype=torch.float32, device=rows.device)
        for f in self.fields:
            values = rows[:, f.column : f.column + f.count]
            if not f.rounded:
                out[:, f.word : f.word + f.count] = values
                continue
            r = None if bits is None else bits[:, f.column : f.column + f.count]
            packed = out[:, f.word : f.word + f.words].view(_TORCH[f.dtype])
            packed[:, : f.count] = stochastic_round(values, f.dtype, r)
        return out

    def encode_np(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`encode` (to nearest) of a host array (returned as it is when fp32)."""
        if not self.compact:
            return rows
        return self.encode(torch.from_numpy(_writable(rows))).numpy()

    @property
    def rounded_columns(self) -> int:
        """Decoded columns a step's random bits must cover (0 when nothing is rounded)."""
        return max((f.column + f.count for f in self.fields if f.rounded), default=0)

    def to_json(self) -> dict[str, object]:
        return {"words": self.words, "fields": [[f.name, f.dtype, f.count, f.word] for f in self.fields]}


@cache
def row_layout(opt_type: str, dim: int, weights_dtype: str = "fp32", state_dtype: str = "fp32") -> RowLayout:
    """The layout of a row of ``dim`` weights for optimizer ``opt_type`` at these precisions."""
    parts = [("weights", dim, weights_dtype)]
    parts += [
        (name, n, state_dtype if per_coord else "fp32") for name, n, per_coord in state_parts(opt_type, dim)
    ]
    parts.append(("counters", NUM_COUNTERS, "fp32"))
    fields, column, word = [], 0, 0
    for name, count, dtype in parts:
        f = Field(name, dtype, count, column, word)
        fields.append(f)
        column, word = column + count, word + f.words
    return RowLayout(tuple(fields))


def _unpack(stored: torch.Tensor, f: Field) -> torch.Tensor:
    """Field ``f`` of stored rows (n, >= f.word + f.words) -> (n, f.count) float32."""
    words = stored[:, f.word : f.word + f.words]
    if f.dtype == "fp32":
        return words
    return words.view(_TORCH[f.dtype])[:, : f.count].float()


def _writable(a: np.ndarray) -> np.ndarray:
    return a if a.flags.writeable and a.flags.c_contiguous else np.ascontiguousarray(a).copy()


def as_stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` as a table of weights ``dtype`` stores them (rounded to nearest), as float32."""
    if dtype == "fp32":
        return values
    return stochastic_round(torch.from_numpy(_writable(values)), dtype, None).float().numpy()


# -- stochastic rounding -------------------------------------------------------------------------
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def rounding_bits(seeds: torch.Tensor, step: int, columns: int) -> torch.Tensor:
    """seeds (U,) int64 (table salt ^ key), the table's step count -> (U, columns) int64 random
    bits in [0, 2**32), one per decoded column: ``mix(mix(lo ^ mix(hi ^ mix(step))) + 0x9E3779B9 *
    column)`` with ``mix`` :func:`_mix32` and ``lo``, ``hi`` the halves of the seed, all mod 2**32."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    s = torch.tensor(step & _M32, dtype=torch.int64, device=seeds.device)
    h = _mix32(lo ^ _mix32(hi ^ _mix32(s)))
    cols = (torch.arange(columns, dtype=torch.int64, device=seeds.device) * 0x9E3779B9) & _M32
    return _mix32((h[:, None] + cols[None, :]) & _M32)


def stochastic_round(values: torch.Tensor, dtype: str, bits: torch.Tensor | None) -> torch.Tensor:
    """values (..., k) float32 -> the same in ``dtype`` (bf16 or fp16), rounded stochastically with
    ``bits`` (..., k) int64 in [0, 2**32) (see the module's docstring), or to nearest if None."""
    if dtype == "fp16":
        values = values.clamp(-_FP16_MAX, _FP16_MAX)
    if bits is None:
        return values.to(_TORCH[dtype])
    x = values.contiguous()
    if dtype == "bf16":
        raised = x.view(torch.int32) + (bits >> 16).to(torch.int32)
        return (raised & -(1 << 16)).view(torch.float32).to(torch.bfloat16)
    raised = x.view(torch.int32) + (bits & 0x1FFF).to(torch.int32)
    normal = (raised & -(1 << 13)).view(torch.float32)
    scaled = x * 2.0**24
    low = scaled.floor()
    up = ((bits >> 8).to(torch.float32) * 2.0**-24) < (scaled - low)
    subnormal = (low + up.to(torch.float32)) * 2.0**-24
    out = torch.where(x.abs() < _FP16_MIN_NORMAL, subnormal, normal)
    return out.clamp_(-_FP16_MAX, _FP16_MAX).to(torch.float16)
