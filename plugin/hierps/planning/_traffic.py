"""The id traffic a plan is made for: passes of ids per table, from a sample of real batches or
drawn from a power law.

A pass is ``{table: ids}`` (int64, repeats included, in arrival order), or, when the traffic knows
its mini-batches (``examples_per_batch``), a list of such, one per mini-batch: the replay then loads a
pass over the device budget in the groups the store plans, as the store does. Either source can be
*spatially sampled*: only the keys whose hash falls in a fraction ``f`` of the hash space are kept
(the way cache simulators such as SHARDS sample a trace), so that a plan of 10^9 keys simulates
a few million; the simulator then scales every budget by ``f``. A key is kept or dropped with all
its occurrences, so per-key behaviour (its reuse from pass to pass) is that of the full traffic.
"""

from __future__ import annotations

import itertools
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hierps.errors import ConfigError
from hierps.rows import splitmix64

__all__ = [
    "BatchTraffic",
    "PowerLaw",
    "SampledTraffic",
    "Traffic",
    "keep_fraction",
    "load_sample",
    "sample_loader",
]

Pass = dict[str, np.ndarray]
Batches = list[Pass]


def keep_fraction(keys: np.ndarray, fraction: float, salt: int = 0) -> np.ndarray:
    """keys (n,) int64 -> (n,) bool: True for the keys in the first ``fraction`` of the hash space.

    ``salt`` picks another slice of the hash space (the ranks of a sharded store hash the same
    way: the slice a rank keeps stands for any rank's)."""
    if fraction >= 1.0:
        return np.ones(len(keys), bool)
    h = splitmix64(np.asarray(keys, np.int64) ^ np.int64(salt))
    return h < np.uint64(int(fraction * 2.0**64))


class Traffic(ABC):
    """Passes of ids; ``fraction`` of the key space kept (1.0: all of it). Two kinds:
    :class:`SampledTraffic` (real batches) and :class:`PowerLaw` (a distribution)."""

    fraction: float = 1.0
    examples_per_pass: int = 0
    examples_per_batch: int | None = None

    @abstractmethod
    def passes(self) -> Iterator[Pass | Batches]:
        """The passes, in order: ``{table: ids}`` each, or their mini-batches when ``examples_per_batch`` is set."""

    def _check_batches(self) -> None:
        if self.examples_per_pass < 1:
            raise ConfigError(
                f"examples_per_pass: expected at least 1. Got {self.examples_per_pass} instead."
            )
        b = self.examples_per_batch
        if b is not None and (b < 1 or self.examples_per_pass % b):
            raise ConfigError(
                f"examples_per_batch: expected a divisor of examples_per_pass ({self.examples_per_pass}) of "
                f"at least 1. Got {b} instead."
            )

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the traffic is, JSON-ready (the plan records it)."""


@dataclass
class SampledTraffic(Traffic):
    """Passes cut from a sample of real batches: ``ids[table]`` (N,) or (N, L) int64, one row per
    example, ``examples_per_pass`` rows a pass (the last, partial pass dropped unless it is the only one).

    With ``examples_per_batch``, each pass is its mini-batches of that many rows, and the passes are
    cut as a loader with ``drop_last`` cuts them: the last partial mini-batch is dropped, the last
    partial pass kept."""

    ids: Mapping[str, np.ndarray]
    examples_per_pass: int
    fraction: float = 1.0
    source: str = "arrays"
    examples_per_batch: int | None = None

    def __post_init__(self) -> None:
        lengths = {t: len(a) for t, a in self.ids.items()}
        if not lengths:
            raise ConfigError("traffic sample: no table's ids found; give one array of ids per table.")
        if len(set(lengths.values())) != 1:
            raise ConfigError(
                f"traffic sample: every table needs one row of ids per example; got rows per table {lengths}."
            )
        self._check_batches()

    @property
    def examples(self) -> int:
        return len(next(iter(self.ids.values())))

    @property
    def count(self) -> int:
        """Passes of the sample."""
        if self.examples_per_batch is None:
            return max(1, self.examples // self.examples_per_pass)
        return -(
            -(self.examples // self.examples_per_batch) // (self.examples_per_pass // self.examples_per_batch)
        )

    def passes(self) -> Iterator[Pass | Batches]:
        n, step = self.examples, self.examples_per_batch
        for p in range(self.count):
            a, b = p * self.examples_per_pass, min(n, (p + 1) * self.examples_per_pass)
            if step is None:
                yield self._rows(a, b)
            else:
                yield [self._rows(c, c + step) for c in range(a, b - step + 1, step)]

    def _rows(self, a: int, b: int) -> Pass:
        out = {}
        for table, ids in self.ids.items():
            flat = np.asarray(ids[a:b], np.int64).reshape(-1)
            out[table] = flat[keep_fraction(flat, self.fraction)]
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "sample",
            "source": self.source,
            "examples": self.examples,
            "examples_per_pass": self.examples_per_pass,
            "examples_per_batch": self.examples_per_batch,
            "passes": self.count,
            "fraction": self.fraction,
        }


@dataclass
class BatchTraffic(Traffic):
    """Passes of ``pass_batches`` mini-batches taken as they are: ``batches`` is ``{table: ids}`` per
    mini-batch (any shape, flattened; bags of any lengths), in training order, the last pass
    partial. Made by :func:`sample_loader` from a few batches of the user's own loader."""

    batches: list[dict[str, np.ndarray]]
    pass_batches: int
    fraction: float = 1.0
    source: str = "batches"
    examples_per_batch: int | None = None
    """Examples of a mini-batch (informative; default: the most ids a table has in the first)."""

    def __post_init__(self) -> None:
        if not self.batches or not self.batches[0]:
            raise ConfigError(
                "traffic of batches: no batch (or no table's ids in the first); give at least one."
            )
        if isinstance(self.pass_batches, bool) or self.pass_batches < 1:
            raise ConfigError(f"pass_batches: expected an int >= 1. Got {self.pass_batches!r} instead.")
        if self.examples_per_batch is None:
            self.examples_per_batch = max(1, int(max(len(a) for a in self.batches[0].values())))
        self.examples_per_pass = self.examples_per_batch * self.pass_batches

    @property
    def ids_per_pass(self) -> float:
        """Mean ids of a pass over every table (repeats included)."""
        total = sum(len(a) for b in self.batches for a in b.values())
        return total / len(self.batches) * self.pass_batches

    def passes(self) -> Iterator[Batches]:
        for start in range(0, len(self.batches), self.pass_batches):
            yield [
                {t: ids[keep_fraction(ids, self.fraction)] for t, ids in b.items()}
                for b in self.batches[start : start + self.pass_batches]
            ]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "batches",
            "source": self.source,
            "batches": len(self.batches),
            "pass_batches": self.pass_batches,
            "examples_per_batch": self.examples_per_batch,
            "passes": -(-len(self.batches) // self.pass_batches),
            "fraction": self.fraction,
        }


