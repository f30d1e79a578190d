"""Criteo-format click data: a synthetic generator with a hidden teacher, and TSV I/O.

Arrays, for ``N`` examples: ``dense (N, 13) float32``, ``log1p`` of non-negative counts;
``sparse (N, 26) int64``, raw 64-bit feature ids (any value, negatives included; ``0`` is the
"missing" sentinel); ``labels (N,) float32`` in ``{0, 1}``.

Synthetic ids are Zipf-distributed per feature and pass through :func:`hierps.rows.splitmix64`,
so they look like the hashed ids of real logs rather than indices ``0..n-1``. Labels come from a
hidden logistic "teacher" whose per-id weights are derived by hashing ``(feature, id)``, so no
weight table is ever materialised, whatever the vocabulary size.
"""

from __future__ import annotations

import gzip
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from hierps.rows import splitmix64

__all__ = [
    "DEFAULT_MAX_IND_RANGE",
    "KAGGLE_TABLE_SIZES",
    "BagBatch",
    "BagData",
    "BagSpec",
    "CriteoData",
    "CriteoSpec",
    "generate",
    "generate_bags",
    "kaggle_table_sizes",
    "power_law_vocab_sizes",
    "read_criteo_tsv",
    "teacher_logits",
    "write_criteo_tsv",
]

N_FIELDS = 40  # label + 13 dense + 26 categorical in one TSV line
MISSING_ID = 0


def _unit(h: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 uniform in [0, 1), from the top 53 bits."""
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _centred(h: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 uniform on [-sqrt(3), sqrt(3)]: zero mean, unit variance."""
    return (2.0 * _unit(h) - 1.0) * math.sqrt(3.0)


def _salt(*parts: int) -> np.uint64:
    """A uint64 salt derived from small non-negative ints (seed, feature, purpose...)."""
    h = splitmix64(0)
    for p in parts:
        h = splitmix64(h ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF))
    return np.uint64(h)


def power_law_vocab_sizes(n_features: int = 26, total: int = 200_000, smallest: int = 3) -> tuple[int, ...]:
    """Per-feature vocabulary sizes spread log-uniformly from ``smallest`` up, largest first.

    Real Criteo cardinalities span 3 to ~10M roughly log-uniformly: a few tables are huge and
    many are tiny. The largest size is solved for so the sizes sum to about ``total``.
    """
    lo, hi = float(smallest), float(total)
    for _ in range(60):  # bisection on the largest size; the sum is monotone in it
        top = math.sqrt(lo * hi)
        s = np.geomspace(top, smallest, n_features).sum()
        lo, hi = (top, hi) if s < total else (lo, top)
    return tuple(int(round(v)) for v in np.geomspace(math.sqrt(lo * hi), smallest, n_features))


@dataclass(frozen=True)
class CriteoSpec:
    """Shape of the synthetic data set and of its hidden teacher.

    ``seed`` fixes everything about the *population*: which raw ids exist and what the teacher
    thinks of them. The ``seed`` given to :func:`generate` only picks which examples are drawn,
    so train and test sets drawn with different seeds share one teacher.
    """

    n_dense: int = 13
    n_sparse: int = 26
    vocab_sizes: tuple[int, ...] | None = None  # None: power_law_vocab_sizes(n_sparse, total_vocab)
    total_vocab: int = 200_000
    zipf_exponent: float = 1.1
    seed: int = 0
    base_ctr: float = 0.25
    sparse_scale: float = 0.2  # std of a typical feature's per-id teacher weight
    dense_scale: float = 0.15  # std of each dense feature's contribution to the logit
    interaction_scale: float = 0.4
    interactions: tuple[tuple[int, int], ...] | None = None  # None: two mid-sized pairs

    def __post_init__(self) -> None:
        n = self.n_sparse
        vocab = power_law_vocab_sizes(n, self.total_vocab) if self.vocab_sizes is None else self.vocab_sizes
        pairs = [(n // 8, n // 3), (n // 4, n // 2)] if self.interactions is None else self.interactions
        # Normalised to plain int tuples so specs hash and compare by value (the bias cache).
        sizes = tuple(int(v) for v in vocab)
        interactions = tuple((int(a), int(b)) for a, b in pairs)
        object.__setattr__(self, "vocab_sizes", sizes)
        object.__setattr__(self, "interactions", interactions)
        if len(sizes) != n or min(sizes) < 1:
            raise ValueError(f"need {n} positive vocab sizes, got {sizes}")
        if any(not (0 <= a < n and 0 <= b < n and a != b) for a, b in interactions):
            raise ValueError(f"interaction pairs must be distinct features below {n}: {interactions}")
        if not 0.0 < self.base_ctr < 1.0:
            raise ValueError("base_ctr must lie in (0, 1)")

    @property
    def resolved_vocab_sizes(self) -> tuple[int, ...]:
        """``vocab_sizes`` as resolved at construction (never None once the spec exists)."""
        if self.vocab_sizes is None:
            raise RuntimeError("CriteoSpec.vocab_sizes is unresolved: __post_init__ did not run")
        return self.vocab_sizes

    @property
    def resolved_interactions(self) -> tuple[tuple[int, int], ...]:
        """``interactions`` as resolved at construction (never None once the spec exists)."""
        if self.interactions is None:
            raise RuntimeError("CriteoSpec.interactions is unresolved: __post_init__ did not run")
        return self.interactions


def _zipf_ranks(u: np.ndarray, vocab: np.ndarray, s: float) -> np.ndarray:
    """Uniforms ``(N, F)`` -> Zipf ranks in ``[0, vocab_f)``, ``P(rank k) ~ (k + 1.5) ** -s``.

    Inverse CDF of a power law on ``[1, n + 1)`` floored to an integer: O(1) per draw with no
    per-id table, so vocabularies of any size cost the same.
    """
    log_n1 = np.log(vocab.astype(np.float64) + 1.0)
    # x**a = 1 - u * (1 - (n+1)**a) with a = 1 - s, via expm1/log1p to stay exact near s = 1;
    # s = 1 itself is the a -> 0 limit, which a tiny a reproduces to ~1e-12.
    a = (1.0 - s) or 1e-12
    log_x = np.log1p(u * np.expm1(a * log_n1)) / a
    ranks = np.floor(np.exp(log_x)).astype(np.int64) - 1
    return np.minimum(ranks, vocab - 1)


def _raw_ids(spec: CriteoSpec, ranks: np.ndarray) -> np.ndarray:
    """Zipf ranks ``(N, F)`` -> raw int64 ids: a per-feature salted bijection of the rank."""
    salts = np.array([_salt(spec.seed, 1, f) for f in range(spec.n_sparse)], dtype=np.uint64)
    ids = splitmix64(ranks.astype(np.uint64) + salts).view(np.int64)
    # 0 is the "missing" sentinel; the odds of a hash hitting it are 2**-64, but be exact.
    return np.where(ids == MISSING_ID, 1, ids)


def _dense_params(spec: CriteoSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per dense feature: log-normal location, scale, and probability of a zero count."""
    h = _unit(splitmix64(_salt(spec.seed, 2) + np.arange(3 * spec.n_dense, dtype=np.uint64))).reshape(-1, 3)
    return 0.5 + 3.0 * h[:, 0], 0.6 + 1.0 * h[:, 1], 0.05 + 0.4 * h[:, 2]


def _sample_features(spec: CriteoSpec, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``n`` examples' features: ``(dense (n, n_dense) float32, sparse (n, n_sparse) int64)``."""
    mu, sigma, p_zero = _dense_params(spec)
    counts = np.floor(np.exp(mu + sigma * rng.standard_normal((n, spec.n_dense))))
    counts[rng.random((n, spec.n_dense)) < p_zero] = 0.0
    # The cap keeps float32 log1p exact enough that expm1 recovers the integer count.
    dense = np.log1p(np.minimum(counts, 100_000.0)).astype(np.float32)
    vocab = np.asarray(spec.vocab_sizes, dtype=np.int64)
    ranks = _zipf_ranks(rng.random((n, spec.n_sparse)), vocab, spec.zipf_exponent)
    return dense, _raw_ids(spec, ranks)


def _id_hash(spec: CriteoSpec, sparse: np.ndarray, purpose: int, column: int, k: int = 0) -> np.ndarray:
    """Deterministic per-(feature, id) hash for teacher weight ``purpose``/component ``k``."""
    return splitmix64(sparse[:, column].view(np.uint64) ^ _salt(spec.seed, purpose, column, k))


def _raw_teacher_logits(spec: CriteoSpec, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """Teacher logit without its bias, ``(N,)`` float64."""
    # Importances span 0.25..1.75 so some tables matter a lot and some are nearly noise; the
    # seed only permutes them, which keeps the total signal (and so the reachable AUC) stable.
    order = np.argsort(splitmix64(_salt(spec.seed, 3) + np.arange(spec.n_sparse, dtype=np.uint64)))
    importance = np.linspace(0.25, 1.75, spec.n_sparse)[order]
    logit = np.zeros(len(dense), dtype=np.float64)
    for f in range(spec.n_sparse):
        logit += spec.sparse_scale * importance[f] * _centred(_id_hash(spec, sparse, 4, f))
    mu, sigma, _ = _dense_params(spec)
    w_dense = _centred(splitmix64(_salt(spec.seed, 5) + np.arange(spec.n_dense, dtype=np.uint64)))
    w_dense /= np.sqrt(np.mean(w_dense**2))  # unit RMS, for the same reason
    logit += ((dense - np.log1p(np.exp(mu))) / sigma) @ (spec.dense_scale * w_dense)
    # Low-rank pairwise terms: exactly what a dot-product interaction layer can represent.
    rank = 4
    for p, (a, b) in enumerate(spec.resolved_interactions):
        u = np.stack([_centred(_id_hash(spec, sparse, 6 + 2 * p, a, k)) for k in range(rank)], axis=1)
        v = np.stack([_centred(_id_hash(spec, sparse, 7 + 2 * p, b, k)) for k in range(rank)], axis=1)
        logit += spec.interaction_scale * (u * v).sum(axis=1) / math.sqrt(rank)
    return logit


@lru_cache(maxsize=16)
def _teacher_bias(spec: CriteoSpec) -> float:
    """Bias that puts the mean click rate at ``spec.base_ctr``, fitted on a fixed sample."""
    dense, sparse = _sample_features(spec, 1 << 16, np.random.default_rng((spec.seed, 0xB1A5)))
    raw = _raw_teacher_logits(spec, dense, sparse)
    lo, hi = -30.0, 30.0
    for _ in range(60):  # mean sigmoid is monotone in the bias
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.mean(1.0 / (1.0 + np.exp(-(raw + mid)))) < spec.base_ctr else (lo, mid)
    return 0.5 * (lo + hi)


def teacher_logits(spec: CriteoSpec, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """The hidden teacher's click logit for given features, ``(N,)`` float64.

    ``sigmoid`` of it is the true click probability, so it bounds the AUC any model can reach.
    """
    return _raw_teacher_logits(spec, dense, sparse) + _teacher_bias(spec)


@dataclass
class CriteoData:
    """A block of examples: ``dense (N, 13) float32``, ``sparse (N, 26) int64``, ``labels (N,) float32``."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        self.dense = np.ascontiguousarray(self.dense, dtype=np.float32)
        self.sparse = np.ascontiguousarray(self.sparse, dtype=np.int64)
        self.labels = np.ascontiguousarray(self.labels, dtype=np.float32)
        n = len(self.labels)
        if self.dense.ndim != 2 or self.sparse.ndim != 2 or len(self.dense) != n or len(self.sparse) != n:
            raise ValueError(f"shapes {self.dense.shape} {self.sparse.shape} {self.labels.shape} disagree")

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index: slice | np.ndarray) -> CriteoData:
        """Rows selected by a slice, an integer index array or a boolean mask."""
        return CriteoData(self.dense[index], self.sparse[index], self.labels[index])

    def split(self, frac: float) -> tuple[CriteoData, CriteoData]:
        """``(first round(frac * N) rows, the rest)``; synthetic rows are i.i.d., so no shuffle."""
        if not 0.0 <= frac <= 1.0:
            raise ValueError("frac must lie in [0, 1]")
        cut = int(round(frac * len(self)))
        return self.subset(slice(0, cut)), self.subset(slice(cut, None))

    def batches(
        self, batch_size: int, shuffle: bool = False, seed: int = 0, drop_last: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield ``(dense (B, 13) float32, sparse (B, 26) int64, labels (B,) float32)`` CPU tensors."""
        n = len(self)
        order = np.random.default_rng(seed).permutation(n) if shuffle else None
        stop = n - n % batch_size if drop_last else n
        for start in range(0, stop, batch_size):
            sel = slice(start, min(start + batch_size, n))
            idx = order[sel] if order is not None else sel
            # from_numpy shares memory; slices of C-contiguous rows stay contiguous.
            dense, sparse, labels = (torch.from_numpy(a[idx]) for a in (self.dense, self.sparse, self.labels))
            yield dense, sparse, labels


def generate(spec: CriteoSpec, n_examples: int, seed: int = 0) -> CriteoData:
    """Draw ``n_examples`` i.i.d. examples with labels ~ Bernoulli(sigmoid(teacher logit))."""
    rng = np.random.default_rng((spec.seed, seed))
    dense, sparse = _sample_features(spec, n_examples, rng)
    prob = 1.0 / (1.0 + np.exp(-teacher_logits(spec, dense, sparse)))
    return CriteoData(dense, sparse, (rng.random(n_examples) < prob).astype(np.float32))


_TAB, _NL = ord("\t"), ord("\n")
_DIGIT = np.full(256, 255, dtype=np.uint8)  # byte -> digit value; 255 marks "not a digit"
_DIGIT[np.frombuffer(b"0123456789abcdefABCDEF", np.uint8)] = [*range(16), *range(10, 16)]
_POW10 = 10 ** np.arange(20, dtype=np.uint64)


def _parse_fields(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, base: int) -> np.ndarray:
    """Unsigned base-10 or base-16 integers in byte fields (any shape; empty -> 0) -> uint64, same shape.

    Vectorised over fields; the only Python loop is over at most 19 decimal places.
    """
    shape, starts, lengths = starts.shape, starts.reshape(-1), lengths.reshape(-1)
    width = int(lengths.max(initial=0))
    if width > (16 if base == 16 else 19):
        raise ValueError(f"field of {width} digits does not fit in 64 bits")
    if width == 0:
        return np.zeros(shape, dtype=np.uint64)
    width = 16 if base == 16 else width
    # A (fields, width) byte matrix without an index matrix: gather rows of a sliding window.
    windows = sliding_window_view(np.concatenate([buf, np.zeros(width, np.uint8)]), width)
    digits = np.where(np.arange(width) < lengths[:, None], _DIGIT[windows[starts]], 0)
    if (digits >= base).any():
        raise ValueError(f"non base-{base} character in a numeric field")
    # Both paths read each field left-aligned in `width` places, zeros past its end, then
    # drop those padding places.
    if base == 16:  # two nibbles per byte, eight bytes per big-endian uint64
        packed = np.ascontiguousarray((digits[:, 0::2] << 4) | digits[:, 1::2])
        out = packed.view(">u8").reshape(-1).astype(np.uint64)
        out >>= (4 * (width - lengths)).astype(np.uint64)
    else:
        out = np.zeros(len(starts), dtype=np.uint64)
        for k in range(width):
            out = out * np.uint64(10) + digits[:, k]
        out //= _POW10[width - lengths]
    return out.reshape(shape)


def _parse_block(raw: bytes, first_line: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Complete ``\\n``-terminated TSV lines -> ``(labels, dense counts int64, sparse int64)``."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    ends = np.flatnonzero((buf == _TAB) | (buf == _NL))  # each field ends at a separator
    is_nl = buf[ends] == _NL
    n = int(is_nl.sum())
    if len(ends) != N_FIELDS * n or not is_nl[N_FIELDS - 1 :: N_FIELDS].all():
        per_line = np.diff(np.concatenate([[-1], np.flatnonzero(is_nl)]))
        bad = int(np.flatnonzero(per_line != N_FIELDS)[0])
        raise ValueError(f"line {first_line + bad + 1}: expected {N_FIELDS} fields, found {per_line[bad]}")
    starts = np.concatenate([[0], ends[:-1] + 1]).reshape(n, N_FIELDS)
    lengths = ends.reshape(n, N_FIELDS) - starts
    labels = _parse_fields(buf, starts[:, 0], lengths[:, 0], 10)
    # Negative counts occur in the raw logs and are treated as missing: zero length parses to 0.
    negative = (lengths[:, 1:14] > 0) & (buf[starts[:, 1:14]] == ord("-"))
    counts = _parse_fields(buf, starts[:, 1:14], np.where(negative, 0, lengths[:, 1:14]), 10).astype(np.int64)
    sparse = _parse_fields(buf, starts[:, 14:], lengths[:, 14:], 16).view(np.int64)
    return labels.astype(np.float32), counts, sparse


def _criteo_files(path: Path) -> list[Path]:
    """The file itself, or a directory's ``day_*`` / ``*.tsv`` / ``*.txt`` (optionally .gz) files."""
    if path.is_file():
        return [path]
    files = [
        p for p in path.iterdir() if p.is_file() and re.fullmatch(r"(day_\d+|.*\.(tsv|txt))(\.gz)?", p.name)
    ]
    if not files:
        raise FileNotFoundError(f"no Criteo files (day_N, *.tsv, *.txt) in {path}")
    # Natural order, so day_2 precedes day_10.
    return sorted(files, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])


def _line_blocks(path: Path, block_bytes: int) -> Iterator[bytes]:
    """Blocks of whole, non-empty, ``\\n``-terminated lines (``\\r`` stripped)."""
    with open(path, "rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"  # gzip magic number: file names are not trusted
    rest = b""
    with gzip.open(path, "rb") if gz else open(path, "rb") as f:
        while True:
            chunk = f.read(block_bytes)
            data = rest + chunk
            cut = data.rfind(b"\n") + 1 if chunk else len(data)
            block, rest = data[:cut], data[cut:]
            block = block.replace(b"\r", b"")
            while b"\n\n" in block:
                block = block.replace(b"\n\n", b"\n")
            block = block.lstrip(b"\n")
            if block:
                yield block if block.endswith(b"\n") else block + b"\n"
            if not chunk:
                return


def read_criteo_tsv(path: str | Path, max_rows: int | None = None, block_bytes: int = 1 << 25) -> CriteoData:
    """Read Criteo Kaggle/Terabyte TSV: ``label \\t 13 decimal counts \\t 26 hex ids`` per line.

    Dense: missing or negative -> 0, then ``log1p`` (float32). Categorical: hex -> 64-bit value
    reinterpreted as signed int64; missing -> ``MISSING_ID`` (0). ``path`` is a file or a
    directory of ``day_N`` / ``*.tsv`` / ``*.txt`` files, each optionally gzip-compressed.
    """
    # Starts with an empty block so that reading no rows still concatenates to the right shapes.
    parts = [(np.zeros(0, np.float32), np.zeros((0, 13), np.int64), np.zeros((0, 26), np.int64))]
    rows, limit = 0, math.inf if max_rows is None else max_rows
    for file in _criteo_files(Path(path)):
        line_no = 0
        for block in _line_blocks(file, block_bytes):
            if rows + block.count(b"\n") > limit:  # drop unwanted lines before parsing, not after
                block = b"".join(block.splitlines(keepends=True)[: int(limit) - rows])
            if rows >= limit:
                break
            try:
                parts.append(_parse_block(block, line_no))
            except ValueError as e:
                raise ValueError(f"{file}: {e}") from None
            line_no, rows = line_no + len(parts[-1][0]), rows + len(parts[-1][0])
        if rows >= limit:
            break
    labels, counts, sparse = (np.concatenate(p) for p in zip(*parts))
    return CriteoData(np.log1p(counts.astype(np.float64)).astype(np.float32), sparse, labels)


def write_criteo_tsv(data: CriteoData, path: str | Path) -> None:
    """Write ``data`` as Criteo TSV (gzip if ``path`` ends in ``.gz``).

    Dense values are written as the integer counts ``round(expm1(x))``: exact for data that
    came from integer counts (the generator's, up to its 100k cap), lossy for anything else.
    Ids are written as 16-digit hex of their two's complement; ``MISSING_ID`` is written empty.
    """
    path, (n, f) = Path(path), data.sparse.shape
    counts = np.rint(np.expm1(data.dense.astype(np.float64))).clip(min=0).astype(np.int64)
    heads = zip(*([str(v) for v in col.tolist()] for col in (data.labels.astype(np.int64), *counts.T)))
    # Ids as one fixed-width byte matrix, from a single bytes.hex() call instead of N * F formats.
    cells = np.full((n, f, 17), _TAB, dtype=np.uint8)
    hex_digits = data.sparse.view(np.uint64).astype(">u8").tobytes().hex().encode("ascii")
    cells[:, :, :16] = np.frombuffer(hex_digits, np.uint8).reshape(n, f, 16)
    cells[:, -1, 16] = _NL
    ids, width = cells.tobytes().decode("ascii"), f * 17
    text = "".join("\t".join(head) + "\t" + ids[i * width : (i + 1) * width] for i, head in enumerate(heads))
    # Missing ids become empty fields. Each pass skips a zero right after a replaced one, so
    # two passes clear any run; fields are exactly 16 digits, so no longer field can match.
    zero = "0" * 16
    for _ in range(2):
        text = text.replace(f"\t{zero}\t", "\t\t")
    text = text.replace(f"\t{zero}\n", "\t\n")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="ascii", newline="\n") as f:
        f.write(text)


# -- bags of ids per table: the reference DLRM's input ------------------------------------------------
# Rows per table of the Criteo Kaggle data set, as dlrm's preprocessing counts them (26 features).
KAGGLE_TABLE_SIZES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# The cap of ids per table (dlrm's --max-ind-range) that leaves about 7.9M rows in all:
# 569,296 rows in the 21 tables below it, plus five tables of 1,466,000.
DEFAULT_MAX_IND_RANGE = 1_466_000


def kaggle_table_sizes(max_ind_range: int | None = DEFAULT_MAX_IND_RANGE) -> tuple[int, ...]:
    """The Kaggle table sizes, each capped at ``max_ind_range`` rows (None: uncapped, 33.8M rows).

    ``kaggle_table_sizes()`` sums to 7,899,296 rows; ``kaggle_table_sizes(1000)`` to 16,727.
    """
    if max_ind_range is None:
        return KAGGLE_TABLE_SIZES
    if isinstance(max_ind_range, bool) or not isinstance(max_ind_range, int) or max_ind_range < 1:
        raise ValueError(f"max_ind_range: expected an int >= 1 or None. Got {max_ind_range!r} instead.")
    return tuple(min(n, max_ind_range) for n in KAGGLE_TABLE_SIZES)


@dataclass(frozen=True)
class BagSpec:
    """Shape of synthetic multi-hot click data and of its hidden teacher.

    Each example has ``n_dense`` dense features (as :class:`CriteoSpec` draws them) and, for each
    table ``k``, a bag of ``min_bag..max_bag`` row ids in ``[0, table_sizes[k])``, Zipf-distributed
    (hot rows scattered over the table by a per-table affine permutation). ``seed`` fixes the
    population and the teacher; the seed given to :func:`generate_bags` picks the examples.
    """

    table_sizes: tuple[int, ...] = KAGGLE_TABLE_SIZES
    n_dense: int = 13
    min_bag: int = 1
    max_bag: int = 10
    zipf_exponent: float = 1.1
    seed: int = 0
    base_ctr: float = 0.25
    sparse_scale: float = 0.3  # std of a typical table's teacher term
    interaction_scale: float = 0.4

    def __post_init__(self) -> None:
        sizes = tuple(int(n) for n in self.table_sizes)
        object.__setattr__(self, "table_sizes", sizes)
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"table_sizes: expected at least 2 positive sizes. Got {sizes} instead.")
        if not 1 <= self.min_bag <= self.max_bag:
            raise ValueError(f"bags: expected 1 <= min_bag <= max_bag. Got {self.min_bag}..{self.max_bag}.")
        if not 0.0 < self.base_ctr < 1.0:
            raise ValueError("base_ctr must lie in (0, 1)")

    @property
    def criteo(self) -> CriteoSpec:
        """The :class:`CriteoSpec` whose dense features these examples share."""
        return CriteoSpec(n_dense=self.n_dense, seed=self.seed)


class BagBatch(NamedTuple):
    """One mini-batch of ``B`` examples: ``dense (B, n_dense) float32``, per table ``k``
    ``ids[k] (N_k,) int64`` and ``offsets[k] (B,) int64`` (start of each example's bag in ``ids[k]``),
    ``labels (B,) float32``. Call table ``k`` as ``nn.EmbeddingBag(...)(ids[k], offsets[k])``."""

    dense: torch.Tensor
    ids: tuple[torch.Tensor, ...]
    offsets: tuple[torch.Tensor, ...]
    labels: torch.Tensor


@dataclass
class BagData:
    """Examples with a bag of ids per table: ``dense (N, n_dense)``, ``lengths (N, F)`` bag sizes,
    ``ids[k]`` every id of table ``k``, example by example (``lengths[:, k].sum()`` of them)."""

    dense: np.ndarray
    lengths: np.ndarray
    ids: tuple[np.ndarray, ...]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[BagBatch]:
        """Consecutive :class:`BagBatch` es of ``batch_size`` examples (CPU tensors), in order."""
        starts = np.zeros((len(self) + 1, self.lengths.shape[1]), np.int64)
        np.cumsum(self.lengths, axis=0, out=starts[1:])
        stop = len(self) - len(self) % batch_size if drop_last else len(self)
        for a in range(0, stop, batch_size):
            b = min(a + batch_size, len(self))
            ids = tuple(torch.from_numpy(t[starts[a, k] : starts[b, k]]) for k, t in enumerate(self.ids))
            offsets = tuple(torch.from_numpy(starts[a:b, k] - starts[a, k]) for k in range(len(self.ids)))
            yield BagBatch(
                torch.from_numpy(self.dense[a:b]), ids, offsets, torch.from_numpy(self.labels[a:b])
            )


def _bag_features(
    spec: BagSpec, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """``n`` examples' features: (dense (n, n_dense) float32, lengths (n, F), ids per table)."""
    criteo = spec.criteo
    mu, sigma, p_zero = _dense_params(criteo)
    counts = np.floor(np.exp(mu + sigma * rng.standard_normal((n, spec.n_dense))))
    counts[rng.random((n, spec.n_dense)) < p_zero] = 0.0
    dense = np.log1p(np.minimum(counts, 100_000.0)).astype(np.float32)
    lengths = rng.integers(spec.min_bag, spec.max_bag + 1, (n, len(spec.table_sizes)))
    ids = []
    for k, size in enumerate(spec.table_sizes):
        ranks = _zipf_ranks(rng.random(int(lengths[:, k].sum())), np.asarray(size), spec.zipf_exponent)
        ids.append(_scatter(ranks, size, _salt(spec.seed, 9, k)))
    return dense, lengths, ids


def _scatter(ranks: np.ndarray, size: int, salt: np.uint64) -> np.ndarray:
    """Zipf ranks -> row ids by ``(a * rank + b) % size`` with ``gcd(a, size) = 1``: a bijection of
    ``[0, size)`` that scatters the hot rows over the table, as a real table's ids are."""
    a = 1 + int(salt) % max(size - 1, 1)
    while math.gcd(a, size) != 1:
        a += 1
    b = int(splitmix64(int(salt))) % size
    return (ranks.astype(object if size > 1 << 31 else np.int64) * a + b) % size


def _bag_means(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-id values of one table (every bag's, in order) -> ``(n,)`` mean over each bag."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.add.reduceat(values, starts) / lengths


def _raw_bag_teacher(
    spec: BagSpec, dense: np.ndarray, lengths: np.ndarray, ids: list[np.ndarray]
) -> np.ndarray:
    """The teacher's logit without its bias, ``(n,)`` float64: per-table bag means of hashed id
    weights, a linear dense term, and two low-rank table pairs (what a dot interaction can learn)."""
    n_tables = len(spec.table_sizes)
    order = np.argsort(splitmix64(_salt(spec.seed, 3) + np.arange(n_tables, dtype=np.uint64)))
    importance = np.linspace(0.25, 1.75, n_tables)[order]

    def weights(k: int, purpose: int, component: int = 0) -> np.ndarray:
        h = splitmix64(ids[k].astype(np.int64).view(np.uint64) ^ _salt(spec.seed, purpose, k, component))
        return _bag_means(_centred(h), lengths[:, k])

    # A mean of L independent unit weights has variance 1/L: scale the bags back to unit variance.
    unit = np.sqrt(lengths)
    logit = sum(spec.sparse_scale * importance[k] * unit[:, k] * weights(k, 4) for k in range(n_tables))
    mu, sigma, _ = _dense_params(spec.criteo)
    w_dense = _centred(splitmix64(_salt(spec.seed, 5) + np.arange(spec.n_dense, dtype=np.uint64)))
    logit = logit + ((dense - np.log1p(np.exp(mu))) / sigma) @ (0.15 * w_dense / np.sqrt(np.mean(w_dense**2)))
    rank = 4
    for p, (a, b) in enumerate([(n_tables // 8, n_tables // 3), (n_tables // 4, n_tables // 2)]):
        u = np.stack([unit[:, a] * weights(a, 6 + 2 * p, r) for r in range(rank)], axis=1)
        v = np.stack([unit[:, b] * weights(b, 7 + 2 * p, r) for r in range(rank)], axis=1)
        logit = logit + spec.interaction_scale * (u * v).sum(axis=1) / math.sqrt(rank)
    return np.asarray(logit, np.float64)


@lru_cache(maxsize=16)
def _bag_teacher_bias(spec: BagSpec) -> float:
    """Bias that puts the mean click rate at ``spec.base_ctr``, fitted on a fixed sample."""
    dense, lengths, ids = _bag_features(spec, 1 << 14, np.random.default_rng((spec.seed, 0xB1A5)))
    raw = _raw_bag_teacher(spec, dense, lengths, ids)
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.mean(1.0 / (1.0 + np.exp(-(raw + mid)))) < spec.base_ctr else (lo, mid)
    return 0.5 * (lo + hi)


def generate_bags(spec: BagSpec, n_examples: int, seed: int = 0) -> BagData:
    """Draw ``n_examples`` i.i.d. examples with labels ~ Bernoulli(sigmoid(teacher logit))."""
    rng = np.random.default_rng((spec.seed, seed))
    dense, lengths, ids = _bag_features(spec, n_examples, rng)
    logit = _raw_bag_teacher(spec, dense, lengths, ids) + _bag_teacher_bias(spec)
    labels = (rng.random(n_examples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return BagData(dense, lengths.astype(np.int64), tuple(np.asarray(t, np.int64) for t in ids), labels)