def sample_loader(
    loader: Iterable[Any],
    ids: Callable[[Any], Mapping[str, Any]] | Mapping[str, Any],
    *,
    batches: int = 64,
    pass_batches: int = 16,
) -> BatchTraffic:
    """The traffic of the first ``batches`` batches of ``loader`` (the user's own ``DataLoader``, or
    any iterable of batches), cut into passes of ``pass_batches`` as a ``PassLoader`` cuts them.

    ``ids``: a function batch -> ``{table: ids}`` (a tensor or array of any shape, or a
    :class:`hierps.Bags`), or a mapping ``{table: key}`` that picks ``batch[key]``. The ids are
    copied out (int64) as each batch comes, so the loader may reuse its buffers."""
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ConfigError(f"batches: expected an int >= 1. Got {batches!r} instead.")
    pick = ids if callable(ids) else (lambda batch: {t: batch[k] for t, k in ids.items()})
    taken: list[dict[str, np.ndarray]] = []
    examples = None
    for batch in itertools.islice(loader, batches):
        one = {}
        for table, value in pick(batch).items():
            if examples is None:  # a bag per example, else a row of ids per example
                examples = len(value.offsets) if hasattr(value, "offsets") else len(value)
            value = getattr(value, "ids", value)  # hierps.Bags: its ids
            if hasattr(value, "detach"):
                value = value.detach().cpu().numpy()
            array = np.asarray(value)
            if not np.issubdtype(array.dtype, np.integer) and not (
                np.issubdtype(array.dtype, np.floating) and np.array_equal(array, np.round(array))
            ):
                raise ConfigError(f"sample_loader: ids of {table!r} are {array.dtype}, not whole numbers.")
            one[str(table)] = array.astype(np.int64).reshape(-1)
        taken.append(one)
    name = type(loader).__name__
    if not taken:
        raise ConfigError(f"sample_loader: the {name} gave no batch.")
    return BatchTraffic(
        taken, pass_batches, source=f"{len(taken)} batches of a {name}", examples_per_batch=examples
    )


def load_sample(
    path: str | os.PathLike[str],
    examples_per_pass: int,
    tables: list[str] | None = None,
    examples_per_batch: int | None = None,
) -> SampledTraffic:
    """A sample of batches from ``path``: an ``.npz`` with one array of ids per table (named by the
    table; (N,) or (N, L) int64), or a Parquet file with one column per table (ints, or lists of
    ints: one row per example). ``tables``: keep only these (all when None)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"traffic sample {str(p)!r}: no such file; give an .npz or .parquet of ids.")
    arrays: dict[str, np.ndarray] = {}
    if p.suffix == ".npz":
        with np.load(p, allow_pickle=False) as data:
            arrays = {name: np.asarray(data[name]) for name in data.files}
    elif p.suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        table = pq.read_table(p)
        for name in table.column_names:
            col = table.column(name).combine_chunks()
            if hasattr(col, "flatten") and hasattr(col, "offsets"):
                lengths = np.diff(np.asarray(col.offsets))
                if len(set(lengths.tolist())) > 1:
                    raise ConfigError(
                        f"traffic sample {str(p)!r}: column {name!r} has lists of several lengths; "
                        "give the same number of ids per example (pad with a repeated id)."
                    )
                width = int(lengths[0]) if len(lengths) else 0
                arrays[name] = np.asarray(col.flatten()).reshape(-1, width)
            else:
                arrays[name] = np.asarray(col)
    else:
        raise ConfigError(f"traffic sample {str(p)!r}: expected a .npz or .parquet file.")
    if tables is not None:
        missing = sorted(set(tables) - set(arrays))
        if missing:
            raise ConfigError(
                f"traffic sample {str(p)!r} has no ids for table {missing[0]!r}; it holds {sorted(arrays)}."
            )
        arrays = {t: arrays[t] for t in tables}
    for name, a in arrays.items():
        if not np.issubdtype(a.dtype, np.integer):
            raise ConfigError(f"traffic sample {str(p)!r}: ids of {name!r} are {a.dtype}, not integers.")
    return SampledTraffic(arrays, examples_per_pass, source=str(p), examples_per_batch=examples_per_batch)


@dataclass(frozen=True)
class TableDraw:
    """The ids of one table drawn from a power law: ``keys`` distinct keys, key of rank ``r``
    drawn with probability proportional to ``r ** -exponent``, ``ids_per_example`` a row."""

    keys: int
    exponent: float
    ids_per_example: int = 1


@dataclass
class PowerLaw(Traffic):
    """``passes`` passes of ``examples_per_pass`` examples, each table's ids from a power law.

    Spatial sampling here keeps a random subset of ``fraction * keys`` ranks per table and draws
    only their occurrences (their number from the binomial law of the whole pass), so a pass of
    10^8 ids over 10^9 keys costs what a pass over the kept keys costs. With ``examples_per_batch``
    each pass is split into its mini-batches, its ids dealt out in order (they are independent draws).
    """

    tables: Mapping[str, TableDraw]
    examples_per_pass: int
    count: int = 4
    fraction: float = 1.0
    seed: int = 0
    examples_per_batch: int | None = None

    def __post_init__(self) -> None:
        self._check_batches()

    def passes(self) -> Iterator[Pass | Batches]:
        rng = np.random.default_rng(self.seed)
        kept = {t: self._kept(d, rng) for t, d in self.tables.items()}
        for _ in range(self.count):
            out = {}
            for table, d in self.tables.items():
                ranks, cdf, mass = kept[table]
                n = int(rng.binomial(self.examples_per_pass * d.ids_per_example, min(1.0, mass)))
                out[table] = ranks[np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")]
            if self.examples_per_batch is None:
                yield out
            else:
                k = self.examples_per_pass // self.examples_per_batch
                split = {t: np.array_split(ids, k) for t, ids in out.items()}
                yield [{t: parts[i] for t, parts in split.items()} for i in range(k)]

    def _kept(self, d: TableDraw, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
        """(kept ranks (k,) int64 sorted, their cumulative weights, their share of the probability)."""
        k = max(1, min(d.keys, round(d.keys * self.fraction)))
        ranks = np.arange(1, k + 1, dtype=np.int64) if k == d.keys else _distinct_ranks(d.keys, k, rng)
        weights = ranks.astype(np.float64) ** -d.exponent
        return ranks, np.cumsum(weights), float(weights.sum() / _zeta(d.keys, d.exponent))

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "power_law",
            "tables": {t: d.__dict__ for t, d in self.tables.items()},
            "examples_per_pass": self.examples_per_pass,
            "examples_per_batch": self.examples_per_batch,
            "passes": self.count,
            "fraction": self.fraction,
            "seed": self.seed,
        }


def _distinct_ranks(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` distinct ranks of 1..n, uniformly, sorted."""
    out = np.unique(rng.integers(1, n + 1, size=int(k * 1.1) + 16))
    while len(out) < k:
        out = np.unique(np.concatenate([out, rng.integers(1, n + 1, size=k - len(out) + 16)]))
    return np.sort(rng.choice(out, size=k, replace=False))


def _zeta(n: int, s: float) -> float:
    """sum_{r=1}^{n} r^-s: the first 10^6 terms exactly, the rest by Euler-Maclaurin."""
    head = min(n, 1_000_000)
    total = float((np.arange(1, head + 1, dtype=np.float64) ** -s).sum())
    if n > head:
        a, b = head + 0.5, n + 0.5  # midpoint rule: sum_{r=a+.5}^{b-.5} r^-s ~ integral from a to b
        total += math.log(b / a) if s == 1.0 else (b ** (1 - s) - a ** (1 - s)) / (1 - s)
    return total
